"""The per-step scalars of AdamW, computed once in Python's double precision exactly as
torch.optim.AdamW computes them, and shared by the torch reference and the C++ kernel."""
from __future__ import annotations

from typing import NamedTuple


class AdamWScalars(NamedTuple):
    """What one step of one tensor (or one flat bucket) needs besides its buffers."""

    decay: float            # param *= decay: 1 - lr * weight_decay (decoupled weight decay)
    beta1_weight: float     # exp_avg.lerp_(grad, beta1_weight): 1 - beta1
    beta2: float
    one_minus_beta2: float
    bias2_sqrt: float       # sqrt(1 - beta2 ** step), as torch: (1 - beta2 ** step) ** 0.5
    eps: float
    neg_step_size: float    # -lr / (1 - beta1 ** step)


def adamw_scalars(lr: float, beta1: float, beta2: float, eps: float, weight_decay: float,
                  step: float) -> AdamWScalars:
    """The scalars of step number `step` (1 for the first step), each expression written as
    torch.optim's `_single_tensor_adam` writes it, so that both round alike."""
    if not step >= 1:
        raise ValueError(f"step={step!r} is invalid; expected the step number after counting it (>= 1)")
    bias_correction1 = 1 - beta1 ** step
    bias_correction2 = 1 - beta2 ** step
    step_size = lr / bias_correction1
    return AdamWScalars(1 - lr * weight_decay, 1 - beta1, beta2, 1 - beta2, bias_correction2 ** 0.5, eps,
                        -step_size)
