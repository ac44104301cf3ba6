"""Every kernel backend on tensors past 2**31 elements against torch's reference."""
from __future__ import annotations

import torch

from gpu_harness import Checks, device_for, empty_cache, synchronize


def check_large_index(checks: Checks, rehearse: bool) -> None:
    from overlap.kernels.backends import available_backends, get_backend
    from overlap.kernels.reference import TorchKernels

    device = device_for(rehearse)
    big = (1 << 20) if rehearse else (1 << 31)
    half = big // 2
    reference = TorchKernels()
    gen = torch.Generator(device=device).manual_seed(0)

    def randn(n: int, dtype: torch.dtype) -> torch.Tensor:
        return torch.randn(n, generator=gen, device=device, dtype=torch.float32).to(dtype)

    def nan(n: int, dtype: torch.dtype) -> torch.Tensor:
        return torch.full((n,), float("nan"), device=device, dtype=dtype)

    # (label, run(backend) -> outputs): each past `big` elements in its offsets or its reads.
    def pack_one(backend):
        src = randn(big + 4099, torch.float32)
        dst = nan(big + 4200, torch.bfloat16)
        backend.pack([src], dst, [37], 0.5)
        return [dst]

    def pack_many(backend):
        srcs = [randn(half + 5, torch.float32), randn(half + 1031, torch.float32)]
        dst = nan(big + 2048, torch.bfloat16)
        backend.pack(srcs, dst, [11, half + 100], 1.0)
        return [dst]

    def accumulate(backend):
        dst = randn(half + 3, torch.float32)
        src = randn(2 * (half + 3), torch.bfloat16)
        backend.accumulate(dst, src, 0.5, 2)
        return [dst]

    ops = {"pack_one": pack_one, "pack_many": pack_many, "accumulate": accumulate}
    names = [n for n in available_backends(device) if n != "torch" and not (rehearse and n == "triton")]
    for name in names:
        backend = get_backend(name, device)
        for label, run in ops.items():
            with checks.guarded(f"large_index[{name}.{label}]"):
                gen.manual_seed(0)
                expected = run(reference)
                gen.manual_seed(0)
                got = run(backend)
                synchronize(device)
                same = all(torch.equal(a.isnan(), b.isnan()) and torch.equal(a.nan_to_num(), b.nan_to_num())
                           for a, b in zip(got, expected))
                checks.verdict(f"large_index[{name}.{label}]", same,
                               f"{sum(t.numel() for t in got):,} output elements {'equal' if same else 'DIFFER'} "
                               "to torch's")
                del expected, got
                empty_cache(device)
