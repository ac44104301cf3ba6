"""Hybrid sharding on one host whose 4 ranks are told they form 2 nodes of 2
(LOCAL_WORLD_SIZE=2): trained with SGD, it equals one process on the same global batches.

SGD, not AdamW: Adam divides each gradient by the root of its own second moment, so a gradient
off by a constant factor (a reduction averaged over the shard group instead of every rank, or
averaged twice) trains almost the same. Under SGD the update is the learning rate times the
gradient, so the final weights carry the gradient's scale; the test checks that a gradient of
the wrong scale would move the weights by far more than its tolerance.
"""
from __future__ import annotations

import dataclasses
import math
import os

import pytest
import torch

from distributed import run_distributed
from parity import Case, train
from parity_cases import CASES

# SGD with momentum (parity.Case's default optimizer). features: a unit skipped on one step, a
# forward that raises inside a unit, evaluation forwards; features_bucketed: the same with
# merged units; gpt_no_sync: no_sync micro-batches.
HYBRID_CASES = ["features", "features_bucketed", "gpt_no_sync"]
WORLD, PER_NODE = 4, 2


def _hybrid(name: str) -> Case:
    case = CASES[name]
    return dataclasses.replace(case, wrap={**case.wrap, "sharding": "hybrid"})


def _train_hybrid(rank: int, world: int, names: list[str]) -> dict:
    os.environ["LOCAL_WORLD_SIZE"] = str(PER_NODE)
    return {name: train(_hybrid(name), rank, world, sharded=True) for name in names}


def _update(state: dict, initial: dict) -> torch.Tensor:
    return torch.cat([(state[k] - initial[k]).flatten().float() for k in sorted(initial)])


@pytest.mark.timeout(400)
def test_hybrid_with_sgd_trains_like_one_process() -> None:
    per_rank = run_distributed(_train_hybrid, WORLD, HYBRID_CASES, timeout=360)
    for name in HYBRID_CASES:
        case = CASES[name]
        assert case.optimizer == "sgd", name
        got, ref = per_rank[0][name], train(case)
        assert got["sharding"].startswith("hybrid sharding"), got["sharding"]
        assert all(math.isfinite(loss) for loss in got["losses"]), got["losses"]
        tol = {"rtol": case.rtol, "atol": case.atol}
        torch.testing.assert_close(torch.tensor(got["losses"]), torch.tensor(ref["losses"]), **tol)
        for rank, outcome in enumerate(per_rank[1:], 1):       # replicas and shards agree
            for key, value in got["state"].items():
                assert torch.equal(outcome[name]["state"][key], value), f"{name} rank {rank}: {key}"
        for key, expected in ref["state"].items():
            torch.testing.assert_close(got["state"][key], expected, **tol, msg=lambda m: f"{name} {key}: {m}")
        # The weights moved by far more than the tolerance, so a gradient scaled by the
        # number of replicas (2) or shards (2) would have failed the comparison above.
        torch.manual_seed(0)
        initial = {k: v.detach().clone() for k, v in case.build().state_dict().items()}
        update, ref_update = _update(got["state"], initial), _update(ref["state"], initial)
        assert ref_update.abs().max() > 100 * case.atol, name
        assert (update - ref_update).norm() / ref_update.norm() < 0.01, name
