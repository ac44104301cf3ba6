"""The planner's arithmetic on synthetic profiles, the probe's fit, the simulator, and that
every rank applies the same plan (at start-up and after a re-plan)."""
from __future__ import annotations

import contextlib
import io
import os
import re

import pytest

from overlap.base.config import config_from_env
from overlap.plan.cost_model import Profile, UnitCost, predict_step, wire_bytes
from overlap.plan.prefetch import (LATENCY_SHARE, MIN_BUCKETS, choose_bucket_bytes, choose_depths, latency_bucket_bytes, merge_costs)
from overlap.control.replanner import drifted
from overlap.control.probe import PROBE_SIZES, fit_alpha_beta
from overlap.cli.simulate import main as simulate
from overlap.plan.links import LinkModel
from distributed import run_distributed

MB = 2**20
FAST = LinkModel("nvlink", 10e-6, 300e9)
SLOW = LinkModel("ethernet", 100e-6, 1e9)


def _alternating_profile(units: int = 8, unit_mb: float = 16.0) -> Profile:
    """Heavy and light units in turn, the same size: compute hides all communication on
    average, but behind a light unit only a gather issued two units ahead arrives in time."""
    costs = []
    for i in range(units):
        heavy = i % 2 == 0
        costs.append(UnitCost(f"u{i}", int(unit_mb * MB), int(unit_mb * MB), int(unit_mb * MB),
                              forward_s=0.040 if heavy else 0.001, backward_s=0.080 if heavy else 0.002))
    return Profile(tuple(costs), world_size=2)


# ---- cost model ------------------------------------------------------------------------------

def test_replay_limits_are_exact():
    profile = _alternating_profile()
    free_link = LinkModel("nvlink", 0.0, 1e30)
    assert predict_step(profile, free_link, 1, 1).step_s == pytest.approx(profile.compute_s)
    idle = Profile(tuple(UnitCost(u.name, u.nbytes, u.gather_bytes, u.reduce_bytes) for u in profile.units), 2)
    prediction = predict_step(idle, SLOW, 2, 2)
    # Every unit gathered in forward and again in backward, except the last, which stays gathered.
    expected = sum(SLOW.time(wire_bytes(u.gather_bytes, 2)) * 2 + SLOW.time(wire_bytes(u.reduce_bytes, 2))
                   for u in idle.units) - SLOW.time(wire_bytes(idle.units[-1].gather_bytes, 2))
    assert prediction.step_s == pytest.approx(expected)      # no compute: comm end to end
    assert prediction.comm_s == pytest.approx(expected)


def test_deeper_prefetch_never_predicted_slower_without_budget():
    profile = _alternating_profile()
    steps = [predict_step(profile, SLOW, d, d).step_s for d in range(5)]
    assert all(b <= a + 1e-12 for a, b in zip(steps, steps[1:]))
    assert steps[0] > steps[1]


def test_slow_link_gets_deeper_prefetch():
    profile = _alternating_profile()
    fast_depth, _, _ = choose_depths(profile, FAST, None)
    slow_depth, _, slow = choose_depths(profile, SLOW, None)
    assert fast_depth <= 1
    assert slow_depth >= 2
    assert slow.step_s < predict_step(profile, SLOW, 1, 1).step_s * 0.95


def test_tight_budget_caps_depth():
    profile = _alternating_profile()
    budget = int(2.5 * 16 * MB)          # the computing unit and one more
    depth, _, prediction = choose_depths(profile, SLOW, budget)
    assert depth <= 1
    assert prediction.peak_gathered_bytes <= budget
    unbounded = predict_step(profile, SLOW, 3, 3)
    assert unbounded.peak_gathered_bytes > budget            # the cap is what changed the choice


def test_forward_and_backward_depths_may_differ():
    profile = _alternating_profile()
    forward_depth, backward_depth, prediction = choose_depths(profile, SLOW, None, shared=False)
    _, _, shared = choose_depths(profile, SLOW, None, shared=True)
    assert prediction.step_s <= shared.step_s + 1e-12
    assert min(forward_depth, backward_depth) >= 1


def test_latency_share_rule():
    for link, world in ((FAST, 8), (SLOW, 2), (LinkModel("infiniband", 45e-6, 46e9), 64)):
        threshold = latency_bucket_bytes(link, world)
        share = link.alpha / link.time(wire_bytes(threshold, world))
        assert share == pytest.approx(LATENCY_SHARE, rel=1e-3)


def test_tiny_units_are_merged_until_latency_is_a_small_share():
    link = LinkModel("loopback", 1e-3, 1e9)
    tiny = [UnitCost(f"t{i}", 256 * 1024, 256 * 1024, 256 * 1024) for i in range(200)]
    big = [UnitCost("big", 200 * MB, 200 * MB, 200 * MB)]
    units = tiny[:100] + big + tiny[100:]
    bucket = choose_bucket_bytes(units, link, world_size=2)
    merged = merge_costs(units, bucket)
    assert len(merged) < len(units) / 10
    assert any(b.name == "big" for b in merged)              # large units are never merged further
    for b in merged[:-1]:
        if b.name != "big":
            assert link.alpha / link.time(wire_bytes(b.gather_bytes, 2)) <= LATENCY_SHARE + 1e-9
    assert merge_costs(big * 3, bucket) == big * 3


def test_small_model_is_not_merged_into_one_bucket():
    """Even where latency would want one collective for everything, at least MIN_BUCKETS
    remain, so that gathers have neighbours' compute to hide under."""
    link = LinkModel("loopback", 5e-3, 1e9)                 # 45 MB latency threshold
    units = [UnitCost(f"b{i}", MB, MB, MB) for i in range(8)]
    merged = merge_costs(units, choose_bucket_bytes(units, link, world_size=2))
    assert len(merged) >= MIN_BUCKETS and len(merged) < len(units)


def test_bucket_respects_the_memory_budget():
    tiny = [UnitCost(f"t{i}", MB, MB, MB) for i in range(64)]
    link = LinkModel("ethernet", 5e-3, 1e9)
    assert choose_bucket_bytes(tiny, link, 2, memory_budget_bytes=8 * MB) <= 4 * MB


def test_every_link_class_has_a_default_model():
    from overlap.base.choices import LINK_CLASSES
    from overlap.plan.links import LINK_DEFAULTS

    assert tuple(LINK_DEFAULTS) == LINK_CLASSES
    assert all(LINK_DEFAULTS[name].link == name for name in LINK_CLASSES)


def test_drift_needs_a_material_change():
    profile = _alternating_profile()
    slower = Profile(tuple(UnitCost(u.name, u.nbytes, u.gather_bytes, u.reduce_bytes, u.forward_s * 1.5,
                                    u.backward_s * 1.5) for u in profile.units), 2)
    noisy = Profile(tuple(UnitCost(u.name, u.nbytes, u.gather_bytes, u.reduce_bytes, u.forward_s * 1.05,
                                   u.backward_s * 1.05) for u in profile.units), 2)
    assert drifted(profile, slower)
    assert not drifted(profile, noisy)


# ---- probe fit and settings --------------------------------------------------------------------

def test_probe_fit_recovers_alpha_beta():
    alpha, beta = 250e-6, 0.4e9
    sizes = [32e3, 1e6, 8e6]
    noise = [1.02, 0.99, 1.01, 0.98, 1.0, 1.01]
    samples = [(x, (alpha + x / beta) * noise[i * 2 + j]) for i, x in enumerate(sizes) for j in range(2)]
    fitted_alpha, fitted_beta = fit_alpha_beta(samples, SLOW)
    assert fitted_beta == pytest.approx(beta, rel=0.05)
    assert fitted_alpha == pytest.approx(alpha, rel=0.5, abs=50e-6)


def test_probe_fit_falls_back_on_a_useless_slope():
    alpha, beta = fit_alpha_beta([(1e6, 0.010), (8e6, 0.009)], SLOW)
    assert beta == SLOW.beta and alpha > 0
    with pytest.raises(ValueError, match="no samples"):
        fit_alpha_beta([], SLOW)


def test_env_settings_are_validated():
    config = config_from_env({"OVERLAP_LINK": "infiniband", "OVERLAP_MEMORY_BUDGET_MB": "512",
                              "OVERLAP_PROBE": "0", "OVERLAP_PROBE_CACHE": "probe.json"})
    assert (config.link, config.memory_budget_mb, config.probe, config.probe_cache) == \
        ("infiniband", 512.0, False, "probe.json")
    with pytest.raises(ValueError, match="OVERLAP_LINK"):
        config_from_env({"OVERLAP_LINK": "carrier-pigeon"})
    with pytest.raises(ValueError, match="OVERLAP_MEMORY_BUDGET_MB"):
        config_from_env({"OVERLAP_MEMORY_BUDGET_MB": "-1"})
    with pytest.raises(ValueError, match="OVERLAP_PROBE_CACHE"):
        config_from_env({"OVERLAP_PROBE_CACHE": " "})


# ---- simulator ---------------------------------------------------------------------------------

ROW = re.compile(r"^\s*(\d+)\s+(\S+)\s+([\d.]+)\s+([\d.]+)\s+([\d.]+)\s+([\d.]+)\s+([\d,]+)(\s+<- planner)?$")


def _simulate(*argv: str) -> str:
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert simulate(list(argv)) == 0
    return out.getvalue()


def test_simulator_output_is_self_consistent():
    text = _simulate("--model", "llama3-8b", "--cluster", "8xH100-nvlink", "--mfu", "0.4")
    rows = [ROW.match(line) for line in text.splitlines()]
    rows = [r for r in rows if r]
    assert len(rows) >= 10
    picked = [r for r in rows if r.group(8)]
    assert len(picked) == 1
    best = min(float(r.group(3)) for r in rows)
    assert float(picked[0].group(3)) <= best * 1.01
    # 8B on 8 H100 at MFU 0.4 is compute-bound. The bound, by hand from Llama 3 8B's published
    # shape (32 layers, d 4096, FFN 14336, 32 heads of 128, 8 KV heads, vocab 128256, sequence
    # 8192) and the MFU convention (6 FLOPs per matmul parameter, the output head included and
    # the input embedding not, plus 12·d·seq per layer for attention), at 989 TFLOP/s × 0.4:
    layer = 2 * 4096 * 4096 + 2 * 4096 * 128 * 8 + 3 * 4096 * 14336
    flops_per_token = 6 * (32 * layer + 128256 * 4096) + 12 * 4096 * 8192 * 32
    bound = 989e12 * 0.4 / flops_per_token
    tokens = float(picked[0].group(7).replace(",", ""))
    # NVLink hides all but the first gather and the last reductions: within 3% of the bound.
    assert 0.97 * bound < tokens <= bound * 1.001, (tokens, bound)
    assert "compute |" in text and "comm    |" in text


def test_simulator_slow_cluster_exposes_more():
    fast = _simulate("--model", "gpt2-xl", "--cluster", "8xH100-nvlink", "--depth", "1", "--bucket-mb", "0")
    slow = _simulate("--model", "gpt2-xl", "--cluster", "4x8xH100-eth-100g", "--depth", "1", "--bucket-mb", "0")
    exposed = [float(ROW.match(next(l for l in t.splitlines() if ROW.match(l))).group(4)) for t in (fast, slow)]
    assert exposed[1] > 10 * exposed[0]


# Modules that run collectives, hold shards or hook the model; the arithmetic floor below
# them (cost model, planner's choices, simulator, estimate) must reach none of them.
def test_simulate_and_estimate_count_activations_alike():
    from overlap.plan.memory import ActivationShape, estimate
    from overlap.cli.simulate import MODELS, activations

    model = MODELS["llama3-8b"]
    for checkpointing in (False, True):
        shape = ActivationShape(2, model.seq, model.hidden, model.layers, model.heads, model.vocab)
        expected = estimate(model.params, 8, precision="bf16", activations=shape, checkpointing=checkpointing)
        assert activations(model, 2, checkpointing) == expected.activations


def test_simulator_rejects_bad_arguments():
    with pytest.raises(SystemExit):
        simulate(["--model", "llama3-8b", "--cluster", "8xH100-nvlink", "--mfu", "1.5"])
    with pytest.raises(SystemExit):
        simulate(["--model", "no-such-model", "--cluster", "8xH100-nvlink"])


# ---- on real ranks -----------------------------------------------------------------------------

def _overrides_and_probe(rank: int, world: int, cache: str):
    import torch

    from overlap import ShardedModule
    from overlap.control.replanner import Replanner
    from overlap.control.probe import probe_link
    from overlap.plan.links import LINK_DEFAULTS
    import torch.distributed as dist

    torch.manual_seed(0)
    fixed = ShardedModule(torch.nn.Sequential(*[torch.nn.Linear(64, 64) for _ in range(4)]))
    x = torch.randn(8, 64)
    for _ in range(3):
        fixed(x).sum().backward()
    fixed_state = (fixed.overlap_config.prefetch_depth, fixed.overlap_config.bucket_mb, fixed.scheduler.prefetch_depth,
                   any(isinstance(c, Replanner) for c in fixed.step_end.controllers))
    argument_wins = ShardedModule(torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 8)),
                                  prefetch_depth=1).overlap_config.prefetch_depth
    group = dist.group.WORLD
    probed = probe_link(group, torch.device("cpu"), LINK_DEFAULTS["loopback"], cache)
    cached = probe_link(group, torch.device("cpu"), LINK_DEFAULTS["loopback"], cache)
    return fixed_state, argument_wins, probed, cached, _probe_after_a_slow_first_size()


def _probe_after_a_slow_first_size() -> tuple[list[int], float]:
    """The probe on a slow link (β 0.1 GB/s, α 0.5 ms) whose first size read three times its time
    (a loaded host): the sizes timed, and the β fitted. Grown by the ratio of sizes, that first
    time overruns the budget; the second size must run all the same (with one repeat)."""
    import torch
    import torch.distributed as dist

    from overlap.control import probe
    from overlap.plan.links import LINK_DEFAULTS

    timed = []

    def pair(timer, nbytes: int) -> tuple[float, float]:
        timed.append(nbytes)
        seconds = 5e-4 + nbytes / 2 / 0.1e9          # two ranks: half the buffer crosses
        return (3 * seconds,) * 2 if nbytes == probe.PROBE_SIZES[0] else (seconds,) * 2

    real_pair, probe._Timer.pair = probe._Timer.pair, pair
    try:
        samples = probe._measure(dist.group.WORLD, torch.device("cpu"), 0.3)
    finally:
        probe._Timer.pair = real_pair
    return timed, probe.fit_alpha_beta(samples, LINK_DEFAULTS["loopback"])[1]


def test_env_overrides_and_probe_cache(tmp_path):
    cache = str(tmp_path / "probe.json")
    results = run_distributed(_overrides_and_probe, 2, cache, timeout=90,
                              env={"OVERLAP_PREFETCH_DEPTH": "3", "OVERLAP_BUCKET_MB": "30", "OVERLAP_PROBE": "0"})
    for fixed_state, argument_wins, probed, cached, (timed, beta) in results:
        assert fixed_state == (3, 30.0, 3, False)           # env beats the planner: no re-planning
        assert argument_wins == 1                            # argument beats env
        assert probed.source == "probe" and cached.source == "cache"
        assert (cached.alpha, cached.beta) == (probed.alpha, probed.beta)
        assert probed.alpha > 0 and probed.beta > 0
        first, second = PROBE_SIZES[:2]                      # warm-up, three repeats, then one of the second
        assert timed == [first] * 4 + [second]
        assert 0.1e9 <= beta < 0.2e9                         # measured, not the loopback default (0.6 GB/s)
    assert results[0][2] == results[1][2]
    assert os.path.exists(cache)


def _replan(rank: int, world: int, evaluate: bool):
    import time

    import torch
    from torch import nn

    from overlap import ShardedModule
    from overlap.control.replanner import Replanner

    delay = {"s": 0.0}

    class SlowBlock(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.fc = nn.Linear(256, 256)

        def forward(self, x):
            time.sleep(delay["s"])
            return torch.relu(self.fc(x))

    class Net(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.blocks = nn.ModuleList(SlowBlock() for _ in range(4))
            self.head = nn.Linear(256, 1)

        def forward(self, x):
            for block in self.blocks:
                x = block(x)
            return self.head(x).sum()

    torch.manual_seed(0)
    model = ShardedModule(Net())
    replanner = next(c for c in model.step_end.controllers if isinstance(c, Replanner))
    if not evaluate:
        replanner.every = 3
    x = torch.randn(16, 256)
    depths = []
    for iteration in range(1, 12):
        # Ranks see different timings; rank 0's slow down part way (drift).
        delay["s"] = (0.030 if iteration >= (7 if evaluate else 4) else 0.0) if rank == 0 else 0.004
        model(x).backward()
        if evaluate:
            with torch.no_grad():
                model(x)
        depths.append(model.scheduler.prefetch_depth)
    return [(d.step, d.forward_depth, d.backward_depth, d.reason) for d in replanner.history], depths


def test_every_rank_applies_rank0_plan_including_replans():
    results = run_distributed(_replan, 2, False, timeout=120,
                              env={"OVERLAP_LINK": "ethernet", "OVERLAP_PROBE": "0", "OVERLAP_BUCKET_MB": "0.1"})
    (history0, depths0), (history1, depths1) = results
    assert history0 == history1 and depths0 == depths1
    assert history0[0][0] == 2 and history0[0][3].startswith("measured")
    assert any("drift" in reason for _, _, _, reason in history0[1:])


def test_replanning_goes_on_under_evaluation_forwards():
    """A training step and an evaluation forward in turn: steps 1, 3, ... train, 2, 4, ...
    evaluate, so every decision step (2, 12, 22) is an evaluation step; decisions are still
    made there, from the training steps measured in between."""
    results = run_distributed(_replan, 2, True, timeout=150,
                              env={"OVERLAP_LINK": "ethernet", "OVERLAP_PROBE": "0", "OVERLAP_BUCKET_MB": "0.1"})
    (history0, depths0), (history1, depths1) = results
    assert history0 == history1 and depths0 == depths1
    assert [step for step, *_ in history0] == [12, 22]
    assert history0[0][3].startswith("measured") and "drift" in history0[1][3]


def _closed_step(forwards: int, reductions: dict[str, int]):
    """A training step of `forwards` micro-batches: units a and b computed 0.2 s forward and
    0.4 s backward each in all, 0.2 s of waits in a 2 s span, `reductions` reduce-scatters per unit."""
    from overlap.base.step_record import Collective, StepKind, StepRecord
    from overlap.observe.report import ClosedStep, StepStats, UnitStats

    collectives = tuple(Collective("reduce_scatter", unit, 1, 0.0, 0.0)
                        for unit, count in reductions.items() for _ in range(count))
    record = StepRecord(3, StepKind.TRAIN, "host", (), collectives, None, {}, forwards, forwards)
    stats = StepStats(3, span_s=2.0, compute_s=1.2, runtime_s=0.0, comm_s=0.0, hidden_s=0.0, exposed_s=0.0,
                      gather_wait_s=0.1, reduce_wait_s=0.1, prefetches=0, hits=0, misses=0, gathered_bytes=0,
                      reduced_bytes=0, peak_gathered_bytes=0,
                      units=(UnitStats("a", 0.2, 0.4), UnitStats("b", 0.2, 0.4)))
    return ClosedStep(record, stats)


def test_a_step_of_micro_batches_is_measured_per_micro_batch():
    """Gradient accumulation: a step of k micro-batches is measured as k steps of one, each
    unit's reduction shared by the micro-batches it was made for (under no_sync, one per step)."""
    from overlap.control.replanner import measure_profile

    base = Profile((UnitCost("a", 8 * MB, 8 * MB, 8 * MB), UnitCost("b", 8 * MB, 8 * MB, 8 * MB)), 2)
    one = measure_profile(_closed_step(1, {"a": 1, "b": 1}), base)
    assert [(u.forward_s, u.backward_s, u.reduce_bytes) for u in one.units] == [(0.2, 0.4, 8 * MB)] * 2
    assert one.other_s == pytest.approx(0.6)
    two = measure_profile(_closed_step(2, {"a": 1, "b": 2}), base)
    assert [(u.forward_s, u.backward_s) for u in two.units] == [(0.1, 0.2)] * 2
    assert [u.reduce_bytes for u in two.units] == [4 * MB, 8 * MB]
    assert two.other_s == pytest.approx(0.3)
    assert [u.gather_bytes for u in two.units] == [8 * MB] * 2


def test_host_link_reads_nvlink_between_each_pair_of_gpus():
    """NVLink only when NVML reports it between every pair of the ranks' GPUs (peer access
    over PCIe is not NVLink); PCIe when a pair lacks it or NVML cannot be asked; loopback for
    ranks on CPU or on one GPU."""
    from overlap.control.gpu_links import NvmlUnavailable, host_link

    asked = []

    def pairs_without(missing):
        def query(gpus):
            asked.append(list(gpus))
            return [pair for pair in missing if set(pair) <= set(gpus)]
        return query

    def unavailable(gpus):
        raise NvmlUnavailable("libnvidia-ml.so.1 not loadable")

    gpus = ["GPU-b", "GPU-a", "GPU-c", "GPU-d"]
    assert host_link(gpus, pairs_without([]))[0] == "nvlink"
    assert asked == [["GPU-a", "GPU-b", "GPU-c", "GPU-d"]]
    link, why = host_link(gpus, pairs_without([("GPU-b", "GPU-c")]))
    assert link == "pcie" and "GPU-b and GPU-c" in why
    link, why = host_link(gpus, unavailable)
    assert link == "pcie" and "not loadable" in why
    # Each rank sees its own GPU only (CUDA_VISIBLE_DEVICES per rank): the ranks' GPUs are
    # still told apart, since each names its GPU by UUID.
    assert host_link(["GPU-a", "GPU-b"], pairs_without([]))[0] == "nvlink"
    asked.clear()
    assert host_link([None, None], pairs_without([]))[0] == "loopback"
    assert host_link(["GPU-a", "GPU-a"], pairs_without([]))[0] == "loopback"
    assert asked == []


def test_nvml_missing_is_reported_not_raised(monkeypatch):
    from overlap.control import gpu_links

    monkeypatch.setattr(gpu_links, "NVML_LIBRARY", "libnot-a-library-overlap.so")
    with pytest.raises(gpu_links.NvmlUnavailable, match="not loadable"):
        gpu_links.nvml_pairs_without_nvlink(["GPU-a", "GPU-b"])
    assert gpu_links.host_link(["GPU-a", "GPU-b"])[0] == "pcie"


def _levels(rank: int, world: int):
    import torch.distributed as dist

    from overlap.control.topology import level_links

    return level_links("auto", dist.group.WORLD)


def test_ranks_on_cpu_detect_loopback():
    assert run_distributed(_levels, 2, timeout=60) == [("loopback", "loopback")] * 2


def test_gpu_uuid_names_the_gpu_as_nvml_does(monkeypatch):
    from types import SimpleNamespace

    import torch

    from overlap.control.gpu_links import gpu_uuid

    props = {0: SimpleNamespace(uuid="5f1e8a2c-0000-1111-2222-333344445555")}
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda device: props[device.index])
    assert gpu_uuid(torch.device("cuda", 0)) == "GPU-5f1e8a2c-0000-1111-2222-333344445555"
    assert gpu_uuid(torch.device("cpu")) is None
