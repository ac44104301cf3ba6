"""The simulator against published scaling ratios, where the assumed MFU cancels.

A predicted tokens/s is only as good as the MFU assumed, so an absolute match proves nothing.
Here each recipe's MFU is fitted, by bisection (`fit_mfu`), so that the simulator gives the
published throughput at the smaller scale; the tests fit it, check that the fit reproduces that
throughput and that it rounds to the MFU docs/planner.md quotes (`Case.mfu`). With that compute
rate fixed, the predicted ratio of the throughputs at the two scales is a prediction of
communication alone (what the cost model replays), compared with the published ratio.

The check must be able to fail. Every published ratio used here lies between 0.973 and 0.983,
so a model that ignores the cluster (perfect scaling, 1.0, or any other constant) would pass a
tolerance of 0.02 on all of them. `TOLERANCE` is therefore below half the spread of the
published ratios, and `test_the_check_rejects_every_constant_prediction` proves it: no single
number, 1.0 included, is within `TOLERANCE` of every published ratio. At that tolerance the
simulator fails two of the three cases; those are marked as expected failures (strict: a model
change that makes them pass must remove the mark) and explained in docs/planner.md.

Sources (TPS/GPU, read at one iteration of each run):
- torchtitan, docs/performance.md (pytorch/torchtitan), Llama 3.1 8B on H100s (Grand Teton:
  8 GPUs per host on NVLink, 400 Gb/s RDMA per GPU between hosts), FSDP (1D), local batch 2,
  sequence 8192, selective activation checkpointing, bf16 parameters and fp32 gradient
  reduction; Table 1 (8 GPUs) and Table 3 (128 GPUs). torchtitan wraps each block, the final
  norm with the output head, and the input embedding (the root) separately:
  `build_profile(..., head_unit=True)`.
      FSDP                  5,762 -> 5,605   ratio 0.973
      FSDP + torch.compile  6,667 -> 6,514   ratio 0.977
  (The Float8 row, 8,532 -> 8,380, is not used: the tables do not say whether its weights
  were gathered in Float8, which is what the simulator would need to know.)
- torchtitan, benchmarks/llama3-8b_h200_202506_trainy-whitefiber.md, Llama 3.1 8B on H200s
  (8 per host, 400 Gb/s RDMA per GPU), FSDP with torch.compile, Float8 linears and Float8
  all-gathers of the weights (one byte per parameter on the wire; gradients reduced in fp32),
  local batch 2, iteration 100:
      4 nodes (32 GPUs) 10,938 -> 8 nodes (64 GPUs) 10,753   ratio 0.983
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Callable

import pytest

from overlap.plan.cost_model import Profile, UnitCost
from overlap.cli.simulate import CLUSTERS, GATHER_BYTES, MODELS, ClusterPreset, build_profile, planned

LLAMA_8B = MODELS["llama3-8b"]
BATCH = 2
# Below half the spread of the published ratios (0.983 - 0.973 = 0.010), so that no constant
# prediction passes every case; see test_the_check_rejects_every_constant_prediction.
TOLERANCE = 0.004
FLOAT8_GATHER_BYTES = 1


def h200_ib_cluster(nodes: int) -> ClusterPreset:
    """H200 hosts joined by one 400 Gb/s NIC per GPU: the H100 NDR preset's link (the peak
    FLOP/s is the same dense bf16 figure; the fitted MFU absorbs the difference in any case)."""
    return replace(CLUSTERS["16x8xH100-ib-ndr"], nodes=nodes, memory_bytes=141e9)


def float8_gathers(profile: Profile) -> Profile:
    def one_byte(unit: UnitCost) -> UnitCost:
        return replace(unit, gather_bytes=unit.gather_bytes * FLOAT8_GATHER_BYTES // GATHER_BYTES)

    return replace(profile, units=tuple(one_byte(u) for u in profile.units), root=one_byte(profile.root))


def bf16_gathers(profile: Profile) -> Profile:
    return profile


@dataclass(frozen=True)
class Case:
    """Two published throughputs of one recipe at two scales, and the MFU fixed beforehand."""

    small_cluster: ClusterPreset
    large_cluster: ClusterPreset
    gathers: Callable[[Profile], Profile]
    small_tps: int
    large_tps: int
    mfu: float      # the fit (fit_mfu below) to three decimals, as docs/planner.md quotes it

    @property
    def published(self) -> float:
        return self.large_tps / self.small_tps

    def tokens_per_s(self, cluster: ClusterPreset, mfu: float) -> float:
        profile = self.gathers(build_profile(LLAMA_8B, cluster, BATCH, mfu, head_unit=True))
        return planned(profile, cluster, LLAMA_8B, BATCH).tokens_per_s

    def predicted(self, mfu: float) -> float:
        return self.tokens_per_s(self.large_cluster, mfu) / self.tokens_per_s(self.small_cluster, mfu)


CASES = {
    "torchtitan-fsdp-128/8": Case(CLUSTERS["8xH100-nvlink"], CLUSTERS["16x8xH100-ib-ndr"], bf16_gathers,
                                  5_762, 5_605, mfu=0.339),
    "torchtitan-fsdp+compile-128/8": Case(CLUSTERS["8xH100-nvlink"], CLUSTERS["16x8xH100-ib-ndr"], bf16_gathers,
                                          6_667, 6_514, mfu=0.392),
    "trainy-h200-float8-8/4-nodes": Case(h200_ib_cluster(4), h200_ib_cluster(8), float8_gathers,
                                         10_938, 10_753, mfu=0.686),
}
# Cases the simulator misses at TOLERANCE (the finding, see docs/planner.md "Where the MFU cancels").
MISSED = {
    "torchtitan-fsdp+compile-128/8": "predicted 0.963: the input embedding's gather and its fp32 reduce-scatter "
                                     "stay exposed and weigh more under compiled compute than they did",
    "trainy-h200-float8-8/4-nodes": "predicted 0.998: every collective hides at both sizes in the replay; "
                                    "the published 1.7% drop is not modelled",
}


_FITTED: dict[str, float] = {}


def fit_mfu(case: Case) -> float:
    """The MFU at which the smaller scale gives the published throughput (bisection;
    throughput rises with MFU)."""
    low, high = 0.01, 1.0
    for _ in range(50):
        mid = (low + high) / 2
        low, high = (mid, high) if case.tokens_per_s(case.small_cluster, mid) < case.small_tps else (low, mid)
    return (low + high) / 2


def fitted_mfu(name: str) -> float:
    """`fit_mfu` of the named case, fitted once per session (a few seconds each)."""
    if name not in _FITTED:
        _FITTED[name] = fit_mfu(CASES[name])
    return _FITTED[name]


@pytest.mark.parametrize("name", list(CASES))
def test_the_fit_gives_the_published_throughput_and_the_quoted_mfu(name):
    case, mfu = CASES[name], fitted_mfu(name)
    assert case.tokens_per_s(case.small_cluster, mfu) == pytest.approx(case.small_tps, rel=1e-6)
    assert round(mfu, 3) == case.mfu, f"{name}: fitted MFU {mfu:.4f}; docs/planner.md and Case.mfu say {case.mfu}"


def test_the_check_rejects_every_constant_prediction():
    """No constant ratio, perfect scaling included, is within TOLERANCE of every published
    ratio: the interval a constant must lie in to pass them all is empty."""
    published = [case.published for case in CASES.values()]
    assert max(published) - TOLERANCE > min(published) + TOLERANCE
    assert all(abs(1.0 - ratio) > TOLERANCE for ratio in published)


@pytest.mark.parametrize("name", [
    pytest.param(name, marks=pytest.mark.xfail(strict=True, reason=MISSED[name])) if name in MISSED else name
    for name in CASES])
def test_predicted_scaling_ratio_matches_published(name):
    case, mfu = CASES[name], fitted_mfu(name)
    predicted = case.predicted(mfu)
    print(f"{name}: MFU {mfu:.4f}, predicted {predicted:.3f}, published {case.published:.3f}")
    assert predicted == pytest.approx(case.published, abs=TOLERANCE)


def test_the_ratio_is_a_prediction_of_communication():
    """On a link with no bandwidth to spare the same MFU must predict a clearly lower ratio."""
    case, mfu = CASES["torchtitan-fsdp-128/8"], fitted_mfu("torchtitan-fsdp-128/8")
    over_ethernet = case.tokens_per_s(CLUSTERS["4x8xH100-eth-100g"], mfu) / case.tokens_per_s(case.small_cluster, mfu)
    assert over_ethernet < case.published - TOLERANCE
