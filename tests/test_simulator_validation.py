"""The simulator against published scaling ratios, where the assumed MFU cancels.

A predicted tokens/s is only as good as the MFU assumed, so an absolute match proves nothing.
Here the MFU is fitted so that the simulator reproduces a published 8-GPU throughput exactly;
with that compute rate fixed, the prediction for the same recipe on more GPUs over a slower
link is a prediction of communication alone (what the cost model replays), compared with the
published ratio of the two throughputs.

Source: torchtitan, docs/performance.md (pytorch/torchtitan), Llama 3.1 8B on H100s
(Grand Teton: 8 GPUs per host on NVLink, 400 Gb/s RDMA per GPU between hosts), FSDP
(1D), local batch 2, sequence 8192, selective activation checkpointing, bf16 parameters
and fp32 gradient reduction (torchtitan's default mixed precision), TPS/GPU:

    | Techniques            | Table 1: 8 GPUs | Table 3: 128 GPUs | ratio |
    | FSDP                  | 5,762           | 5,605             | 0.973 |
    | FSDP + torch.compile  | 6,667           | 6,514             | 0.977 |

torchtitan wraps each transformer block, the final norm with the output head, and the input
embedding (the root here) separately: `build_profile(..., head_unit=True)`. The compiled row
is the same communication under faster compute (a higher fitted MFU), so it checks that the
exposed part scales with the compute it hides under.
"""
from __future__ import annotations

from dataclasses import replace
from functools import partial
from typing import Callable

import pytest

from overlap.plan.cost_model import Profile, UnitCost
from overlap.cli.simulate import CLUSTERS, GATHER_BYTES, MODELS, ClusterPreset, build_profile, planned

LLAMA_8B = MODELS["llama3-8b"]
BATCH = 2
TOLERANCE = 0.02  # two points of the ratio

# (8-GPU TPS/GPU, 128-GPU TPS/GPU) from the tables above.
TORCHTITAN = {"fsdp": (5_762, 5_605), "fsdp+compile": (6_667, 6_514)}


def tokens_per_s(cluster: str, mfu: float) -> float:
    preset = CLUSTERS[cluster]
    return planned(build_profile(LLAMA_8B, preset, BATCH, mfu, head_unit=True), preset, LLAMA_8B, BATCH).tokens_per_s


def fitted_mfu(throughput: Callable[[float], float], target: float) -> float:
    """The MFU at which `throughput(mfu)` (tokens/s/GPU) is `target` (bisection: throughput
    rises with MFU)."""
    low, high = 0.01, 1.0
    for _ in range(50):
        mid = (low + high) / 2
        low, high = (mid, high) if throughput(mid) < target else (low, mid)
    return (low + high) / 2


@pytest.mark.parametrize("recipe", sorted(TORCHTITAN))
def test_torchtitan_llama8b_128_over_8_gpus(recipe):
    small, large = TORCHTITAN[recipe]
    mfu = fitted_mfu(partial(tokens_per_s, "8xH100-nvlink"), small)
    assert tokens_per_s("8xH100-nvlink", mfu) == pytest.approx(small, rel=1e-3)
    predicted = tokens_per_s("16x8xH100-ib-ndr", mfu) / small
    published = large / small
    print(f"{recipe}: fitted MFU {mfu:.3f}, 128/8 GPUs predicted {predicted:.3f}, published {published:.3f}")
    assert predicted == pytest.approx(published, abs=TOLERANCE)


def test_the_ratio_is_a_prediction_of_communication():
    """On a link with no bandwidth to spare the same fit must predict a clearly lower ratio:
    the check above can fail."""
    mfu = fitted_mfu(partial(tokens_per_s, "8xH100-nvlink"), TORCHTITAN["fsdp"][0])
    over_ethernet = tokens_per_s("4x8xH100-eth-100g", mfu) / TORCHTITAN["fsdp"][0]
    assert over_ethernet < TORCHTITAN["fsdp"][1] / TORCHTITAN["fsdp"][0] - TOLERANCE


# A second source, other hardware and another recipe: torchtitan, benchmarks/
# llama3-8b_h200_202506_trainy-whitefiber.md (pytorch/torchtitan), Llama 3.1 8B on H200s (8 per
# host on NVLink, 400 Gb/s RDMA per GPU between hosts), FSDP with torch.compile, Float8 linears
# and Float8 all-gathers of the weights (one byte per parameter on the wire; gradients still
# reduced in fp32), local batch 2, TPS/GPU sampled at iteration 100:
#
#     | nodes | GPUs | TPS/GPU |
#     | 4     | 32   | 10,938  |
#     | 8     | 64   | 10,753  |   ratio 0.983
#
# The MFU is fitted at 4 nodes (it absorbs H200 against H100 and Float8 against bf16 compute);
# the 8-node prediction then only differs in the ring's length. The simulator predicts 0.998:
# within the two points, but flatter than published; the published 1.7% drop is of the size of
# step-to-step variation at a single sampled iteration, which the model does not describe.
TRAINY_H200 = (10_938, 10_753)
FLOAT8_GATHER_BYTES = 1


def h200_ib_cluster(nodes: int) -> ClusterPreset:
    """H200 hosts joined by one 400 Gb/s NIC per GPU: the H100 NDR preset's link (the peak
    FLOP/s is the same dense bf16 figure; the fitted MFU absorbs the difference in any case)."""
    ndr = CLUSTERS["16x8xH100-ib-ndr"]
    return replace(ndr, nodes=nodes, memory_bytes=141e9)


def float8_gathers(profile: Profile) -> Profile:
    def one_byte(unit: UnitCost) -> UnitCost:
        return replace(unit, gather_bytes=unit.gather_bytes * FLOAT8_GATHER_BYTES // GATHER_BYTES)

    return replace(profile, units=tuple(one_byte(u) for u in profile.units), root=one_byte(profile.root))


def h200_tokens_per_s(nodes: int, mfu: float) -> float:
    cluster = h200_ib_cluster(nodes)
    profile = float8_gathers(build_profile(LLAMA_8B, cluster, BATCH, mfu, head_unit=True))
    return planned(profile, cluster, LLAMA_8B, BATCH).tokens_per_s


def test_trainy_h200_llama8b_8_over_4_nodes():
    small, large = TRAINY_H200
    mfu = fitted_mfu(partial(h200_tokens_per_s, 4), small)
    assert h200_tokens_per_s(4, mfu) == pytest.approx(small, rel=1e-3)
    predicted, published = h200_tokens_per_s(8, mfu) / small, large / small
    print(f"H200 Float8: fitted MFU {mfu:.3f}, 8/4 nodes predicted {predicted:.3f}, published {published:.3f}")
    assert predicted == pytest.approx(published, abs=TOLERANCE)
