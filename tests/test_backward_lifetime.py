"""A unit's gathered parameters stay until every backward node that reads them has run,
frozen ones included (see [Note: when a unit is freed in backward] in overlap/runtime/scheduler.py)."""
from __future__ import annotations

import pytest
import torch

from distributed import run_distributed
from models import LateFrozenNet
from parity import Case, train, token_batches

CASE = Case("late_frozen", LateFrozenNet, lambda model, batch: model(*batch), token_batches(37, 6, 3),
            wrap={"bucket_mb": 1e-4, "prefetch_depth": 1})


def _sharded(rank: int, world: int) -> dict:
    return train(CASE, rank, world, sharded=True)


@pytest.mark.timeout(180)
@pytest.mark.parametrize("world", [1, 2])
def test_frozen_weights_read_after_the_trainable_gradient(world: int) -> None:
    got, ref = run_distributed(_sharded, world, timeout=150)[0], train(CASE)
    torch.testing.assert_close(torch.tensor(got["losses"]), torch.tensor(ref["losses"]), rtol=1e-4, atol=1e-5)
    for key, expected in ref["state"].items():
        torch.testing.assert_close(got["state"][key], expected, rtol=1e-4, atol=1e-5, msg=lambda m: f"{key}: {m}")
    torch.manual_seed(0)
    initial = LateFrozenNet().state_dict()
    # The embedding's gradient passes through every frozen projection's backward.
    assert not torch.equal(ref["state"]["embed.weight"], initial["embed.weight"])
    assert torch.equal(ref["state"]["blocks.0.proj.weight"], initial["blocks.0.proj.weight"])
