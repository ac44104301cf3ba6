"""`overlap train --checkpoint-dir`: a run stopped and started again, or one whose rank is
killed under `torchrun --max-restarts`, ends exactly where an uninterrupted run ends."""
from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time

import pytest
import torch

from overlap.checkpoint import latest_checkpoint
from overlap.train.batches import ByteBatches
from overlap.train.job import main

STEPS = 30              # the fewest that cross two checkpoints and a `step N:` window spanning one
EVERY = 10              # steps between checkpoints
# --eval-every is not a multiple of EVERY, so the train-loss window of a `step N:` line
# spans a checkpoint; fixed --bucket-mb and --prefetch-depth give every run the same layout.
TINY = ["--layers", "2", "--hidden", "32", "--heads", "2", "--seq", "32", "--batch", "4", "--lr", "1e-2",
        "--eval-every", "7", "--checkpoint-every", str(EVERY), "--bucket-mb", "1", "--prefetch-depth", "1"]
RUN_TIMEOUT_S = 180

FINAL = re.compile(r"^final step (\d+): loss ([\d.]+) .*, val loss ([\d.]+)$", re.M)
STEP_LINE = re.compile(r"^step (\d+): train loss [\d.]+, val loss [\d.]+$", re.M)
RESUMED = re.compile(r"^resumed from (\S+) at step (\d+)$", re.M)


def _env() -> dict:
    env = {key: value for key, value in os.environ.items() if not key.startswith(("TORCHELASTIC_", "OVERLAP_"))}
    env["OMP_NUM_THREADS"] = "1"
    return env


# The pipeline job at (pp 2, dp 2): its stages take no --bucket-mb nor --prefetch-depth.
PIPELINE = [*TINY[:TINY.index("--bucket-mb")], "--pp", "2", "--microbatches", "2"]


def _train(workdir, *argv: str, job: list[str] = TINY) -> str:
    """The self-launched job (2 gloo ranks unless `argv` says otherwise); its stdout."""
    done = subprocess.run([sys.executable, "-m", "overlap", "train", *job, *argv], cwd=workdir, env=_env(),
                          capture_output=True, text=True, timeout=RUN_TIMEOUT_S)
    assert done.returncode == 0, done.stdout + done.stderr
    return done.stdout


def _final(out: str) -> tuple[int, float, float]:
    found = FINAL.findall(out)
    assert found, out
    step, loss, val = found[-1]
    return int(step), float(loss), float(val)


def _step_lines(out: str, after: int) -> list[str]:
    return [m.group(0) for m in STEP_LINE.finditer(out) if int(m.group(1)) > after]


def _assert_same_end(out: str, reference: str, resumed_at: int) -> None:
    step, loss, val = _final(out)
    ref_step, ref_loss, ref_val = _final(reference)
    assert step == ref_step == STEPS
    assert abs(loss - ref_loss) <= 1e-5 and abs(val - ref_val) <= 1e-5, (out, reference)
    assert _step_lines(out.split("resumed from", 1)[-1], resumed_at) == _step_lines(reference, resumed_at)


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory) -> str:
    workdir = tmp_path_factory.mktemp("uninterrupted")
    out = _train(workdir, "--steps", str(STEPS), "--checkpoint-dir", "ckpt")
    assert "resumed from" not in out
    assert re.search(r"^checkpoints: \d+ saves, [\d.]+ m?s blocking each \(median", out, re.M), out
    assert sorted(os.listdir(workdir / "ckpt")) == [f"step-{s:08d}" for s in range(EVERY, STEPS + 1, EVERY)]
    return out


@pytest.mark.timeout(3 * RUN_TIMEOUT_S)
def test_a_second_run_with_more_steps_continues_exactly(uninterrupted, tmp_path):
    half = STEPS // 2
    # The first run stops at `half` on the learning-rate schedule of the whole run.
    first = _train(tmp_path, "--steps", str(half), "--schedule-steps", str(STEPS), "--checkpoint-dir", "ckpt")
    assert _final(first)[0] == half
    second = _train(tmp_path, "--steps", str(STEPS), "--checkpoint-dir", "ckpt")
    assert RESUMED.findall(second) == [(os.path.join("ckpt", f"step-{half:08d}"), str(half))]
    _assert_same_end(second, uninterrupted, half)


def _torchrun() -> list[str]:
    script = os.path.join(os.path.dirname(sys.executable), "torchrun")
    return [script] if os.path.exists(script) else [sys.executable, "-m", "torch.distributed.run"]


def _worker_of_rank(agent: int, rank: int) -> int:
    """The pid of torchrun's worker process with that RANK."""
    for task in os.listdir(f"/proc/{agent}/task"):
        with open(f"/proc/{agent}/task/{task}/children") as f:
            for child in f.read().split():
                with open(f"/proc/{child}/environ", "rb") as env:
                    if f"RANK={rank}".encode() in env.read().split(b"\0"):
                        return int(child)
    raise AssertionError(f"torchrun ({agent}) has no worker with RANK={rank}")


@pytest.mark.timeout(3 * RUN_TIMEOUT_S)
def test_a_killed_rank_restarts_under_torchrun_and_ends_the_same(uninterrupted, tmp_path):
    _kill_and_restart(tmp_path, 2, TINY, uninterrupted)


@pytest.mark.slow          # two four-rank runs (about 40 s under load): in `make test-all`
@pytest.mark.timeout(4 * RUN_TIMEOUT_S)
def test_a_killed_pipeline_rank_restarts_under_torchrun_and_ends_the_same(tmp_path):
    """--pp 2 over four ranks: each stage's state comes back from the checkpoint under the
    whole model's names."""
    reference = tmp_path / "uninterrupted"
    reference.mkdir()
    uninterrupted = _train(reference, "--world-size", "4", "--steps", str(STEPS), "--checkpoint-dir", "ckpt",
                           job=PIPELINE)
    _kill_and_restart(tmp_path, 4, PIPELINE, uninterrupted)


def _kill_and_restart(tmp_path, ranks: int, job: list[str], uninterrupted: str) -> None:
    """The job under `torchrun --max-restarts 3`, rank 0 killed once a checkpoint is complete:
    it restarts, resumes and ends as `uninterrupted` did."""
    checkpoints = tmp_path / "ckpt"
    log = tmp_path / "torchrun.log"
    command = [*_torchrun(), "--standalone", "--nproc-per-node", str(ranks), "--max-restarts", "3",
               "-m", "overlap", "train", *job, "--steps", str(STEPS), "--checkpoint-dir", str(checkpoints)]
    with open(log, "w") as sink:
        # LOGLEVEL=INFO: torchrun's agent says when it restarts the worker group.
        agent = subprocess.Popen(command, cwd=tmp_path, env=dict(_env(), LOGLEVEL="INFO"), stdout=sink,
                                 stderr=subprocess.STDOUT)
        try:
            deadline = time.monotonic() + RUN_TIMEOUT_S
            while latest_checkpoint(checkpoints) is None:
                assert agent.poll() is None, log.read_text()
                assert time.monotonic() < deadline, "no checkpoint was completed in time\n" + log.read_text()
                time.sleep(0.02)
            os.kill(_worker_of_rank(agent.pid, rank=0), signal.SIGKILL)
            returncode = agent.wait(timeout=max(1.0, deadline - time.monotonic()))
        finally:
            if agent.poll() is None:
                agent.kill()
                agent.wait()
    out = log.read_text()
    assert returncode == 0, out
    assert re.search(r"failed \(exitcode: -9\) local_rank: 0", out), out
    assert "will restart worker group" in out and "restart_count=1" in out, out
    assert len(re.findall(r"^overlap train: GPT ", out, re.M)) == 2, out      # the job started twice
    resumed = RESUMED.findall(out)
    assert len(resumed) == 1, out
    path, step = resumed[0]
    assert path.startswith(str(checkpoints)) and EVERY <= int(step) < STEPS, out
    _assert_same_end(out, uninterrupted, int(step))


def test_batches_depend_on_seed_shard_and_draw_only():
    text = bytes(range(256)) * 8
    batches = ByteBatches(text, seq=8, device=torch.device("cpu"), seed=3)
    later = batches.get("train", 4, draw=7, shard=1)
    batches.get("train", 4, draw=0)
    again = ByteBatches(text, seq=8, device=torch.device("cpu"), seed=3)
    assert all(torch.equal(a, b) for a, b in zip(later, again.get("train", 4, draw=7, shard=1)))
    for other in (again.get("train", 4, draw=7, shard=0),
                  ByteBatches(text, seq=8, device=torch.device("cpu"), seed=4).get("train", 4, draw=7, shard=1),
                  again.get("train", 4, draw=8, shard=1)):
        assert not torch.equal(later[0], other[0])


def test_checkpoint_every_needs_a_directory(capsys):
    assert main(["--checkpoint-every", "10"]) == 2
    assert "--checkpoint-every 10 needs --checkpoint-dir" in capsys.readouterr().err


def test_an_unusable_checkpoint_dir_is_named(tmp_path, capsys):
    blocker = tmp_path / "file"
    blocker.write_text("")
    assert main(["--checkpoint-dir", str(blocker / "ckpt")]) == 2
    assert f"--checkpoint-dir {str(blocker / 'ckpt')!r} cannot be made" in capsys.readouterr().err
