"""`compression="auto"`: compressed only where the replayed step is communication-bound."""
from __future__ import annotations

from overlap.plan.compression import EXPOSED_SHARE, CodecCost, choose_compression, compressed_profile, wire_ratio
from overlap.plan.cost_model import Profile, UnitCost, predict_step
from overlap.plan.links import LinkModel

MB = 2**20
CODEC = CodecCost(quantize_s=2e-9, dequantize_s=1e-9, block=128)


def _profile(compute_s_per_unit: float, units: int = 4, nbytes: int = 16 * MB) -> Profile:
    return Profile(tuple(UnitCost(f"u{i}", nbytes, nbytes, nbytes, compute_s_per_unit / 3, 2 * compute_s_per_unit / 3)
                         for i in range(units)), world_size=2)


def test_wire_ratio_is_what_the_codec_sends() -> None:
    """The planner's ratio against the buffers the codec actually fills and sends (values and
    scales, `overlap.kernels.quantized.empty_quantized`), over the uncompressed bytes."""
    import torch

    from overlap.kernels.quantized import empty_quantized

    numel = 128 * 96
    for bits, block, itemsize in ((8, 128, 4), (4, 128, 4), (8, 64, 2), (4, 256, 2)):
        q, scales = empty_quantized(numel, block, bits, torch.device("cpu"))
        sent = q.numel() * q.element_size() + scales.numel() * scales.element_size()
        assert wire_ratio(bits, block, itemsize) == sent / (numel * itemsize), (bits, block, itemsize)


def test_slow_link_compresses_and_says_why() -> None:
    link = LinkModel("ethernet", 1e-4, 0.25e9)          # 2 Gbit/s
    profile = _profile(0.02)                              # a gather takes 34 ms, compute 20 ms per unit
    choice = choose_compression(profile, link, CODEC, 2, 2)
    assert choice.mode in ("int8", "int8-int4")
    assert "exposed" in choice.reason and choice.mode in choice.reason.split(":")[0]


def test_compute_bound_step_stays_uncompressed() -> None:
    link = LinkModel("nvlink", 15e-6, 370e9)
    profile = _profile(0.05)
    base = predict_step(profile, link, 2, 2)
    assert base.exposed_s / base.step_s < EXPOSED_SHARE
    choice = choose_compression(profile, link, CODEC, 2, 2)
    assert choice.mode == "none" and "not communication-bound" in choice.reason


def test_codec_time_can_outweigh_the_bytes_saved() -> None:
    """On a link slow enough to expose communication, a codec slower than the link saves nothing."""
    link = LinkModel("ethernet", 1e-4, 0.25e9)
    profile = _profile(0.01)
    slow_codec = CodecCost(quantize_s=2e-7, dequantize_s=2e-7, block=128)
    assert choose_compression(profile, link, CODEC, 2, 2).mode != "none"
    assert choose_compression(profile, link, slow_codec, 2, 2).mode == "none"


def test_compressed_profile_scales_bytes_and_adds_codec_time_where_it_runs() -> None:
    link = LinkModel("ethernet", 1e-4, 1e9)
    profile = _profile(0.01, units=1, nbytes=4 * MB)
    on_cpu = compressed_profile(profile, link, CODEC, 8, 4).units[0]
    assert on_cpu.gather_bytes == int(4 * MB * wire_ratio(8, 128, 4))
    assert on_cpu.reduce_bytes == int(4 * MB * wire_ratio(4, 128, 4))
    assert on_cpu.forward_s > profile.units[0].forward_s
    gpu_codec = CodecCost(2e-9, 1e-9, 128, on_compute_lane=False)
    on_gpu = compressed_profile(profile, link, gpu_codec, 8, 4).units[0]
    assert on_gpu.forward_s == profile.units[0].forward_s
    assert on_gpu.gather_bytes > on_cpu.gather_bytes
