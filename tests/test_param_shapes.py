"""Each parameter of a ShardedModule has its module parameter's dimensions: this rank's
block of whole rows, trailing dimensions intact, `.grad` of the same shape; the blocks of all
ranks, in rank order, are the parameter."""
from __future__ import annotations

import pytest
import torch

from distributed import run_distributed
from models import Block, FeatureNet, Tiny

from overlap.models import GPT, GPTConfig

SMALL_GPT = GPTConfig(vocab_size=64, block_size=16, n_layer=2, n_head=2, n_embd=32)


def _models() -> dict:
    return {"gpt": (lambda: GPT(SMALL_GPT), {}), "features": (FeatureNet, {"unit_types": (Block, Tiny)})}


def _parts(rank: int, world: int) -> dict:
    from overlap import ShardedModule

    out = {}
    for name, (build, wrap) in _models().items():
        torch.manual_seed(0)
        model = ShardedModule(build(), **wrap)
        tokens = torch.randint(0, 37, (2, 6), generator=torch.Generator().manual_seed(rank))
        model(tokens, tokens).backward()
        out[name] = {key: (p.detach().clone(), None if p.grad is None else tuple(p.grad.shape))
                     for key, p in model.named_parameters()}
    return out


@pytest.mark.timeout(300)
@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_parts_keep_the_parameters_dimensions(world: int) -> None:
    results = run_distributed(_parts, world)
    for name, (build, _) in _models().items():
        torch.manual_seed(0)
        reference = dict(build().named_parameters())
        assert list(results[0][name]) == list(reference)
        for key, full in reference.items():
            parts = [result[name][key] for result in results]
            for part, grad_shape in parts:
                assert part.dim() == max(full.dim(), 1), (key, part.shape)
                assert part.shape[1:] == full.shape[1:], (key, part.shape)
                assert grad_shape in (None, tuple(part.shape)), (key, grad_shape)
            rows = torch.cat([part for part, _ in parts]) if full.dim() else torch.cat([p for p, _ in parts])
            torch.testing.assert_close(rows.reshape(full.shape), full.detach(), rtol=0, atol=0, msg=key)
            # nanoGPT's grouping gives the same groups as one process.
            assert all((part.dim() >= 2) == (full.dim() >= 2) for part, _ in parts), key
