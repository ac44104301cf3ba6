"""`fully_shard` on one rank, where each flat shard is its gathered buffer (`resident`, see
overlap/runtime/flat_group.py): the views a unit's forward makes serve its backward, so a step
makes them once per unit, and training equals the unwrapped model's with activation
checkpointing of each kind (non-reentrant, reentrant, torch's checkpoint wrapper) and an
optimizer stepping the DTensor parameters one tensor at a time."""
from __future__ import annotations

import copy

import pytest
import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from distributed import run_distributed

BLOCKS, WIDTH, HIDDEN, STEPS = 3, 7, 11, 4
FP32 = {"rtol": 1e-5, "atol": 1e-6}
VARIANTS = ("plain", "non-reentrant", "reentrant", "wrapper")


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.up = nn.Linear(WIDTH, HIDDEN)
        self.down = nn.Linear(HIDDEN, WIDTH)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(torch.relu(self.up(x)))


class Net(nn.Module):
    def __init__(self, recompute: str) -> None:
        super().__init__()
        self.recompute = recompute
        self.blocks = nn.ModuleList(Block() for _ in range(BLOCKS))
        self.head = nn.Linear(WIDTH, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            if self.recompute in ("non-reentrant", "reentrant"):
                x = checkpoint(block, x, use_reentrant=self.recompute == "reentrant")
            else:
                x = block(x)
        return self.head(x)


def _train(model: nn.Module, batches: list[torch.Tensor]) -> list[float]:
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, foreach=False)
    losses = []
    for x in batches:
        loss = model(x).square().mean()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm=0.5, foreach=False)
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return losses


def _full(value: torch.Tensor) -> torch.Tensor:
    return value.full_tensor() if hasattr(value, "full_tensor") else value


def _variant(recompute: str) -> dict:
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import apply_activation_checkpointing

    from overlap import fully_shard
    from overlap.runtime.flat_group import FlatGroup

    torch.manual_seed(0)
    reference = Net(recompute)
    model = copy.deepcopy(reference)
    if recompute == "wrapper":
        for net in (reference, model):
            apply_activation_checkpointing(net, check_fn=lambda m: isinstance(m, Block))
    for block in model.blocks:
        fully_shard(block)
    fully_shard(model)
    # The batch requires a gradient: a reentrant recompute gives the parameters none otherwise.
    batches = [torch.randn(5, WIDTH, generator=torch.Generator().manual_seed(i)).requires_grad_()
               for i in range(STEPS)]
    installs = []
    install_views = FlatGroup.install_views

    def counted(group: FlatGroup) -> None:
        installs.append(group)
        install_views(group)

    FlatGroup.install_views = counted
    try:
        losses = _train(model, batches)
    finally:
        FlatGroup.install_views = install_views
    expected = _train(reference, batches)
    values = {name: _full(value) for name, value in model.state_dict().items()}
    return dict(losses=losses, expected=expected, values=values, reference=reference.state_dict(),
                installs_per_step=len(installs) / STEPS, units=len(model.overlap_runtime.scheduler.all_units))


def _variants(rank: int, world: int) -> dict[str, dict]:
    return {recompute: _variant(recompute) for recompute in VARIANTS}


@pytest.fixture(scope="module")
def outcomes() -> dict[str, dict]:
    (result,) = run_distributed(_variants, 1, timeout=240)
    return result


@pytest.mark.timeout(300)
@pytest.mark.parametrize("recompute", VARIANTS)
def test_one_rank_trains_as_the_unwrapped_model(outcomes: dict[str, dict], recompute: str) -> None:
    outcome = outcomes[recompute]
    torch.testing.assert_close(torch.tensor(outcome["losses"]), torch.tensor(outcome["expected"]), **FP32)
    for name, value in outcome["reference"].items():
        torch.testing.assert_close(outcome["values"][name], value, **FP32, msg=lambda m: f"{name}: {m}")


@pytest.mark.timeout(300)
def test_one_rank_makes_each_units_views_once_a_step(outcomes: dict[str, dict]) -> None:
    """Forward makes them; backward keeps them (the buffer is never freed)."""
    outcome = outcomes["plain"]
    assert outcome["installs_per_step"] == outcome["units"], outcome["installs_per_step"]
