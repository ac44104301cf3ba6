"""Full state dicts: the wrapped module's keys, full CPU tensors on every rank, round trips."""
from __future__ import annotations

import pytest
import torch

from distributed import run_distributed
from models import Block, FeatureNet, Tiny

STEPS = 2


def _train(model, opt, seed: int, rank: int, world: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    for _ in range(STEPS):
        tokens = torch.randint(0, 37, (4 * world, 6), generator=gen)
        targets = torch.randint(0, 37, (4 * world, 6), generator=gen)
        model(tokens[4 * rank:4 * rank + 4], targets[4 * rank:4 * rank + 4]).backward()
        opt.step()
        opt.zero_grad()


def _round_trip(rank: int, world: int) -> dict:
    from overlap import ShardedModule

    torch.manual_seed(0)
    first = ShardedModule(FeatureNet(), unit_types=(Block, Tiny))
    _train(first, torch.optim.SGD(first.parameters(), lr=0.1), 1, rank, world)
    saved = first.full_state_dict()

    torch.manual_seed(123)                      # different initial values, then loaded over
    second = ShardedModule(FeatureNet(), unit_types=(Block, Tiny))
    second.load_full_state_dict(saved)
    loaded = second.full_state_dict()

    # Both continue identically from the same state.
    for model in (first, second):
        _train(model, torch.optim.SGD(model.parameters(), lr=0.1), 2, rank, world)
    errors = []
    try:
        second.load_full_state_dict({k: v for k, v in saved.items() if k != "head.weight"})
    except KeyError as exc:
        errors.append(str(exc))
    try:
        second.load_full_state_dict({**saved, "blocks.0.up.weight": torch.zeros(3, 3)})
    except ValueError as exc:
        errors.append(str(exc))
    return {"saved": saved, "loaded": loaded, "first": first.full_state_dict(),
            "second": second.full_state_dict(), "errors": errors}


@pytest.mark.timeout(240)
@pytest.mark.parametrize("world", [2, 3])
def test_full_state_dict_round_trip(world: int) -> None:
    results = run_distributed(_round_trip, world)
    torch.manual_seed(0)
    reference_keys = list(FeatureNet().state_dict())
    for result in results:
        saved = result["saved"]
        assert list(saved) == reference_keys
        assert all(t.device.type == "cpu" for t in saved.values())
        assert torch.equal(saved["embed.weight"], saved["head.weight"])          # tied, under both names
        for key in reference_keys:
            assert torch.equal(result["loaded"][key], saved[key]), key
            assert torch.equal(result["first"][key], result["second"][key]), key
            assert torch.equal(saved[key], results[0]["saved"][key]), key      # same on every rank
        assert "head.weight" in result["errors"][0]
        assert "blocks.0.up.weight" in result["errors"][1] and "(3, 3)" in result["errors"][1]
