"""`ShardedModule`: the public face of the runtime."""
from __future__ import annotations

import contextlib
import logging
import math
from collections import defaultdict
from typing import TYPE_CHECKING, Any, Callable, Iterator, Mapping, Optional, Sequence

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed._shard.sharded_tensor import ShardedTensor
from torch.utils._pytree import tree_map

from overlap.control.auto_sharding import sharding_at_startup
from overlap.runtime.collectives import Collectives
from overlap.runtime.process_group import device_backend
from overlap.runtime.compression import Compression, QuantizedCodec
from overlap.control.compression_auto import chooser_for
from overlap.base.config import (Config, config_from_env, local_rank_from_env, local_world_size_from_env, validate_bucket_mb, validate_compress, validate_prefetch_depth, validate_sharding)
from overlap.runtime.flat_group import FlatGroup
from overlap.kernels import BackendUnavailable, get_backend
from overlap.runtime.materialize import check_same_values, materialize, meta_places
from overlap.runtime.mesh import sharding_error
from overlap.base.mixed_precision import MixedPrecision
from overlap.control.startup_plan import plan_at_startup
from overlap.control.replanner import replanner_for
from overlap.base.profiling import enable_nvtx
from overlap.observe.report import OverlapMonitor, OverlapReport
from overlap.runtime.scheduler import Scheduler
from overlap.control.topology import detect_link
from overlap.runtime.unit import Unit
from overlap.base.units import UnitSpec, discover_units, merge_into_buckets

if TYPE_CHECKING:
    from overlap.plan.memory import ActivationShape
    from overlap.observe.memory import MemoryReport

logger = logging.getLogger("overlap")


def _device_for(group: dist.ProcessGroup) -> torch.device:
    """Where shards and gathered buffers live: CUDA when the group runs CUDA tensors on NCCL
    (`init_process_group()` on a GPU machine, "nccl", "cpu:gloo,cuda:nccl"), else the CPU.

    The CUDA device is the one the group is bound to (`init_process_group(device_id=...)`),
    else the current one, which must be LOCAL_RANK's when the launcher set it: a missing
    `torch.cuda.set_device(local_rank)` would otherwise put every rank on GPU 0.
    """
    if device_backend(group, "cuda") != "nccl" or not torch.cuda.is_available():
        return torch.device("cpu")
    bound = group.bound_device_id
    if bound is not None:
        return torch.device("cuda", torch.cuda.current_device() if bound.index is None else bound.index)
    index = torch.cuda.current_device()
    local_rank = local_rank_from_env()
    if local_rank is not None and local_rank < torch.cuda.device_count() and local_rank != index:
        raise ValueError(f"ShardedModule: rank {dist.get_rank()}: the current CUDA device is cuda:{index} but "
                         f"LOCAL_RANK is {local_rank}; call torch.cuda.set_device({local_rank}) before wrapping, "
                         "or pass device_id to init_process_group")
    return torch.device("cuda", index)


def _signature(root: UnitSpec, units: list[UnitSpec]) -> list[tuple]:
    return [(spec.name or "<root>", [(name, tuple(p.shape), str(p.dtype), p.requires_grad)
                                     for name, p, _ in spec.params]) for spec in [root, *units]]


def _agree(group: dist.ProcessGroup, error: Optional[str], signature: list[tuple], config: Config) -> None:
    """Raise the same error on every rank if any rank failed to configure or sees another model."""
    world = dist.get_world_size(group)
    reports: list[Any] = [None] * world
    dist.all_gather_object(reports, (error, signature, config), group=group)
    for rank, (rank_error, _, _) in enumerate(reports):
        if rank_error is not None:
            raise ValueError(f"ShardedModule: rank {rank}: {rank_error}")
    _, ref_signature, ref_config = reports[0]
    for rank, (_, rank_signature, rank_config) in enumerate(reports):
        if rank_signature != ref_signature:
            names = [u[0] for u in ref_signature], [u[0] for u in rank_signature]
            if names[0] != names[1]:
                detail = f"units {names[1]} vs rank 0's {names[0]}"
            else:
                unit = next(a for a, b in zip(ref_signature, rank_signature) if a != b)
                other = dict(rank_signature)[unit[0]]
                diff = next((a, b) for a, b in zip(unit[1] + [None], other + [None]) if a != b)
                detail = f"unit {unit[0]!r}: parameter {diff[1]} vs rank 0's {diff[0]}"
            raise ValueError(f"ShardedModule: rank {rank} wraps a different model than rank 0: {detail}")
        if rank_config != ref_config:
            raise ValueError(f"ShardedModule: rank {rank} has settings {rank_config} but rank 0 has {ref_config}; "
                             "OVERLAP_* variables and arguments must match on every rank")


class ShardedModule(nn.Module):
    """Shard `module`'s parameters, gradients and optimizer state across the ranks of
    `process_group` (ZeRO-3), gathering each unit's parameters just before it computes.

    Args:
        module: any nn.Module; rank 0's initial parameter values are used on every rank.
        unit_types: a module class, or a sequence of them, whose instances each become a
            unit; None for the automatic policy (see `overlap.base.units`).
        process_group: defaults to the world group.
        mixed_precision: dtypes to gather in and reduce in; master shards keep the
            parameters' own dtype.
        prefetch_depth: units gathered ahead of the one computing (argument > OVERLAP_PREFETCH_DEPTH > planner).
        bucket_mb: consecutive units are merged into buckets up to this size (argument > OVERLAP_BUCKET_MB > planner).
        reshard_after_forward: free each unit after its forward and gather it again for
            backward (3 passes of communication per step); False keeps it until its backward (2).
        param_init_fn: for a module built on the meta device, called on each module that holds
            meta parameters or buffers once they exist in full (default: the module's own
            `reset_parameters()`); see `overlap.runtime.materialize`.
        mesh: a 2-D DeviceMesh ("replicate", "shard"): shard over its second dimension,
            replicate over its first (hybrid sharding, FSDP2's HSDP); a 1-D mesh shards.
        sharding: "full" (over every rank of the group), "hybrid" (inside each node of
            LOCAL_WORLD_SIZE ranks, replicated across nodes) or "hpz" (over every rank, with a
            node-local copy for backward's gathers), or "auto" (the planner chooses among
            them; see `overlap.control.auto_sharding`): argument > OVERLAP_SHARDING > "full".
            See `overlap.runtime.mesh`.
        compression: quantise what crosses the wire: "none", "int8" (weights and gradients),
            "int8-int4" (int8 weights, int4 gradients with error feedback) or "auto" (the
            planner decides from measured steps): argument > OVERLAP_COMPRESS > "none".
            See docs/compression.md.
    """

    def __init__(self, module: nn.Module, *, unit_types: Optional[Sequence[type]] = None,
                 process_group: Optional[dist.ProcessGroup] = None,
                 mixed_precision: Optional[MixedPrecision] = None, prefetch_depth: Optional[int] = None,
                 bucket_mb: Optional[float] = None, reshard_after_forward: bool = True,
                 param_init_fn: Optional[Callable[[nn.Module], None]] = None,
                 mesh: Optional[DeviceMesh] = None, sharding: Optional[str] = None,
                 compression: Optional[str] = None) -> None:
        super().__init__()
        if not dist.is_initialized():
            raise RuntimeError("ShardedModule needs torch.distributed to be initialised "
                               "(dist.init_process_group(), launched with torchrun)")
        all_group = process_group if process_group is not None else dist.group.WORLD
        device = _device_for(all_group)
        mp = mixed_precision or MixedPrecision()

        error: Optional[str] = None
        config = Config()
        local_world_size: Optional[int] = None
        try:
            config = config_from_env().with_overrides(
                prefetch_depth=None if prefetch_depth is None else validate_prefetch_depth(prefetch_depth),
                bucket_mb=None if bucket_mb is None else validate_bucket_mb(bucket_mb),
                sharding=None if sharding is None else validate_sharding(sharding),
                compress=None if compression is None else validate_compress(compression))
            local_world_size = local_world_size_from_env()
            error = sharding_error(process_group, mesh, config.sharding, local_world_size)
            kernels = get_backend(config.kernels, device)
        except (ValueError, BackendUnavailable) as exc:
            error = str(exc)
        if any(isinstance(m, ShardedModule) for m in module.modules()):
            error = ("the module already contains a ShardedModule; wrap the model once, at its root, "
                     "and choose units with unit_types")
        root_spec, unit_specs = discover_units(module, unit_types)
        _agree(all_group, error, _signature(root_spec, unit_specs), config)
        self.sharding, auto = sharding_at_startup(process_group, mesh, config, local_world_size, device, unit_specs, mp)
        # sharding="auto" on several nodes: the options compared and the one taken.
        self.sharding_choice = None if auto is None else auto.choice
        group = self.sharding.shard
        logger.info("%s", self.sharding.describe())

        enable_nvtx(config.nvtx)
        self.link = detect_link(group, config.link, local_world_size) if auto is None else auto.link.link
        startup = plan_at_startup(group, device, self.link, config, unit_specs, mp, auto)
        self.overlap_config = config.with_overrides(
            prefetch_depth=startup.plan.forward_depth if config.prefetch_depth is None else None,
            bucket_mb=startup.plan.bucket_mb if config.bucket_mb is None else None,
            memory_budget_mb=startup.memory_budget_bytes / 2**20 if config.memory_budget_mb is None else None)
        if self.sharding.replicate is not None:
            # Each shard group planned on its own link measurements; replicas must hold the
            # same layout (their gradient shards are summed element by element), so every
            # rank takes rank 0's plan.
            plan = [self.overlap_config]
            dist.broadcast_object_list(plan, src=dist.get_global_rank(all_group, 0), group=all_group)
            self.overlap_config = plan[0]
        logger.info("plan: %s; using depth %d, bucket %.3g MB", startup.plan.reason, self.overlap_config.prefetch_depth,
                    self.overlap_config.bucket_mb)

        for sub in module.modules():
            for name, buf in sub._buffers.items():
                if buf is not None and not buf.is_meta:
                    sub._buffers[name] = buf.to(device)
        on_meta = meta_places(module)
        # State-dict keys in the module's own order, read before parameters leave their modules.
        keys = [(key, id(value)) for key, value in module.state_dict(keep_vars=True).items()]

        codec = None
        if config.compress != "none":
            # "auto" starts uncompressed; overlap.plan.compression switches it on if worth it.
            mode = "none" if config.compress == "auto" else config.compress
            codec = QuantizedCodec(Compression(mode, config.compress_block), kernels)
        self.collectives = Collectives(group, device, kernels, self.sharding.replicate, all_group, codec=codec)
        self.mixed_precision = mp
        self.module = module
        self._slot_of: dict[int, tuple[FlatGroup, int]] = {}
        buckets = merge_into_buckets(unit_specs, int(self.overlap_config.bucket_mb * 2**20))
        root = self._build_unit(root_spec, "root", modules=[]) if root_spec.params else None
        units = [self._build_unit(spec, f"unit{i}", spec.modules) for i, spec in enumerate(buckets)]
        if on_meta or any(b.is_meta for b in module.buffers()):
            check_same_values(materialize(module, on_meta, self._slot_of, device, param_init_fn), all_group)
        budget = None if self.overlap_config.memory_budget_mb is None else int(self.overlap_config.memory_budget_mb * 2**20)
        self.scheduler = Scheduler(root, units, self.collectives, self.overlap_config.prefetch_depth, budget,
                                   reshard_after_forward)
        if config.prefetch_depth is None:
            # Depth follows measured steps; see overlap.control.replanner.Replanner.
            self.scheduler.step_end_callbacks.append(
                replanner_for(self.scheduler, startup, int(self.overlap_config.bucket_mb * 2**20), group, device))
        if config.compress == "auto":
            # Every rank, replicas included, must compress alike: the choice is rank 0's.
            self.scheduler.step_end_callbacks.append(
                chooser_for(codec, self.scheduler, startup, all_group))
        # Per-step timings of compute and communication for `overlap_report()`.
        self.overlap_monitor = OverlapMonitor()
        self.scheduler.step_end_callbacks.append(self.overlap_monitor.on_step_end)
        module.register_forward_pre_hook(self._root_pre_forward, with_kwargs=True)
        module.register_forward_hook(self._root_post_forward)
        # key -> (group, slot index) for parameters, None for buffers and extra state.
        self._state_dict_layout = [(key, self._slot_of.get(ident)) for key, ident in keys]

    def _build_unit(self, spec: UnitSpec, key: str, modules: list[nn.Module]) -> Unit:
        by_kind: dict[tuple[torch.dtype, bool], list] = defaultdict(list)
        for entry in spec.params:
            by_kind[(entry[1].dtype, entry[1].requires_grad)].append(entry)
        groups = []
        for (dtype, requires_grad), entries in by_kind.items():
            group = FlatGroup(entries, self.collectives, self.mixed_precision.gather_dtype(dtype),
                              self.mixed_precision.grad_reduce_dtype(dtype), self.sharding.node)
            for index, (_, param, _) in enumerate(entries):
                self._slot_of[id(param)] = (group, index)
            groups.append(group)
        return Unit(spec.name or "<root>", modules, groups)

    # ---- public API -----------------------------------------------------------------------

    def __getattr__(self, name: str) -> Any:
        try:
            return super().__getattr__(name)
        except AttributeError:
            return getattr(self._modules["module"], name)

    def named_parameters(self, prefix: str = "", recurse: bool = True,
                         remove_duplicate: bool = True) -> Iterator[tuple[str, nn.Parameter]]:
        """The wrapped module's own parameters under its own names, each holding this rank's
        part as a 1-D tensor (see [Note: original parameters are views of the flat shard])."""
        return self.module.named_parameters(prefix=prefix, recurse=recurse, remove_duplicate=remove_duplicate)

    def named_buffers(self, prefix: str = "", recurse: bool = True,
                      remove_duplicate: bool = True) -> Iterator[tuple[str, torch.Tensor]]:
        return self.module.named_buffers(prefix=prefix, recurse=recurse, remove_duplicate=remove_duplicate)

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        # The root hooks on the wrapped module do the work, so that calls that reach it
        # another way (its own `generate`, say) are handled the same.
        return self.module(*args, **kwargs)

    def _root_pre_forward(self, module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        self.scheduler.begin_forward()
        param_dtype = self.mixed_precision.param_dtype
        if param_dtype is None:
            return args, kwargs

        def cast(x: Any) -> Any:
            return x.to(param_dtype) if isinstance(x, torch.Tensor) and x.is_floating_point() else x

        return tree_map(cast, args), tree_map(cast, kwargs)

    def _root_post_forward(self, module: nn.Module, args: tuple, output: Any) -> None:
        self.scheduler.end_forward(output)

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Accumulate gradients locally (unsharded, in the reduce dtype) without communicating;
        the next backward outside the context reduces everything accumulated."""
        previous = self.scheduler.sync_grads
        self.scheduler.sync_grads = False
        try:
            yield
        finally:
            self.scheduler.sync_grads = previous

    @torch.no_grad()
    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
        """Clip the gradients of all parameters together; returns the total norm, the same on
        every rank (`torch.nn.utils.clip_grad_norm_` would see only this rank's parts)."""
        norm_type = float(norm_type)
        grads = [p.grad for p in self.parameters() if p.grad is not None]
        device = self.collectives.device
        group = self.collectives.group
        norms = torch._foreach_norm(grads, norm_type) if grads else []
        if norm_type == math.inf:
            total = torch.stack(norms).max().float() if grads else torch.zeros((), device=device)
            dist.all_reduce(total, op=dist.ReduceOp.MAX, group=group)
        else:
            local = torch.stack(norms).float().pow(norm_type).sum() if grads else torch.zeros((), device=device)
            dist.all_reduce(local, group=group)
            total = local.pow(1.0 / norm_type)
        coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
        if grads:
            torch._foreach_mul_(grads, coef.to(grads[0].dtype))
        return total

    def full_state_dict(self, rank0_only: bool = False) -> dict[str, torch.Tensor]:
        """The wrapped module's state dict with full (unsharded) CPU tensors, on every rank,
        or with `rank0_only` on rank 0 alone (the others return {}). Gathers one flat group
        at a time, so a rank holds at most one unit's parameters beyond its shards (plus the
        result on the ranks that keep it)."""
        keep = not rank0_only or self.collectives.rank == 0
        parts: dict[tuple[FlatGroup, int], torch.Tensor] = {}
        for unit in self.scheduler.all_units:
            for group in unit.groups:
                flat = group.full_values()
                if keep:
                    flat = flat.cpu()
                    for index, slot in enumerate(group.slots):
                        parts[(group, index)] = flat[slot.offset:slot.offset + slot.numel].view(slot.shape).clone()
                del flat
        if not keep:
            return {}
        others = self.module.state_dict()
        out: dict[str, torch.Tensor] = {}
        for key, where in self._state_dict_layout:
            if where is not None:
                out[key] = parts[where]
            else:
                value = others[key]
                out[key] = value.detach().cpu().clone() if isinstance(value, torch.Tensor) else value
        return out

    def overlap_report(self) -> OverlapReport:
        """How much communication ran under compute, per step and per unit, measured so far."""
        return self.overlap_monitor.report()

    def memory_report(self, optimizer: Optional[torch.optim.Optimizer] = None,
                      step_fn: Optional[Callable[[], object]] = None, *,
                      activations: Optional["ActivationShape"] = None,
                      checkpointing: bool = False) -> "MemoryReport":
        """Memory per category measured over one training step (`step_fn`: one forward,
        backward and optimizer step) next to the estimate for this model."""
        # Imported here: torch's memory tracker loads Triton, ~145 MB of resident memory
        # that training does not otherwise need.
        from overlap.observe.memory import memory_report

        return memory_report(self, optimizer, step_fn, activations=activations, checkpointing=checkpointing)

    def state_dict(self) -> dict[str, Any]:  # type: ignore[override]
        """The wrapped module's state dict, sharded: each parameter a `ShardedTensor` of its
        full shape whose local shards are views of this rank's part (FSDP2 gives DTensors
        here), buffers as they are. `torch.distributed.checkpoint` saves it without gathering
        and loads into it in place, at any world size; `overlap.checkpoint` does both, with
        the optimizer."""
        others = self.module.state_dict()
        out: dict[str, Any] = {}
        for key, where in self._state_dict_layout:
            if where is None:
                out[key] = others[key]
            else:
                group, index = where
                out[key] = group.sharded_tensor(group.params[index], index)
        return out

    def load_state_dict(self, state_dict: Mapping[str, Any], strict: bool = True,
                        assign: bool = False) -> Any:
        """Load a state dict from `state_dict()` (sharded, this world size and layout) or
        from `full_state_dict()` (full tensors, any layout)."""
        if assign:
            raise ValueError("ShardedModule.load_state_dict: assign=True would replace the views of the flat shards")
        sharded = {key: value for key, value in state_dict.items() if isinstance(value, ShardedTensor)}
        if not sharded:
            return self.load_full_state_dict(state_dict)
        mine = self.state_dict()
        missing = [key for key in mine if key not in state_dict]
        unexpected = [key for key in state_dict if key not in mine]
        if strict and (missing or unexpected):
            raise KeyError(f"load_state_dict: missing keys {missing}, unexpected keys {unexpected}")
        with torch.no_grad():
            for key, value in state_dict.items():
                target = mine.get(key)
                if isinstance(target, ShardedTensor):
                    if not isinstance(value, ShardedTensor) or value.metadata() != target.metadata():
                        raise ValueError(f"load_state_dict: {key} is not sharded like this model's parameter; "
                                         "load full tensors, or load a checkpoint with overlap.checkpoint.load")
                    for ours, theirs in zip(target.local_shards(), value.local_shards()):
                        ours.tensor.copy_(theirs.tensor)
        others = {key: value for key, value in state_dict.items() if not isinstance(mine.get(key), ShardedTensor)}
        if others:
            self.module.load_state_dict(others, strict=False)

    def load_full_state_dict(self, state_dict: Mapping[str, torch.Tensor]) -> None:
        """Load full tensors (as `full_state_dict` returns them); every rank passes the same."""
        expected = [key for key, _ in self._state_dict_layout]
        missing = [key for key in expected if key not in state_dict]
        unexpected = sorted(set(state_dict) - set(expected))
        if missing or unexpected:
            raise KeyError(f"load_full_state_dict: missing keys {missing}, unexpected keys {unexpected}")
        per_group: dict[FlatGroup, list[Optional[torch.Tensor]]] = {}
        others = {}
        for key, where in self._state_dict_layout:
            value = state_dict[key]
            if where is None:
                others[key] = value
                continue
            group, index = where
            slot = group.slots[index]
            if tuple(value.shape) != tuple(slot.shape):
                raise ValueError(f"load_full_state_dict: {key} has shape {tuple(value.shape)}, "
                                 f"expected {tuple(slot.shape)}")
            per_group.setdefault(group, [None] * len(group.slots))[index] = value
        for group, tensors in per_group.items():
            group.load_full(tensors)
        if others:
            self.module.load_state_dict(others, strict=False)
