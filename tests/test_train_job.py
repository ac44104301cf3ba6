"""`overlap train`: the whole job through its own launcher, with tiny settings, and its errors."""
from __future__ import annotations

import json
import math
import os
import re
import subprocess
import sys

import pytest
import torch

from overlap.train.batches import ByteBatches
from overlap.train.job import main

TINY = ["--steps", "16", "--eval-every", "8", "--layers", "2", "--hidden", "32", "--heads", "2", "--seq", "32",
        "--batch", "8", "--lr", "1e-2", "--sample", "1", "--sample-len", "24"]


@pytest.fixture(scope="module")
def job(tmp_path_factory):
    """One self-launched run (2 gloo ranks) with --trace; shared by the tests below."""
    workdir = tmp_path_factory.mktemp("train")
    env = dict(os.environ, OMP_NUM_THREADS="1")
    env.pop("TORCHELASTIC_RUN_ID", None)      # make sure the job launches its own ranks
    done = subprocess.run([sys.executable, "-m", "overlap", "train", *TINY, "--trace", "trace"], cwd=workdir,
                          env=env, capture_output=True, text=True, timeout=150)
    assert done.returncode == 0, done.stdout + done.stderr
    return workdir, done.stdout


@pytest.mark.timeout(180)
def test_train_prints_a_falling_loss_and_the_report(job):
    _, out = job
    losses = [float(x) for x in re.findall(r"^step \d+: train loss ([\d.]+), val loss [\d.]+$", out, re.M)]
    assert len(losses) == 2, out
    assert losses[-1] < losses[0] < 5.6, out      # starts near ln(256) = 5.55 and falls
    assert re.search(r"^communication [\d.]+ m?s/step, \d+% hidden, exposed [\d.]+ m?s$", out, re.M), out
    assert re.search(r"^blocks\.0[ .]", out, re.M), out     # a per-unit row (blocks may share a bucket)
    assert "--- sample 1 ---" in out


@pytest.mark.timeout(180)
def test_trace_writes_chrome_traces_and_a_timeline(job):
    workdir, _ = job
    for rank in (0, 1):
        with open(workdir / "trace" / f"trace_rank{rank}.json") as f:
            names = {event.get("name", "") for event in json.load(f)["traceEvents"]}
        assert any(name.startswith("overlap::all_gather::blocks.") for name in names)
        assert any(name.startswith("overlap::pre_backward::blocks.") for name in names)
    with open(workdir / "trace" / "timeline.png", "rb") as f:
        assert f.read(8) == b"\x89PNG\r\n\x1a\n"


@pytest.mark.parametrize("argv, message", [
    (["--hidden", "30", "--heads", "4"], "--hidden 30 must be a multiple of --heads 4"),
    (["--data", "no/such/file.txt"], "--data 'no/such/file.txt' cannot be read"),
    (["--seq", "100000"], "--seq 100000 is too long"),
])
def test_bad_settings_are_named(argv, message, capsys):
    assert main(argv) == 2
    assert message in capsys.readouterr().err


def test_bad_option_values_are_rejected(capsys):
    with pytest.raises(SystemExit):
        main(["--steps", "0"])
    assert "--steps" in capsys.readouterr().err


def test_batches_are_next_byte_targets():
    text = bytes(range(200))
    batches = ByteBatches(text, seq=8, device=torch.device("cpu"), seed=0)
    inputs, targets = batches.get("train", 4)
    assert inputs.shape == targets.shape == (4, 8)
    assert torch.equal(inputs[:, 1:], targets[:, :-1])
    assert int(inputs.max()) < 180           # train split: the first 90%
    val_inputs, _ = batches.get("val", 2)
    assert int(val_inputs.min()) >= 180


def _both_builds(rank: int, world: int, argv: list[str]) -> list:
    from overlap.train.options import build_parser
    from overlap.train.rank import train

    finals = []
    for build in ([], ["--eager-init"]):
        losses = train(build_parser().parse_args([*argv, *build]), torch.device("cpu"))
        finals.append((losses.train, losses.val))
    return finals


@pytest.mark.timeout(200)
def test_meta_build_trains_exactly_like_the_eager_build():
    """The job builds on the meta device by default; --eager-init builds the whole model
    first. Same values, so the same final train and validation losses, bit for bit (bucket
    size and depth fixed: the planner's choice changes which rank sums which element first).
    Both builds on one launch of the job's ranks: the launcher is tested by the run above."""
    from distributed import run_distributed

    # Four steps, no samples: the values the two builds start from show in the first losses.
    short = [*TINY, "--steps", "4", "--eval-every", "2", "--sample", "0", "--bucket-mb", "1", "--prefetch-depth", "1"]
    for meta, eager in run_distributed(_both_builds, 2, short, timeout=180):
        assert all(math.isfinite(x) for x in meta) and meta == eager, (meta, eager)


# Every pairing of precision, offload tier and compression the job accepts, with the other
# flags spread over them; each trains two steps, saving and evaluating at each.
ACCEPTED = [
    ["--mixed-precision", "fp32", "--offload", "none", "--compress", "int8"],
    ["--mixed-precision", "fp32", "--offload", "cpu", "--compress", "int8-int4", "--eager-init"],
    ["--mixed-precision", "bf16", "--offload", "none", "--compress", "auto", "--prefetch-depth", "0"],
    ["--mixed-precision", "bf16", "--offload", "cpu", "--compress", "none", "--sample", "1", "--sample-len", "4"],
    ["--mixed-precision", "bf16", "--offload", "disk", "--compress", "none"],
    ["--mixed-precision", "bf16", "--offload", "disk", "--eager-init", "--prefetch-depth", "0"],
    ["--mixed-precision", "bf16", "--offload", "cpu", "--compile"],
    ["--mixed-precision", "bf16", "--offload", "disk", "--compile"],
]
# Pairings the runtime refuses, and the reason each rank must give.
REFUSED = [
    (["--mixed-precision", "bf16", "--offload", "disk", "--compress", "int8"], "offload='disk' with compression"),
]
FEW = ["--steps", "2", "--eval-every", "1", "--layers", "2", "--hidden", "32", "--heads", "2", "--seq", "16",
       "--batch", "2", "--checkpoint-every", "1"]


def _try_train(argv: list[str]):
    """The job's final losses, or the JobError its rank raised."""
    from overlap.train.options import JobError, build_parser
    from overlap.train.rank import train

    try:
        losses = train(build_parser().parse_args(argv), torch.device("cpu"))
    except JobError as exc:
        return f"JobError: {exc}"
    return None if losses is None else (losses.train, losses.val)


def _flag_combinations(rank: int, world: int, directory: str) -> dict:
    out: dict = {"accepted": [], "refused": []}
    for index, flags in enumerate(ACCEPTED):
        out["accepted"].append(_try_train([*FEW, *flags, "--checkpoint-dir", f"{directory}/accepted-{index}"]))
    for index, (flags, _) in enumerate(REFUSED):
        out["refused"].append(_try_train([*FEW, *flags, "--checkpoint-dir", f"{directory}/refused-{index}"]))
    model = f"{directory}/accepted-0"
    # The same directory again: another model's checkpoint, one past --steps, a world unlike torchrun's.
    out["other model"] = _try_train([*FEW, "--hidden", "64", "--checkpoint-dir", model])
    out["past steps"] = _try_train([*FEW, "--steps", "1", "--checkpoint-dir", model])
    out["world size"] = _try_train([*FEW, "--world-size", "3"])
    out["done"] = _try_train([*FEW, *ACCEPTED[0], "--checkpoint-dir", model])
    return out


def _trained_and_refused(results: list[dict], accepted: list, refused: list) -> None:
    """Every rank trained each accepted combination to finite losses and refused each other
    one with its reason."""
    for rank, out in enumerate(results):
        for flags, losses in zip(accepted, out["accepted"]):
            assert isinstance(losses, tuple) and all(math.isfinite(x) and 0 < x < 6 for x in losses), (rank, flags,
                                                                                                      losses)
        for (flags, reason), error in zip(refused, out["refused"]):
            assert error.startswith("JobError: ") and reason in error, (rank, flags, error)


@pytest.mark.timeout(400)
def test_every_accepted_flag_combination_trains_and_the_rest_are_refused_on_every_rank(tmp_path):
    from distributed import run_distributed

    results = run_distributed(_flag_combinations, 2, str(tmp_path), timeout=360)
    _trained_and_refused(results, ACCEPTED, REFUSED)
    for out in results:
        assert out["other model"].startswith(f"JobError: --checkpoint-dir {tmp_path}/accepted-0: "), out
        assert "transformer" in out["other model"] or "shape" in out["other model"], out["other model"]
        assert out["past steps"] == (f"JobError: the newest checkpoint in --checkpoint-dir {tmp_path}/accepted-0 "
                                     "is at step 2, past --steps 1"), out["past steps"]
        assert out["world size"].startswith("JobError: --world-size 3 but torchrun started 2 ranks"), out
        assert out["done"] is None
    assert results[0]["accepted"] == results[1]["accepted"]        # the losses are means over ranks


# --moe with every tier (the experts sharded with the rest), and --expert-parallel with every
# tier, int8 and an expert capacity; hpZ (OVERLAP_SHARDING, no flag) is refused on every rank.
# Expert parallelism with compiled units trains in tests/test_expert_parallel_combinations.py's
# slow tier (a compile here costs more than the rest of the test).
MOE_ACCEPTED = [
    ["--moe", "--mixed-precision", "bf16", "--offload", "cpu", "--compress", "int8"],
    ["--moe", "--mixed-precision", "bf16", "--offload", "disk", "--eager-init"],
    ["--moe", "--expert-parallel", "2"],
    ["--moe", "--expert-parallel", "2", "--mixed-precision", "bf16", "--prefetch-depth", "0", "--experts", "4",
     "--top-k", "1", "--sample", "1", "--sample-len", "4"],
    ["--moe", "--expert-parallel", "2", "--mixed-precision", "bf16", "--offload", "cpu", "--compress", "int8"],
    ["--moe", "--expert-parallel", "2", "--mixed-precision", "bf16", "--offload", "disk", "--capacity-factor", "0.5"],
]
MOE_REFUSED = [
    (["--moe", "--expert-parallel", "2"], "expert_parallel with sharding='hpz' is not supported"),
]
MOE_REFUSED_ENV = {"OVERLAP_SHARDING": "hpz"}


def _moe_flags(rank: int, world: int, directory: str) -> dict:
    accepted = [_try_train([*FEW, *flags, "--checkpoint-dir", f"{directory}/moe-{index}"])
                for index, flags in enumerate(MOE_ACCEPTED)]
    # Expert parallelism's checkpoint of step 2 resumed for a third step, and three steps at once.
    expert_parallel = MOE_ACCEPTED[2]
    os.environ.update(MOE_REFUSED_ENV)
    try:
        refused = [_try_train([*FEW[:-2], *flags]) for flags, _ in MOE_REFUSED]
    finally:
        for name in MOE_REFUSED_ENV:
            del os.environ[name]
    return {"accepted": accepted,
            "refused": refused,
            "resumed": _try_train([*FEW, "--steps", "3", *expert_parallel, "--checkpoint-dir", f"{directory}/moe-2"]),
            "uninterrupted": _try_train([*FEW[:-2], "--steps", "3", *expert_parallel])}


@pytest.mark.timeout(400)
def test_moe_and_expert_parallel_train_with_what_they_compose_with_and_refuse_the_rest(tmp_path):
    from distributed import run_distributed

    results = run_distributed(_moe_flags, 2, str(tmp_path), timeout=360)
    _trained_and_refused(results, MOE_ACCEPTED, MOE_REFUSED)
    assert results[0]["accepted"] == results[1]["accepted"]
    for out in results:
        assert out["resumed"] == out["uninterrupted"], out


@pytest.mark.parametrize("argv, message", [
    (["--expert-parallel", "2"], "--expert-parallel 2 needs --moe"),
    (["--moe", "--experts", "8", "--expert-parallel", "3"], "--expert-parallel 3 must divide --experts 8"),
    (["--moe", "--experts", "2", "--top-k", "3"], "--top-k 3 exceeds --experts 2"),
    (["--capacity-factor", "1.5"], "--capacity-factor 1.5 needs --moe"),
])
def test_moe_settings_that_cannot_work_are_named_before_any_rank_starts(argv, message, capsys, tmp_path,
                                                                          monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert main(argv) == 2
    assert message in capsys.readouterr().err


@pytest.mark.parametrize("option, value", [("--lr", "0"), ("--lr", "-1e-3"), ("--lr", "nan"), ("--batch", "0"),
                                           ("--eval-every", "0"), ("--eval-every", "-2"),
                                           ("--capacity-factor", "0"), ("--capacity-factor", "-1")])
def test_non_positive_values_are_refused_naming_the_option(option, value, capsys):
    with pytest.raises(SystemExit) as exited:
        main([f"{option}={value}"])       # the = form: argparse reads "-2" alone as an option
    assert exited.value.code == 2
    assert f"argument {option}: {value!r} must be" in capsys.readouterr().err


def test_disk_offload_without_bf16_is_refused_before_any_rank_starts(capsys):
    assert main(["--offload", "disk"]) == 2
    err = capsys.readouterr().err
    assert "--offload disk keeps the fp32 masters in a file" in err and "needs --mixed-precision bf16 (got fp32)" in err
    for compression in ("int8", "int8-int4", "auto"):
        assert main(["--offload", "disk", "--mixed-precision", "bf16", "--compress", compression]) == 2
        assert f"--offload disk with --compress {compression} is not supported" in capsys.readouterr().err


class _FixedLoss:
    """Steps whose every train and validation loss is 1.0, counting the train steps."""

    monitor = type("NoReport", (), {"last": None})()

    def train(self, optimizer: torch.optim.Optimizer, step: int, clip_norm: float) -> float:
        return 1.0

    def val_loss(self, draws: int) -> float:
        return 1.0


def _first_step_calls(rank: int, world: int, resumed_at: int) -> int:
    """How often the loop calls its first-step callback over --steps 4, from `resumed_at`."""
    from overlap.train.checkpoints import Progress
    from overlap.train.loop import train_loop
    from overlap.train.options import build_parser

    calls: list[int] = []
    args = build_parser().parse_args(["--steps", "4", "--eval-every", "2"])
    train_loop(_FixedLoss(), None, Progress(resumed_at, 1), args, torch.device("cpu"), None, None,
               lambda bar: calls.append(1))
    return len(calls)


@pytest.mark.timeout(120)
def test_the_first_step_callback_runs_once_whatever_step_the_run_starts_at():
    """The compile-time line (`--compile`) is printed after the run's first step only."""
    from distributed import run_distributed

    for resumed_at in (0, 2):
        assert run_distributed(_first_step_calls, 1, resumed_at, timeout=60) == [1]
