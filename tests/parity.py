"""Train the same model on the same global batches two ways and return what to compare:
one process on whole batches (the reference), and N ranks of ShardedModule on slices."""
from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

import torch
import torch.distributed as dist
from torch import nn

GLOBAL_BATCH = 24   # divisible by every world size tested (1-4) and by 2 micro-batches


@dataclass
class Case:
    name: str
    build: Callable[[], nn.Module]
    loss: Callable[[nn.Module, tuple], torch.Tensor]
    batches: Callable[[], list[tuple]]
    optimizer: str = "sgd"                   # see _optimizer: SGD variants (tight check), AdamW (loose)
    wrap: dict = field(default_factory=dict)
    micro_batches: int = 1                   # >1: all but the last under no_sync
    clip: Optional[float] = None
    before_step: Optional[Callable[[nn.Module, int], None]] = None
    fail_step: Optional[int] = None          # this step first runs a forward that raises inside a unit
    eval_every_step: bool = False            # an eval forward under no_grad after each step
    rewrap: Optional[Callable[[nn.Module], nn.Module]] = None   # applied to the ShardedModule (torch.compile)
    rtol: float = 1e-4
    atol: float = 1e-5


def token_batches(vocab: int, seq: int, steps: int, seed: int = 1) -> Callable[[], list[tuple]]:
    def make() -> list[tuple]:
        gen = torch.Generator().manual_seed(seed)
        return [(torch.randint(0, vocab, (GLOBAL_BATCH, seq), generator=gen),
                 torch.randint(0, vocab, (GLOBAL_BATCH, seq), generator=gen)) for _ in range(steps)]
    return make


def _no_decay(name: str) -> bool:
    """The usual LLM recipe's split, by name: no weight decay on biases, norms and embeddings."""
    return name.endswith("bias") or "norm" in name or "ln_" in name or "embed" in name or "wte" in name


class _SGDThroughData(torch.optim.Optimizer):
    """Plain SGD writing through `p.data`, whose in-place updates leave `p._version` as it was
    (as an optimizer writing through raw pointers does)."""

    def __init__(self, params, lr: float) -> None:
        super().__init__(params, {"lr": lr})

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is not None:
                    p.data.add_(p.grad, alpha=-group["lr"])


def _optimizer(kind: str, model: nn.Module) -> torch.optim.Optimizer:
    from factored import Factored
    from overlap import ShardedModule

    if kind == "sgd":
        return torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    if kind == "sgd_decay":
        return torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9, weight_decay=0.05)
    if kind == "adamw":
        return torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.1)
    if kind == "sgd_through_data":
        return _SGDThroughData(model.parameters(), lr=0.05)
    if kind == "overlap_adamw":
        from overlap.optim import AdamW

        return AdamW(model.parameters(), lr=1e-3, weight_decay=0.1)
    if kind == "adamw_groups":
        named = list(model.named_parameters())
        return torch.optim.AdamW([
            {"params": [p for n, p in named if not _no_decay(n)], "weight_decay": 0.1},
            {"params": [p for n, p in named if _no_decay(n)], "weight_decay": 0.0, "lr": 3e-3},
        ], lr=1e-3)
    if kind == "adamw_dim_groups":
        # nanoGPT's rule (and many recipes'): decay every parameter of two or more dimensions.
        params = [p for p in model.parameters() if p.requires_grad]
        return torch.optim.AdamW([
            {"params": [p for p in params if p.dim() >= 2], "weight_decay": 0.1},
            {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0, "lr": 3e-3},
        ], lr=1e-3)
    if kind == "overlap_adamw_dim_groups":
        from overlap.optim import AdamW

        params = [p for p in model.parameters() if p.requires_grad]
        return AdamW([
            {"params": [p for p in params if p.dim() >= 2], "weight_decay": 0.1},
            {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0, "lr": 3e-3},
        ], lr=1e-3)
    if kind == "factored":
        if isinstance(model, ShardedModule):
            group = model.collectives.group
            return Factored(model.parameters(), reduce=lambda t: dist.all_reduce(t, group=group))
        return Factored(model.parameters())
    raise ValueError(kind)


def _slice(batch: tuple, part: int, parts: int) -> tuple:
    size = batch[0].shape[0] // parts
    return tuple(t[part * size:(part + 1) * size] for t in batch)


def train(case: Case, rank: int = 0, world: int = 1, sharded: bool = False,
          after: Optional[Callable[[nn.Module], None]] = None) -> dict[str, Any]:
    """Losses (global mean), clip norms and the final full state dict of one run of `case`;
    `after(model)` is called once training ends (before the state dict is gathered)."""
    from overlap import ShardedModule

    torch.manual_seed(0)
    inner = case.build()
    model = ShardedModule(inner, **case.wrap) if sharded else inner
    if sharded and case.rewrap is not None:
        model = case.rewrap(model)
    opt = _optimizer(case.optimizer, model)
    losses, norms, eval_losses = [], [], []
    for step, batch in enumerate(case.batches()):
        if case.before_step is not None:
            case.before_step(inner, step)
        if step == case.fail_step:
            inner.fail_in_block = True
            try:
                case.loss(model, _slice(batch, rank, world) if sharded else batch)
            except RuntimeError:
                pass
            else:
                raise AssertionError("the failing forward did not raise")
            inner.fail_in_block = False
        step_loss = torch.zeros(())
        for k in range(case.micro_batches):
            micro = _slice(batch, k, case.micro_batches)
            local = _slice(micro, rank, world) if sharded else micro
            accumulate = sharded and k < case.micro_batches - 1
            with model.no_sync() if accumulate else contextlib.nullcontext():
                loss = case.loss(model, local) / case.micro_batches
                loss.backward()
            step_loss += loss.detach().float()
        if case.clip is not None:
            norm = model.clip_grad_norm_(case.clip) if sharded else \
                torch.nn.utils.clip_grad_norm_(model.parameters(), case.clip)
            norms.append(float(norm))
        opt.step()
        opt.zero_grad()
        if sharded:
            dist.all_reduce(step_loss)
            step_loss /= world
        losses.append(float(step_loss))
        if case.eval_every_step:
            model.eval()
            with torch.no_grad():
                eval_loss = case.loss(model, _slice(batch, rank, world) if sharded else batch).float()
            if sharded:
                dist.all_reduce(eval_loss)
                eval_loss /= world
            eval_losses.append(float(eval_loss))
            model.train()
    if after is not None:
        after(model)
    if sharded:
        state = model.full_state_dict()
    else:
        state = {k: v.detach().clone() for k, v in inner.state_dict().items()}
    return {"losses": losses, "norms": norms, "eval_losses": eval_losses, "state": state,
            "sharding": model.sharding.describe() if sharded else None}
