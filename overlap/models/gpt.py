"""A nanoGPT-style decoder: token + position embeddings, pre-norm blocks, tied output head."""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable, Iterable

import torch
from torch import nn
from torch.nn import functional as F


@dataclass(frozen=True)
class GPTConfig:
    vocab_size: int = 8192
    block_size: int = 128
    n_layer: int = 6
    n_head: int = 8
    n_embd: int = 512
    dropout: float = 0.0

    @property
    def num_params(self) -> int:
        """Parameters of `GPT(self)`, the tied head counted once."""
        d, v, t, n = self.n_embd, self.vocab_size, self.block_size, self.n_layer
        per_block = 2 * 2 * d + (d * 3 * d + 3 * d) + (d * d + d) + (d * 4 * d + 4 * d) + (4 * d * d + d)
        return v * d + t * d + n * per_block + 2 * d


class Linear(nn.Linear):
    """A linear layer initialised as GPT-2's: weight normal(0, std), bias zero. The
    initialisation is its `reset_parameters`, run at construction, so the whole model
    initialises in construction order, and one built on the meta device gets the same values
    from `ShardedModule` (which calls `reset_parameters` module by module)."""

    def __init__(self, d_in: int, d_out: int, bias: bool = True, std: float = 0.02) -> None:
        self.std = std
        super().__init__(d_in, d_out, bias=bias)

    def reset_parameters(self) -> None:
        nn.init.normal_(self.weight, mean=0.0, std=self.std)
        if self.bias is not None:
            nn.init.zeros_(self.bias)


class Embedding(nn.Embedding):
    """An embedding initialised as GPT-2's, normal(0, 0.02), at construction (see Linear)."""

    def reset_parameters(self) -> None:
        nn.init.normal_(self.weight, mean=0.0, std=0.02)


def _residual_std(config: GPTConfig) -> float:
    """GPT-2 scales the projections that write into the residual stream by 1/√(2·layers)."""
    return 0.02 / math.sqrt(2 * config.n_layer)


class CausalSelfAttention(nn.Module):
    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.n_head = config.n_head
        self.qkv = Linear(config.n_embd, 3 * config.n_embd)
        self.proj = Linear(config.n_embd, config.n_embd, std=_residual_std(config))
        self.dropout = config.dropout

    def forward(self, x_BTD: torch.Tensor) -> torch.Tensor:
        B, T, D = x_BTD.shape
        q, k, v = self.qkv(x_BTD).split(D, dim=2)
        q_BHTd, k_BHTd, v_BHTd = (t.view(B, T, self.n_head, D // self.n_head).transpose(1, 2) for t in (q, k, v))
        y = F.scaled_dot_product_attention(q_BHTd, k_BHTd, v_BHTd, is_causal=True,
                                           dropout_p=self.dropout if self.training else 0.0)
        return self.proj(y.transpose(1, 2).reshape(B, T, D))


class Block(nn.Module):
    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.ln_1 = nn.LayerNorm(config.n_embd)
        self.attn = CausalSelfAttention(config)
        self.ln_2 = nn.LayerNorm(config.n_embd)
        self.fc = Linear(config.n_embd, 4 * config.n_embd)
        self.out = Linear(4 * config.n_embd, config.n_embd, std=_residual_std(config))

    def forward(self, x_BTD: torch.Tensor) -> torch.Tensor:
        x_BTD = x_BTD + self.attn(self.ln_1(x_BTD))
        return x_BTD + self.out(F.gelu(self.fc(self.ln_2(x_BTD))))


class GPT(nn.Module):
    def __init__(self, config: GPTConfig, block: Callable[[GPTConfig], nn.Module] = Block) -> None:
        super().__init__()
        self.config = config
        self.wte = Embedding(config.vocab_size, config.n_embd)
        self.wpe = Embedding(config.block_size, config.n_embd)
        self.blocks = nn.ModuleList(block(config) for _ in range(config.n_layer))
        self.ln_f = nn.LayerNorm(config.n_embd)
        self.lm_head = Linear(config.n_embd, config.vocab_size, bias=False)
        self.lm_head.weight = self.wte.weight      # tied: the embedding's values are kept

    def forward(self, idx_BT: torch.Tensor, targets_BT: torch.Tensor | None = None):
        """Logits (B, T, vocab); with targets, the mean cross-entropy loss instead."""
        T = idx_BT.shape[1]
        if T > self.config.block_size:
            raise ValueError(f"sequence length {T} exceeds block_size {self.config.block_size}")
        pos_T = torch.arange(T, device=idx_BT.device)
        x_BTD = self.wte(idx_BT) + self.wpe(pos_T)
        for block in self.blocks:
            x_BTD = block(x_BTD)
        logits_BTV = self.lm_head(self.ln_f(x_BTD))
        if targets_BT is None:
            return logits_BTV
        return F.cross_entropy(logits_BTV.flatten(0, 1).float(), targets_BT.flatten())

    @staticmethod
    def optimizer_groups(named_parameters: Iterable[tuple[str, nn.Parameter]], weight_decay: float) -> list[dict]:
        """nanoGPT's two optimizer groups: weight decay on every parameter of two or more
        dimensions (the embeddings and linear weights), none on norms and biases. The rule
        reads `p.dim()`, which a sharded model's parameters keep (docs/parameters.md)."""
        decay, no_decay = [], []
        for _, param in named_parameters:
            if param.requires_grad:
                (decay if param.dim() >= 2 else no_decay).append(param)
        return [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]

    @torch.no_grad()
    def generate(self, idx_BT: torch.Tensor, max_new_tokens: int, temperature: float = 1.0) -> torch.Tensor:
        for _ in range(max_new_tokens):
            logits = self(idx_BT[:, -self.config.block_size:])[:, -1, :] / temperature
            next_B1 = torch.multinomial(F.softmax(logits.float(), dim=-1), num_samples=1)
            idx_BT = torch.cat([idx_BT, next_B1], dim=1)
        return idx_BT
