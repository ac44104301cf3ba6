"""torch's own state-dict API over ShardedModule's state dicts, in every mode, at uneven rows.

`model.state_dict()` values are DTensors over this rank's rows ([Note: row-aligned shards as
a DTensor placement]): `full_tensor()`, `redistribute` to `Replicate`, elementwise operators,
`get/set_model_state_dict` and `get/set_optimizer_state_dict` with `full_state_dict` (with
`cpu_offload`, `broadcast_from_rank0`) are checked against the runtime's own gathers
(`full_state_dict()`, `full_optim_state_dict()`, themselves checked against one process in
tests/test_state_dict.py), and in fp32 against one process trained on the same global batch.
`dcp.save(model.state_dict())` is checked over random small models at worlds 2 to 4, in both
directions against FSDP2.
"""
from __future__ import annotations

import os
import random
from typing import Any, Callable

import pytest
import torch
from torch import nn

from distributed import CaseLaunch, RankCase

# Each mode's ShardedModule arguments, and the environment its sharding needs.
MODES: dict[str, dict[str, Any]] = {
    "fp32": {},
    "bf16": {"mixed_precision": "bf16"},
    "offload-cpu": {"offload": "cpu"},
    "offload-disk": {"offload": "disk", "mixed_precision": "bf16"},     # the disk tier gathers 16-bit copies
    "int8": {"compression": "int8"},
    "hybrid": {"sharding": "hybrid"},
    "hpz": {"sharding": "hpz"},
}
NODE_MODES = ("hybrid", "hpz")        # two nodes of LOCAL_WORLD_SIZE ranks, at world 4
RANDOM_MODELS = 8


class Net(nn.Module):
    """Layers of uneven widths, so that row blocks fall unevenly and some rank holds none of a
    small parameter."""

    def __init__(self, widths: list[int], norms: list[bool]) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.Sequential(nn.Linear(a, b), nn.LayerNorm(b) if norm else nn.Identity())
                                    for a, b, norm in zip(widths, widths[1:], norms))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = torch.tanh(layer(x))
        return x


def _net(seed: int, values: int = 0) -> Net:
    """The random architecture of `seed`, its initial values drawn from `seed + values`."""
    rng = random.Random(seed)
    widths = [rng.randint(1, 40) for _ in range(rng.randint(2, 5))]
    norms = [rng.random() < 0.4 for _ in widths[1:]]
    torch.manual_seed(seed + values)
    return Net(widths, norms)


def _wrap(model: nn.Module, mode: str) -> nn.Module:
    from overlap import MixedPrecision, ShardedModule

    kwargs = dict(MODES[mode])
    if kwargs.pop("mixed_precision", None):
        kwargs["mixed_precision"] = MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    return ShardedModule(model, **kwargs)


def _optimizer(model: nn.Module, mode: str) -> torch.optim.Optimizer:
    if mode == "offload-disk":
        from overlap.optim import AdamW

        return AdamW(model.parameters(), lr=1e-2)
    return torch.optim.AdamW(model.parameters(), lr=1e-2)


def _step(model: nn.Module, optimizer: torch.optim.Optimizer, rank: int, world: int, width: int) -> None:
    batch = torch.randn(2 * world, width, generator=torch.Generator().manual_seed(5))
    model(batch[2 * rank:2 * rank + 2]).pow(2).sum().backward()
    optimizer.step()
    optimizer.zero_grad()


def _attempt(fn: Callable[[], bool]) -> Any:
    """True/False from a check, or the error it raised (every rank calls every check)."""
    try:
        return bool(fn())
    except Exception as exc:  # noqa: BLE001 - the outcome of the check
        return f"{type(exc).__name__}: {str(exc).splitlines()[0][:200]}"


def _same(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k].cpu(), b[k].cpu()) for k in a)


def _api_checks(rank: int, world: int, mode: str, seed: int = 3) -> dict[str, Any]:
    """Each use of torch's state-dict API -> True, False (a wrong value) or the error raised."""
    from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_model_state_dict,
                                                         get_optimizer_state_dict, set_model_state_dict,
                                                         set_optimizer_state_dict)

    model = _wrap(_net(seed), mode)
    optimizer = _optimizer(model, mode)
    width = model.module.layers[0][0].in_features
    _step(model, optimizer, rank, world, width)
    full = model.full_state_dict()
    names = [name for name, _ in model.named_parameters()]
    checks: dict[str, Any] = {}
    state = model.state_dict()
    checks["full_tensor"] = _attempt(lambda: _same({k: v.full_tensor() for k, v in state.items()}, full))
    checks["redistribute"] = _attempt(lambda: _same(
        {k: v.redistribute(v.device_mesh, [torch.distributed.tensor.Replicate()]).to_local()
         for k, v in state.items()}, full))
    checks["elementwise"] = _attempt(lambda: _same({k: (v * 2 + 1).to(torch.float64).full_tensor()
                                                    for k, v in state.items()},
                                                   {k: (v * 2 + 1).double() for k, v in full.items()}))
    checks["get_model_full"] = _attempt(lambda: _same(
        get_model_state_dict(model, options=StateDictOptions(full_state_dict=True)), full))
    offloaded = _attempt(lambda: get_model_state_dict(
        model, options=StateDictOptions(full_state_dict=True, cpu_offload=True)))
    checks["get_model_cpu_offload"] = offloaded if isinstance(offloaded, str) else True
    if mode != "offload-disk":
        # The optimizer's whole state (the disk tier keeps its moments in the state file: its
        # full optimizer state goes through overlap.checkpoint, see docs/offload_disk.md).
        whole = model.full_optim_state_dict(optimizer)["state"]
        expected = {names[index]: values for index, values in whole.items()}

        def optimizer_full() -> bool:
            got = get_optimizer_state_dict(model, optimizer, options=StateDictOptions(full_state_dict=True))["state"]
            return got.keys() == expected.keys() and all(
                torch.equal(got[name][key].cpu(), expected[name][key].cpu()) for name in got for key in got[name])

        checks["get_optimizer_full"] = _attempt(optimizer_full)

        def optimizer_round_trip() -> bool:
            saved = get_optimizer_state_dict(model, optimizer, options=StateDictOptions(full_state_dict=True))
            for values in optimizer.state.values():
                for value in values.values():
                    if value.dim():
                        value.zero_()
            set_optimizer_state_dict(model, optimizer, saved, options=StateDictOptions(full_state_dict=True))
            back = model.full_optim_state_dict(optimizer)["state"]
            return all(torch.equal(back[index][key], whole[index][key]) for index in whole for key in whole[index])

        checks["set_optimizer_full"] = _attempt(optimizer_round_trip)
    new = {key: torch.full_like(value, 0.25) + torch.arange(value.numel()).view_as(value) / 100
           for key, value in full.items()}

    def set_model() -> bool:
        set_model_state_dict(model, new if rank == 0 else {},
                             options=StateDictOptions(full_state_dict=True, broadcast_from_rank0=True))
        return _same(model.full_state_dict(), new)

    checks["set_model_broadcast"] = _attempt(set_model)
    return checks


def _one_process_state(seed: int, world: int) -> dict[str, torch.Tensor]:
    model = _net(seed)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    width = model.layers[0][0].in_features
    batch = torch.randn(2 * world, width, generator=torch.Generator().manual_seed(5))
    model(batch).pow(2).sum().div(world).backward()
    optimizer.step()
    return {key: value.detach().clone() for key, value in model.state_dict().items()}


def _fp32_against_one_process(rank: int, world: int) -> float:
    """The largest difference between `get_model_state_dict(full_state_dict=True)` and one process."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    model = _wrap(_net(3), "fp32")
    optimizer = _optimizer(model, "fp32")
    _step(model, optimizer, rank, world, model.module.layers[0][0].in_features)
    got = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True))
    reference = _one_process_state(3, world)
    assert got.keys() == reference.keys()
    return max(float((got[k] - reference[k]).abs().max()) if got[k].numel() else 0.0 for k in got)


def _fsdp2(model: Net, world: int) -> nn.Module:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cpu", (world,))
    for layer in model.layers:
        fully_shard(layer, mesh=mesh)
    return fully_shard(model, mesh=mesh)


def _full_values(state: dict) -> dict[str, torch.Tensor]:
    return {key: value.full_tensor() if isinstance(value, torch.distributed.tensor.DTensor) else value
            for key, value in state.items()}


def _dcp_random_models(rank: int, world: int, directory: str) -> list[str]:
    """For random models: `dcp.save(model.state_dict())` loads back into another ShardedModule
    and into FSDP2, and FSDP2's loads into ShardedModule, each to the saved values. Returns
    the failures (empty when all hold)."""
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp

    failures = []
    for index in range(RANDOM_MODELS):
        seed = 100 + index
        ours = _wrap(_net(seed), "fp32")
        saved = _full_values(ours.state_dict())
        path = os.path.join(directory, f"world{world}-model{index}")
        theirs_path = path + "-fsdp2"
        try:
            dcp.save(ours.state_dict(), checkpoint_id=path)
            other = _wrap(_net(seed, values=1000), "fp32")   # other values, then loaded over
            target = other.state_dict()
            dcp.load(target, checkpoint_id=path)
            other.load_state_dict(target)
            if not _same(_full_values(other.state_dict()), saved):
                failures.append(f"model {index}: overlap -> overlap values differ")
            fsdp = _fsdp2(_net(seed, values=2000), world)
            target = fsdp.state_dict()
            dcp.load(target, checkpoint_id=path)
            fsdp.load_state_dict(target)
            if not _same(_full_values(fsdp.state_dict()), saved):
                failures.append(f"model {index}: overlap -> FSDP2 values differ")
            fsdp_saved = _full_values(fsdp.state_dict())
            dcp.save(fsdp.state_dict(), checkpoint_id=theirs_path)
            target = ours.state_dict()
            with torch.no_grad():
                for param in ours.parameters():
                    param.zero_()
            dcp.load(target, checkpoint_id=theirs_path)
            ours.load_state_dict(target)
            if not _same(_full_values(ours.state_dict()), fsdp_saved):
                failures.append(f"model {index}: FSDP2 -> overlap values differ")
        except Exception as exc:  # noqa: BLE001 - a failure of this model, reported by name
            failures.append(f"model {index}: {type(exc).__name__}: {str(exc).splitlines()[0][:200]}")
        dist.barrier()
    return failures


@pytest.fixture(scope="module")
def launches(tmp_path_factory) -> dict[int, CaseLaunch]:
    directory = str(tmp_path_factory.mktemp("state_dict_api"))
    launches = {}
    for world in (2, 3, 4):
        cases = {"dcp": RankCase(_dcp_random_models, (directory,)), "one-process": RankCase(_fp32_against_one_process)}
        modes = [mode for mode in MODES if (mode in NODE_MODES) == (world == 4)] if world != 2 else ["fp32"]
        for mode in modes:
            env = {"LOCAL_WORLD_SIZE": "2"} if mode in NODE_MODES else {}
            if mode == "offload-disk":
                env["OVERLAP_OFFLOAD_DIR"] = os.path.join(directory, f"disk-{world}")
                os.makedirs(env["OVERLAP_OFFLOAD_DIR"])
            cases[f"api-{mode}"] = RankCase(_api_checks, (mode,), env=env)
        launches[world] = CaseLaunch(cases, world_size=world, timeout=420)
    return launches


CASES = [(world, mode) for world in (2, 3, 4)
         for mode in ([m for m in MODES if (m in NODE_MODES) == (world == 4)] if world != 2 else ["fp32"])]


@pytest.mark.timeout(900)
@pytest.mark.parametrize("world,mode", CASES, ids=[f"w{w}-{m}" for w, m in CASES])
def test_torchs_state_dict_api_gives_the_whole_values(launches, world: int, mode: str) -> None:
    for outcome in launches[world][f"api-{mode}"]:
        checks = outcome.result()
        assert all(value is True for value in checks.values()), checks


@pytest.mark.timeout(900)
@pytest.mark.parametrize("world", (2, 3, 4))
def test_the_full_state_dict_equals_one_process(launches, world: int) -> None:
    for outcome in launches[world]["one-process"]:
        assert outcome.result() < 1e-6


@pytest.mark.timeout(900)
@pytest.mark.parametrize("world", (2, 3, 4))
def test_dcp_of_state_dict_round_trips_and_interchanges_with_fsdp2(launches, world: int) -> None:
    for outcome in launches[world]["dcp"]:
        assert outcome.result() == []
