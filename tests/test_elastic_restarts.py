"""`overlap train` under torchrun on the emulated two-node cluster (benchmarks/cluster.py):
workers killed mid-step and during an asynchronous save, on either node, in one job (and,
marked slow, before the first checkpoint, in a job of its own); every restart meets again on
both nodes and the job ends on the uninterrupted run's final loss. A node removed for good leaves an elastic job (`--nnodes
1:2`) finishing on the other node alone, on the same global batches; one that comes back
grows the job to two nodes again (marked slow: a second elastic job)."""
from __future__ import annotations

import os
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

STEPS = 15         # checkpoints at 5 and 10: each kill point has one to come after
ARGV = [*JOB, "--steps", str(STEPS), "--checkpoint-every", "5"]
# A kill mid-step and one during a save, on nodes 0 and 1, in one job: two restarts, each from
# a checkpoint. A kill before the first checkpoint (a restart from step 0) is its own job, in
# the slow tier; repeated kills per point are measured by benchmarks/recovery.py --runs.
KILLS = ["step", "save"]
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


def _last_round(outcome) -> str:
    return outcome.logs[0].rsplit("overlap train: GPT ", 1)[-1]


@needs_cluster
@pytest.mark.slow          # 21 s alone, 75 s beside CI's other worker: benchmarks/recovery.py runs these kills
@pytest.mark.timeout(JOB_TIMEOUT_S + 120)
def test_workers_killed_mid_step_and_during_a_save_restart_on_both_nodes_and_end_exactly(tmp_path, reference):
    outcome = run_schedule(str(tmp_path), ARGV, KILLS, timeout_s=JOB_TIMEOUT_S)
    for kill in outcome.kills:
        assert kill.fired and kill.recovered_s is not None, (kill, _logs(outcome))
    step, save = outcome.kills
    assert [kill.node for kill in outcome.kills] == [0, 1]
    assert step.newest is not None and step.at_step > step.newest and step.resumed_at >= step.newest, step
    # The save being written when its worker died is passed over: the previous one is resumed.
    assert save.during_save and save.resumed_at == save.newest < save.saving, save
    assert outcome.returncodes == [0, 0], _logs(outcome)
    assert [r.world for r in outcome.rounds] == [2] * (len(KILLS) + 1), outcome.rounds
    assert outcome.final == reference, _logs(outcome)


@needs_cluster
@pytest.mark.slow
@pytest.mark.timeout(JOB_TIMEOUT_S + 120)
def test_a_worker_killed_before_the_first_checkpoint_restarts_from_step_0_and_ends_exactly(tmp_path, reference):
    outcome = run_schedule(str(tmp_path), ARGV, ["start"], timeout_s=JOB_TIMEOUT_S)
    start, = outcome.kills
    assert start.fired and start.recovered_s is not None, (start, _logs(outcome))
    assert start.newest is None and start.resumed_at == 0, start
    assert outcome.returncodes == [0, 0], _logs(outcome)
    assert outcome.final == reference, _logs(outcome)


@pytest.mark.slow          # two emulated nodes, one lost for good (about 55 s under CI's load): in `make test-all`
@needs_cluster
@pytest.mark.timeout(JOB_TIMEOUT_S + 120)
def test_a_node_removed_for_good_leaves_the_job_finishing_on_one_node(tmp_path, reference):
    outcome = run_schedule(str(tmp_path), ARGV, ["node"], nnodes="1:2", timeout_s=JOB_TIMEOUT_S)
    kill = outcome.kills[0]
    assert kill.fired and kill.recovered_s is not None, (kill, _logs(outcome))
    assert kill.newest is not None and kill.resumed_at >= kill.newest > 0, kill
    assert outcome.returncodes[0] == 0, _logs(outcome)
    assert outcome.rounds[-1].world == 1 and outcome.rounds[-2].world == 2, outcome.rounds
    last_round = _last_round(outcome)
    assert "on 1 CPU ranks (gloo)" in last_round and "batch 4/rank x 2 accumulated" in last_round, last_round
    assert "resumed from " in last_round and f" at step {kill.resumed_at}\n" in last_round, last_round
    step, loss, val = outcome.final
    assert step == STEPS
    assert abs(loss - reference[1]) <= WORLD_1_TOLERANCE and abs(val - reference[2]) <= WORLD_1_TOLERANCE, \
        (outcome.final, reference)


@needs_cluster
@pytest.mark.slow
@pytest.mark.timeout(JOB_TIMEOUT_S + 120)
def test_a_removed_node_that_comes_back_grows_the_job_to_two_nodes_again(tmp_path, reference):
    outcome = run_schedule(str(tmp_path), ARGV, ["node", "rejoin"], nnodes="1:2", timeout_s=JOB_TIMEOUT_S)
    removed, rejoined = outcome.kills
    for kill in outcome.kills:
        assert kill.fired and kill.recovered_s is not None, (kill, _logs(outcome))
    assert [r.world for r in outcome.rounds][-3:] == [2, 1, 2], outcome.rounds
    # Node 0 alone saved a checkpoint of its own, and the two nodes resumed from it.
    assert rejoined.newest > removed.resumed_at and rejoined.resumed_at >= rejoined.newest, outcome.kills
    assert outcome.returncodes == [0, 0], _logs(outcome)
    assert "batch 4/rank;" in _last_round(outcome), _last_round(outcome)
    step, loss, val = outcome.final
    assert step == STEPS
    assert abs(loss - reference[1]) <= WORLD_1_TOLERANCE and abs(val - reference[2]) <= WORLD_1_TOLERANCE, \
        (outcome.final, reference)


def test_a_world_size_that_cannot_split_the_global_batch_is_refused():
    assert list(shards_of_rank(4, 1, 2)) == [2, 3]
    assert list(shards_of_rank(2, 0, 1)) == [0, 1]
    with pytest.raises(JobError, match=r"3 ranks cannot split it evenly: use a world size \(under --pp: world / "
                                       r"--pp\) that divides 2"):
        shards_of_rank(2, 0, 3)
