"""An optimizer that reads `p.shape`: Adafactor-style factored second moments over the rows
and columns of each parameter, for the parity tests.

For a parameter of two or more dimensions (rows = dim 0, columns = the trailing dimensions
flattened) it keeps a running mean of each row's sum of squared gradients and of each
column's, and scales the gradient by sqrt(row_i * column_j / total). On a sharded model each
rank holds a block of whole rows: the row sums are local, the column sums are summed over the
ranks by `reduce` (an all-reduce over the sharding group; nothing in one process), so the
sharded run does the same arithmetic as one process. Parameters below two dimensions keep an
element-wise running mean of squared gradients. `eps` is large enough that gradients which are
zero but for rounding (an attention key bias's) do not become full-size steps of noise.
"""
from __future__ import annotations

import math
from typing import Callable, Iterable

import torch


class Factored(torch.optim.Optimizer):
    def __init__(self, params: Iterable[torch.Tensor], lr: float = 1e-2, beta: float = 0.9, eps: float = 1e-4,
                 reduce: Callable[[torch.Tensor], None] = lambda t: None) -> None:
        super().__init__(params, {"lr": lr, "beta": beta, "eps": eps})
        self.reduce = reduce

    @torch.no_grad()
    def step(self, closure=None) -> None:
        for group in self.param_groups:
            lr, beta, eps = group["lr"], group["beta"], group["eps"]
            for p in group["params"]:
                # Every rank reaches the same parameters (`.grad` is None on all or on none), so
                # the column all-reduces below line up across ranks.
                if p.grad is None:
                    continue
                state = self.state[p]
                grad = p.grad
                if p.dim() < 2:
                    state.setdefault("second", torch.zeros_like(p)).mul_(beta).add_(grad.square(), alpha=1 - beta)
                    p.add_(grad / (state["second"].sqrt() + eps), alpha=-lr)
                    continue
                g_RC = grad.reshape(p.shape[0], math.prod(p.shape[1:]))   # the local block of rows
                squares_RC = g_RC.square()
                columns = squares_RC.sum(0)
                self.reduce(columns)                          # the column sums over every row
                rows = state.setdefault("rows", torch.zeros(p.shape[0], dtype=p.dtype, device=p.device))
                cols = state.setdefault("columns", torch.zeros_like(columns))
                rows.mul_(beta).add_(squares_RC.sum(1), alpha=1 - beta)
                cols.mul_(beta).add_(columns, alpha=1 - beta)
                second_RC = rows[:, None] * cols[None, :] / cols.sum().clamp_min(eps)
                p.add_((g_RC / (second_RC.sqrt() + eps)).view_as(p), alpha=-lr)
