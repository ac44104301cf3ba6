"""The state machine of a unit (see [Note: the states of a unit] in overlap/runtime/unit.py):
transitions it refuses, and the states each unit of a small model goes through in a step."""
from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from distributed import run_distributed
from models import Block
from overlap.runtime.unit import GatherState, TrainingState, Unit, UnitStateError


def test_gather_transitions_are_checked() -> None:
    unit = Unit("blocks.3", [], [])
    with pytest.raises(UnitStateError, match="'blocks.3': cannot reshard while sharded"):
        unit.reshard()
    with pytest.raises(UnitStateError, match="cannot discard while sharded"):
        unit.discard()
    with pytest.raises(UnitStateError, match="cannot install parameter views while sharded"):
        unit.install_views()
    unit.start_gather()
    # A unit that has not computed is dropped only at the end of a pass, never resharded.
    with pytest.raises(UnitStateError, match=r"cannot reshard while gathering \(only while gathered\); "
                                             r"its states: gather gathering, training idle"):
        unit.reshard()
    with pytest.raises(UnitStateError, match="cannot start a gather while gathering"):
        unit.start_gather()
    unit.finish_gather()
    unit.finish_gather()                   # gathered already: nothing to do
    assert unit.gather_state is GatherState.GATHERED
    unit.reshard()
    unit.finish_gather()                   # from sharded: gathers on demand (checkpoint recompute)
    unit.discard()
    assert unit.gather_state is GatherState.SHARDED


def test_training_transitions_are_checked() -> None:
    unit = Unit("blocks.0", [nn.Linear(1, 1)], [])
    unit.begin_pass()
    unit.enter_forward(unit.modules[0])
    unit.enter_forward(unit.modules[0])    # called twice in one forward
    assert unit.all_members_ran
    assert unit.enter_backward() and not unit.enter_backward()   # its second output: nothing new
    with pytest.raises(UnitStateError, match="'blocks.0': cannot run forward while pre_backward"):
        unit.enter_forward()
    unit.end_pass()
    assert unit.training_state is TrainingState.IDLE


class CheckpointedNet(nn.Module):
    def __init__(self, vocab: int = 17, d: int = 8) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, d)
        self.blocks = nn.ModuleList([Block(d, 12), Block(d, 12)])
        self.head = nn.Linear(d, vocab)

    def forward(self, tokens: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        x = self.blocks[0](self.embed(tokens))
        x = checkpoint(self.blocks[1], x, use_reentrant=False)
        return nn.functional.cross_entropy(self.head(x).flatten(0, 1), targets.flatten())


def _states_over_a_step(rank: int, world: int) -> dict[str, dict[str, list[str]]]:
    from overlap import ShardedModule

    seen: dict[str, list[str]] = {}
    move = Unit._move

    def recording(unit: Unit, to, sources, action: str) -> None:
        move(unit, to, sources, action)
        seen.setdefault(unit.name, []).append(to.value)

    Unit._move = recording
    torch.manual_seed(0)
    model = ShardedModule(CheckpointedNet(), unit_types=(Block,), prefetch_depth=1, bucket_mb=1e-4)
    tokens = torch.randint(0, 17, (2, 5))
    model(tokens, tokens).backward()       # the first step learns the order
    steps = {}
    seen.clear()
    model(tokens, tokens).backward()
    steps["train"], seen = seen, {}
    with torch.no_grad():
        model(tokens, tokens)
    steps["eval"] = seen
    return steps


@pytest.mark.timeout(120)
@pytest.mark.parametrize("world", [1, 2])
def test_states_of_each_unit_over_a_step(world: int) -> None:
    steps = run_distributed(_states_over_a_step, world, timeout=100)[0]
    if world == 1:
        # One rank: the shard is the parameters (a free releases nothing), so every unit is
        # gathered once, at its first forward, and stays gathered from step to step.
        for name in ("blocks.0", "blocks.1", "<root>"):
            assert steps["train"][name] == ["idle", "forward", "pre_backward", "post_backward", "idle"]
            assert steps["eval"][name] == ["idle", "forward", "idle"]
        return
    # Prefetched in forward and freed after it; gathered again ahead of its backward (under
    # blocks.1's), freed once its gradients and its input's are complete.
    assert steps["train"]["blocks.0"] == ["idle", "gathering", "gathered", "forward", "sharded",
                                          "gathering", "pre_backward", "gathered", "post_backward", "sharded",
                                          "idle"]
    # Last in forward, so kept for backward; its checkpointed forward runs again inside
    # backward without a change of state.
    assert steps["train"]["blocks.1"] == ["idle", "gathering", "gathered", "forward",
                                          "pre_backward", "post_backward", "sharded", "idle"]
    assert steps["train"]["<root>"] == ["idle", "gathering", "gathered", "forward",
                                        "pre_backward", "post_backward", "sharded", "idle"]
    # No backward follows an evaluation forward: each unit is freed after its forward; the
    # root stays gathered until the next forward (a head called on returned hidden states
    # computes with it, as with FSDP2's root).
    for name in ("blocks.0", "blocks.1"):
        assert steps["eval"][name] == ["idle", "gathering", "gathered", "forward", "sharded", "idle"]
    assert steps["eval"]["<root>"] == ["idle", "gathering", "gathered", "forward", "idle"]
