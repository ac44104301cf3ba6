"""A model where Inductor's CPU code beats eager (compare.py's `--model mlp`, docs/compile.md): many
narrow residual layers (LayerNorm, linear, GELU, linear), so elementwise work and dispatch
dominate the small matmuls. It keeps the GPT's interface, one unit per block.
"""
from __future__ import annotations

import torch
from torch import nn
from torch.nn import functional as F

# Layers per block: enough per compiled graph that fusing outweighs the compiled call's fixed cost.
LAYERS_PER_BLOCK = 6
EXPANSION = 2           # hidden width over the model width


class NarrowLayer(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(width)
        self.up = nn.Linear(width, EXPANSION * width)
        self.down = nn.Linear(EXPANSION * width, width)

    def forward(self, x_BTD: torch.Tensor) -> torch.Tensor:
        return x_BTD + self.down(F.gelu(self.up(self.norm(x_BTD))))


class NarrowBlock(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.layers = nn.ModuleList(NarrowLayer(width) for _ in range(LAYERS_PER_BLOCK))

    def forward(self, x_BTD: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x_BTD = layer(x_BTD)
        return x_BTD


class NarrowMLP(nn.Module):
    def __init__(self, n_layer: int, width: int, vocab_size: int) -> None:
        super().__init__()
        self.wte = nn.Embedding(vocab_size, width)
        self.blocks = nn.ModuleList(NarrowBlock(width) for _ in range(n_layer))
        self.ln_f = nn.LayerNorm(width)
        self.lm_head = nn.Linear(width, vocab_size, bias=False)

    def forward(self, idx_BT: torch.Tensor, targets_BT: torch.Tensor) -> torch.Tensor:
        x_BTD = self.wte(idx_BT)
        for block in self.blocks:
            x_BTD = block(x_BTD)
        logits_BTV = self.lm_head(self.ln_f(x_BTD))
        return F.cross_entropy(logits_BTV.flatten(0, 1).float(), targets_BT.flatten())
