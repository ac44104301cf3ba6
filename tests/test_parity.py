"""Sharded training equals one process training on the same global batches."""
from __future__ import annotations

import functools

import pytest
import torch

from distributed import run_distributed
from parity import train
from parity_cases import CASES, run_sharded_cases

WORLD_SIZES = [1, 2, 3, 4]


@functools.lru_cache(maxsize=None)
def _sharded(world: int) -> dict:
    """All cases at one world size, in one group of processes (rank 0's view)."""
    return run_distributed(run_sharded_cases, world, list(CASES), timeout=600)[0]


@functools.lru_cache(maxsize=None)
def _reference(name: str) -> dict:
    return train(CASES[name])


@pytest.mark.timeout(900)
@pytest.mark.parametrize("world", WORLD_SIZES)
@pytest.mark.parametrize("name", list(CASES))
def test_matches_single_process(name: str, world: int) -> None:
    case, ref, got = CASES[name], _reference(name), _sharded(world)[name]
    tol = {"rtol": case.rtol, "atol": case.atol}
    torch.testing.assert_close(torch.tensor(got["losses"]), torch.tensor(ref["losses"]), **tol)
    torch.testing.assert_close(torch.tensor(got["norms"]), torch.tensor(ref["norms"]), **tol)
    torch.testing.assert_close(torch.tensor(got["eval_losses"]), torch.tensor(ref["eval_losses"]), **tol)
    assert list(got["state"]) == list(ref["state"])
    for key, expected in ref["state"].items():
        torch.testing.assert_close(got["state"][key], expected, **tol, msg=lambda m: f"{key}: {m}")


def test_training_moves_the_parameters() -> None:
    """Guards the comparison above against a run that never changes anything."""
    ref = _reference("features")
    torch.manual_seed(0)
    initial = CASES["features"].build().state_dict()
    moved = [k for k, v in ref["state"].items() if not torch.equal(v, initial[k])]
    assert "blocks.0.up.weight" in moved and "embed.weight" in moved
    assert "blocks.1.up.weight" not in moved          # frozen
