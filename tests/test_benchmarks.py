"""Smoke tests of the benchmark scripts: they run end to end on a tiny problem and write
results that hold what their readers expect. Plain loopback only (no root needed)."""
from __future__ import annotations

import importlib.util
import json
import math
import os
import pathlib
import subprocess
import sys

import pytest

from compiled_extension import require_extension

BENCHMARKS = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks")
ENV = {**os.environ, "OMP_NUM_THREADS": "1"}


def _run(script: str, *args: str, timeout: float) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, os.path.join(BENCHMARKS, script), *args], env=ENV,
                          capture_output=True, text=True, timeout=timeout)


@pytest.fixture(scope="module")
def quick_compare(tmp_path_factory) -> tuple[pathlib.Path, dict]:
    """`compare.py --quick` over every implementation: its output directory and report (read
    by the compressed rows' test too, which runs only the compressed implementations)."""
    out = tmp_path_factory.mktemp("compare")
    proc = _run("compare.py", "--quick", "--links", "loopback", "--out", str(out), timeout=240)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    with open(out / "compare.json") as f:
        return out, json.load(f)


# Every implementation and the compressed rows: nine launches, about 110 s of the default
# suite's budget, so in `make test-all`; the default suite runs compare.py end to end through
# test_compare_trains_the_narrow_mlp.
@pytest.mark.slow
@pytest.mark.timeout(310)
def test_compare_quick_covers_every_implementation(quick_compare):
    tmp_path, report = quick_compare
    results = report["results"]["loopback"]
    expected = {"overlap", "fsdp2", "fsdp2-tuned", "ddp", "ddp-tuned", "local"}
    if importlib.util.find_spec("deepspeed") is not None:
        expected.add("deepspeed")
    else:
        assert "deepspeed: skipped" in (tmp_path / "compare.md").read_text()
    assert set(results) == expected
    assert len({json.dumps(run["optimizer"], sort_keys=True) for run in report["runs"]}) == 1  # the same for all
    for impl, entry in results.items():
        assert entry["step_ms"] > 0, impl
        assert all(peak > 0 for peak in entry["peak_tracked"]), impl
        assert len(entry["peak_rss"]) == (1 if impl == "local" else 2), impl
    # The data-parallel implementations train the same model on the same batches with the
    # same optimizer: after the same steps rank 0's loss agrees (it differs from `local`,
    # which has no gradients from rank 1).
    losses = {impl: results[impl]["final_loss"] for impl in ("overlap", "fsdp2", "fsdp2-tuned", "ddp", "ddp-tuned")}
    assert all(math.isfinite(loss) for loss in losses.values())
    assert max(losses.values()) - min(losses.values()) < 1e-3 * abs(losses["ddp"]), losses
    # ShardedModule's recorded traffic lies between ZeRO-3 with every unit kept gathered from
    # forward into backward (one all-gather and one reduce-scatter of every parameter) and
    # FSDP2's count (blocks gathered twice), give or take the flat shards' padding.
    overlap, params = results["overlap"], results["overlap"]["params"]
    two_passes = 2 * params * 4 * (2 - 1) / 2  # fp32, 2 ranks
    assert overlap["sent_source"] == "measured"
    assert two_passes * 0.99 <= overlap["sent_bytes"] <= results["fsdp2"]["sent_bytes"] * 1.01
    assert (tmp_path / "compare.png").stat().st_size > 0
    assert "overlap / fsdp2" in (tmp_path / "compare.md").read_text()
    # The same launches merged twice: twice the rounds, the same medians.
    source = str(tmp_path / "compare.json")
    proc = _run("compare.py", "--merge", source, source, "--out", str(tmp_path / "merged"), timeout=60)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    with open(tmp_path / "merged" / "compare.json") as f:
        merged = json.load(f)
    assert len(merged["meta"]["sources"]) == 2
    assert sorted({run["round"] for run in merged["runs"]}) == [0, 1]
    for impl, entry in merged["results"]["loopback"].items():
        assert entry["step_ms"] == pytest.approx(results[impl]["step_ms"]), impl


@pytest.mark.slow            # with the run above: see there
@pytest.mark.timeout(400)
def test_compare_runs_the_compressed_rows(quick_compare, tmp_path):
    """The compressed rows, against the uncompressed rows of the quick run over every
    implementation (the same model, batches and steps: its bytes and losses are
    deterministic)."""
    impls = "overlap-int8,overlap-int8-int4,ddp-fp16"
    proc = _run("compare.py", "--quick", "--links", "loopback", "--impls", impls, "--out", str(tmp_path), timeout=190)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    with open(tmp_path / "compare.json") as f:
        report = json.load(f)
    results = report["results"]["loopback"]
    assert set(results) == set(impls.split(","))
    uncompressed = quick_compare[1]["results"]["loopback"]
    results.update({impl: uncompressed[impl] for impl in ("overlap", "ddp-tuned")})
    # Measured bytes: int8 weights and gradients a quarter of fp32 plus one fp32 scale per 128
    # values (0.26), each shard padded to whole blocks of 128: on the quick model's shards of a
    # few hundred values the padding adds several percent (0.31 measured with row-aligned
    # shards); int4 gradients less. DDP's fp16 hook halves DDP's all-reduce (counted by the
    # algorithm).
    sent = {impl: results[impl]["sent_bytes"] for impl in results}
    assert sent["overlap-int8-int4"] < sent["overlap-int8"] < 0.35 * sent["overlap"]
    assert sent["ddp-fp16"] * 2 == sent["ddp-tuned"]
    # After two steps, the compressed runs' losses stay close to the uncompressed ones.
    losses = {impl: results[impl]["final_loss"] for impl in results}
    assert abs(losses["ddp-fp16"] - losses["ddp-tuned"]) < 1e-2 * losses["ddp-tuned"]
    for impl in ("overlap-int8", "overlap-int8-int4"):
        assert abs(losses[impl] - losses["overlap"]) < 1e-2 * losses["overlap"], impl
    assert any(t["what"] == "overlap-int8 step time / ddp-fp16" for t in report["targets"])


@pytest.mark.slow          # collectives.py's smoke run over its links (about 14 s under CI's load): in `make test-all`
@pytest.mark.timeout(90)
def test_collectives_tiny(tmp_path):
    proc = _run("collectives.py", "--sizes-mb", "0.25", "--links", "loopback", "--iters", "2",
                "--out", str(tmp_path), timeout=80)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    with open(tmp_path / "collectives.json") as f:
        results = json.load(f)["results"]["loopback"]["0.25"]
    assert set(results) == {"reduce_scatter", "all_to_all+sum", "all_reduce+slice", "all_gather"}
    assert all(entry["ms"] > 0 and len(entry["samples_s"]) == 2 for entry in results.values())


@pytest.mark.slow          # four ranks launched (about 15 s under CI's load): in `make test-all`
@pytest.mark.timeout(120)
def test_moe_tiny(tmp_path):
    """Every variant timed in its round, expert parallelism's all-to-alls counted, the others' not."""
    variants = "no EP,EP 2,EP 4,FSDP2,fully_shard EP 2,EP 2 unsplit"
    proc = _run("moe.py", "--rounds", "1", "--steps", "1", "--width", "32", "--layers", "1", "--expert-hidden", "32",
                "--seq", "16", "--variants", variants, "--out", str(tmp_path), timeout=110)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    with open(tmp_path / "moe_loopback.json") as f:
        data = json.load(f)
    summary = data["summary"]
    assert set(summary) == set(variants.split(","))
    assert all(entry["step_ms"] > 0 for entry in summary.values())
    assert summary["no EP"]["all_to_all_mb_per_step"] == 0
    assert summary["EP 2"]["all_to_all_mb_per_step"] > 0 and summary["fully_shard EP 2"]["all_to_all_mb_per_step"] > 0
    assert summary["fully_shard EP 2"]["ratio_to_EP_2"]["median"] > 0
    assert summary["EP 2 unsplit"]["ratio_to_EP_2"]["median"] > 0
    assert all(entry["peak_tensor_rise_mb_per_rank"] > 0 for entry in summary.values())
    assert data["commit"] and data["command"].startswith("python benchmarks/moe.py")


@pytest.mark.slow          # three models built on 2 ranks (about 18 s): in `make test-all`
@pytest.mark.timeout(120)
def test_state_dict_api_tiny(tmp_path):
    """Every call timed for every variant, with its per-round ratio to FSDP2's."""
    proc = _run("state_dict_api.py", "--rounds", "1", "--width", "32", "--layers", "1", "--seq", "8",
                "--out", str(tmp_path), timeout=110)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    with open(tmp_path / "state_dict_api.json") as f:
        data = json.load(f)
    summary = data["summary"]
    assert set(summary) == {"overlap ShardedModule", "overlap fully_shard", "FSDP2"}
    for variant, calls in summary.items():
        assert len(calls) == 6 and all(call["ms"] > 0 for call in calls.values()), variant
        assert all(len(call["over_fsdp2"]["per_round"]) == 1 for call in calls.values())
    assert all(call["over_fsdp2"]["median"] == 1 for call in summary["FSDP2"].values())
    assert data["commit"] and data["command"].startswith("python benchmarks/state_dict_api.py")


@pytest.mark.slow          # three `overlap train` launches (about 40 s): in `make test-all`
@pytest.mark.timeout(300)
def test_compression_accuracy_reads_every_run(tmp_path):
    out = tmp_path / "accuracy.json"
    proc = _run("compression_accuracy.py", "--steps", "4", "--out", str(out), timeout=280)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    data = json.loads(out.read_text())
    assert set(data["runs"]) == {"none", "int8", "int8-int4"} and data["commit"]
    for mode, run in data["runs"].items():
        assert run["evals"] and math.isfinite(run["final_val_loss"]) and run["wire_mb_per_step"] > 0, mode
    # Compression sends fewer bytes than the same collectives would uncompressed.
    assert data["runs"]["int8"]["wire_mb_per_step"] < data["runs"]["int8"]["uncompressed_mb_per_step"]


@pytest.mark.slow          # DeepSpeed's import and every optimizer built (about 16 s): in `make test-all`
@pytest.mark.timeout(300)
def test_optim_step_tiny(tmp_path):
    """Every optimizer measured (DeepSpeed's or its reason for being skipped), with the bound."""
    require_extension()
    out = tmp_path / "optim_step.json"
    proc = _run("optim_step.py", "--sizes", "200k", "--threads", "1", "--rounds", "2", "--steps", "1",
                "--out", str(out), timeout=280)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    report = json.loads(out.read_text())
    entry, = report["results"]
    measured = set(entry["implementations"])
    assert {"overlap", "torch-foreach", "torch-fused"} <= measured
    assert measured | set(report["skipped_implementations"]) >= {"deepspeed-cpu-adam"}
    assert entry["bound_params_per_s"] > 0 and entry["copy_GBps"] > 0
    for name, result in entry["implementations"].items():
        assert result["params_per_s"] > 0 and len(result["seconds_per_round"]) == 2, name
    assert entry["implementations"]["overlap"]["time_over_overlap_median"] == 1.0
    assert report["commit"] and report["command"] and len(report["host"]["load_before"]) == 3


@pytest.mark.timeout(200)
def test_offload_disk_tiny(tmp_path):
    """The disk tier's three modes at two tiny sizes, with paired ratios and the dd reference."""
    require_extension()
    out = tmp_path / "offload_disk.json"
    proc = _run("offload_disk.py", "--sizes", "300k,1M", "--rounds", "2", "--dd-mib", "8", "--dir", str(tmp_path),
                "--out", str(out), timeout=180)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    report = json.loads(out.read_text())
    assert report["dd_direct"]["read_gbps"] > 0 and report["dd_direct"]["write_gbps"] > 0
    assert report["commit"] and len(report["host"]["load_before"]) == 3
    for entry in report["results"]:
        assert len(entry["rounds"]) == 2 and all(r[m] > 0 for r in entry["rounds"] for m in ("io", "update", "pipelined"))
        assert len(entry["pipelined_over_sum"]["per_round"]) == 2
        assert entry["peak_buffers"] <= 3 and entry["file_bytes"] >= 12 * entry["params"]
    assert [p.name for p in tmp_path.iterdir()] == ["offload_disk.json"], "state files must be removed"


def test_compare_rejects_a_bad_link(capsys):
    sys.path.insert(0, BENCHMARKS)
    try:
        from compare import main
    finally:
        sys.path.remove(BENCHMARKS)
    with pytest.raises(SystemExit) as exited:
        main(["--links", "loopback,fast"])
    assert exited.value.code != 0
    assert "'fast'" in capsys.readouterr().err


def _numbers(value, path="") -> list[tuple[str, float]]:
    """Every number in a JSON value, with where it is."""
    if isinstance(value, bool) or value is None or isinstance(value, str):
        return []
    if isinstance(value, (int, float)):
        return [(path, value)]
    items = value.items() if isinstance(value, dict) else enumerate(value)
    return [found for key, item in items for found in _numbers(item, f"{path}/{key}")]


@pytest.mark.slow          # overhead.py's smoke run, every row launched (about 24 s under CI's load): in `make test-all`
@pytest.mark.timeout(120)
def test_overhead_smoke(tmp_path):
    out = tmp_path / "overhead.json"
    rows = "overlap-full,fsdp2,fsdp2-tuned"
    proc = _run("overhead.py", "--units", "8", "--world", "1", "--rounds", "1", "--warmup", "1", "--steps", "3",
                "--rows", rows, "--out", str(out), timeout=110)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    with open(out) as f:
        report = json.load(f)
    meta = report["meta"]
    assert meta["commit"] and meta["command"].startswith("python benchmarks/overhead.py")
    assert set(meta["host_load"]) >= {"load_1_5_15min_before", "load_1_5_15min_after", "launched_cpu_s"}
    results = report["results"]["1"]["8"]
    assert set(results) == set(rows.split(","))
    for row, entry in results.items():
        assert len(entry["host_us_per_unit"]["per_round"]) == 1, row
        assert set(entry["ratios"]) == {"fsdp2", "fsdp2-tuned"}, row
    assert results["fsdp2"]["ratios"]["fsdp2"]["median"] == pytest.approx(1.0)
    assert results["overlap-full"]["settings"]["runtime_units"] == 8
    assert 0 < results["overlap-full"]["runtime_share"]["median"] < 1
    assert all(0 < entry["cpu_per_wall"]["median"] <= 1.5 for entry in results.values())
    assert len(report["runs"]) == 3
    for run in report["runs"]:
        assert len(run["ranks"]) == 1 and len(run["ranks"][0]["wrapped_s"]) == 3, run["row"]
    numbers = _numbers(report)
    assert numbers and all(math.isfinite(value) for _, value in numbers), [n for n in numbers
                                                                           if not math.isfinite(n[1])]
    assert "| overlap-full |" in proc.stdout


def test_peak_tensor_rise_follows_what_the_call_holds():
    """The peak is the most the call held at once over what was held before it: a buffer freed
    before the next is allocated counts once, one kept alive counts with the next."""
    import torch

    sys.path.insert(0, BENCHMARKS)
    try:
        from tensor_memory import peak_tensor_rise_mb
    finally:
        sys.path.remove(BENCHMARKS)
    before = torch.ones(4 * 2**18)             # 4 MiB held before the call: not part of the rise
    kept = []

    def one_at_a_time() -> None:
        for _ in range(3):
            torch.empty(3 * 2**18).fill_(1.0)  # 3 MiB, freed at once

    def held_together() -> None:
        kept.append(torch.empty(2 * 2**18).fill_(1.0))
        torch.empty(3 * 2**18).fill_(1.0)

    assert 3 <= peak_tensor_rise_mb(one_at_a_time) < 3.1
    assert 5 <= peak_tensor_rise_mb(held_together) < 5.1
    assert before.sum() > 0 and len(kept) == 1


def test_overhead_profile_paths_are_relative():
    sys.path.insert(0, BENCHMARKS)
    try:
        from overhead import REPO, relative_paths
    finally:
        sys.path.remove(BENCHMARKS)
    import site
    import sysconfig

    text = (f"{os.path.join(REPO, 'overlap', 'runtime', 'unit.py')}:10(f)\n"
            f"{os.path.join(site.getsitepackages()[0], 'torch', 'nn', 'modules', 'module.py')}:1(g)\n"
            f"{os.path.join(sysconfig.get_paths()['stdlib'], 'threading.py')}:2(h)\n"
            "/somewhere/else/entirely/x.py:3(i)\n{built-in method builtins.len}")
    assert relative_paths(text, REPO).splitlines() == [
        "overlap/runtime/unit.py:10(f)", "site-packages/torch/nn/modules/module.py:1(g)", "stdlib/threading.py:2(h)",
        "x.py:3(i)", "{built-in method builtins.len}"]


@pytest.mark.slow          # compare.py end to end, two launches (about 25 s under CI's load): in `make test-all`
@pytest.mark.timeout(200)
def test_compare_trains_the_narrow_mlp(tmp_path):
    """`--model mlp`: every implementation wraps the narrow MLP's blocks (ShardedModule with
    the MLP's block class as its unit) and trains it to the same loss; the run records the
    model, the commit and the host load."""
    impls = "overlap,ddp-tuned"
    # Buckets too small to merge two blocks: the probe's choice would vary with the host's load.
    proc = _run("compare.py", "--quick", "--model", "mlp", "--links", "loopback", "--impls", impls,
                "--bucket-mb", "0.001", "--out", str(tmp_path), timeout=190)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    with open(tmp_path / "compare.json") as f:
        report = json.load(f)
    meta, results = report["meta"], report["results"]["loopback"]
    assert meta["model"]["kind"] == "mlp"
    assert len(meta["loadavg_before"]) == 3 and len(meta["loadavg_after"]) == 3 and meta["commit"]
    assert results["overlap"]["settings"]["units"] == meta["model"]["n_layer"]
    losses = {impl: results[impl]["final_loss"] for impl in ("overlap", "ddp-tuned")}
    assert all(math.isfinite(loss) for loss in losses.values())
    assert abs(losses["overlap"] - losses["ddp-tuned"]) < 1e-3 * abs(losses["ddp-tuned"]), losses


def test_compile_targets_hold_or_miss_by_round():
    """The compiled targets' ratios, paired round by round from the rows' per-round medians."""
    sys.path.insert(0, BENCHMARKS)
    try:
        import compare_report
        import compare_summary
        import compare_targets
    finally:
        sys.path.remove(BENCHMARKS)
    runs = [dict(link="loopback", round=r, impl=impl, ranks=[dict(step_s=[ms / 1e3])])
            for r, steps in enumerate([dict(overlap=10, local=4), dict(overlap=10, local=4)])
            for impl, ms in [*steps.items(), ("overlap-compiled", 9 if r == 0 else 10), ("local-compiled", 3.6)]]
    ratios = compare_summary.compiled_over_eager(runs)["loopback"]
    assert ratios["overlap-compiled"] == pytest.approx([0.9, 1.0])
    assert ratios["local-compiled"] == pytest.approx([0.9, 0.9])
    summary = {"loopback": {
        "overlap-compiled": dict(compiled_over_eager=0.95, compiled_over_eager_rounds=ratios["overlap-compiled"],
                                 round_step_ms=[9.0, 10.0], rounds=[0, 1], step_ms=9.5),
        "local-compiled": dict(compiled_over_eager=0.9, compiled_over_eager_rounds=ratios["local-compiled"]),
        "fsdp2-tuned-compiled": dict(round_step_ms=[9.5, 9.5], rounds=[0, 1], step_ms=9.5)}}
    keeps, ahead = compare_targets.compile_targets(summary)
    assert keeps["rounds"] == pytest.approx([1.0, 1.0 / 0.9])     # met in round 1, missed in round 2
    assert (keeps["held"], keeps["met"]) == (1, False)
    assert ahead["rounds"] == pytest.approx([9 / 9.5, 10 / 9.5])
    lines = compare_report.target_lines([keeps, ahead])
    assert "by round: 1.00 (met), 1.11 (missed)" in lines
    assert "held in 1 of 2 rounds" in lines


def test_step_time_targets_are_paired_per_round_and_met_only_in_every_round():
    """The ratio reported is the median of per-round ratios (each round against the faster
    peer of that round), not a ratio of pooled medians, and "met" needs every round."""
    sys.path.insert(0, BENCHMARKS)
    try:
        import compare_targets
    finally:
        sys.path.remove(BENCHMARKS)
    # Round 0 ran on a loaded host (everything 2x slower); pooled medians would mix the rounds.
    steps = {"overlap": [1.6, 0.85, 0.85], "fsdp2-tuned": [2.0, 1.0, 0.9], "ddp": [1.4, 0.9, 0.8],
             "ddp-tuned": [1.6, 0.8, 0.9]}
    summary = {"loopback": {impl: dict(round_step_ms=ms, rounds=[0, 1, 2], step_ms=sorted(ms)[1])
                            for impl, ms in steps.items()}}
    vs_fsdp2, vs_ddp = compare_targets.check_targets(summary)
    assert vs_fsdp2["rounds"] == pytest.approx([0.8, 0.85, 0.85 / 0.9])
    assert vs_fsdp2["ratio"] == pytest.approx(0.85)
    assert (vs_fsdp2["held"], vs_fsdp2["met"]) == (2, False)
    assert vs_ddp["rounds"] == pytest.approx([1.6 / 1.4, 0.85 / 0.8, 0.85 / 0.8])
    assert (vs_ddp["held"], vs_ddp["met"]) == (0, False)
    summary["loopback"]["overlap"]["round_step_ms"] = [1.5, 0.85, 0.8]
    assert compare_targets.check_targets(summary)[0]["met"] is True
