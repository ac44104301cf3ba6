"""AdamW's step on one tensor (or one flat bucket) in plain torch ops: the source of truth the
C++ kernel is tested against, and the path taken wherever the kernel cannot run (no
extension built, tensors off the CPU, a non-float32 state, strided tensors).

The ops, their order and their scalars are torch.optim.AdamW's (`_single_tensor_adam`,
foreach=False), so this path matches it bit for bit.
"""
from __future__ import annotations

import torch

from .scalars import AdamWScalars


def adamw_step_reference(param: torch.Tensor, grad: torch.Tensor, exp_avg: torch.Tensor, exp_avg_sq: torch.Tensor,
                         scalars: AdamWScalars, maximize: bool = False) -> None:
    """One AdamW step in place on `param`, `exp_avg` and `exp_avg_sq` (same shape); `grad` may
    be in a lower precision than `param`, and is widened first (exactly)."""
    if grad.dtype != param.dtype:
        grad = grad.to(param.dtype)
    if maximize:
        grad = -grad
    if scalars.decay != 1.0:
        param.mul_(scalars.decay)
    exp_avg.lerp_(grad, scalars.beta1_weight)
    exp_avg_sq.mul_(scalars.beta2).addcmul_(grad, grad, value=scalars.one_minus_beta2)
    denom = (exp_avg_sq.sqrt() / scalars.bias2_sqrt).add_(scalars.eps)
    param.addcdiv_(exp_avg, denom, value=scalars.neg_step_size)
