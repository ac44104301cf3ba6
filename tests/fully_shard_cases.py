"""Code written for FSDP2, run twice in one launch: once with torch's `fully_shard`, once with
`overlap.fully_shard` and nothing else changed. What tests/test_fully_shard.py compares.

The flows follow what FSDP2's users write: PyTorch's FSDP2 example (a model built on the meta
device, blocks then root sharded, `to_empty` and an init, Adam with torch's clip, explicit
prefetch lists and `unshard()`, a full checkpoint saved through DTensors or torch's state-dict
API and loaded back), torchtitan's `apply_fsdp` (bf16 gathers, fp32 reductions, the last block
and the root kept gathered after forward) and torchtune's full-state load
(`distribute_tensor` into the sharded parameters).
"""
from __future__ import annotations

import contextlib
import os
import tempfile
from typing import Any, Callable, Iterator, Optional

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from parity import _slice, token_batches
from parity_cases import SMALL_GPT

BATCHES = token_batches(SMALL_GPT.vocab_size, 12, steps=6)
TRAIN_STEPS = 3
# The modes that save and resume (through DTensors, through torch's state-dict API); the
# others train only: their checkpoints go the same way as the default mode's.
CHECKPOINT_MODES = ("default", "dcp-api")


def implementations() -> dict[str, Callable]:
    from torch.distributed.fsdp import fully_shard as torchs

    from overlap import fully_shard as ours

    return {"fsdp2": torchs, "overlap": ours}


def init_weights(model: nn.Module) -> None:
    """torchtitan's `init_weights`: every module's own initialisation, in module order."""
    for module in model.modules():
        if hasattr(module, "reset_parameters"):
            module.reset_parameters()


def meta_gpt() -> nn.Module:
    from overlap.models import GPT

    with torch.device("meta"):
        return GPT(SMALL_GPT)


def shard_blocks_then_root(model: nn.Module, fully_shard: Callable, **kwargs: Any) -> nn.Module:
    for block in model.blocks:
        fully_shard(block, **kwargs)
    return fully_shard(model, **kwargs)


def materialise(model: nn.Module, seed: int) -> None:
    model.to_empty(device="cpu")
    torch.manual_seed(seed)
    with torch.no_grad():
        init_weights(model)


def steps(model: nn.Module, optimizer: torch.optim.Optimizer, first: int, last: int, rank: int, world: int,
          unshard_first: bool = False, keep: bool = False, group: Optional[dist.ProcessGroup] = None) -> list[float]:
    """Adam steps with torch's clip, as the example trains; each loss averaged over the ranks
    (rank `rank` of `world` in `group`, by default every rank). `keep`: each rank's batch in two
    microbatches under FSDP2's accumulation pattern, the units kept gathered between them
    (`set_reshard_after_backward(False)`) and no sync until the last."""
    losses = []
    batches = BATCHES()
    for step in range(first, last):
        if unshard_first:
            model.unshard()
        if keep:
            halves = []
            for micro in range(2):
                model.set_requires_gradient_sync(micro == 1)
                model.set_reshard_after_backward(micro == 1)
                half = model(*_slice(_slice(batches[step], rank, world), micro, 2)) / 2
                half.backward()
                halves.append(half.detach())
            loss = halves[0] + halves[1]
        else:
            loss = model(*_slice(batches[step], rank, world))
            loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm=1.0)
        optimizer.step()
        optimizer.zero_grad()
        losses.append(rank_mean(loss, world, group))
    return losses


def rank_mean(loss: torch.Tensor, world: int, group: Optional[dist.ProcessGroup] = None) -> float:
    """`loss` averaged over the `world` ranks of `group` (each rank's own, on its rows)."""
    total = loss.detach().clone()
    if world > 1:
        dist.all_reduce(total, group=group)
    return float(total) / world


def _prefetch_lists(model: nn.Module, depth: int) -> None:
    blocks = list(model.blocks)
    for i, block in enumerate(blocks):
        block.set_modules_to_forward_prefetch(blocks[i + 1:i + 1 + depth])
        block.set_modules_to_backward_prefetch(blocks[max(0, i - depth):i][::-1])


def save_full(model: nn.Module, optimizer: torch.optim.Optimizer, path: str, through_dcp_api: bool) -> None:
    """A full checkpoint in one file per state dict, written by rank 0: gathered through each
    DTensor's `full_tensor()`, or through torch's state-dict API."""
    from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_model_state_dict,
                                                         get_optimizer_state_dict)
    from torch.distributed.tensor import DTensor

    if through_dcp_api:
        options = StateDictOptions(full_state_dict=True, cpu_offload=True)
        model_state = get_model_state_dict(model, options=options)
        optim_state = get_optimizer_state_dict(model, optimizer, options=options)
    else:
        model_state = {key: value.full_tensor() for key, value in model.state_dict().items()}
        packed = optimizer.state_dict()
        optim_state = {"param_groups": packed["param_groups"],
                       "state": {index: {name: value.full_tensor() if isinstance(value, DTensor) else value
                                         for name, value in values.items()}
                                 for index, values in packed["state"].items()}}
    if dist.get_rank() == 0:
        torch.save({"model": model_state, "optimizer": optim_state}, path)
    dist.barrier()


def load_full(model: nn.Module, optimizer: torch.optim.Optimizer, path: str, through_dcp_api: bool) -> None:
    """The checkpoint of `save_full` loaded back: through `distribute_tensor` into each sharded
    parameter and optimizer state (then `load_state_dict(assign=True)`), or through torch's
    state-dict API from rank 0."""
    from torch.distributed.checkpoint.state_dict import (StateDictOptions, _init_optim_state, set_model_state_dict,
                                                         set_optimizer_state_dict)
    from torch.distributed.tensor import DTensor, distribute_tensor

    full = torch.load(path, weights_only=True)
    if through_dcp_api:
        options = StateDictOptions(full_state_dict=True, broadcast_from_rank0=True)
        set_model_state_dict(model, full["model"], options=options)
        set_optimizer_state_dict(model, optimizer, full["optimizer"], options=options)
        return
    sharded = model.state_dict()
    model.load_state_dict({key: nn.Parameter(distribute_tensor(value, sharded[key].device_mesh,
                                                                 sharded[key].placements))
                           for key, value in full["model"].items()}, strict=False, assign=True)
    _init_optim_state(optimizer)
    packed = optimizer.state_dict()
    for number, values in packed["state"].items():
        for name, value in values.items():
            saved = full["optimizer"]["state"][number][name]
            values[name] = distribute_tensor(saved, value.device_mesh, value.placements) \
                if isinstance(value, DTensor) else saved
    optimizer.load_state_dict(packed)


def example_flow(rank: int, world: int, directory: str, mode: str) -> dict[str, Any]:
    """The FSDP2 example's run, per implementation: losses of training, of resuming from its own
    checkpoint, and of resuming from the other implementation's checkpoint."""
    from torch.distributed.fsdp import MixedPrecisionPolicy

    kwargs = {"mp_policy": MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)} \
        if mode == "mixed-precision" else {}
    dcp_api = mode == "dcp-api"
    out: dict[str, Any] = {}
    for name, fully_shard in implementations().items():
        model = shard_blocks_then_root(meta_gpt(), fully_shard, **kwargs)
        if mode == "explicit-prefetching":
            _prefetch_lists(model, 2)
        materialise(model, seed=0)
        optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
        losses = steps(model, optimizer, 0, TRAIN_STEPS, rank, world, unshard_first=mode == "explicit-prefetching")
        save_full(model, optimizer, os.path.join(directory, f"{mode}-{name}.pt"), dcp_api)
        out[name] = {"train": losses, "is_fsdp_module": _is_fsdp_module(model),
                     "dtensors": all(isinstance(p, torch.distributed.tensor.DTensor) for p in model.parameters())}
    if mode not in CHECKPOINT_MODES:
        out["one-process"] = {"train": one_process(0, TRAIN_STEPS)}
        return out
    for name, fully_shard in implementations().items():
        for source in ("fsdp2", "overlap"):
            model = shard_blocks_then_root(meta_gpt(), fully_shard, **kwargs)
            materialise(model, seed=123)                 # other values, then loaded over
            optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
            load_full(model, optimizer, os.path.join(directory, f"{mode}-{source}.pt"), dcp_api)
            out[name][f"resumed-from-{source}"] = steps(model, optimizer, TRAIN_STEPS, TRAIN_STEPS + 2, rank, world)
    out["one-process"] = {"train": one_process(0, TRAIN_STEPS)}
    for source in ("fsdp2", "overlap"):
        out["one-process"][f"resumed-from-{source}"] = one_process(
            TRAIN_STEPS, TRAIN_STEPS + 2, os.path.join(directory, f"{mode}-{source}.pt"))
    return out


def one_process(first: int, last: int, checkpoint: str | None = None,
                make_optimizer: Callable[[Any], torch.optim.Optimizer] = lambda params: torch.optim.Adam(
                    params, lr=1e-2)) -> list[float]:
    """The reference: one process training the same model on the global batch, from the same
    meta-device init, or from a full checkpoint file (either implementation's)."""
    from overlap.models import GPT

    model = GPT(SMALL_GPT)
    materialise(model, seed=0)
    optimizer = make_optimizer(model.parameters())
    if checkpoint is not None:
        full = torch.load(checkpoint, weights_only=True)
        model.load_state_dict(full["model"])
        optimizer.load_state_dict(_numbered(full["optimizer"], [name for name, _ in model.named_parameters()]))
    return steps(model, optimizer, first, last, 0, 1)


def _numbered(state: dict, names: list[str]) -> dict:
    """An optimizer state dict keyed by parameter names (torch's state-dict API) keyed by
    their numbers, as `optimizer.load_state_dict` of a plain model takes it."""
    number = {name: index for index, name in enumerate(names)}
    return {"state": {number.get(key, key): value for key, value in state["state"].items()},
            "param_groups": [{**group, "params": [number.get(p, p) for p in group["params"]]}
                             for group in state["param_groups"]]}


def _is_fsdp_module(model: nn.Module) -> bool:
    from torch.distributed.fsdp import FSDPModule

    return isinstance(model, FSDPModule) and all(isinstance(block, FSDPModule) for block in model.blocks)


def torchtitan_flow(rank: int, world: int) -> dict[str, list[float]]:
    """torchtitan's `apply_fsdp`: bf16 parameters, fp32 reductions, every block but the last
    resharded after forward, the root not; AdamW."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy

    out = {}
    for name, fully_shard in implementations().items():
        model = meta_gpt()
        mesh = init_device_mesh("cpu", (world,))
        policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        for index, block in enumerate(model.blocks):
            fully_shard(block, mesh=mesh, mp_policy=policy, reshard_after_forward=index < len(model.blocks) - 1)
        fully_shard(model, mesh=mesh, mp_policy=policy, reshard_after_forward=False)
        materialise(model, seed=0)
        out[name] = steps(model, _adamw(model.parameters()), 0, TRAIN_STEPS, rank, world)
    out["one-process"] = one_process(0, TRAIN_STEPS, make_optimizer=_adamw)
    return out


def _adamw(params: Any) -> torch.optim.Optimizer:
    # foreach=True: the multi-tensor step GPUs take by default, over the DTensor parameters.
    return torch.optim.AdamW(params, lr=1e-2, weight_decay=0.1, foreach=True)


def torchtune_load(rank: int, world: int) -> dict[str, Any]:
    """torchtune's full-state load: a one-process state dict distributed into the sharded
    parameters of a meta model, then training; compared with one process."""
    from torch.distributed.tensor import distribute_tensor

    from overlap.models import GPT

    torch.manual_seed(7)
    reference = GPT(SMALL_GPT)
    full = {key: value.detach().clone() for key, value in reference.state_dict().items()}
    out: dict[str, Any] = {}
    for name, fully_shard in implementations().items():
        model = shard_blocks_then_root(meta_gpt(), fully_shard)
        sharded = model.state_dict()
        model.load_state_dict({key: nn.Parameter(distribute_tensor(value, sharded[key].device_mesh,
                                                                     sharded[key].placements))
                               for key, value in full.items()}, strict=False, assign=True)
        gathered = {key: value.full_tensor() for key, value in model.state_dict().items()}
        out[name] = {"loaded": all(torch.equal(gathered[key], full[key]) for key in full),
                     "losses": steps(model, torch.optim.Adam(model.parameters(), lr=1e-2), 0, 2, rank, world)}
    optimizer = torch.optim.Adam(reference.parameters(), lr=1e-2)
    out["one-process"] = steps(reference, optimizer, 0, 2, 0, 1)
    return out


def module_calls(rank: int, world: int) -> dict[str, Any]:
    """FSDPModule's calls against one process: gradient accumulation without sync (units kept
    gathered between microbatches), the gradient
    divide factor (overlap's only: FSDP2's needs a reduce op gloo lacks), and unshard/reshard
    outside a step followed by a forward."""
    from overlap.models import GPT

    out: dict[str, Any] = {}
    batches = BATCHES()
    for name, fully_shard in implementations().items():
        model = shard_blocks_then_root(meta_gpt(), fully_shard)
        materialise(model, seed=0)
        # FSDP2's accumulation without sync, the units kept gathered between the two.
        model.set_requires_gradient_sync(False)
        model.set_reshard_after_backward(False)
        model(*_slice(_slice(batches[0], rank, world), 0, 2)).backward()
        model.set_requires_gradient_sync(True)
        model.set_reshard_after_backward(True)
        model(*_slice(_slice(batches[0], rank, world), 1, 2)).backward()
        out[name] = {"accumulated": {key: param.grad.full_tensor() for key, param in model.named_parameters()}}
        model.zero_grad()
        model.unshard()
        model.reshard()
        for block in model.blocks:
            block.set_reshard_after_forward(False)
        with torch.no_grad():
            out[name]["after_unshard"] = float(model(*_slice(batches[2], rank, world)))
        if name == "overlap":
            model.set_gradient_divide_factor(1.0)        # sums instead of means
            model(*_slice(batches[1], rank, world)).backward()
            out[name]["summed"] = {key: param.grad.full_tensor() for key, param in model.named_parameters()}
            report = model.overlap_report()
            out[name]["hints"], out[name]["decided"] = report.hints, report.decisions
    reference = GPT(SMALL_GPT)
    materialise(reference, seed=0)
    for part in range(world):                  # each rank's two micro-batches, averaged over the ranks
        for micro in range(2):
            reference(*_slice(_slice(batches[0], part, world), micro, 2)).div(world).backward()
    accumulated = {key: param.grad.clone() for key, param in reference.named_parameters()}
    reference.zero_grad()
    reference(*batches[1]).backward()
    with torch.no_grad():
        loss = float(reference(*_slice(batches[2], rank, world)))
    out["one-process"] = {"accumulated": accumulated, "after_unshard": loss,
                          "summed": {key: param.grad * world for key, param in reference.named_parameters()}}
    return out


# Each mode a user reaches through fully_shard's arguments (or the environment), and the
# tolerance against one fp32 process.
COMBINATIONS: dict[str, dict[str, Any]] = {
    "cpu-offload": {"offload_policy": "cpu"},
    "bf16-cpu-offload": {"offload_policy": "cpu", "mp_policy": "bf16"},
    "hybrid-2d-mesh": {"mesh": ("replicate", "shard")},
    # FSDP2's int: the size of the groups resharded to after forward; at 4 ranks, 2 is hpZ
    # over pairs of ranks, and at 2 ranks, 1 keeps every unit whole.
    "hpz-int-2": {"reshard_after_forward": 2, "world": 4},
    # The same on a 1-D mesh of every rank: the groups of two made from the mesh's ranks.
    "hpz-int-2-1d-mesh": {"reshard_after_forward": 2, "world": 4, "mesh": ("dp",)},
    "reshard-int-1": {"reshard_after_forward": 1},
    "int8-compression": {"env": {"OVERLAP_COMPRESS": "int8"}},
    "compiled": {"env": {"OVERLAP_COMPILE": "1"}},
    # The runtime's settings through OverlapPolicy on the calls instead of OVERLAP_* variables.
    "policy-int8-prefetch-1-unit-per-call": {"overlap_policy": {"compression": "int8", "prefetch_depth": 1,
                                                                "bucket_mb": 0.0001}},
    "policy-int8-int4-compression": {"overlap_policy": {"compression": "int8-int4"}},
    # `shard_placement_fn`: every matrix sharded on its last dimension (Shard(-1)), alone and
    # with the other modes.
    "last-dim": {"shard_placement_fn": "last"},
    "last-dim-bf16-cpu-offload-int8": {"shard_placement_fn": "last", "offload_policy": "cpu", "mp_policy": "bf16",
                                       "overlap_policy": {"compression": "int8"}},
    "last-dim-hybrid-2d-mesh": {"shard_placement_fn": "last", "mesh": ("replicate", "shard")},
    "last-dim-int8-int4-no-reshard": {"shard_placement_fn": "last", "reshard_after_forward": 1,
                                      "overlap_policy": {"compression": "int8-int4"}},
    "last-dim-hpz-int-2-compiled": {"shard_placement_fn": "last", "reshard_after_forward": 2, "world": 4,
                                    "env": {"OVERLAP_COMPILE": "1"}},
}


def combination(rank: int, world: int, name: str, keep: bool = False) -> dict[str, Any]:
    """Two Adam steps of the example's model sharded with fully_shard in one mode, and one
    process's; with `keep`, each step as two microbatches with the units kept gathered between
    them, and what the runtime decided to keep."""
    from overlap import fully_shard

    how = COMBINATIONS[name]
    with _environment(how.get("env", {})):
        model = shard_blocks_then_root(meta_gpt(), fully_shard, **_shard_kwargs(how, world))
    materialise(model, seed=0)
    losses = steps(model, torch.optim.Adam(model.parameters(), lr=1e-2), 0, 2, rank, world, keep=keep)
    decided = model.overlap_report().decisions if keep else []
    runtime = model.overlap_runtime
    codec = runtime.collectives.codec
    settings = {"compression": "none" if codec is None else codec.settings.mode,
                "prefetch_depth": runtime.overlap_config.prefetch_depth,
                "units": len(runtime.scheduler.units), "blocks": len(model.blocks),
                "sharding": runtime.sharding.describe(),
                "kept-whole": [not unit.reshard_after_forward for unit in runtime.scheduler.units]}
    return {"overlap": losses, "one-process": one_process(0, 2), "decided": decided, "settings": settings}


def copies_on_a_sub_mesh(rank: int, world: int) -> dict[str, Any]:
    """An int `reshard_after_forward` on a sub-mesh, as a pipeline stage's data-parallel ranks
    are given one: a (pp 2, dp world/2) mesh, each row sharding a copy of the model over its "dp"
    ranks with hpZ over pairs of them; each row's losses on the global batch, and one
    process's. (FSDP2 in torch 2.13 hangs in this script: each row makes its post-forward mesh
    by a collective over every rank, which the other row never joins.) Then the same int on a
    2-D (replicate 2, shard world/2) mesh: every rank trains on its own rows of the global
    batch, hpZ over pairs inside each replica."""
    from torch.distributed.device_mesh import init_device_mesh

    from overlap import fully_shard

    mesh = init_device_mesh("cpu", (2, world // 2), mesh_dim_names=("pp", "dp"))
    model = shard_blocks_then_root(meta_gpt(), fully_shard, mesh=mesh["dp"], reshard_after_forward=2)
    materialise(model, seed=0)
    losses = steps(model, torch.optim.Adam(model.parameters(), lr=1e-2), 0, 2, mesh.get_local_rank("dp"),
                   mesh["dp"].size(), group=mesh["dp"].get_group())
    replicas = init_device_mesh("cpu", (2, world // 2), mesh_dim_names=("replicate", "shard"))
    hybrid = shard_blocks_then_root(meta_gpt(), fully_shard, mesh=replicas, reshard_after_forward=2)
    materialise(hybrid, seed=0)
    hybrid_losses = steps(hybrid, torch.optim.Adam(hybrid.parameters(), lr=1e-2), 0, 2, rank, world)
    from overlap.models import GPT

    reference = GPT(SMALL_GPT)
    materialise(reference, seed=0)
    reference_losses = steps(reference, torch.optim.Adam(reference.parameters(), lr=1e-2), 0, 2, 0, 1)
    values = {key: value.full_tensor() for key, value in hybrid.state_dict().items()}
    return {"overlap": losses, "one-process": reference_losses,
            "sharding": model.overlap_runtime.sharding.describe(), "2-D": hybrid_losses,
            "2-D sharding": hybrid.overlap_runtime.sharding.describe(),
            "2-D values": max(float((values[key] - value).abs().max()) for key, value in reference.state_dict().items())}


def policy_refusals(rank: int, world: int) -> dict[str, str]:
    """A block given another OverlapPolicy than its root's, a policy of another type,
    ignored_params holding a tensor that is no Parameter, an int reshard_after_forward that
    divides no group of the ranks, a module given to fully_shard twice, and overlap.checkpoint
    (a ShardedModule's) asked to save a model sharded with fully_shard."""
    from overlap import OverlapPolicy, fully_shard

    out = {}
    model = meta_gpt()
    for block in model.blocks:
        fully_shard(block, overlap_policy=OverlapPolicy(prefetch_depth=1))
    try:
        fully_shard(model, overlap_policy=OverlapPolicy(prefetch_depth=2))
        model.to_empty(device="cpu")
        out["differs"] = "built"
    except ValueError as error:
        out["differs"] = str(error)
    try:
        fully_shard(meta_gpt(), overlap_policy={"prefetch_depth": 1})
        out["type"] = "returned"
    except TypeError as error:
        out["type"] = str(error)
    try:
        fully_shard(meta_gpt(), ignored_params={torch.zeros(2)})
        out["ignored"] = "returned"
    except TypeError as error:
        out["ignored"] = str(error)
    try:
        fully_shard(meta_gpt(), reshard_after_forward=world + 1)
        out["int"] = "returned"
    except ValueError as error:
        out["int"] = str(error)
    try:
        fully_shard(fully_shard(nn.Linear(2, 2)))
        out["twice"] = "returned"
    except ValueError as error:
        out["twice"] = str(error)
    from overlap import checkpoint
    path = os.path.join(tempfile.mkdtemp(), "checkpoint")
    try:
        checkpoint.save(path, fully_shard(nn.Linear(2, 2)))
        out["overlap.checkpoint"] = "saved"
    except TypeError as error:
        out["overlap.checkpoint"] = str(error)
    out["written"] = os.listdir(os.path.dirname(path))
    return out


def _adamw_square_losses(model: nn.Module, batches: list[torch.Tensor], rank: int, *inputs: Any) -> list[float]:
    """AdamW steps on the mean square of `model`'s output over this rank's four rows of each
    batch (`inputs` passed after them); this rank's losses."""
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    losses = []
    for x in batches:
        loss = model(x[4 * rank:4 * rank + 4], *inputs).square().mean()
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(float(loss))
    return losses


def output_dtypes(rank: int, world: int) -> dict[str, Any]:
    """FSDP2's `MixedPrecisionPolicy(output_dtype=...)` per call: bf16 blocks, one of them and
    the root casting their outputs to fp32. Under torch's `fully_shard` and ours, from the same
    seed and batches: the dtype each module's forward hook sees, and three AdamW steps' losses."""
    from torch.distributed.fsdp import MixedPrecisionPolicy

    bf16 = dict(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    gen = torch.Generator().manual_seed(2)
    batches = [torch.randn(4 * world, 10, generator=gen) for _ in range(3)]
    out: dict[str, Any] = {}
    for name, shard in implementations().items():
        torch.manual_seed(0)
        model = nn.Sequential(*[nn.Sequential(nn.Linear(10, 10), nn.Tanh()) for _ in range(3)], nn.Linear(10, 1))
        for index, block in enumerate(model[:3]):
            shard(block, mp_policy=MixedPrecisionPolicy(**bf16, output_dtype=torch.float32 if index == 1 else None))
        shard(model, mp_policy=MixedPrecisionPolicy(**bf16, output_dtype=torch.float32))
        seen: list[str] = []
        for module in (*model[:3], model):
            module.register_forward_hook(lambda _, args, output: seen.append(str(output.dtype)))
        out[name] = {"losses": _adamw_square_losses(model, batches, rank), "dtypes": seen[:4]}
    return out


class _ScaledBlock(nn.Module):
    """A block that takes a second input and records the dtypes its inputs arrive in."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(10, 10)
        self.seen: list[str] = []

    def forward(self, x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
        self.seen.append(f"{x.dtype} {scale.dtype}")
        return torch.tanh(self.linear(x.to(self.linear.weight.dtype))) * scale


class _Scaled(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(_ScaledBlock() for _ in range(2))
        self.head = nn.Linear(10, 1)

    def forward(self, x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x, scale)
        return self.head(x.to(self.head.weight.dtype)).float()


def input_casts(rank: int, world: int) -> dict[str, Any]:
    """FSDP2's `MixedPrecisionPolicy(cast_forward_inputs=...)` over bf16 blocks taking a second
    input: the dtypes each block's inputs arrive in, and two AdamW steps' losses, under torch's
    `fully_shard` and ours, casting and not."""
    from torch.distributed.fsdp import MixedPrecisionPolicy

    gen = torch.Generator().manual_seed(3)
    batches = [torch.randn(4 * world, 10, generator=gen) for _ in range(2)]
    scale = torch.full((1, 10), 0.5)
    out: dict[str, Any] = {}
    for cast in (True, False):
        for name, shard in implementations().items():
            torch.manual_seed(0)
            model = _Scaled()
            policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32,
                                          cast_forward_inputs=cast)
            for block in model.blocks:
                shard(block, mp_policy=policy)
            shard(model, mp_policy=policy)
            losses = _adamw_square_losses(model, batches, rank, scale)
            out[f"{name} cast={cast}"] = {"seen": [block.seen[0] for block in model.blocks], "losses": losses}
    return out


def bucket_layout(rank: int, world: int) -> dict[str, Any]:
    """Six blocks sharded one by one, the fifth kept gathered after forward, then the root:
    which blocks share a unit (with the bucket size the launch's OVERLAP_BUCKET_MB gives), each
    unit's resharding, and two SGD steps' losses against one process."""
    from overlap import fully_shard

    def blocks() -> nn.Sequential:
        torch.manual_seed(0)
        return nn.Sequential(*[nn.Sequential(nn.Linear(10, 10), nn.Tanh()) for _ in range(6)])

    model, reference = blocks(), blocks()
    for index, block in enumerate(model):
        fully_shard(block, reshard_after_forward=index != 4)
    fully_shard(model)
    gen = torch.Generator().manual_seed(1)
    batches = [torch.randn(4 * world, 10, generator=gen) for _ in range(2)]
    out: dict[str, Any] = {"losses": [], "reference": []}
    for net, key, rows in ((model, "losses", slice(4 * rank, 4 * rank + 4)), (reference, "reference", slice(None))):
        optimizer = torch.optim.SGD(net.parameters(), lr=0.5)
        for x in batches:
            loss = net(x[rows]).square().mean()
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
            out[key].append(float(loss))
    if world > 1:
        gathered = [None] * world
        dist.all_gather_object(gathered, out["losses"])
        out["losses"] = [sum(step) / world for step in zip(*gathered)]
    position = {id(block): index for index, block in enumerate(model)}
    out["units"] = [([position[id(m)] for m in unit.modules], unit.reshard_after_forward)
                    for unit in model.overlap_runtime.scheduler.units]
    return out


class _RoutedBlock(nn.Module):
    """A block whose router computes in fp32 from its own whole weights on every rank: the
    parameters a user leaves out of sharding with `ignored_params` and syncs alone."""

    def __init__(self) -> None:
        super().__init__()
        self.router = nn.Linear(10, 10)
        self.proj = nn.Linear(10, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate = torch.sigmoid(self.router(x.float()))
        return torch.tanh(self.proj(x)) * gate.to(x.dtype)


def _routed() -> nn.Module:
    return nn.Sequential(_RoutedBlock(), _RoutedBlock(), nn.Linear(10, 1))


# fully_shard's arguments in each mode; "overlap-only" modes are the runtime's own.
IGNORED_MODES: dict[str, dict[str, Any]] = {
    "default": {}, "keep-gathered": {"reshard_after_forward": False}, "cpu-offload": {"offload_policy": "cpu"},
    "bf16": {"mp_policy": "bf16"}, "hybrid-2d-mesh": {"mesh": ("replicate", "shard")}, "meta-init": {"meta": True},
    "hpz-int-2": {"reshard_after_forward": 2, "world": 4},
    # DDP over the sharded model syncs the routers (FSDP2's own test of ignored_params).
    "ddp-syncs-them": {"ddp": True},
    # torch's clip over the sharded and the left-out gradients together (binding here).
    "clipped": {"clip": 0.01},
    "int8-compression": {"overlap_policy": {"compression": "int8"}, "overlap-only": True},
    "int8-int4-compression": {"overlap_policy": {"compression": "int8-int4"}, "overlap-only": True},
}


def ignored_params(rank: int, world: int, modes: tuple[str, ...]) -> dict[str, Any]:
    """Blocks and root sharded with each block's router left out (`ignored_params`), under
    torch's `fully_shard` and ours in each of `modes` (IGNORED_MODES): three AdamW steps on this
    rank's rows, the routers' gradients averaged by the loop (no wrapper reduces them), against
    one process on every row; and what the routers are after wrapping and in the state dict."""
    from torch.distributed.tensor import DTensor

    gen = torch.Generator().manual_seed(4)
    batches = [torch.randn(4 * world, 10, generator=gen) for _ in range(3)]
    out: dict[str, Any] = {}
    for mode in modes:
        how = IGNORED_MODES[mode]
        reference = _routed_model(how.get("meta", False), initialise=True)
        out[f"one-process {mode}"] = _train_routed(reference, batches, rank, world, False, how.get("clip"))
        for name, shard in implementations().items():
            if how.get("overlap-only") and name != "overlap":
                continue
            with _environment(how.get("env", {})):
                model = _routed_model(how.get("meta", False), initialise=False)
                ignored = {p for block in model[:2] for p in block.router.parameters()}
                kwargs = _shard_kwargs(how, world)
                for block in model[:2]:
                    shard(block, ignored_params=ignored, **kwargs)
                shard(model, ignored_params=ignored, **kwargs)
                if how.get("meta"):
                    _initialise_routed(model)
                routers = [p for block in model[:2] for p in block.router.parameters()]
                net = _ddp_over_routers(model) if how.get("ddp") else model
                result: dict[str, Any] = {
                    "routers-plain": all(type(p) is nn.Parameter for p in routers),
                    "routers-kept": all(p in ignored for p in routers),
                    "state-kinds": sorted({f"router={'router' in key} dtensor={isinstance(value, DTensor)}"
                                           for key, value in model.state_dict().items()}),
                    "losses": _train_routed(net, batches, rank, world, True, how.get("clip"))}
            full = {key: value.full_tensor() if isinstance(value, DTensor) else value
                    for key, value in model.state_dict().items()}
            result["final-max-diff"] = max(float((full[key] - value).abs().max())
                                           for key, value in reference.state_dict().items())
            out[f"{name} {mode}"] = result
    return out


def _ddp_over_routers(model: nn.Module) -> nn.Module:
    """DDP over `model`, syncing only what no fully_shard call shards (the routers)."""
    from torch.distributed.tensor import DTensor
    from torch.nn.parallel import DistributedDataParallel

    sharded = [name for name, param in model.named_parameters() if isinstance(param, DTensor)]
    DistributedDataParallel._set_params_and_buffers_to_ignore_for_model(model, sharded)
    return DistributedDataParallel(model)


def _routed_model(meta: bool, initialise: bool) -> nn.Module:
    """The model from seed 0; built on the meta device, given values (seed 1) with `initialise`."""
    torch.manual_seed(0)
    if not meta:
        return _routed()
    with torch.device("meta"):
        model = _routed()
    if initialise:
        _initialise_routed(model)
    return model


def _initialise_routed(model: nn.Module) -> None:
    model.to_empty(device="cpu")
    torch.manual_seed(1)
    with torch.no_grad():
        init_weights(model)


def _shard_kwargs(how: dict[str, Any], world: int) -> dict[str, Any]:
    """fully_shard's keyword arguments for one mode of IGNORED_MODES or COMBINATIONS."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy

    from overlap import OverlapPolicy

    kwargs: dict[str, Any] = {}
    if "overlap_policy" in how:
        kwargs["overlap_policy"] = OverlapPolicy(**how["overlap_policy"])
    if how.get("offload_policy") == "cpu":
        kwargs["offload_policy"] = CPUOffloadPolicy(pin_memory=False)   # FSDP2 pins only on accelerators
    if how.get("mp_policy") == "bf16":
        kwargs["mp_policy"] = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    if "mesh" in how:
        shape = (world,) if len(how["mesh"]) == 1 else (world, 1)
        kwargs["mesh"] = init_device_mesh("cpu", shape, mesh_dim_names=how["mesh"])
    if "reshard_after_forward" in how:
        kwargs["reshard_after_forward"] = how["reshard_after_forward"]
    if how.get("shard_placement_fn") == "last":
        from torch.distributed.tensor import Shard

        kwargs["shard_placement_fn"] = lambda param: Shard(-1)
    return kwargs


def _train_routed(model: nn.Module, batches: list[torch.Tensor], rank: int, world: int, sharded: bool,
                  clip: Optional[float] = None) -> list[float]:
    """Three AdamW steps; each loss averaged over the ranks. `sharded`: each rank on its rows,
    the routers' gradients averaged here, as a user of `ignored_params` syncs them (unless
    `model` is DDP's, which does). With `clip`, SGD (whose steps a binding clip scales, where
    AdamW's would hardly change) after torch's clip over every parameter, under DTensor's
    `implicit_replication()` (the routers' gradients are plain tensors), as FSDP2's users clip
    such a model."""
    from torch.distributed.tensor.experimental import implicit_replication
    from torch.nn.parallel import DistributedDataParallel

    ddp = isinstance(model, DistributedDataParallel)
    blocks = model.module[:2] if ddp else model[:2]
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2) if clip is None else \
        torch.optim.SGD(model.parameters(), lr=0.5)
    losses = []
    for x in batches:
        loss = model(x[4 * rank:4 * rank + 4] if sharded else x).float().square().mean()
        loss.backward()
        if sharded:
            for param in (p for block in blocks for p in block.router.parameters() if not ddp):
                dist.all_reduce(param.grad)
                param.grad /= world
        if clip is not None:
            with implicit_replication():
                torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm=clip)
        optimizer.step()
        optimizer.zero_grad()
        losses.append(rank_mean(loss, world if sharded else 1))
    return losses


@contextlib.contextmanager
def _environment(env: dict[str, str]) -> Iterator[None]:
    """`env` set in os.environ for the duration, what was there before put back."""
    saved = {key: os.environ.get(key) for key in env}
    os.environ.update(env)
    try:
        yield
    finally:
        for key, value in saved.items():
            if value is None:
                del os.environ[key]
            else:
                os.environ[key] = value


class _TokenModel(nn.Module):
    """An untied embedding, whose backward reads its indices only, two blocks and a head."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(32, 16)
        self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(16, 16), nn.Tanh()) for _ in range(2))
        self.head = nn.Linear(16, 32)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.embed(idx)
        for block in self.blocks:
            x = x + block(x)
        return F.cross_entropy(self.head(x).flatten(0, 1), idx.flatten())


# The modes `set_unshard_in_backward(False)` is tried in under overlap.fully_shard (keys of
# IGNORED_MODES); torch's fully_shard is the control in the first.
UNSHARD_MODES = ("default", "keep-gathered", "cpu-offload", "bf16", "hybrid-2d-mesh", "int8-compression")


def unshard_in_backward(rank: int, world: int) -> dict[str, Any]:
    """OLMo-core's pattern: the embedding sharded on its own and told
    `set_unshard_in_backward(False)` before the blocks and the root are sharded. Three AdamW
    steps on this rank's rows under torch's `fully_shard` and ours (in each of UNSHARD_MODES),
    against one process; the gathers of each of our units per step, and of the embedding
    without the call, each call a unit of its own (default buckets would merge it with the
    blocks); then FSDPModule's calls about collectives: the hints they leave and the refusals."""
    from overlap import OverlapPolicy

    gen = torch.Generator().manual_seed(5)
    batches = [torch.randint(0, 32, (2 * world, 6), generator=gen) for _ in range(3)]
    # (name, fully_shard, its keyword arguments, set_unshard_in_backward's argument or None)
    runs = [("fsdp2", implementations()["fsdp2"], {}, False)]
    runs += [(f"overlap {mode}", implementations()["overlap"], _shard_kwargs(IGNORED_MODES[mode], world), False)
             for mode in UNSHARD_MODES]
    # Each call a unit of its own (default buckets would merge the embedding with the blocks):
    # asked to gather, and not asked (an embedding's unit is not gathered for backward anyway).
    one_unit_each = {"overlap_policy": OverlapPolicy(bucket_mb=1e-6)}
    runs += [("overlap gathering", implementations()["overlap"], one_unit_each, True),
             ("overlap not asked", implementations()["overlap"], one_unit_each, None)]
    out: dict[str, Any] = {}
    for name, shard, kwargs, unshard in runs:
        torch.manual_seed(0)
        model = _TokenModel()
        shard(model.embed, **kwargs)
        if unshard is not None:
            model.embed.set_unshard_in_backward(unshard)
        for block in model.blocks:
            shard(block, **kwargs)
        shard(model, **kwargs)
        out[name] = {"losses": _adamw_mean_losses(model, [x[2 * rank:2 * rank + 2] for x in batches], world)}
        if name != "fsdp2":
            report = model.overlap_report()
            out[name]["gathers"] = {unit.unit: unit.gathers for unit in report.mean_step().units}
            out[name]["decided"] = report.decisions
    torch.manual_seed(0)
    out["one-process"] = {"losses": _adamw_mean_losses(_TokenModel(), batches, 1)}
    out["calls"] = _collective_calls(model)
    return out


def _adamw_mean_losses(model: nn.Module, batches: list[torch.Tensor], world: int) -> list[float]:
    """AdamW steps on the model's loss over each batch; each loss averaged over the ranks."""
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    losses = []
    for batch in batches:
        loss = model(batch)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(rank_mean(loss, world))
    return losses


def _collective_calls(model: nn.Module) -> dict[str, Any]:
    """FSDPModule's calls about collectives on an overlap.fully_shard model: what each does."""
    out: dict[str, Any] = {}
    model.set_reduce_scatter_divide_factor(4.0)
    out["divide-factor"] = model.overlap_runtime.collectives.gradient_divide_factor
    model.set_force_sum_reduction_for_comms(True)
    model.set_reduce_scatter_unused_params(True)
    model.set_reduce_scatter_max_input_buffers(2)
    model.set_separate_reduce_scatter_group(True)
    model.set_allocate_memory_from_process_group_for_comm(True)
    model.set_symm_mem_for_comm()
    model._set_unshard_async_op(True)
    out["hints"] = model.overlap_report().hints
    for call, argument in (("set_custom_all_gather", None), ("set_custom_reduce_scatter", None),
                           ("set_all_reduce_hook", lambda output: None)):
        try:
            getattr(model, call)(argument)
            out[call] = "returned"
        except NotImplementedError as error:
            out[call] = str(error)
    return out


class _Recorder(nn.Module):
    """A Linear(100, 100) that records the input its forward gets, under `name`; with
    `cast`, it casts that input to its weight's dtype itself."""

    def __init__(self, seen: dict[str, str], name: str, cast: bool) -> None:
        super().__init__()
        self.linear = nn.Linear(100, 100)
        self.seen, self.name, self.cast = seen, name, cast

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.seen[self.name] = str(x.dtype).removeprefix("torch.")
        return self.linear(x.to(self.linear.weight.dtype) if self.cast else x)


class _RecordedPair(_Recorder):
    """Records its input as "model", then runs two recorders, "c1" and "c2"."""

    def __init__(self, seen: dict[str, str], cast: bool) -> None:
        super().__init__(seen, "model", cast=False)
        self.c1, self.c2 = _Recorder(seen, "c1", cast), _Recorder(seen, "c2", cast)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.seen[self.name] = str(x.dtype).removeprefix("torch.")
        return self.c2(self.c1(x))


class _ExternalInput(nn.Module):
    """FSDP2's test of a submodule given a tensor made inside the root's forward."""

    def __init__(self, seen: dict[str, str]) -> None:
        super().__init__()
        self.l1 = nn.Linear(100, 100)
        self.l2 = _TwoInputs(seen)
        self.seen = seen

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.seen["model x"] = str(x.dtype).removeprefix("torch.")
        return self.l2(self.l1(x), torch.ones(2, 100))


class _TwoInputs(nn.Module):
    def __init__(self, seen: dict[str, str]) -> None:
        super().__init__()
        self.linear = nn.Linear(100, 100)
        self.seen = seen

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        self.seen["l2 x"], self.seen["l2 y"] = (str(t.dtype).removeprefix("torch.") for t in (x, y))
        return self.linear(x)


def per_call_policies(rank: int, world: int) -> dict[str, Any]:
    """FSDP2's per-call `mp_policy` (test_fully_shard_mixed_precision.py's
    test_float16_on_one_submodule and test_submodules_with_external_inputs): the dtype each
    module's forward receives, one forward and backward each, under torch's `fully_shard` and
    ours; and three AdamW steps with bf16 blocks under an fp32 root."""
    from torch.distributed.fsdp import MixedPrecisionPolicy as Policy

    fp16 = torch.float16
    out: dict[str, Any] = {}
    for name, shard in implementations().items():
        seen_by_case: dict[str, dict[str, str]] = {}
        for case, cast, target, policy in (
                ("fp16 c2", False, "c2", Policy(param_dtype=fp16)),
                ("fp16 c2 casting itself", True, "c2", Policy(param_dtype=fp16, cast_forward_inputs=False)),
                ("fp16 c1 with fp32 output", False, "c1", Policy(param_dtype=fp16, output_dtype=torch.float32))):
            seen: dict[str, str] = {}
            torch.manual_seed(0)
            model = _RecordedPair(seen, cast)
            shard(getattr(model, target), mp_policy=policy)
            shard(model)
            model(torch.zeros(2, 100)).float().sum().backward()
            seen_by_case[case] = dict(seen)
        for cast in (False, True):
            seen = {}
            torch.manual_seed(0)
            model = _ExternalInput(seen)
            shard(model.l2, mp_policy=Policy(param_dtype=fp16, cast_forward_inputs=cast))
            shard(model, mp_policy=Policy(param_dtype=fp16))
            model(torch.zeros(2, 100)).float().sum().backward()
            seen_by_case[f"external input, l2 casting {cast}"] = dict(seen)
        out[name] = {"seen": seen_by_case, "losses": _bf16_blocks_losses(shard, rank, world)}
    for mode in POLICY_MODES:
        out[f"overlap {mode}"] = {"losses": _bf16_blocks_losses(implementations()["overlap"], rank, world,
                                                                **_shard_kwargs(IGNORED_MODES[mode], world))}
    return out


# The modes bf16 blocks under an fp32 root are trained in under overlap.fully_shard besides
# the default (keys of IGNORED_MODES).
POLICY_MODES = ("keep-gathered", "cpu-offload", "hybrid-2d-mesh", "int8-compression")


def _bf16_blocks_losses(shard: Callable, rank: int, world: int, **kwargs: Any) -> list[float]:
    """Three AdamW steps of three blocks computing in bf16 (reducing in fp32, their outputs
    cast to fp32) under a root with no mixed precision; `kwargs` to every call."""
    from torch.distributed.fsdp import MixedPrecisionPolicy

    gen = torch.Generator().manual_seed(6)
    batches = [torch.randn(4 * world, 10, generator=gen) for _ in range(3)]
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Sequential(nn.Linear(10, 10), nn.Tanh()) for _ in range(3)], nn.Linear(10, 1))
    for block in model[:3]:
        shard(block, mp_policy=MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32,
                                                    output_dtype=torch.float32), **kwargs)
    shard(model, **kwargs)
    return _adamw_square_losses(model, [x.float() for x in batches], rank)


def unshard_in_backward_hpz(rank: int, world: int) -> dict[str, Any]:
    """hpZ over pairs of ranks (`reshard_after_forward=2` at 4 ranks) with the embedding's unit
    not gathered for backward: the bytes of hpZ's node copy the embedding's unit and the first
    block's keep once freed after their forward (the next module's forward starting), then
    three AdamW steps against one process."""
    from overlap import OverlapPolicy, fully_shard

    gen = torch.Generator().manual_seed(5)
    batches = [torch.randint(0, 32, (2 * world, 6), generator=gen) for _ in range(3)]
    torch.manual_seed(0)
    model = _TokenModel()
    kwargs = {"reshard_after_forward": 2, "overlap_policy": OverlapPolicy(bucket_mb=1e-6)}
    fully_shard(model.embed, **kwargs)
    for block in model.blocks:
        fully_shard(block, **kwargs)
    fully_shard(model, **kwargs)
    copies: dict[str, int] = {}

    def record(freed: str) -> Callable:
        """A pre-hook noting the copy a unit freed just before keeps (read before prefetch)."""
        def hook(*_: Any) -> None:
            unit = next(u for u in model.overlap_runtime.scheduler.units if u.name == freed)
            copies[freed] = sum(group.node_copy.nbytes for group in unit.groups)
        return hook

    model.blocks[0].register_forward_pre_hook(record("embed"))
    model.blocks[1].register_forward_pre_hook(record("blocks.0"))
    model(batches[0][2 * rank:2 * rank + 2]).backward()
    model.zero_grad()
    torch.manual_seed(0)
    return {"copies": copies, "losses": _adamw_mean_losses(model, [x[2 * rank:2 * rank + 2] for x in batches], world),
            "one-process": _adamw_mean_losses(_TokenModel(), batches, 1)}


def _buffered(seed: int) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 8), nn.BatchNorm1d(8), nn.Linear(8, 3))


def state_dict_round_trips(rank: int, world: int, directory: str) -> dict[str, Any]:
    """A model with BatchNorm buffers and its first Linear left out (`ignored_params`), one
    step trained, then its state carried into a model built from another seed three ways:
    `load_state_dict(state_dict())`, DCP's save and load, and torch's full state dict set
    with `broadcast_from_rank0`. Under torch's `fully_shard` and ours: the largest difference
    of any value (buffers and left-out parameters included) after each, and what a strict load
    missing a buffer raises."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict, set_model_state_dict
    from torch.distributed.tensor import DTensor

    def sharded(seed: int, shard: Callable) -> nn.Module:
        model = _buffered(seed)
        ignored = set(model[0].parameters())
        for index in (1, 3):
            shard(model[index], ignored_params=ignored)
        return shard(model, ignored_params=ignored)

    def whole(model: nn.Module) -> dict[str, torch.Tensor]:
        return {key: value.full_tensor() if isinstance(value, DTensor) else value
                for key, value in model.state_dict().items()}

    def largest_difference(a: nn.Module, b: nn.Module) -> float:
        ours, theirs = whole(a), whole(b)
        return max(float((ours[key].float() - theirs[key].float()).abs().max()) for key in ours)

    out: dict[str, Any] = {}
    for name, shard in implementations().items():
        model = sharded(0, shard)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        # The same rows on every rank: the left-out parameters and the buffers, which no rank
        # syncs, stay equal (DCP keeps one rank's copy of a plain tensor).
        model(torch.randn(4, 8, generator=torch.Generator().manual_seed(2))).square().mean().backward()
        optimizer.step()
        loaded = sharded(1, shard)
        before = largest_difference(model, loaded)
        loaded.load_state_dict(model.state_dict())
        path = os.path.join(directory, f"dcp-{name}")
        dcp.save(model.state_dict(), checkpoint_id=path)
        from_dcp = sharded(1, shard)
        state = from_dcp.state_dict()
        dcp.load(state, checkpoint_id=path)
        from_dcp.load_state_dict(state)
        full = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
        broadcast = sharded(1, shard)
        set_model_state_dict(broadcast, full, options=StateDictOptions(full_state_dict=True, broadcast_from_rank0=True))
        partial = {key: value for key, value in model.state_dict().items() if key != "2.running_mean"}
        try:
            loaded.load_state_dict(partial)
            missing = "loaded"
        except RuntimeError as error:
            missing = str(error)
        out[name] = {"before": before, "load_state_dict": largest_difference(model, loaded),
                     "dcp": largest_difference(model, from_dcp), "broadcast": largest_difference(model, broadcast),
                     "missing": missing}
    return out



def flattening_views(rank: int, world: int) -> dict[str, Any]:
    """Views of the DTensor parameters that flatten their rows (`p.view(-1)`, `p.flatten()`,
    `p.view(p.shape[0], -1)`, and back), `parameters_to_vector`, on rows that are not DTensor's
    even chunks here: the largest difference from one process's values."""
    from torch.distributed.tensor import DTensor

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 6), nn.Linear(6, 3))
    torch.manual_seed(0)
    reference = nn.Sequential(nn.Linear(8, 6), nn.Linear(6, 3))
    implementations()["overlap"](model[0])
    implementations()["overlap"](model)
    model(torch.ones(1, 8))
    weight, expected = model[0].weight.detach(), reference[0].weight.detach()
    out = {"rows": str(weight.placements)}
    for name, view in (("view(-1)", lambda w: w.view(-1)), ("flatten()", lambda w: w.flatten()),
                       ("view(rows, -1)", lambda w: w.view(w.shape[0], -1)),
                       ("view(-1).view(shape)", lambda w: w.view(-1).view(6, 8)),
                       ("view(12, 4)", lambda w: w.view(12, 4))):
        got = view(weight)
        out[name] = float((got.full_tensor() - view(expected)).abs().max()) if isinstance(got, DTensor) else "plain"
    vector = torch.nn.utils.parameters_to_vector(model[0].parameters())
    out["parameters_to_vector"] = float(
        (vector.full_tensor() - torch.nn.utils.parameters_to_vector(reference[0].parameters())).abs().max())
    return out


def penalties_on_parameters(rank: int, world: int) -> dict[str, Any]:
    """An L2 penalty taken from the DTensor parameters outside forward and added to the loss,
    as `(p ** 2).sum()` and through a flattening view, built before the forward's loss and
    after it (so its gradient reaches the parameters before their reduction or after), twice
    without clearing the gradients between, and alone in a backward of its own: the gradients
    against one process, under torch's `fully_shard` and ours (whose rows per rank are not
    even chunks here)."""
    from torch.distributed.tensor import DTensor

    def whole(value: torch.Tensor) -> torch.Tensor:
        return value.full_tensor() if isinstance(value, DTensor) else value

    def penalty(model: nn.Module, view: bool) -> torch.Tensor:
        return sum(((p.view(-1) if view else p) ** 2).sum() for p in model[0].parameters())

    x = torch.randn(4, 8, generator=torch.Generator().manual_seed(7))
    out: dict[str, Any] = {}
    for name, shard in implementations().items():
        for case in ("before the loss", "after the loss", "viewed", "twice", "alone"):
            models = []
            for _ in range(2):
                torch.manual_seed(0)
                models.append(nn.Sequential(nn.Linear(8, 6), nn.Linear(6, 3)))
            model, reference = models
            shard(model[0])
            shard(model)
            for net, rows in ((model, x[2 * rank:2 * rank + 2]), (reference, x)):
                if case == "alone":
                    net(rows).square().mean().backward()
                    whole(penalty(net, False)).backward()
                elif case in ("before the loss", "twice"):
                    for _ in range(2 if case == "twice" else 1):
                        (whole(penalty(net, False)) + net(rows).square().mean()).backward()
                else:
                    (net(rows).square().mean() + whole(penalty(net, case == "viewed"))).backward()
            out[f"{name} {case}"] = max(float((whole(p.grad) - q.grad).abs().max())
                                        for p, q in zip(model.parameters(), reference.parameters()))
    return out


class _StackedExperts(nn.Module):
    """Experts stacked on dimension 0 of one 3-D parameter (as torchtitan's and HF's MoE layers
    hold them), each applied to every row and averaged."""

    def __init__(self, experts: int, width: int, out: int) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.randn(experts, width, out) * 0.2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return (x.unsqueeze(0) @ self.w).mean(0)


def _other_dims_model(seed: int, even: bool) -> nn.Module:
    """Widths even on every dimension the placement below shards at 2 ranks (torch's
    `fully_shard` refuses uneven chunks on a dimension other than 0), or not."""
    torch.manual_seed(seed)
    if even:
        return nn.Sequential(nn.Linear(10, 12), nn.LayerNorm(12), nn.Linear(12, 4), _StackedExperts(3, 4, 6),
                             nn.Linear(6, 3))
    return nn.Sequential(nn.Linear(9, 11), nn.LayerNorm(11), nn.Linear(11, 5), _StackedExperts(3, 5, 7),
                         nn.Linear(7, 3))


def _largest_dim(param: nn.Parameter) -> Any:
    """FSDP2's own test's placement: the experts on dimension 1, every other parameter on its
    largest dimension (the first of equals)."""
    from torch.distributed.tensor import Shard

    if param.dim() == 3:
        return Shard(1)
    return Shard(max(range(param.dim()), key=lambda dim: param.shape[dim]))


def _sharded_other_dims(shard: Callable, seed: int, even: bool) -> nn.Module:
    model = _other_dims_model(seed, even)
    for index in (0, 2, 3):
        shard(model[index], shard_placement_fn=_largest_dim)
    return shard(model, shard_placement_fn=_largest_dim)


def _train_other_dims(model: nn.Module, rank: int, world: int, steps_: int = 3) -> tuple[list[float], Any]:
    """AdamW steps with torch's clip on this rank's rows of the global batch (rank -1: one
    process, every rank's rows): the mean loss of each step, and the optimizer."""
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    width = model[0].in_features
    generator = torch.Generator().manual_seed(1)
    losses = []
    for _ in range(steps_):
        batch = torch.randn(4 * world, width, generator=generator)
        loss = model(batch if rank < 0 else batch[4 * rank:4 * rank + 4]).square().mean()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5)
        optimizer.step()
        optimizer.zero_grad()
        losses.append(rank_mean(loss.detach(), world) if rank >= 0 else float(loss))
    return losses, optimizer


def other_dims(rank: int, world: int, directory: str) -> dict[str, Any]:
    """`shard_placement_fn` sharding parameters on dimensions other than 0 (FSDP2's test's
    largest dimension, experts on dimension 1): under torch's `fully_shard` and ours, each
    parameter's placement, the losses and final values against one process, DCP checkpoints
    read by the other implementation, torch's full model and optimizer state dicts; ours also
    on widths that do not divide (which torch's refuses), and the placements it refuses."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_model_state_dict,
                                                         get_optimizer_state_dict, set_model_state_dict)
    from torch.distributed.tensor import Replicate, Shard

    full = StateDictOptions(full_state_dict=True)        # on every rank
    out: dict[str, Any] = {}
    for even in (True, False):
        reference = _other_dims_model(0, even)
        ref_losses, ref_optimizer = _train_other_dims(reference, -1, world)
        ref_moments = {name: ref_optimizer.state[param]["exp_avg"] for name, param in reference.named_parameters()}
        for name, shard in implementations().items():
            if name == "fsdp2" and not even:
                continue
            key = f"{name}-{'even' if even else 'uneven'}"
            model = _sharded_other_dims(shard, 0, even)
            losses, optimizer = _train_other_dims(model, rank, world)
            values = get_model_state_dict(model, options=full)
            moments = get_optimizer_state_dict(model, optimizer, options=full)["state"]
            out[key] = {
                "placements": {n: [p.dim for p in param.placements] for n, param in model.named_parameters()},
                # Parameters sharded on another dimension whose slices more than one rank holds.
                "split": [n for n, param in model.named_parameters() if param.placements[0].dim and
                          sum(bool(rows) for rows in getattr(param.placements[0], "rows", (1, 1))) > 1],
                "losses": losses, "one-process": ref_losses,
                "values": max(float((values[n] - v).abs().max()) for n, v in reference.state_dict().items()),
                "moments": max(float((moments[n]["exp_avg"] - m).abs().max()) for n, m in ref_moments.items())}
            path = os.path.join(directory, f"other-dims-{key}")
            dcp.save(model.state_dict(), checkpoint_id=path)
            # The other implementation (or, uneven, ours again) reads the checkpoint.
            readers = [other for other in implementations().items() if even or other[0] == "overlap"]
            for reader_name, reader in readers:
                loaded = _sharded_other_dims(reader, 1, even)
                state = loaded.state_dict()
                dcp.load(state, checkpoint_id=path)
                loaded.load_state_dict(state)
                got = get_model_state_dict(loaded, options=full)
                out[key][f"dcp into {reader_name}"] = max(float((got[n] - v).abs().max()) for n, v in values.items())
            broadcast = _sharded_other_dims(shard, 1, even)
            # (torch's set replaces the given dict's values with DTensors: a copy is given)
            set_model_state_dict(broadcast, dict(values), options=StateDictOptions(full_state_dict=True,
                                                                                 broadcast_from_rank0=True))
            got = get_model_state_dict(broadcast, options=full)
            out[key]["broadcast"] = max(float((got[n] - v).abs().max()) for n, v in values.items())
            if name == "overlap":
                # Pretrained weights streamed from a safetensors file into each rank's slices.
                from safetensors.torch import save_file

                from overlap.checkpoint import load_pretrained

                weights = os.path.join(directory, f"other-dims-{key}.safetensors")
                if rank == 0:
                    save_file({n: v.contiguous() for n, v in values.items()}, weights)
                dist.barrier()
                pretrained = _sharded_other_dims(shard, 1, even)
                load_pretrained(pretrained.overlap_runtime, weights)
                got = get_model_state_dict(pretrained, options=full)
                out[key]["pretrained"] = max(float((got[n] - v).abs().max()) for n, v in values.items())
    from overlap import fully_shard

    refusals = {}
    for what, placement in (("replicate", Replicate()), ("past the last dimension", Shard(2))):
        try:
            fully_shard(nn.Linear(4, 4), shard_placement_fn=lambda param, placement=placement: placement)
            refusals[what] = "accepted"
        except ValueError as error:
            refusals[what] = str(error)
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import distribute_tensor

    mesh = init_device_mesh("cpu", (world,))
    split = nn.Linear(4, 4)             # a tensor-parallel parameter: a DTensor before sharding
    split.weight = nn.Parameter(distribute_tensor(split.weight.detach(), mesh, [Shard(0)]))
    try:
        fully_shard(split, mesh=mesh, shard_placement_fn=lambda p: Shard(1))
        refusals["tensor parallel"] = "accepted"
    except NotImplementedError as error:
        refusals["tensor parallel"] = str(error)
    out["refusals"] = refusals
    # A call's placement is for the parameters it shards: the root's Shard(2), which its
    # block's matrices lack, reaches only the experts, as under FSDP2.
    placements = {}
    for name, shard in implementations().items():
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(4, 4), _StackedExperts(2, 4, 4))
        whole = {key: value.detach().clone() for key, value in model.state_dict().items()}
        shard(model[0])
        shard(model, shard_placement_fn=lambda param: Shard(2))
        placements[name] = {key: ([p.dim for p in value.placements], float((value.full_tensor() - whole[key]).abs().max()))
                            for key, value in model.state_dict().items()}
    out["root's placement"] = placements
    return out
