"""Checkpoints interchange with FSDP2: one written as torchtitan writes it (`dcp.save` of
`{"model": get_model_state_dict(m), "optimizer": get_optimizer_state_dict(m, opt)}`) loads
through `overlap.checkpoint.load`, and one written by `overlap.checkpoint.save` loads into
FSDP2 (`dcp.load` of that dict, then `set_state_dict`), at another world size; either way
training continues like one process."""
from __future__ import annotations

import functools
import os

import pytest
import torch
from torch import nn

from distributed import CaseLaunch, RankCase
from parity import _slice, token_batches
from parity_cases import SMALL_GPT

SAVE_AFTER = 2
STEPS = 4
BATCHES = token_batches(SMALL_GPT.vocab_size, 12, steps=STEPS)
TOLERANCE = 1e-5          # relative, over the whole model: other world sizes sum in another order


def _model(seed: int) -> nn.Module:
    from overlap.models import GPT

    torch.manual_seed(seed)
    return GPT(SMALL_GPT)


def _optimizer(model: nn.Module) -> torch.optim.Optimizer:
    named = list(model.named_parameters())
    return torch.optim.AdamW([{"params": [p for _, p in named if p.dim() >= 2], "weight_decay": 0.1},
                              {"params": [p for _, p in named if p.dim() < 2], "weight_decay": 0.0}], lr=1e-3)


def _steps(model: nn.Module, optimizer: torch.optim.Optimizer, first: int, last: int, rank: int, world: int) -> None:
    batches = BATCHES()
    for step in range(first, last):
        inputs, targets = _slice(batches[step], rank, world)
        model(inputs, targets).backward()
        optimizer.step()
        optimizer.zero_grad()


def _fsdp2(seed: int, world: int) -> nn.Module:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    model = _model(seed)
    mesh = init_device_mesh("cpu", (world,))
    for block in model.blocks:
        fully_shard(block, mesh=mesh)
    return fully_shard(model, mesh=mesh)


def _full(model: nn.Module) -> dict[str, torch.Tensor]:
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    state = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True))
    return {key: value.clone() for key, value in state.items()}


def _fsdp2_saves(rank: int, world: int, path: str) -> dict:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_optimizer_state_dict

    model = _fsdp2(0, world)
    optimizer = _optimizer(model)
    _steps(model, optimizer, 0, SAVE_AFTER, rank, world)
    dcp.save({"model": get_model_state_dict(model), "optimizer": get_optimizer_state_dict(model, optimizer)},
             checkpoint_id=path)
    return {"at_save": _full(model)}


def _overlap_loads(rank: int, world: int, path: str) -> dict:
    from overlap import ShardedModule, checkpoint

    model = ShardedModule(_model(1))            # other initial values: everything comes from the file
    optimizer = _optimizer(model)
    checkpoint.load(path, model, optimizer)
    loaded = model.full_state_dict()
    _steps(model, optimizer, SAVE_AFTER, STEPS, rank, world)
    return {"loaded": loaded, "final": model.full_state_dict()}


def _overlap_saves(rank: int, world: int, path: str) -> dict:
    from overlap import ShardedModule, checkpoint

    model = ShardedModule(_model(0))
    optimizer = _optimizer(model)
    _steps(model, optimizer, 0, SAVE_AFTER, rank, world)
    checkpoint.save(path, model, optimizer)
    return {"at_save": model.full_state_dict()}


def _fsdp2_loads(rank: int, world: int, path: str) -> dict:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import (get_model_state_dict, get_optimizer_state_dict,
                                                         set_state_dict)

    model = _fsdp2(1, world)
    optimizer = _optimizer(model)
    state = {"model": get_model_state_dict(model), "optimizer": get_optimizer_state_dict(model, optimizer)}
    dcp.load(state, checkpoint_id=path)
    set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optimizer"])
    loaded = _full(model)
    _steps(model, optimizer, SAVE_AFTER, STEPS, rank, world)
    return {"loaded": loaded, "final": _full(model)}


@functools.lru_cache(maxsize=None)
def _one_process() -> dict[str, torch.Tensor]:
    model = _model(0)
    _steps(model, _optimizer(model), 0, STEPS, 0, 1)
    return {key: value.detach().clone() for key, value in model.state_dict().items()}


def _relative_error(got: dict, expected: dict) -> float:
    diff = sum(float((got[k] - v).double().pow(2).sum()) for k, v in expected.items()) ** 0.5
    return diff / sum(float(v.double().pow(2).sum()) for v in expected.values()) ** 0.5


def _check(saved: dict, loads: list[dict]) -> None:
    reference = _one_process()
    for result in loads:
        assert list(result["final"]) == list(reference)
        for key, value in saved["at_save"].items():
            torch.testing.assert_close(result["loaded"][key], value, rtol=0, atol=0, msg=key)
        assert _relative_error(result["final"], reference) <= TOLERANCE
    assert _relative_error(saved["at_save"], reference) > 1e-3      # the check can fail


FSDP2_TO_OVERLAP = [(2, 3), (3, 2)]
OVERLAP_TO_FSDP2 = [(3, 2), (2, 4)]


@pytest.fixture(scope="module")
def launches(tmp_path_factory) -> dict[str, CaseLaunch]:
    """Both writers save at 2 ranks and at 3; each load runs at its world size after the
    saves it reads: 4 launches, not 8 (tests/distributed.py's [Note: many cases on one launch])."""
    directory = str(tmp_path_factory.mktemp("fsdp2"))

    def path(writer: str, world: int) -> str:
        return os.path.join(directory, f"{writer}-{world}")

    def saves(world: int) -> dict:
        return {f"fsdp2-saves-{world}": RankCase(_fsdp2_saves, (path("fsdp2", world),)),
                f"overlap-saves-{world}": RankCase(_overlap_saves, (path("overlap", world),))}

    def loads(world: int) -> dict:
        return {**{f"overlap-loads-{s}": RankCase(_overlap_loads, (path("fsdp2", s),))
                   for s, w in FSDP2_TO_OVERLAP if w == world},
                **{f"fsdp2-loads-{s}": RankCase(_fsdp2_loads, (path("overlap", s),))
                   for s, w in OVERLAP_TO_FSDP2 if w == world}}

    at_2 = CaseLaunch(saves(2), world_size=2, timeout=400)
    at_3 = CaseLaunch({**saves(3), **loads(3)}, world_size=3, timeout=400, after=[at_2])
    return {"saves-2": at_2, "at-3": at_3,
            "loads-2": CaseLaunch(loads(2), world_size=2, timeout=400, after=[at_3]),
            "loads-4": CaseLaunch(loads(4), world_size=4, timeout=400, after=[at_2])}


def _launch_of(launches: dict[str, CaseLaunch], action: str, world: int) -> CaseLaunch:
    if world == 3:
        return launches["at-3"]
    return launches[f"{action}-{world}"]


def _saved_and_loaded(launches: dict[str, CaseLaunch], writer: str, reader: str, save_world: int,
                      load_world: int) -> tuple[dict, list[dict]]:
    saved = _launch_of(launches, "saves", save_world)[f"{writer}-saves-{save_world}"][0].result()
    loaded = _launch_of(launches, "loads", load_world)[f"{reader}-loads-{save_world}"]
    return saved, [outcome.result() for outcome in loaded]


@pytest.mark.timeout(900)
@pytest.mark.parametrize("save_world,load_world", FSDP2_TO_OVERLAP)
def test_fsdp2_checkpoint_loads_into_sharded_module(save_world: int, load_world: int, launches) -> None:
    _check(*_saved_and_loaded(launches, "fsdp2", "overlap", save_world, load_world))


@pytest.mark.timeout(900)
@pytest.mark.parametrize("save_world,load_world", OVERLAP_TO_FSDP2)
def test_sharded_module_checkpoint_loads_into_fsdp2(save_world: int, load_world: int, launches) -> None:
    _check(*_saved_and_loaded(launches, "overlap", "fsdp2", save_world, load_world))
