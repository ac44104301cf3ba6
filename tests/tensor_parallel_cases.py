"""Training a model split by torch's tensor parallelism and sharded over dp by ShardedModule,
and the same model in one process on the same global batches: what tests/test_tensor_parallel.py
compares."""
from __future__ import annotations

import contextlib
import copy
import functools
from typing import Any, Optional

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from overlap.models.tensor_parallel_plan import gpt_tp_plan
from parity import _optimizer, _slice, token_batches
from parity_cases import SMALL_GPT

STEPS = 3
CLIP = 0.5                     # below the first steps' norms, so clipping scales every step
BATCHES = token_batches(SMALL_GPT.vocab_size, 12, steps=STEPS)
LLAMA_BATCHES = token_batches(61, 12, steps=STEPS)


def llama_tp_plan() -> dict[str, Any]:
    """Megatron's split of a Llama block, as torchtitan writes it for Hugging Face's names:
    q, k, v and the MLP's gate and up projections by columns (each rank keeps whole heads),
    o and down projections by rows."""
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    columns = ["self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "mlp.gate_proj", "mlp.up_proj"]
    return {**{f"model.layers.*.{name}": ColwiseParallel() for name in columns},
            "model.layers.*.self_attn.o_proj": RowwiseParallel(), "model.layers.*.mlp.down_proj": RowwiseParallel()}


def _plan(how: dict) -> dict[str, Any]:
    return llama_tp_plan() if how.get("model") == "llama" else gpt_tp_plan()


def _batches(how: dict) -> list[tuple]:
    return LLAMA_BATCHES() if how.get("model") == "llama" else BATCHES()


def _loss(model: nn.Module, batch: tuple, how: dict) -> torch.Tensor:
    if how.get("model") == "llama":
        return model(input_ids=batch[0], labels=batch[0]).loss
    return model(*batch)


def _build(checkpointed: bool = False, how: Optional[dict] = None) -> nn.Module:
    from overlap.models import GPT

    torch.manual_seed(0)
    if (how or {}).get("model") == "llama":
        from parity_cases import _hf_llama

        return _hf_llama()
    model = GPT(SMALL_GPT)
    if checkpointed:
        # Activation checkpointing of every block: backward recomputes its forward.
        for block in model.blocks:
            block.forward = functools.partial(checkpoint, type(block).forward.__get__(block), use_reentrant=False)
    return model


def _step(model: nn.Module, optimizer: torch.optim.Optimizer, batch: tuple, how: dict) -> tuple[float, float]:
    """One step; with how["micro"] > 1, gradients of all but the last micro-batch accumulate
    without syncing (`no_sync()` on a ShardedModule)."""
    micro = how.get("micro", 1)
    total = 0.0
    for k in range(micro):
        unsynced = k < micro - 1 and hasattr(model, "no_sync")
        with model.no_sync() if unsynced else contextlib.nullcontext():
            loss = _loss(model, _slice(batch, k, micro), how) / micro
            loss.backward()
        total += float(loss.detach())
    clip = how.get("clip")
    if clip is None:
        norm = 0.0
    elif how.get("module_clip") and hasattr(model, "clip_grad_norm_"):
        norm = float(model.clip_grad_norm_(clip))          # ShardedModule's own
    else:
        norm = float(torch.nn.utils.clip_grad_norm_(model.parameters(), clip))
    optimizer.step()
    optimizer.zero_grad()
    return total, norm


def reference(optimizer: str, how: dict, steps: Optional[int] = None) -> dict[str, Any]:
    """One process on the whole batches (or the first `steps`): its losses, clip norms, model
    state, and optimizer state by parameter name."""
    model = _build(how.get("checkpointed", False), how)
    opt = _optimizer(optimizer, model)
    taken = [_step(model, opt, batch, how) for batch in _batches(how)[:steps]]
    names = [name for name, _ in model.named_parameters()]
    return {"losses": [s[0] for s in taken], "norms": [s[1] for s in taken],
            "state": {key: value.detach().clone() for key, value in model.state_dict().items()},
            "optimizer": {names[number]: {key: value.clone() for key, value in values.items()}
                          for number, values in opt.state_dict()["state"].items()}}


def initial_state() -> dict[str, torch.Tensor]:
    return {key: value.detach().clone() for key, value in _build().state_dict().items()}


def blocks_of(state: dict[str, Any]) -> dict[str, Any]:
    """Each DTensor of a sharded state dict as (global shape, this rank's block, its offset)."""
    from torch.distributed.tensor import DTensor

    from overlap.runtime.row_dtensors import local_part

    out = {}
    for key, value in state.items():
        if isinstance(value, DTensor):
            block, offset = local_part(value)
            out[key] = (tuple(value.shape), block.detach().clone(), offset)
        else:
            out[key] = value.detach().clone()
    return out


def assemble(per_rank: list[dict[str, Any]]) -> dict[str, torch.Tensor]:
    """Whole tensors from every rank's blocks (replicated blocks written more than once)."""
    out: dict[str, torch.Tensor] = {}
    for blocks in per_rank:
        for key, value in blocks.items():
            if not isinstance(value, tuple):
                out[key] = value
                continue
            shape, block, offset = value
            whole = out.setdefault(key, torch.full(shape or (1,), float("nan"), dtype=block.dtype))
            index = tuple(slice(o, o + n) for o, n in zip(offset, block.shape))
            whole[index] = block
    return out


def train_2d(rank: int, world: int, dp: int, optimizer: str, how: dict, wrap: dict) -> dict[str, Any]:
    """ShardedModule over dp of the GPT split over tp = world // dp ranks; with how["hybrid"],
    the dp ranks are replicas (a ("replicate", "shard", "tp") mesh of dp x 1 x tp)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import parallelize_module

    from overlap import ShardedModule

    if how.get("hybrid"):
        mesh = init_device_mesh("cpu", (dp, 1, world // dp), mesh_dim_names=("replicate", "shard", "tp"))
        dp_mesh, part = mesh["replicate", "shard"], mesh.get_local_rank("replicate")
    else:
        mesh = init_device_mesh("cpu", (dp, world // dp), mesh_dim_names=("dp", "tp"))
        dp_mesh, part = mesh["dp"], mesh.get_local_rank("dp")
    inner = _build(how.get("checkpointed", False), how)
    parallelize_module(inner, mesh["tp"], _plan(how))
    model = ShardedModule(inner, mesh=dp_mesh, **wrap)
    opt = _optimizer(optimizer, model)
    steps = []
    for batch in _batches(how):
        loss, norm = _step(model, opt, _slice(batch, part, dp), how)
        total = torch.tensor([loss])
        torch.distributed.all_reduce(total)          # the tp ranks of a dp rank hold the same loss
        steps.append((float(total) / world, norm))
    specs = [tp for unit in model.scheduler.all_units for group in unit.groups for tp in group.tensor_parallel]
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    return {"losses": [s[0] for s in steps], "norms": [s[1] for s in steps], "blocks": blocks_of(model.state_dict()),
            "full": model.full_state_dict(),
            "api_full": get_model_state_dict(model, options=StateDictOptions(full_state_dict=True)),
            "parameter_count": model.parameter_count(), "sharding": model.sharding.describe(),
            "graphs_compiled": torch._dynamo.utils.counters["stats"]["unique_graphs"],
            "tp_split": sum(tp is not None and tp.norm_group is not None for tp in specs)}


def refused(rank: int, world: int, what: str) -> None:
    """Wrap the split GPT (dp = 2) in a way that is not supported, or do with it what is not;
    raises what ShardedModule raised."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import parallelize_module

    from overlap import ShardedModule

    mesh = init_device_mesh("cpu", (2, world // 2), mesh_dim_names=("dp", "tp"))
    inner = _build()
    parallelize_module(inner, mesh["tp"], gpt_tp_plan())
    wraps = {"offload_disk": {"offload": "disk"},
             "hpz": {"sharding": "hpz"}, "sharding_hybrid": {"sharding": "hybrid"}}
    if what in wraps:
        ShardedModule(inner, mesh=mesh["dp"], **wraps[what])
    elif what == "no_mesh":
        ShardedModule(inner)
    elif what == "tp_mesh_as_dp":
        ShardedModule(inner, mesh=mesh["tp"])
    elif what == "replicas_outside_the_plane":
        # A hybrid mesh's shard dimension alone: the replicas would train apart.
        hybrid = init_device_mesh("cpu", (2, 1, world // 2), mesh_dim_names=("replicate", "shard", "tp"))
        split = _build()
        parallelize_module(split, hybrid["tp"], gpt_tp_plan())
        ShardedModule(split, mesh=hybrid["shard"])
    elif what == "meta":
        with torch.device("meta"):
            on_meta = _build()
        parallelize_module(on_meta, mesh["tp"], gpt_tp_plan())
        ShardedModule(on_meta, mesh=mesh["dp"])
    elif what == "optimizer_before_wrapping":
        optimizer = torch.optim.SGD(inner.parameters(), lr=0.1)
        model = ShardedModule(inner, mesh=mesh["dp"])
        model(*_slice(BATCHES()[0], 0, 2)).backward()
        optimizer.step()
    else:
        raise AssertionError(what)


def _wrapped(world: int, dp: int, split: bool) -> tuple[nn.Module, Any]:
    """The GPT sharded over dp ranks, split over tp = world // dp ranks when `split` (else
    1-D over every rank), and its dp mesh."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import parallelize_module

    from overlap import ShardedModule

    inner = _build()
    if not split:
        return ShardedModule(inner), None
    mesh = init_device_mesh("cpu", (dp, world // dp), mesh_dim_names=("dp", "tp"))
    parallelize_module(inner, mesh["tp"], gpt_tp_plan())
    return ShardedModule(inner, mesh=mesh["dp"]), mesh["dp"]


def save_after(rank: int, world: int, path: str, dp: int, steps: int) -> None:
    """`steps` AdamW steps of the split GPT, then overlap.checkpoint.save of model and optimizer."""
    from overlap import checkpoint

    model, dp_mesh = _wrapped(world, dp, split=True)
    opt = _optimizer("adamw", model)
    for batch in BATCHES()[:steps]:
        _step(model, opt, _slice(batch, dp_mesh.get_local_rank(), dp), {})
    checkpoint.save(path, model, opt)


def resume(rank: int, world: int, path: str, dp: int, split: bool, steps: int) -> dict[str, Any]:
    """Load the checkpoint into a new model of this shape and train the remaining steps."""
    from overlap import checkpoint

    model, dp_mesh = _wrapped(world, dp, split)
    opt = _optimizer("adamw", model)
    checkpoint.load(path, model, opt)
    part = rank if dp_mesh is None else dp_mesh.get_local_rank()
    losses = []
    for batch in BATCHES()[steps:]:
        loss, _ = _step(model, opt, _slice(batch, part, dp), {})
        total = torch.tensor([loss])
        torch.distributed.all_reduce(total, group=None if dp_mesh is None else dp_mesh.get_group())
        losses.append(float(total) / dp)
    return {"losses": losses, "blocks": blocks_of(model.state_dict())}


def _hybrid_offloaded(world: int, dp: int) -> nn.Module:
    """The split GPT as `dp` replicas of one shard (a ("replicate", "shard", "tp") mesh), its
    state offloaded to the host."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import parallelize_module

    from overlap import ShardedModule

    mesh = init_device_mesh("cpu", (dp, 1, world // dp), mesh_dim_names=("replicate", "shard", "tp"))
    inner = _build()
    parallelize_module(inner, mesh["tp"], gpt_tp_plan())
    return ShardedModule(inner, mesh=mesh["replicate", "shard"], offload="cpu")


def full_state_round_trip(rank: int, world: int, dp: int, steps: int) -> dict[str, Any]:
    """`steps` AdamW steps of the split GPT; its sharded state dict's values used as DTensors
    (`full_tensor`, `redistribute` to `Replicate`, elementwise operators); its state gathered
    whole by the runtime (`full_state_dict`, `full_optim_state_dict`) and by torch's API
    (`full_state_dict=True`),
    then loaded into a new model and optimizer each way (the runtime's `load_full_state_dict`
    and `optimizer.load_state_dict` at the same layout; torch's `set_model_state_dict` from
    rank 0 and `set_optimizer_state_dict` into replicas offloaded to the host), each of which
    trains the remaining steps."""
    from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_model_state_dict,
                                                         get_optimizer_state_dict, set_model_state_dict,
                                                         set_optimizer_state_dict)
    from torch.distributed.tensor import DTensor, Replicate

    model, dp_mesh = _wrapped(world, dp, split=True)
    opt = _optimizer("adamw", model)
    part = dp_mesh.get_local_rank()
    for batch in BATCHES()[:steps]:
        _step(model, opt, _slice(batch, part, dp), {})
    full = StateDictOptions(full_state_dict=True)
    ours = (model.full_state_dict(), model.full_optim_state_dict(opt))
    # The sharded state dict's values as DTensors, each against its whole value.
    as_dtensors = {key: [torch.equal(value.full_tensor(), ours[0][key]),
                         torch.equal(value.redistribute(placements=[Replicate()] * value.device_mesh.ndim).to_local(),
                                     ours[0][key]),
                         torch.equal((value * 2 + value).full_tensor(), ours[0][key] * 2 + ours[0][key])]
                   for key, value in model.state_dict().items() if isinstance(value, DTensor)}
    theirs = (get_model_state_dict(model, options=full), get_optimizer_state_dict(model, opt, options=full))
    names = [name for name, _ in model.named_parameters()]
    # Copies, here and at each load: the gathered states hold the optimizer's own `step`
    # tensors, as `optimizer.state_dict()` does, and a loaded optimizer steps those in place.
    out: dict[str, Any] = copy.deepcopy({
        "as_dtensors": as_dtensors, "model": {"ours": ours[0], "torch": theirs[0]},
        "optimizer": {"ours": {names[number]: values for number, values in ours[1]["state"].items()},
                      "torch": theirs[1]["state"]}})
    for how in ("ours", "torch"):
        # torch's loads go into another layout: replicas of one shard, offloaded to the host.
        fresh = _wrapped(world, dp, split=True)[0] if how == "ours" else _hybrid_offloaded(world, dp)
        fresh_opt = _optimizer("adamw", fresh)
        if how == "ours":
            fresh.load_full_state_dict(ours[0])
            fresh_opt.load_state_dict(copy.deepcopy(ours[1]))
        else:
            set_model_state_dict(fresh, theirs[0] if rank == 0 else {},
                                 options=StateDictOptions(full_state_dict=True, broadcast_from_rank0=True))
            set_optimizer_state_dict(fresh, fresh_opt, copy.deepcopy(theirs[1]), options=full)
        losses = []
        for batch in BATCHES()[steps:]:
            loss, _ = _step(fresh, fresh_opt, _slice(batch, part, dp), {})
            total = torch.tensor([loss])
            torch.distributed.all_reduce(total)          # the tp ranks of a dp rank hold the same loss
            losses.append(float(total) / world)
        out[f"resumed_{how}"] = {"losses": losses, "blocks": blocks_of(fresh.state_dict())}
    return out


def _fsdp2_tp(world: int, dp: int) -> tuple[nn.Module, Any]:
    """The same split GPT under FSDP2 over dp (torchtitan's 2-D recipe), and its dp mesh."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor.parallel import parallelize_module

    mesh = init_device_mesh("cpu", (dp, world // dp), mesh_dim_names=("dp", "tp"))
    model = _build()
    parallelize_module(model, mesh["tp"], gpt_tp_plan())
    for block in model.blocks:
        fully_shard(block, mesh=mesh["dp"])
    return fully_shard(model, mesh=mesh["dp"]), mesh["dp"]


def _fsdp2_steps(model: nn.Module, opt: torch.optim.Optimizer, dp_mesh: Any, batches: list[tuple]) -> list[float]:
    losses = []
    for batch in batches:
        loss, _ = _step(model, opt, _slice(batch, dp_mesh.get_local_rank(), dp_mesh.size()), {})
        total = torch.tensor([loss])
        torch.distributed.all_reduce(total, group=dp_mesh.get_group())
        losses.append(float(total) / dp_mesh.size())
    return losses


def fsdp2_saves(rank: int, world: int, path: str, dp: int, steps: int) -> None:
    """FSDP2 + TP trains `steps` AdamW steps and saves as torchtitan does."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_optimizer_state_dict

    model, dp_mesh = _fsdp2_tp(world, dp)
    opt = _optimizer("adamw", model)
    _fsdp2_steps(model, opt, dp_mesh, BATCHES()[:steps])
    dcp.save({"model": get_model_state_dict(model), "optimizer": get_optimizer_state_dict(model, opt)},
             checkpoint_id=path)


def fsdp2_resumes(rank: int, world: int, path: str, dp: int, steps: int) -> dict[str, Any]:
    """FSDP2 + TP loads a checkpoint as torchtitan does and trains the remaining steps."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_model_state_dict,
                                                         get_optimizer_state_dict, set_state_dict)

    model, dp_mesh = _fsdp2_tp(world, dp)
    opt = _optimizer("adamw", model)
    state = {"model": get_model_state_dict(model), "optimizer": get_optimizer_state_dict(model, opt)}
    dcp.load(state, checkpoint_id=path)
    set_state_dict(model, opt, model_state_dict=state["model"], optim_state_dict=state["optimizer"])
    losses = _fsdp2_steps(model, opt, dp_mesh, BATCHES()[steps:])
    full = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True))
    return {"losses": losses, "state": {key: value.detach().clone() for key, value in full.items()}}
