"""One AdamW step on one flat bucket (or one tensor): the C++ kernel where it can run, the
torch reference everywhere else.

A bucketed caller (fp32 master shard, its gradient in fp32, bf16 or fp16, two fp32 moments,
all the same length) steps one bucket at a time through `adamw_step`, keeping one step count
per bucket; `overlap.optim.AdamW` calls it once per parameter.

Backends: `ext` is `torch.ops.overlap.adamw_step` (csrc/adamw_cpu.cpp): CPU tensors,
float32 param and moments, contiguous; one vectorised pass on `torch.get_num_threads()`
threads. `torch` is `overlap.optim.reference`: any device, any float dtype, any strides.
`auto` takes `ext` for the calls it covers and `torch` for the rest (CUDA tensors among them:
they are stepped by torch ops, correct but not fused).
"""
from __future__ import annotations

import functools
from typing import Tuple

import torch

from overlap.kernels.backends import load_extension

from .reference import adamw_step_reference
from .scalars import adamw_scalars

OPTIM_BACKENDS = ("auto", "ext", "torch")
_GRAD_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


class ExtensionUnavailable(RuntimeError):
    """backend="ext" was asked for where `overlap._C` was not built."""


@functools.cache
def extension_available() -> bool:
    """Whether `torch.ops.overlap.adamw_step` has a CPU kernel in this install."""
    return load_extension() and torch._C._dispatch_has_kernel_for_dispatch_key("overlap::adamw_step", "CPU")


def kernel_covers(param: torch.Tensor, grad: torch.Tensor, exp_avg: torch.Tensor, exp_avg_sq: torch.Tensor) -> bool:
    """Whether the C++ kernel takes these tensors (else the reference steps them)."""
    states = (param, exp_avg, exp_avg_sq)
    return (all(t.device.type == "cpu" and t.dtype == torch.float32 and t.is_contiguous() for t in states)
            and grad.device.type == "cpu" and grad.dtype in _GRAD_DTYPES and grad.is_contiguous()
            and all(t.shape == param.shape for t in (grad, exp_avg, exp_avg_sq)))


@torch.no_grad()
def adamw_step(param: torch.Tensor, grad: torch.Tensor, exp_avg: torch.Tensor, exp_avg_sq: torch.Tensor, *,
               lr: float, betas: Tuple[float, float], eps: float, weight_decay: float, step: float,
               maximize: bool = False, backend: str = "auto") -> str:
    """Step `param`, `exp_avg` and `exp_avg_sq` in place by AdamW, as torch.optim.AdamW does for
    one parameter whose `state['step']` has just become `step` (1 at the first step).

    Returns the backend that ran ("ext" or "torch"). backend="ext" raises where the kernel
    cannot run (no extension, or tensors it does not take: `kernel_covers`).
    """
    if backend not in OPTIM_BACKENDS:
        raise ValueError(f"backend={backend!r} is invalid; expected one of {', '.join(OPTIM_BACKENDS)}")
    scalars = adamw_scalars(lr, betas[0], betas[1], eps, weight_decay, step)
    if backend != "torch" and extension_available() and kernel_covers(param, grad, exp_avg, exp_avg_sq):
        torch.ops.overlap.adamw_step(param.view(-1), grad.view(-1), exp_avg.view(-1), exp_avg_sq.view(-1),
                                     *scalars, maximize)
        # The kernel writes through raw pointers: tell autograd (and whoever watches `_version`,
        # as offload's device copy does) that these tensors changed, as an in-place op would.
        torch.autograd.graph.increment_version((param, exp_avg, exp_avg_sq))
        return "ext"
    if backend == "ext":
        reason = ("overlap._C was not built (reinstall with a C++ compiler)" if not extension_available() else
                  "the kernel takes CPU, contiguous tensors of one shape: float32 param and moments, a float32, "
                  f"bfloat16 or float16 grad; got param {param.dtype} on {param.device}, grad {grad.dtype}")
        raise ExtensionUnavailable(f"overlap.optim: backend='ext' cannot step these tensors: {reason}")
    adamw_step_reference(param, grad, exp_avg, exp_avg_sq, scalars, maximize)
    return "torch"
