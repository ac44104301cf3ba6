"""Smoke tests of the benchmark scripts: they run end to end on a tiny problem and write
results that hold what their readers expect. Plain loopback only (no root needed)."""
from __future__ import annotations

import importlib.util
import json
import math
import os
import subprocess
import sys

import pytest

BENCHMARKS = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks")
ENV = {**os.environ, "OMP_NUM_THREADS": "1"}


def _run(script: str, *args: str, timeout: float) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, os.path.join(BENCHMARKS, script), *args], env=ENV,
                          capture_output=True, text=True, timeout=timeout)


@pytest.mark.timeout(310)
def test_compare_quick_covers_every_implementation(tmp_path):
    proc = _run("compare.py", "--quick", "--links", "loopback", "--out", str(tmp_path), timeout=240)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    with open(tmp_path / "compare.json") as f:
        report = json.load(f)
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


@pytest.mark.timeout(200)
def test_compare_runs_the_compressed_rows(tmp_path):
    impls = "overlap,overlap-int8,overlap-int8-int4,ddp-tuned,ddp-fp16"
    proc = _run("compare.py", "--quick", "--links", "loopback", "--impls", impls, "--out", str(tmp_path), timeout=190)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    with open(tmp_path / "compare.json") as f:
        report = json.load(f)
    results = report["results"]["loopback"]
    assert set(results) == set(impls.split(","))
    # Measured bytes: int8 weights and gradients about a quarter of fp32, int4 gradients less;
    # DDP's fp16 hook halves DDP's all-reduce (counted by the algorithm).
    sent = {impl: results[impl]["sent_bytes"] for impl in results}
    assert sent["overlap-int8-int4"] < sent["overlap-int8"] < 0.3 * sent["overlap"]
    assert sent["ddp-fp16"] * 2 == sent["ddp-tuned"]
    # After two steps, the compressed runs' losses stay close to the uncompressed ones.
    losses = {impl: results[impl]["final_loss"] for impl in results}
    assert abs(losses["ddp-fp16"] - losses["ddp-tuned"]) < 1e-2 * losses["ddp-tuned"]
    for impl in ("overlap-int8", "overlap-int8-int4"):
        assert abs(losses[impl] - losses["overlap"]) < 1e-2 * losses["overlap"], impl
    assert any(t["what"] == "overlap-int8 step time / ddp-fp16" for t in report["targets"])


@pytest.mark.timeout(90)
def test_collectives_tiny(tmp_path):
    proc = _run("collectives.py", "--sizes-mb", "0.25", "--links", "loopback", "--iters", "2",
                "--out", str(tmp_path), timeout=80)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    with open(tmp_path / "collectives.json") as f:
        results = json.load(f)["results"]["loopback"]["0.25"]
    assert set(results) == {"reduce_scatter", "all_to_all+sum", "all_reduce+slice", "all_gather"}
    assert all(entry["ms"] > 0 and len(entry["samples_s"]) == 2 for entry in results.values())


@pytest.mark.timeout(300)
def test_optim_step_tiny(tmp_path):
    """Every optimizer measured (DeepSpeed's or its reason for being skipped), with the bound."""
    pytest.importorskip("overlap._C", reason="the overlap._C extension was not built")
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


def test_compare_rejects_a_bad_link():
    proc = _run("compare.py", "--links", "loopback,fast", timeout=60)
    assert proc.returncode != 0
    assert "'fast'" in proc.stderr
