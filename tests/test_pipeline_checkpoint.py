"""DCP checkpoints of pipeline stages keep the whole model's names: stages cut from the whole
model by deleting the layers they do not hold (torchtitan's way), so a checkpoint taken at
(pp 2, dp 2) loads at another layout, into FSDP2 with pipelining, and into one process."""
from __future__ import annotations

import os

import pytest
import torch
from torch import nn

from distributed import CaseLaunch, RankCase
from test_pipeline import LAYERS, MICROBATCHES, PER_DP_RANK, STEPS, _batches, _loss, _model, _one_process

WRAPS = ("fully_shard", "sharded")


class Stack(nn.Module):
    """The test's model (tests/test_pipeline.py) with its layers named by their index in the
    whole model: a stage deletes the others."""

    def __init__(self, holds: range = range(LAYERS)) -> None:
        super().__init__()
        whole = _model()
        self.layers = nn.ModuleDict({str(i): whole[i] for i in holds})

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers.values():
            x = layer(x)
        return x


def _shard(stage: Stack, mesh, wrap: str) -> nn.Module:
    if wrap == "sharded":
        from overlap import ShardedModule
        return ShardedModule(stage, mesh=mesh)
    if wrap == "fsdp2":
        from torch.distributed.fsdp import fully_shard
    else:
        from overlap import fully_shard
    for layer in stage.layers.values():
        fully_shard(layer, mesh=mesh)
    return fully_shard(stage, mesh=mesh)


def train_and_save(rank: int, world: int, wrap: str, directory: str) -> None:
    """STEPS steps of 1F1B at (pp 2, dp 2), then every rank saves its stage with DCP."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_model_state_dict
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B

    pp, dp = 2, world // 2
    mesh = init_device_mesh("cpu", (pp, dp), mesh_dim_names=("pp", "dp"))
    pp_rank, dp_rank = mesh.get_local_rank("pp"), mesh.get_local_rank("dp")
    half = LAYERS // pp
    stage = _shard(Stack(range(pp_rank * half, (pp_rank + 1) * half)), mesh["dp"], wrap)
    runner = Schedule1F1B(PipelineStage(stage, pp_rank, pp, torch.device("cpu"), group=mesh["pp"].get_group()),
                          n_microbatches=MICROBATCHES, loss_fn=_loss)
    optimizer = torch.optim.SGD(stage.parameters(), lr=0.1)
    rows = slice(dp_rank * PER_DP_RANK, (dp_rank + 1) * PER_DP_RANK)
    for x, y in _batches(dp):
        runner.step(*((x[rows],) if pp_rank == 0 else ()), **({"target": y[rows]} if pp_rank == pp - 1 else {}))
        optimizer.step()
        optimizer.zero_grad()
    dcp.save(get_model_state_dict(stage), checkpoint_id=directory)


def load(rank: int, world: int, wrap: str, pp: int, directory: str) -> dict[str, torch.Tensor]:
    """This rank's stage at (pp, world // pp), sharded with `wrap`, loaded from the checkpoint
    through torch's state-dict API: its full values by name."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_model_state_dict,
                                                         set_model_state_dict)
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (pp, world // pp), mesh_dim_names=("pp", "dp"))
    per_stage = LAYERS // pp
    first = mesh.get_local_rank("pp") * per_stage
    stage = _shard(Stack(range(first, first + per_stage)), mesh["dp"], wrap)
    with torch.no_grad():
        for param in stage.parameters():
            param.zero_()                       # nothing of the initial values survives by chance
    state = get_model_state_dict(stage)
    dcp.load(state, checkpoint_id=directory)
    set_model_state_dict(stage, state)
    full = get_model_state_dict(stage, options=StateDictOptions(full_state_dict=True))
    return {key: value.detach().clone() for key, value in full.items()}


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("pipeline-dcp")
    return {wrap: str(root / wrap) for wrap in WRAPS}


@pytest.fixture(scope="module")
def launches(checkpoints) -> dict[int, CaseLaunch]:
    saved = CaseLaunch({wrap: RankCase(train_and_save, (wrap, checkpoints[wrap])) for wrap in WRAPS},
                       world_size=4, timeout=300)
    loads = {}
    for wrap in WRAPS:
        loads[f"{wrap}:overlap-pp2-dp1"] = RankCase(load, ("fully_shard", 2, checkpoints[wrap]))
        loads[f"{wrap}:fsdp2-pp2-dp1"] = RankCase(load, ("fsdp2", 2, checkpoints[wrap]))
        loads[f"{wrap}:overlap-pp1-dp2"] = RankCase(load, ("sharded", 1, checkpoints[wrap]))
    return {4: saved, 2: CaseLaunch(loads, world_size=2, timeout=300, after=[saved])}


def _expected() -> dict[str, torch.Tensor]:
    """One process's parameters after the same steps, under the stages' names."""
    return {f"layers.{key}": value for key, value in _one_process(2).items()}


@pytest.mark.timeout(600)
@pytest.mark.parametrize("saved_by", WRAPS)
@pytest.mark.parametrize("loaded_by", ("overlap-pp2-dp1", "fsdp2-pp2-dp1", "overlap-pp1-dp2"))
def test_a_stage_checkpoint_loads_at_another_layout(launches, saved_by: str, loaded_by: str) -> None:
    for outcome in launches[4][saved_by]:
        outcome.result()
    expected, seen = _expected(), set()
    for outcome in launches[2][f"{saved_by}:{loaded_by}"]:
        for key, value in outcome.result().items():
            torch.testing.assert_close(value, expected[key], rtol=1e-5, atol=1e-6, msg=lambda m: f"{key}: {m}")
            seen.add(key)
    assert seen == set(expected)


@pytest.mark.timeout(600)
@pytest.mark.parametrize("saved_by", WRAPS)
def test_a_stage_checkpoint_loads_into_one_process(launches, checkpoints, saved_by: str, tmp_path) -> None:
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    for outcome in launches[4][saved_by]:
        outcome.result()
    path = os.path.join(tmp_path, "whole.pt")
    dcp_to_torch_save(checkpoints[saved_by], path)
    model = Stack()
    model.load_state_dict(torch.load(path, weights_only=True))
    expected = _expected()
    for key, value in model.state_dict().items():
        torch.testing.assert_close(value, expected[key], rtol=1e-5, atol=1e-6, msg=lambda m: f"{key}: {m}")
