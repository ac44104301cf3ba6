"""`overlap train` under torchrun on the emulated two-node cluster (benchmarks/cluster.py):
workers killed before the first checkpoint, mid-step and during an asynchronous save, on
either node, in one job; every restart meets again on both nodes and the job ends on the
uninterrupted run's final loss. A node removed for good leaves an elastic job (`--nnodes
1:2`) finishing on the other node alone, on the same global batches."""
from __future__ import annotations

import os
import re
import sys

import pytest
import torch

from distributed import run_distributed

from overlap.train.batches import shards_of_rank
from overlap.train.options import JobError, build_parser

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks"))

from cluster import why_no_cluster                 # noqa: E402
from recovery import JOB, run_schedule             # noqa: E402

REASON = why_no_cluster()
needs_cluster = pytest.mark.skipif(REASON is not None, reason=f"emulated cluster: {REASON}")

STEPS = 30
ARGV = [*JOB, "--steps", str(STEPS), "--checkpoint-every", "5"]
# Each kill point twice, on node 0 then node 1 (kills alternate), in one job: six restarts.
KILLS = ["start", "start", "step", "step", "save", "save"]
# Node 0 alone accumulates both shards of each global batch: the same sums in another order.
WORLD_1_TOLERANCE = 1e-4
JOB_TIMEOUT_S = 300


def _uninterrupted(rank: int, world: int, argv: list[str]) -> tuple[str, str]:
    from overlap.train.rank import train

    losses = train(build_parser().parse_args(argv), torch.device("cpu"))
    return f"{losses.train:.8f}", f"{losses.val:.8f}"


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> tuple[int, float, float]:
    directory = tmp_path_factory.mktemp("uninterrupted")
    loss, val = run_distributed(_uninterrupted, 2, [*ARGV, "--checkpoint-dir", str(directory)], timeout=200)[0]
    return STEPS, float(loss), float(val)


def _logs(outcome) -> str:
    return "\n".join(f"--- node {node} ---\n{log[-6000:]}" for node, log in enumerate(outcome.logs))


@needs_cluster
@pytest.mark.timeout(JOB_TIMEOUT_S + 240)
def test_workers_killed_at_each_point_restart_on_both_nodes_and_end_exactly(tmp_path, reference):
    outcome = run_schedule(str(tmp_path), ARGV, KILLS, timeout_s=JOB_TIMEOUT_S)
    for kill in outcome.kills:
        assert kill.recovered_s is not None, (kill, _logs(outcome))
    assert [kill.node for kill in outcome.kills] == [0, 1, 0, 1, 0, 1]
    assert all(kill.during_save for kill in outcome.kills if kill.point == "save"), outcome.kills
    assert outcome.returncodes == [0, 0], _logs(outcome)
    assert len(re.findall(r"^overlap train: GPT ", outcome.logs[0], re.M)) == len(KILLS) + 1
    assert outcome.final == reference, _logs(outcome)


@needs_cluster
@pytest.mark.timeout(JOB_TIMEOUT_S + 240)
def test_a_node_removed_for_good_leaves_the_job_finishing_on_one_node(tmp_path, reference):
    outcome = run_schedule(str(tmp_path), ARGV, ["node"], nnodes="1:2", timeout_s=JOB_TIMEOUT_S)
    assert outcome.kills[0].recovered_s is not None, _logs(outcome)
    assert outcome.returncodes[0] == 0, _logs(outcome)
    last_round = outcome.logs[0].rsplit("overlap train: GPT ", 1)[-1]
    assert "on 1 CPU ranks (gloo)" in last_round and "batch 4/rank x 2 accumulated" in last_round, last_round
    assert re.search(r"^resumed from \S+ at step ([1-9]\d*)$", last_round, re.M), last_round
    step, loss, val = outcome.final
    assert step == STEPS and torch.isfinite(torch.tensor(loss))
    assert abs(loss - reference[1]) <= WORLD_1_TOLERANCE and abs(val - reference[2]) <= WORLD_1_TOLERANCE, \
        (outcome.final, reference)


def test_a_world_size_that_cannot_split_the_global_batch_is_refused():
    assert list(shards_of_rank(4, 1, 2)) == [2, 3]
    assert list(shards_of_rank(2, 0, 1)) == [0, 1]
    with pytest.raises(JobError, match="3 ranks cannot split it evenly: use a world size that divides 2"):
        shards_of_rank(2, 0, 3)
