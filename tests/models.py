"""Small models that exercise what the runtime must handle."""
from __future__ import annotations

from typing import Callable

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint


class Block(nn.Module):
    def __init__(self, d: int, hidden: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(d)
        self.up = nn.Linear(d, hidden)
        self.down = nn.Linear(hidden, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(torch.tanh(self.up(self.norm(x))))


class FrozenBlock(Block):
    """A block whose projection weights are frozen (its norm stays trainable)."""

    def __init__(self, d: int, hidden: int) -> None:
        super().__init__(d, hidden)
        self.up.requires_grad_(False)
        self.down.weight.requires_grad_(False)


class Tiny(nn.Module):
    """Parameters with fewer elements than ranks and sizes no world size divides."""

    def __init__(self, d: int) -> None:
        super().__init__()
        self.gain = nn.Parameter(torch.ones(1))
        self.bias = nn.Parameter(torch.zeros(5))
        self.proj = nn.Linear(d, 5, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * self.gain + (self.proj(x) + self.bias).sum(-1, keepdim=True) * 0.1


class FeatureNet(nn.Module):
    """Tied embedding/head, a frozen block, a block called twice, a checkpointed block, tiny
    odd-sized parameters, and a block used only on some steps (no gradient on the others)."""

    def __init__(self, vocab: int = 37, d: int = 12, hidden: int = 20) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, d)
        self.blocks = nn.ModuleList([Block(d, hidden), FrozenBlock(d, hidden), Block(d, hidden),
                                     Block(d, hidden), Tiny(d), Block(d, hidden)])
        self.head = nn.Linear(d, vocab, bias=False)
        self.head.weight = self.embed.weight
        self.frozen_scale = nn.Parameter(torch.full((d,), 0.5), requires_grad=False)
        self.use_optional = True
        self.fail_in_block = False

    def forward(self, tokens: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        b = self.blocks
        x = self.embed(tokens) * self.frozen_scale
        x = b[0](x)
        x = b[1](x)
        x = b[0](x)                                            # called twice in one forward
        x = checkpoint(b[2], x, use_reentrant=False)           # activation checkpointing
        if self.fail_in_block:
            x = b[3](x[..., :-1])                              # shape error inside a unit
        x = b[3](x)
        x = b[4](x)
        if self.use_optional:
            x = b[5](x)                                        # no gradient on steps that skip it
        logits = self.head(x)
        return nn.functional.cross_entropy(logits.flatten(0, 1), targets.flatten())


class Reorderable(nn.Module):
    """Blocks run in `order`, which can change between steps (data-dependent control flow)."""

    def __init__(self, vocab: int = 37, d: int = 12, hidden: int = 20, n: int = 4) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, d)
        self.blocks = nn.ModuleList(Block(d, hidden) for _ in range(n))
        self.head = nn.Linear(d, vocab)
        self.order = list(range(n))

    def forward(self, tokens: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens)
        for i in self.order:
            x = self.blocks[i](x)
        return nn.functional.cross_entropy(self.head(x).flatten(0, 1), targets.flatten())


class LateFrozenBlock(nn.Module):
    """A frozen projection that autograd reads only after the block's trainable gradient is
    complete: the trainable scale runs under reentrant checkpointing, whose backward (a
    backward pass of its own, run first) finishes the scale's gradient before the outer pass
    reaches the projection's backward, which needs the frozen weight for the input gradient."""

    def __init__(self, d: int) -> None:
        super().__init__()
        self.proj = nn.Linear(d, d)
        self.proj.requires_grad_(False)
        self.scale = nn.Parameter(torch.linspace(0.5, 1.5, d))

    def _scaled(self, y: torch.Tensor) -> torch.Tensor:
        return torch.tanh(y * self.scale)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return checkpoint(self._scaled, self.proj(x), use_reentrant=True)


class LateFrozenNet(nn.Module):
    def __init__(self, vocab: int = 37, d: int = 12, n: int = 3) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, d)
        self.blocks = nn.ModuleList(LateFrozenBlock(d) for _ in range(n))
        self.head = nn.Linear(d, vocab)

    def forward(self, tokens: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens)
        for block in self.blocks:
            x = block(x)
        return nn.functional.cross_entropy(self.head(x).flatten(0, 1), targets.flatten())


def language_model_step(model: nn.Module, optimizer_name: str, idx: torch.Tensor
                        ) -> tuple[torch.optim.Optimizer, Callable[[], None]]:
    """AdamW ('adamw') or SGD with momentum ('sgd-momentum') over `model`'s parameters, and one
    training step that predicts `idx` from itself, run once so the optimizer state exists, as
    in any later step."""
    optimizer = (torch.optim.AdamW(model.parameters(), lr=1e-3) if optimizer_name == "adamw"
                 else torch.optim.SGD(model.parameters(), lr=1e-3, momentum=0.9))

    def step() -> None:
        optimizer.zero_grad(set_to_none=True)
        model(idx, idx).backward()
        optimizer.step()

    step()
    return optimizer, step
