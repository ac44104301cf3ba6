"""Full state dicts: the wrapped module's keys, full CPU tensors on every rank, round trips."""
from __future__ import annotations

import os

import pytest
import torch

from distributed import CaseLaunch, RankCase
from models import Block, FeatureNet, Tiny

STEPS = 2


@pytest.fixture(scope="module")
def directory(tmp_path_factory) -> str:
    return str(tmp_path_factory.mktemp("state_dict"))


@pytest.fixture(scope="module")
def launches(directory: str) -> dict[int, CaseLaunch]:
    """One launch per world size, its cases in turn (tests/distributed.py's [Note: many cases
    on one launch])."""
    return {world: CaseLaunch({"round-trip": RankCase(_round_trip),
                               "export-hf": RankCase(_export_hf, (os.path.join(directory, f"hf-{world}"),)),
                               "dcp": RankCase(_dcp_round_trip, (os.path.join(directory, f"dcp-{world}"),))},
                              world_size=world, timeout=500)
            for world in (2, 3)}


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
    except RuntimeError as exc:
        errors.append(str(exc))
    try:
        second.load_full_state_dict({**saved, "blocks.0.up.weight": torch.zeros(3, 3)})
    except ValueError as exc:
        errors.append(str(exc))
    return {"saved": saved, "loaded": loaded, "first": first.full_state_dict(),
            "second": second.full_state_dict(), "errors": errors}


@pytest.mark.timeout(600)
@pytest.mark.parametrize("world", [2, 3])
def test_full_state_dict_round_trip(world: int, launches: dict) -> None:
    results = [outcome.result() for outcome in launches[world]["round-trip"]]
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


def _export_hf(rank: int, world: int, directory: str) -> dict:
    from parity_cases import _hf_gpt2
    from transformers import GPT2LMHeadModel

    from overlap import ShardedModule

    torch.manual_seed(0)
    model = ShardedModule(_hf_gpt2())
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    tokens = torch.randint(0, 61, (2 * world, 12), generator=torch.Generator().manual_seed(3))
    model(input_ids=tokens[2 * rank:2 * rank + 2], labels=tokens[2 * rank:2 * rank + 2]).loss.backward()
    optimizer.step()
    full = model.full_state_dict(rank0_only=True)
    with torch.no_grad():
        logits = model(input_ids=tokens).logits
    if rank == 0:
        plain = GPT2LMHeadModel(model.config)
        plain.load_state_dict(full)
        plain.save_pretrained(directory)
    return {"keys": list(full), "logits": logits}


@pytest.mark.timeout(600)
@pytest.mark.parametrize("world", [2, 3])
def test_rank0_export_saves_with_save_pretrained(world: int, launches: dict, directory: str) -> None:
    from transformers import GPT2LMHeadModel

    results = [outcome.result() for outcome in launches[world]["export-hf"]]
    assert results[0]["keys"] and all(result["keys"] == [] for result in results[1:])
    plain = GPT2LMHeadModel.from_pretrained(os.path.join(directory, f"hf-{world}"))
    tokens = torch.randint(0, 61, (2 * world, 12), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        expected = plain(input_ids=tokens).logits
    for result in results:
        torch.testing.assert_close(result["logits"], expected, rtol=1e-5, atol=1e-5)


def _dcp_round_trip(rank: int, world: int, path: str) -> dict:
    import warnings

    import torch.distributed.checkpoint as dcp
    from torch.distributed.tensor import DTensor

    from overlap import ShardedModule

    torch.manual_seed(0)
    first = ShardedModule(FeatureNet(), unit_types=(Block, Tiny))
    _train(first, torch.optim.SGD(first.parameters(), lr=0.1), 1, rank, world)
    with warnings.catch_warnings():
        warnings.simplefilter("error", FutureWarning)          # ShardedTensor's deprecation would raise
        state = first.state_dict()
        dcp.save(state, checkpoint_id=path)
    torch.manual_seed(123)
    second = ShardedModule(FeatureNet(), unit_types=(Block, Tiny))
    target = second.state_dict()
    dcp.load(target, checkpoint_id=path)
    second.load_state_dict(target)
    reference = FeatureNet().state_dict()
    return {"dtensors": {k: isinstance(v, DTensor) and tuple(v.shape) == tuple(reference[k].shape)
                         for k, v in state.items() if k in dict(first.named_parameters())},
            "first": first.full_state_dict(), "second": second.full_state_dict()}


@pytest.mark.timeout(600)
@pytest.mark.parametrize("world", [2, 3])
def test_state_dict_is_dtensors_that_dcp_saves_and_loads(world: int, launches: dict) -> None:
    for result in (outcome.result() for outcome in launches[world]["dcp"]):
        assert result["dtensors"] and all(result["dtensors"].values()), result["dtensors"]
        for key, value in result["first"].items():
            assert torch.equal(result["second"][key], value), key
