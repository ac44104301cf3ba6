"""`overlap train --pp N`: the job's GPT cut into pipeline stages trains as the job without
stages does on the same global batch, composes with precision and offload, and refuses by
name what it does not take."""
from __future__ import annotations

import math
import os
from typing import Optional

import pytest
import torch

from distributed import CaseLaunch, RankCase
from overlap.train.job import main

FEW = ["--steps", "4", "--eval-every", "2", "--layers", "4", "--hidden", "32", "--heads", "2", "--seq", "16",
       "--batch", "4", "--lr", "1e-2"]
# Each trains FEW's steps at (pp 2, dp 2); the first is the parity case.
ACCEPTED = [
    ["--pp", "2"],
    ["--pp", "2", "--pp-schedule", "GPipe", "--microbatches", "4", "--mixed-precision", "bf16"],
    ["--pp", "2", "--offload", "cpu", "--eager-init"],
    ["--pp", "4", "--microbatches", "4"],
    # Two stages per rank (stages r and r + 2), with a zero-bubble schedule and without.
    ["--pp", "2", "--pp-schedule", "InterleavedZeroBubble", "--microbatches", "4"],
    ["--pp", "2", "--pp-schedule", "Interleaved1F1B", "--microbatches", "4"],
    # GPT-MoE stages: one microbatch (the parity case, the routers' loss over the whole
    # batch as the job without stages takes it), and four under a split backward.
    ["--pp", "2", "--moe", "--experts", "4", "--pp-schedule", "GPipe", "--microbatches", "1"],
    ["--pp", "2", "--moe", "--experts", "4", "--pp-schedule", "InterleavedZeroBubble", "--microbatches", "4",
     "--capacity-factor", "1.0"],
    # The same MoE stages with their experts split over each stage's two ranks: the parity
    # case, and two stages per rank with a capacity. They come after --pp 4, whose tied-head
    # group holds ranks 0 and 3 only: the stages' ranks belong to different numbers of groups
    # when their expert groups are made ([Note: groups made by some ranks only]).
    ["--pp", "2", "--moe", "--experts", "4", "--pp-schedule", "GPipe", "--microbatches", "1", "--expert-parallel", "2"],
    ["--pp", "2", "--moe", "--experts", "4", "--pp-schedule", "Interleaved1F1B", "--microbatches", "4",
     "--expert-parallel", "2", "--capacity-factor", "1.0", "--mixed-precision", "bf16"],
    # The runtime's own options (OverlapPolicy on each stage's root call).
    ["--pp", "2", "--compress", "int8", "--prefetch-depth", "1", "--bucket-mb", "0.001"],
    # The V-shaped schedules: rank r holds stages r and 3 - r, rank 0 both copies of the tied
    # weight; validation runs through the stages without the schedule.
    ["--pp", "2", "--pp-schedule", "ZBVZeroBubble", "--microbatches", "4"],
    ["--pp", "2", "--pp-schedule", "DualPipeV", "--microbatches", "4"],
    # Experts split under a schedule that splits backward (ACCEPTED[9]'s flags under DualPipeV).
    ["--pp", "2", "--pp-schedule", "DualPipeV", "--microbatches", "4", "--moe", "--experts", "4",
     "--expert-parallel", "2", "--capacity-factor", "1.0", "--mixed-precision", "bf16"],
]
# Which of ACCEPTED ask the runtime for settings, and what rank 0's report then prints (of
# its first stage's runtime): the all-to-alls of split experts, the compressed bytes, the
# prefetch depth and bucket size.
PRINTED = {8: ["all-to-all: "], 9: ["all-to-all: "], 13: ["all-to-all: "],
           10: ["before compression)", "prefetch depth 1, bucket 0.001 MB"]}


def _losses_per_step(argv: list[str], printed: Optional[list[str]] = None):
    """Each step's train loss (mean over ranks) and the final validation loss, or the
    JobError's text; what the job printed is appended to `printed`."""
    import contextlib
    import io

    from overlap.train.options import JobError, build_parser
    from overlap.train.rank import train

    seen: list[float] = []
    out = io.StringIO()
    try:
        with _recording(seen), contextlib.redirect_stdout(out):
            losses = train(build_parser().parse_args(argv), torch.device("cpu"))
    except JobError as exc:
        return f"JobError: {exc}"
    finally:
        if printed is not None:
            printed.append(out.getvalue())
    return seen, losses.val


class _recording:
    """Records each step's mean loss as the loop computes it."""

    def __init__(self, seen: list[float]) -> None:
        self.seen = seen

    def __enter__(self) -> None:
        from overlap.train import loop
        self.original = loop.mean_over_ranks

        def recorded(values, device):
            out = self.original(values, device)
            if len(values) == 2:                    # [loss, peak memory]: once per step
                self.seen.append(out[0])
            return out

        loop.mean_over_ranks = recorded

    def __exit__(self, *exc) -> None:
        from overlap.train import loop
        loop.mean_over_ranks = self.original


def _pipeline_runs(rank: int, world: int, directory: str) -> dict:
    printed: list[str] = []
    return {"accepted": [_losses_per_step([*FEW, *flags], printed) for flags in ACCEPTED], "printed": printed,
            "uneven": _losses_per_step([*FEW, "--pp", "3"]), **_resumed_runs(directory),
            "traced": _traced(os.path.join(directory, "trace")), "sampled": _samples([*FEW, "--pp", "2"])}


def _samples(argv: list[str]) -> str:
    """What the job prints from its first sample on (rank 0), after --steps 4 of `argv`."""
    printed: list[str] = []
    _losses_per_step([*argv, "--sample", "2", "--sample-len", "24"], printed)
    text = printed[0]
    return text[text.find("--- sample 1 ---"):]


def _traced(directory: str) -> dict:
    """Two stages per rank with --trace: this rank's Chrome trace (its event names), and on
    rank 0, which draws it, the timeline's first bytes."""
    import json

    import torch.distributed as dist

    _losses_per_step([*FEW, "--pp", "2", "--pp-schedule", "Interleaved1F1B", "--microbatches", "4",
                      "--trace", directory])
    with open(os.path.join(directory, f"trace_rank{dist.get_rank()}.json")) as f:
        names = {event.get("name", "") for event in json.load(f)["traceEvents"]}
    if dist.get_rank() != 0:
        return {"names": names}
    with open(os.path.join(directory, "timeline.png"), "rb") as f:
        return {"names": names, "png": f.read(8)}


# The runs from the job without stages to stages and back: six steps.
SIX = ["--steps", "6", "--schedule-steps", "6"]


def _resumed_runs(directory: str) -> dict:
    """ACCEPTED[0]'s run cut at step 2 and resumed from its checkpoint: at the same layout, at
    four stages (two per rank, InterleavedZeroBubble), at one data-parallel rank (--pp 4: both
    batch shards of the step on each rank), and refused without stages over four ranks (two
    shards cannot split) and for another model. And the job without stages over four ranks (a
    checkpoint every step), resumed from its step 1 with stages to step 3 (--pp 2, two shards per data-parallel rank; also
    under DualPipeV, where rank 0 holds the tied head's copy too), whose checkpoint the job
    without stages resumes to step 6; against that job uninterrupted. Each resumed part runs
    two steps or more, so that the optimizer state it loaded moves a loss it reports."""
    import shutil

    import torch.distributed as dist

    def run(path: str, *flags: str):
        return _losses_per_step([*FEW, "--pp", "2", "--schedule-steps", "4", "--checkpoint-dir", path, *flags])

    def without_stages(path: str, *flags: str):
        return _losses_per_step([*FEW, "--eager-init", *SIX, "--checkpoint-dir", path, *flags])

    path = {name: os.path.join(directory, name)
            for name in ("same", "other", "one dp", "no stages", "dp uninterrupted", "dp", "dp V")}
    out = {"first half": run(path["same"], "--steps", "2"),
           "dp uninterrupted": without_stages(path["dp uninterrupted"], "--checkpoint-every", "1")}
    dist.barrier()
    if dist.get_rank() == 0:
        for copy in ("other", "one dp", "no stages"):
            shutil.copytree(path["same"], path[copy])
        for copy in ("dp", "dp V"):
            shutil.copytree(os.path.join(path["dp uninterrupted"], "step-00000001"),
                            os.path.join(path[copy], "step-00000001"))
    dist.barrier()
    out["resumed"] = run(path["same"])
    out["relaid"] = run(path["other"], "--pp-schedule", "InterleavedZeroBubble", "--microbatches", "4")
    out["one dp"] = _losses_per_step([*FEW, "--pp", "4", "--microbatches", "4", "--checkpoint-dir", path["one dp"]])
    out["no stages"] = without_stages(path["no stages"])
    out["other model"] = run(path["same"], "--hidden", "48")
    out["fewer layers"] = run(path["same"], "--layers", "2")
    out["saved"] = sorted(os.listdir(path["same"]))
    out["dp to stages"] = run(path["dp"], *SIX, "--steps", "3")
    out["dp to V"] = run(path["dp V"], *SIX, "--steps", "3", "--pp-schedule", "DualPipeV", "--microbatches", "4")
    out["stages to dp"] = without_stages(path["dp"])
    return out


def _data_parallel_run(rank: int, world: int) -> dict:
    return {"reference": _losses_per_step([*FEW, "--eager-init"]),
            "offload cpu": _losses_per_step([*FEW, "--eager-init", "--offload", "cpu"]),
            "sampled": _samples([*FEW, "--eager-init"]),
            "moe": _losses_per_step([*FEW, "--eager-init", "--moe", "--experts", "4"])}


@pytest.fixture(scope="module")
def launches(tmp_path_factory) -> dict[int, CaseLaunch]:
    directory = str(tmp_path_factory.mktemp("pipeline-job"))
    return {4: CaseLaunch({"pipeline": RankCase(_pipeline_runs, (directory,))}, world_size=4, timeout=400),
            2: CaseLaunch({"reference": RankCase(_data_parallel_run)}, world_size=2, timeout=200)}


@pytest.mark.timeout(600)
def test_two_stages_train_as_the_job_without_stages_on_the_same_global_batch(launches) -> None:
    """(pp 2, dp 2) against dp 2: the global batch is the data-parallel ranks' shards in both;
    the tied head is summed across the stages, the clip's norm taken over both."""
    reference, reference_val = launches[2]["reference"][0].result()["reference"]
    for outcome in launches[4]["pipeline"]:
        losses, val = outcome.result()["accepted"][0]
        assert len(losses) == len(reference) == 4
        torch.testing.assert_close(torch.tensor(losses), torch.tensor(reference), rtol=1e-4, atol=1e-5)
        assert math.isclose(val, reference_val, rel_tol=1e-4)


def _same_losses_as(launches, index: int, reference: str) -> None:
    """ACCEPTED[index]'s losses on every rank: the reference run's, within the stage layouts'
    rounding."""
    losses_reference, val_reference = launches[2]["reference"][0].result()[reference]
    for outcome in launches[4]["pipeline"]:
        losses, val = outcome.result()["accepted"][index]
        torch.testing.assert_close(torch.tensor(losses), torch.tensor(losses_reference), rtol=1e-4, atol=1e-5)
        assert math.isclose(val, val_reference, rel_tol=1e-4)


@pytest.mark.timeout(600)
@pytest.mark.parametrize("index", (4, 5, 11, 12), ids=["InterleavedZeroBubble", "Interleaved1F1B", "ZBVZeroBubble",
                                                      "DualPipeV"])
def test_two_stages_per_rank_train_as_the_job_without_stages(launches, index: int) -> None:
    """Four stages at (pp 2, dp 2), each rank holding two: the schedule's microbatch losses
    make the same global-batch mean, and the tied head is summed across the first and last
    row (under the V-shaped schedules on rank 0's row, which holds both)."""
    _same_losses_as(launches, index, "reference")


@pytest.mark.timeout(600)
@pytest.mark.parametrize("index", (6, 8), ids=["experts-whole", "expert-parallel-2"])
def test_moe_stages_train_as_the_moe_job_without_stages(launches, index: int) -> None:
    """GPT-MoE blocks in two stages: each block's routers' loss joins the backward where it is
    made and the reported loss, so the losses are the job's without stages at dp 2; also with
    each stage's experts split over its two ranks (`--expert-parallel 2`, tokens sent by
    all-to-all)."""
    _same_losses_as(launches, index, "moe")


@pytest.mark.timeout(600)
def test_split_experts_under_a_split_backward_train_as_under_full_backwards(launches) -> None:
    """DualPipeV splits each backward into an input step, which runs every all-to-all, and a
    weight step from where the parameters join the input's path: the losses are those of
    Interleaved1F1B with the same flags, within bf16's rounding between stage layouts."""
    for outcome in launches[4]["pipeline"]:
        accepted = outcome.result()["accepted"]
        (split, split_val), (full, full_val) = accepted[13], accepted[9]
        torch.testing.assert_close(torch.tensor(split), torch.tensor(full), rtol=1e-3, atol=1e-4)
        assert math.isclose(split_val, full_val, rel_tol=1e-3)


@pytest.mark.timeout(600)
def test_the_runtimes_options_reach_every_stage(launches) -> None:
    printed = launches[4]["pipeline"][0].result()["printed"]
    for index, wanted in PRINTED.items():
        for text in wanted:
            assert text in printed[index], (ACCEPTED[index], text, printed[index])
    assert "all-to-all: " not in printed[6] and "before compression)" not in printed[0]   # the checks can fail


@pytest.mark.timeout(600)
def test_two_stages_with_offload_train_as_the_job_with_offload(launches) -> None:
    _same_losses_as(launches, 2, "offload cpu")                 # --pp 2 --offload cpu --eager-init


@pytest.mark.timeout(600)
def test_each_accepted_combination_trains_on_every_rank(launches) -> None:
    results = [outcome.result() for outcome in launches[4]["pipeline"]]
    for rank, out in enumerate(results):
        for flags, (losses, val) in zip(ACCEPTED, out["accepted"]):
            assert all(math.isfinite(x) and 0 < x < 6 for x in [*losses, val]), (rank, flags, losses, val)
            assert losses[-1] < losses[0], (rank, flags, losses)
        assert out["uneven"] == "JobError: --pp 3 must divide the world size 4: each stage runs on world/pp ranks"
    assert all(out["accepted"] == results[0]["accepted"] for out in results)     # means over ranks


@pytest.mark.timeout(600)
def test_a_pipeline_run_resumes_from_its_checkpoint_at_the_same_or_another_layout(launches) -> None:
    """Two steps, a checkpoint, two more: at the same layout the losses are the uninterrupted
    run's bit for bit; at four stages cut otherwise and at one data-parallel rank, within the
    stage layouts' rounding."""
    results = [outcome.result() for outcome in launches[4]["pipeline"]]
    for out in results:
        uninterrupted, _ = out["accepted"][0]
        first, _ = out["first half"]
        resumed, resumed_val = out["resumed"]
        relaid, _ = out["relaid"]
        assert first == uninterrupted[:2] and resumed == uninterrupted[2:], (first, resumed, uninterrupted)
        torch.testing.assert_close(torch.tensor(relaid), torch.tensor(uninterrupted[2:]), rtol=1e-4, atol=1e-5)
        assert out["saved"] == ["step-00000002", "step-00000004"], out["saved"]
        torch.testing.assert_close(torch.tensor(out["one dp"][0]), torch.tensor(uninterrupted[2:]), rtol=1e-4,
                                   atol=1e-5)
        assert out["no stages"].startswith("JobError: the run's global batch is 2 shards") and \
            "4 ranks cannot split it evenly" in out["no stages"], out["no stages"]
        assert out["other model"].startswith("JobError: --checkpoint-dir ") and "shape" in out["other model"], \
            out["other model"]
        assert out["fewer layers"].startswith("JobError: --checkpoint-dir ") and \
            "'model.blocks.2." in out["fewer layers"] and "which no rank has" in out["fewer layers"], \
            out["fewer layers"]


@pytest.mark.timeout(600)
def test_a_run_resumes_with_stages_from_the_job_without_them_and_back(launches) -> None:
    """The job without stages over four ranks resumed from its step 1: steps 2 and 3 with
    stages (two layouts), and steps 4 to 6 without stages again from the stages' checkpoint,
    each within the stage layouts' rounding of the job uninterrupted."""
    for outcome in launches[4]["pipeline"]:
        out = outcome.result()
        reference, reference_val = out["dp uninterrupted"]
        assert len(reference) == 6, reference
        for name, steps in (("dp to stages", slice(1, 3)), ("dp to V", slice(1, 3)), ("stages to dp", slice(3, 6))):
            torch.testing.assert_close(torch.tensor(out[name][0]), torch.tensor(reference[steps]), rtol=1e-4,
                                       atol=1e-5, msg=lambda text, name=name: f"{name}: {text}")
        assert math.isclose(out["stages to dp"][1], reference_val, rel_tol=1e-4)


@pytest.mark.timeout(600)
def test_a_pipeline_run_samples_what_the_job_without_stages_samples(launches) -> None:
    """--sample: rank 0 builds the whole model from the stages' values and draws from it; the
    same seed's draws from the same (to 1e-5) weights give the same bytes as the job at dp 2."""
    reference = launches[2]["reference"][0].result()["sampled"]
    assert reference.startswith("--- sample 1 ---") and "--- sample 2 ---" in reference, reference
    results = [outcome.result()["sampled"] for outcome in launches[4]["pipeline"]]
    assert results[0] == reference, (results[0], reference)
    assert all(text == "" for text in results[1:]), results


@pytest.mark.timeout(600)
def test_a_pipeline_run_writes_its_trace_and_timeline(launches) -> None:
    for rank, outcome in enumerate(launches[4]["pipeline"]):
        traced = outcome.result()["traced"]
        assert rank != 0 or traced["png"] == b"\x89PNG\r\n\x1a\n"
        assert any(name.startswith("overlap::pre_forward::blocks.") for name in traced["names"]), traced["names"]
        assert any(name.startswith("overlap::reduce_scatter::") for name in traced["names"]), traced["names"]


@pytest.mark.parametrize("argv, message", [
    (["--pp", "2", "--offload", "disk", "--mixed-precision", "bf16"], "offload disk with --pp is not supported yet"),
    (["--microbatches", "2"], "--microbatches needs --pp"),
    (["--pp-schedule", "GPipe"], "--pp-schedule needs --pp"),
    (["--pp", "4", "--layers", "2"],
     "--pp 4 with --pp-schedule 1F1B makes 4 stages and needs at least as many --layers (got 2)"),
    (["--pp", "2", "--pp-schedule", "Interleaved1F1B", "--layers", "3"],
     "makes 4 stages and needs at least as many --layers (got 3)"),
    (["--pp", "2", "--microbatches", "3", "--batch", "8"], "--microbatches 3 must divide --batch 8"),
    (["--pp", "2", "--microbatches", "1"], "--pp-schedule 1F1B needs --microbatches >= --pp 2 (got 1)"),
    (["--pp", "2", "--pp-schedule", "DualPipeV", "--microbatches", "2"],
     "--pp-schedule DualPipeV needs --microbatches >= its 4 stages (got 2)"),
    (["--pp", "2", "--pp-schedule", "InterleavedZeroBubble", "--microbatches", "5", "--batch", "10"],
     "max(1, M // --pp) = 2 rounds: --microbatches 5 must be a multiple of that"),
    (["--pp", "2", "--world-size", "4", "--moe", "--experts", "4", "--expert-parallel", "4"],
     "--expert-parallel 4 must divide the 2 ranks that hold each stage (world 4 / --pp 2)"),
    (["--moe", "--experts", "4", "--expert-parallel", "4"], "--expert-parallel 4 must divide the world size 2"),
])
def test_pipeline_settings_that_cannot_work_are_named_before_any_rank_starts(argv, message, capsys, tmp_path,
                                                                            monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert main(argv) == 2
    assert message in capsys.readouterr().err


def test_pp_must_be_at_least_two(capsys):
    with pytest.raises(SystemExit):
        main(["--pp", "1"])
    assert "argument --pp: '1' must be >= 2" in capsys.readouterr().err


# ACCEPTED[13]: split experts under DualPipeV, whose backward runs in an input and a weight half.
SPLIT_BACKWARD = ACCEPTED[13]


def _compiled_run(rank: int, world: int) -> dict:
    printed: list[str] = []
    return {"losses": _losses_per_step([*FEW, "--pp", "2", "--compile"], printed), "printed": printed[0],
            "split": _losses_per_step([*FEW, *SPLIT_BACKWARD, "--compile"]),
            "split_eager": _losses_per_step([*FEW, *SPLIT_BACKWARD])}


@pytest.mark.slow          # four ranks compiling every stage's blocks (40 s from a cold cache): in `make test-all`
@pytest.mark.timeout(600)
def test_compiled_stages_train_and_say_their_compile_time_once() -> None:
    """Also under a schedule that splits backward (see [Note: compiled blocks under a split
    backward]): as without compiling, within compiled code's rounding."""
    from distributed import run_distributed

    results = run_distributed(_compiled_run, 4, timeout=500)
    for result in results:
        losses, val = result["losses"]
        assert all(math.isfinite(x) and 0 < x < 6 for x in [*losses, val]) and losses[-1] < losses[0], losses
        assert not isinstance(result["split"], str), result["split"]
        (compiled, compiled_val), (eager, eager_val) = result["split"], result["split_eager"]
        assert all(math.isfinite(x) for x in [*compiled, compiled_val]), compiled
        assert compiled == pytest.approx(eager, abs=1e-3) and compiled_val == pytest.approx(eager_val, abs=1e-3)
    assert results[0]["printed"].count("compiled the blocks in ") == 1, results[0]["printed"]
