"""A GPT whose MLPs are mixtures of experts: a top-k softmax router and experts held as 3-D
tensors (`gate_up_proj` (E, 2F, D), `down_proj` (E, D, F)), called as Hugging Face's expert
modules are, `experts(hidden (N, D), top_k_index (N, k), top_k_weights (N, k))`, so the same
expert parallelism serves both (overlap.runtime.expert_parallel).

Routing is dropless by default; `MoEConfig(capacity_factor=c)` caps each expert's pairs per
forward by the rule the runtime applies to any expert module (see [Note: expert capacity] in
overlap/base/expert_capacity.py), applied by the router as Megatron-Core's.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
from torch import nn
from torch.nn import functional as F

from overlap.base.expert_capacity import capacity_factor_error, drop_over_capacity
from overlap.models.gpt import GPT, CausalSelfAttention, GPTConfig, Linear


@dataclass(frozen=True)
class MoEConfig(GPTConfig):
    n_expert: int = 8
    top_k: int = 2
    expert_hidden: int = 256             # F, each expert's SwiGLU width
    aux_loss_weight: float = 0.01        # the router's load-balancing loss (Switch Transformer's)
    # Pairs an expert takes per forward, as a multiple of an even share (None: dropless); see
    # [Note: expert capacity].
    capacity_factor: Optional[float] = None

    def __post_init__(self) -> None:
        error = capacity_factor_error("capacity_factor", self.capacity_factor)
        if error is not None:
            raise ValueError(f"MoEConfig: {error}")

    @property
    def num_params(self) -> int:
        """Parameters of `GPTMoE(self)`, the tied head counted once."""
        d, v, t, n, e, f = self.n_embd, self.vocab_size, self.block_size, self.n_layer, self.n_expert, self.expert_hidden
        per_block = 2 * 2 * d + (d * 3 * d + 3 * d) + (d * d + d) + d * e + e * 3 * f * d
        return v * d + t * d + n * per_block + 2 * d


class Experts(nn.Module):
    """`num_experts` SwiGLU experts; `forward` sums each token's chosen experts' outputs
    weighted by the router. An index equal to `num_experts` is a dropped choice."""

    def __init__(self, num_experts: int, d_model: int, hidden: int) -> None:
        super().__init__()
        self.num_experts = num_experts
        self.gate_up_proj = nn.Parameter(torch.empty(num_experts, 2 * hidden, d_model))
        self.down_proj = nn.Parameter(torch.empty(num_experts, d_model, hidden))
        self.reset_parameters()

    def reset_parameters(self) -> None:
        nn.init.normal_(self.gate_up_proj, std=0.02)
        nn.init.normal_(self.down_proj, std=0.02)

    def forward(self, hidden_ND: torch.Tensor, top_k_index_NK: torch.Tensor,
                top_k_weights_NK: torch.Tensor) -> torch.Tensor:
        out_ND = torch.zeros_like(hidden_ND)
        # One expert's weights by unbind, not by indexing: indexing's backward writes a gradient
        # of every expert's size for each expert used, unbind's one for the call.
        gate_up_FD, down_DF = self.gate_up_proj.unbind(0), self.down_proj.unbind(0)
        for expert in range(self.num_experts):
            token_M, slot_M = torch.where(top_k_index_NK == expert)
            if token_M.numel() == 0:
                continue
            gate_MF, up_MF = F.linear(hidden_ND[token_M], gate_up_FD[expert]).chunk(2, dim=-1)
            y_MD = F.linear(F.silu(gate_MF) * up_MF, down_DF[expert])
            out_ND = out_ND.index_add(0, token_M, y_MD * top_k_weights_NK[token_M, slot_M, None])
        return out_ND


class MoE(nn.Module):
    """Router and experts. The router's load-balancing loss of the last forward is kept in
    `aux_loss` for the model to add (each rank's own tokens, as DDP's semantics average it)."""

    def __init__(self, config: MoEConfig) -> None:
        super().__init__()
        self.top_k = config.top_k
        self.capacity_factor = config.capacity_factor
        self.router = Linear(config.n_embd, config.n_expert, bias=False)
        self.experts = Experts(config.n_expert, config.n_embd, config.expert_hidden)
        self.aux_loss = torch.zeros(())

    def forward(self, x_BTD: torch.Tensor) -> torch.Tensor:
        B, T, D = x_BTD.shape
        x_ND = x_BTD.reshape(B * T, D)
        probs_NE = F.softmax(self.router(x_ND).float(), dim=-1)
        weights_NK, index_NK = probs_NE.topk(self.top_k, dim=-1)
        weights_NK = (weights_NK / weights_NK.sum(-1, keepdim=True)).to(x_ND.dtype)
        E = probs_NE.shape[-1]
        chosen_E = F.one_hot(index_NK, E).sum(1).float().mean(0) / self.top_k
        self.aux_loss = E * (chosen_E * probs_NE.mean(0)).sum()
        if self.capacity_factor is not None:
            index_NK = drop_over_capacity(index_NK, E, self.capacity_factor)
        return self.experts(x_ND, index_NK, weights_NK).reshape(B, T, D)


class MoEBlock(nn.Module):
    def __init__(self, config: MoEConfig) -> None:
        super().__init__()
        self.ln_1 = nn.LayerNorm(config.n_embd)
        self.attn = CausalSelfAttention(config)
        self.ln_2 = nn.LayerNorm(config.n_embd)
        self.moe = MoE(config)

    def forward(self, x_BTD: torch.Tensor) -> torch.Tensor:
        x_BTD = x_BTD + self.attn(self.ln_1(x_BTD))
        return x_BTD + self.moe(self.ln_2(x_BTD))


class GPTMoE(GPT):
    """GPT with every block's MLP a mixture of experts; with targets, the loss includes the
    routers' load-balancing loss."""

    def __init__(self, config: MoEConfig) -> None:
        super().__init__(config, block=MoEBlock)

    def forward(self, idx_BT: torch.Tensor, targets_BT: torch.Tensor | None = None):
        out = super().forward(idx_BT, targets_BT)
        if targets_BT is None:
            return out
        aux = sum(block.moe.aux_loss for block in self.blocks)
        return out + self.config.aux_loss_weight * aux
