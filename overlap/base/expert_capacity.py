"""Expert capacity: the rule that caps the (token, choice) pairs each expert of a mixture of
experts takes in one forward, shared by the reference GPT-MoE's router (overlap.models.moe)
and the runtime's expert modules (overlap.runtime.expert_parallel).

[Note: expert capacity]
Routing is dropless by default. With a capacity factor c (Megatron-Core's
`moe_expert_capacity_factor`), each expert takes at most ceil(c · N · k / n_expert) of a
forward's N tokens' (token, choice) pairs; the pairs past that get the index n_expert, which
expert modules skip (Hugging Face's convention for a dropped choice) and expert parallelism
sends nowhere. Which pairs stay is decided by position alone, as GShard's and Switch
Transformer's dispatch does: every token's first choice before any token's second, and within
a choice, tokens in order. The rule reads nothing but the forward's own indices, so it is the
same in one process and on each rank: under data or expert parallelism each rank's forward
applies it to its own tokens, and a one-process forward per rank's batch applies the same. A
pair already dropped (an index of n_expert or more) stays dropped and takes no place, so
applying the rule twice keeps what the smaller capacity keeps. A router's load-balancing loss
is taken before the drop, as Switch Transformer's.
"""
from __future__ import annotations

import math
from typing import Optional

import torch
from torch.nn import functional as F


def capacity_factor_error(name: str, value: object) -> Optional[str]:
    """Why `value` cannot be the capacity factor `name`, or None: a finite positive number, or
    None (dropless)."""
    if value is None:
        return None
    if isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value) and value > 0:
        return None
    return f"{name} must be a positive number or None (dropless), got {value!r}"


def drop_over_capacity(index_NK: torch.Tensor, num_experts: int, capacity_factor: float) -> torch.Tensor:
    """`index_NK` with each (token, choice) pair past its expert's capacity set to
    `num_experts`, a dropped choice (see [Note: expert capacity])."""
    N, K = index_NK.shape
    capacity = math.ceil(capacity_factor * N * K / num_experts)
    index_P = index_NK.t().reshape(-1).clamp(max=num_experts)            # choice-major: first choices first
    chosen_PE = F.one_hot(index_P, num_experts + 1)[:, :num_experts]     # a dropped pair is in no queue
    place_P = (chosen_PE.cumsum(0) * chosen_PE).sum(1) - 1               # the pair's place in its expert's queue
    kept_NK = ((place_P >= 0) & (place_P < capacity)).view(K, N).t()
    return torch.where(kept_NK, index_NK, torch.full_like(index_NK, num_experts))
