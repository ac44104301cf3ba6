"""Whether compressing the wire pays, from the step replay (`overlap.plan.cost_model`): arithmetic
only, no runtime.

[Note: when `auto` compresses]
Compression trades bytes on the wire for quantise / dequantise work, and accuracy. It is
turned on only where the step is communication-bound: the replayed uncompressed step must
leave at least EXPOSED_SHARE of its time as exposed communication, and the replayed
compressed step (wire bytes scaled by the compressed size, codec time added where it runs)
must be at least MIN_GAIN shorter. int8-int4 is taken over int8 only when it beats int8 by
MIN_GAIN again, since it costs more accuracy and the error-feedback memory. On CPU the codec
runs on the thread that computes, so its time joins the compute lane; on CUDA it runs on the
communication streams, so it joins the communication lane.
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Optional

from overlap.base.choices import COMPRESSION_BITS
from overlap.plan.cost_model import Prediction, Profile, UnitCost, predict_step
from overlap.plan.links import LinkModel

EXPOSED_SHARE = 0.10
MIN_GAIN = 0.05
# Modes `auto` considers, cheapest in accuracy first: (name, weight bits, gradient bits).
CANDIDATES = tuple((mode, weight_bits, grad_bits) for mode, (weight_bits, grad_bits) in COMPRESSION_BITS.items()
                   if mode != "none")


@dataclass(frozen=True)
class CodecCost:
    """Measured seconds per element to quantise and to dequantise (accumulate), and the
    per-element bytes uncompressed (`gather_itemsize`, `reduce_itemsize`)."""

    quantize_s: float
    dequantize_s: float
    block: int
    gather_itemsize: int = 4
    reduce_itemsize: int = 4
    on_compute_lane: bool = True


def wire_ratio(bits: int, block: int, itemsize: int) -> float:
    """Compressed bytes over uncompressed bytes per element: the values and a fp32 scale per block."""
    return (bits / 8 + 4 / block) / itemsize


def compressed_profile(profile: Profile, link: LinkModel, codec: CodecCost, weight_bits: int,
                       grad_bits: int) -> Profile:
    """`profile` with compressed wire bytes and the codec's time added (see [Note: when
    `auto` compresses]). Per gather a rank quantises its shard and dequantises the whole
    buffer; per reduction it quantises the N-1 chunks it sends and dequantises the N-1 it
    receives (one chunk each)."""
    world = profile.world_size

    def unit(u: UnitCost) -> UnitCost:
        gathered = u.gather_bytes / codec.gather_itemsize
        reduced = u.reduce_bytes / codec.reduce_itemsize
        gather_s = gathered / world * codec.quantize_s + gathered * codec.dequantize_s
        reduce_s = reduced * (world - 1) / world * codec.quantize_s + reduced * (world - 1) / world ** 2 * codec.dequantize_s
        gather_bytes = int(u.gather_bytes * wire_ratio(weight_bits, codec.block, codec.gather_itemsize))
        reduce_bytes = int(u.reduce_bytes * wire_ratio(grad_bits, codec.block, codec.reduce_itemsize))
        if codec.on_compute_lane:
            # Each gather runs before the unit's forward and again before its backward.
            return replace(u, gather_bytes=gather_bytes, reduce_bytes=reduce_bytes,
                           forward_s=u.forward_s + gather_s, backward_s=u.backward_s + gather_s + reduce_s)
        extra = link.beta * world / max(world - 1, 1)       # seconds on the link as bytes
        return replace(u, gather_bytes=gather_bytes + int(gather_s * extra),
                       reduce_bytes=reduce_bytes + int(reduce_s * extra))

    root = unit(profile.root) if profile.root is not None else None
    return replace(profile, units=tuple(unit(u) for u in profile.units), root=root)


@dataclass(frozen=True)
class CompressionChoice:
    mode: str
    reason: str


def choose_compression(profile: Profile, link: LinkModel, codec: CodecCost, forward_depth: int,
                       backward_depth: int, memory_budget_bytes: Optional[int] = None) -> CompressionChoice:
    """The mode for `compression="auto"`, with the figures behind it. See [Note: when `auto`
    compresses]."""
    def step(p: Profile) -> Prediction:
        return predict_step(p, link, forward_depth, backward_depth, memory_budget_bytes)

    base = step(profile)
    share = base.exposed_s / base.step_s if base.step_s > 0 else 0.0
    figures = [f"uncompressed {base.step_s * 1e3:.0f} ms ({share:.0%} exposed communication)"]
    best, best_s = "none", base.step_s
    for mode, weight_bits, grad_bits in CANDIDATES:
        predicted = step(compressed_profile(profile, link, codec, weight_bits, grad_bits)).step_s
        figures.append(f"{mode} {predicted * 1e3:.0f} ms")
        if predicted <= best_s * (1 - MIN_GAIN):
            best, best_s = mode, predicted
    if share < EXPOSED_SHARE:
        best = "none"
        figures.append(f"not communication-bound (< {EXPOSED_SHARE:.0%} exposed)")
    return CompressionChoice(best, f"compression {best}: predicted " + ", ".join(figures))
