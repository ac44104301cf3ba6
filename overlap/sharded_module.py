"""`ShardedModule`: the public face of the runtime."""
from __future__ import annotations

import contextlib
import functools
from typing import TYPE_CHECKING, Any, Callable, Iterator, Mapping, Optional, Sequence

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor
from torch.nn.modules.module import _IncompatibleKeys
from torch.utils._pytree import tree_map

from overlap.base.config import Config
from overlap.base.mixed_precision import MixedPrecision
from overlap.control.settings import StartupRequest
from overlap.control.startup import start_up
from overlap.observe.report import OverlapReport
from overlap.pipeline_stage import Unsharded, is_stage_mesh, make_stage
from overlap.plan.microbatch_keep import units_to_keep
from overlap.runtime.bound_params import apply_keeping_shards
from overlap.runtime.compiled import eager_hook
from overlap.runtime.disk_tier import master_part, refresh_resident, wait_for_saves
from overlap.runtime.expert_parallel import all_experts
from overlap.runtime.flat_group import FlatGroup
from overlap.runtime.row_dtensors import local_part, local_rows, shard_mesh
from overlap.runtime.scheduler import Scheduler
from overlap.runtime.unpicklable_state import FULL_MODEL, SHARDED, PartialStateError

if TYPE_CHECKING:
    from overlap.observe.memory import MemoryReport
    from overlap.runtime.unit import Unit
    from overlap.plan.memory import ActivationShape
    from overlap.plan.sharding import ShardingChoice
    from overlap.runtime.mesh import ShardingGroups


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
        compile: compile each unit's compute with `torch.compile`, gathers, frees and
            reductions outside the compiled regions: argument > OVERLAP_COMPILE > False.
            Blocks compiled before wrapping (`block.compile()`) are compiled the same way.
            See docs/compile.md.
        offload: where this rank's master shards, gradient shards and optimizer state live:
            "none" (on the device it computes on), "cpu" (host memory; the optimizer steps
            host tensors) or "disk": argument > OVERLAP_OFFLOAD > "none". See docs/offload.md.
        expert_parallel: E, ranks per expert-parallel group: each MoE layer's experts are split
            across E ranks, tokens reach them by all-to-all, and they shard over the world/E
            ranks holding the same experts. Expert modules of Hugging Face's MoE models and
            `overlap.models.moe` are found by class; `expert_types` names others. See
            docs/moe.md.
        expert_capacity_factor: with `expert_parallel`, cap each expert module's (token,
            choice) pairs per forward at ceil(c · tokens · top_k / experts), first choices
            first, the rest dropped before the dispatch (None: dropless). See docs/moe.md.
    """

    def __init__(self, module: nn.Module, *, unit_types: Optional[Sequence[type]] = None,
                 process_group: Optional[dist.ProcessGroup] = None,
                 mixed_precision: Optional[MixedPrecision] = None, prefetch_depth: Optional[int] = None,
                 bucket_mb: Optional[float] = None, reshard_after_forward: bool = True,
                 param_init_fn: Optional[Callable[[nn.Module], None]] = None,
                 mesh: Optional[DeviceMesh] = None, sharding: Optional[str] = None,
                 compression: Optional[str] = None, compile: Optional[bool] = None,
                 offload: Optional[str] = None, expert_parallel: Optional[int] = None,
                 expert_types: Sequence[type] = (), expert_capacity_factor: Optional[float] = None) -> None:
        super().__init__()
        self._start(module, StartupRequest(
            unit_types=unit_types, process_group=process_group, mixed_precision=mixed_precision,
            prefetch_depth=prefetch_depth, bucket_mb=bucket_mb, reshard_after_forward=reshard_after_forward,
            param_init_fn=param_init_fn, mesh=mesh, sharding=sharding, compression=compression, compile=compile,
            offload=offload, nested=any(isinstance(m, ShardedModule) for m in module.modules()),
            expert_parallel=expert_parallel, expert_types=tuple(expert_types),
            expert_capacity_factor=expert_capacity_factor, stage=is_stage_mesh(mesh)))
        if is_stage_mesh(mesh):
            make_stage(self)

    @classmethod
    def _for_request(cls, module: nn.Module, request: StartupRequest) -> "ShardedModule":
        """The runtime over `module` as `request` asks (`fully_shard` builds its own this way)."""
        self = cls.__new__(cls)
        nn.Module.__init__(self)
        self._start(module, request)
        return self

    def _start(self, module: nn.Module, request: StartupRequest) -> None:
        started = start_up(module, request)
        self.module = module
        # Sharding groups, link, plan and settings, the same on every rank; see overlap.control.startup.
        self.startup = started.decision
        self.collectives, self.scheduler = started.collectives, started.scheduler
        # What optimizers that step the model's parameters are told: resharded state, refused
        # steps and state dicts, the disk tier's step during backward; see
        # overlap.runtime.optimizer_link.
        self.optimizer_link = started.optimizer_link
        # Called in order after every step: the re-planner, the compression chooser, then
        # `overlap_monitor`, which measures for `overlap_report()`.
        self.step_end, self.overlap_monitor = started.step_end, started.monitor
        # key -> (group, slot index) for parameters, None for buffers and extra state.
        self._state_dict_layout = started.state_dict_layout
        # Expert parallelism: expert slots hold this rank's experts only (see full_state_dict).
        self._expert_groups = started.expert_groups
        module.register_forward_pre_hook(eager_hook(self._root_pre_forward), with_kwargs=True, prepend=True)
        module.register_forward_hook(eager_hook(self._root_post_forward))
        # `model.module.state_dict()` refuses at the call, never giving the parameters' local
        # parts as if they were whole ([Note: a one-rank save of a sharded state]).
        self._raw_module_state = False
        if not request.dtensor_params:          # with DTensor parameters, the module's own is the sharded form
            module._register_state_dict_hook(self._module_state_dict_hook)
        # Made now, on every rank: the mesh the state dicts' DTensors live on.
        shard_mesh(self.collectives.group, self.collectives.device.type)

    @property
    def sharding(self) -> "ShardingGroups":
        return self.startup.sharding

    @property
    def sharding_choice(self) -> Optional["ShardingChoice"]:
        """sharding="auto" on several nodes: the options compared and the one taken."""
        return self.startup.sharding_choice

    @property
    def link(self) -> str:
        return self.startup.link

    @property
    def overlap_config(self) -> Config:
        """The settings in use: argument > OVERLAP_* > the planner's choice."""
        return self.startup.config

    @property
    def mixed_precision(self) -> MixedPrecision:
        return self.startup.mixed_precision

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

    def _fqn_modifiers(self) -> dict[str, str]:
        """For torch.distributed.checkpoint.state_dict (`get_model_state_dict`,
        `get_optimizer_state_dict` and their setters): the names under this wrapper carry no
        "module." prefix, as `named_parameters()` and `state_dict()` give them."""
        return {"module": "module"}

    def named_buffers(self, prefix: str = "", recurse: bool = True,
                      remove_duplicate: bool = True) -> Iterator[tuple[str, torch.Tensor]]:
        return self.module.named_buffers(prefix=prefix, recurse=recurse, remove_duplicate=remove_duplicate)

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        # The root hooks on the wrapped module do the work, so that calls that reach it
        # another way (its own `generate`, say) are handled the same.
        return self.module(*args, **kwargs)

    def _root_pre_forward(self, module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        if not self.scheduler.root_methods_running:         # else part of the method's pass
            self.scheduler.begin_forward()
        param_dtype = self.scheduler.cast_dtype          # None: no cast (or cast_forward_inputs=False)
        if param_dtype is None:
            return args, kwargs

        def cast(x: Any) -> Any:
            return x.to(param_dtype) if isinstance(x, torch.Tensor) and x.is_floating_point() else x

        return tree_map(cast, args), tree_map(cast, kwargs)

    def _root_post_forward(self, module: nn.Module, args: tuple, output: Any) -> None:
        if not self.scheduler.root_methods_running:
            self.scheduler.end_forward(output)

    def register_forward_method(self, module: nn.Module, method_name: str) -> None:
        """Make `module.<method_name>()` (a method other than `forward`: `generate`, a decoding
        step) gather the parameters it computes with as `module`'s forward does, and free them
        after (FSDP2's `register_fsdp_forward_method`; `overlap.register_fsdp_forward_method`
        takes FSDP2's arguments). `module` is this ShardedModule or any module inside it: a
        method of the wrapped module (or of a module that belongs to no unit) runs as one
        forward of the whole model, its own forward calls inside included; a method of a
        unit's module (or of a module inside one) runs between that unit's forward hooks.

        Outside forward, the modules' parameters are not gathered, so an unregistered method
        that computes with them directly does not compute with the whole parameters; register
        it."""
        target = self.module if module is self else module
        method = _method(target, method_name)
        if not any(sub is target for sub in self.module.modules()):
            raise ValueError(f"register_forward_method: {type(target).__name__} is not a module of this ShardedModule")
        member = self._unit_member_holding(target)
        if member is None:
            target.__dict__[method_name] = functools.wraps(method)(self._as_root_forward(method))
        else:
            _run_in_unit(target, method_name, self.scheduler, member)

    def _unit_member_holding(self, module: nn.Module) -> Optional[nn.Module]:
        """The innermost unit's member module that is `module` or holds it; None if none does."""
        holders = [member for unit in self.scheduler.units for member in unit.modules
                   if any(sub is module for sub in member.modules())]
        # The innermost holder has the fewest modules under it.
        return min(holders, key=lambda member: sum(1 for _ in member.modules()), default=None)

    def _as_root_forward(self, method: Callable[..., Any]) -> Callable[..., Any]:
        def run(*args: Any, **kwargs: Any) -> Any:
            if self.scheduler.root_methods_running or self.scheduler.in_forward:     # inside a pass
                return method(*args, **kwargs)
            args, kwargs = self._root_pre_forward(self.module, args, kwargs)
            self.scheduler.root_methods_running += 1
            try:
                output = method(*args, **kwargs)
            finally:
                self.scheduler.root_methods_running -= 1
            self._root_post_forward(self.module, args, output)
            return output

        return run

    def _apply(self, fn: Callable[[torch.Tensor], torch.Tensor], recurse: bool = True) -> "ShardedModule":
        """`.to(...)`, `.cuda()`, `to_empty`: buffers move as asked; parameters stay bound to
        their shards, a change of their dtype or device is refused by name
        (overlap.runtime.bound_params)."""
        groups = [group for unit in self.scheduler.all_units for group in unit.groups]
        apply_keeping_shards(self.module, fn, groups,
                             f"ShardedModule (rank {self.collectives.rank} of {self.collectives.world_size})")
        return self

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

    @property
    def require_backward_grad_sync(self) -> bool:
        """DDP's switch: False accumulates gradients locally, as inside `no_sync()`."""
        return self.scheduler.sync_grads

    @require_backward_grad_sync.setter
    def require_backward_grad_sync(self, value: bool) -> None:
        if not isinstance(value, bool):
            raise TypeError(f"require_backward_grad_sync must be a bool, got {value!r}")
        self.scheduler.sync_grads = value

    def set_requires_gradient_sync(self, requires_gradient_sync: bool, *, recurse: bool = True) -> None:
        """FSDP2's switch: False accumulates gradients locally, as inside `no_sync()` (the
        whole model at once: `recurse` is accepted for FSDP2's signature)."""
        self.require_backward_grad_sync = requires_gradient_sync

    def set_reshard_after_backward(self, reshard_after_backward: bool, *, recurse: bool = True) -> None:
        """FSDP2's switch: False keeps units gathered after backward, and across the passes
        of the step until its gradients are reduced (a pipeline schedule's microbatches,
        gradient accumulation under `set_requires_gradient_sync(False)`). Which units: as many
        as fit the memory budget, first in forward order, or OVERLAP_KEEP_UNITS of them; the
        overlap report says which. True takes effect when the step's gradients are reduced
        (see [Note: gathers kept across microbatches] in overlap/runtime/scheduler.py)."""
        if not isinstance(reshard_after_backward, bool):
            raise TypeError(f"set_reshard_after_backward: expected a bool, got {reshard_after_backward!r}")
        if reshard_after_backward:
            return
        self.scheduler.keep_gathered(self._choose_kept)

    def set_is_last_backward(self, is_last_backward: bool) -> None:
        """FSDP2's switch: every backward that syncs waits for its reductions at its end, so
        there is nothing to change."""

    def unshard(self, async_op: bool = False) -> Optional[Unsharded]:
        """FSDP2's call: gather the root unit, if any parameters lie outside the units, now
        (collective). A hint: prefetch gathers the units ahead of their forward anyway; the
        next forward starts from sharded again."""
        if self.scheduler.root is not None:
            self.scheduler.unshard(self.scheduler.root)
        return Unsharded() if async_op else None

    def reshard(self) -> None:
        """FSDP2's call: free every gathered unit now (a pipeline schedule's RESHARD)."""
        for unit in self.scheduler.all_units:
            self.scheduler.reshard_now(unit)

    def _choose_kept(self, order: list["Unit"]) -> tuple[int, str]:
        """How many of the units (in forward order) to keep gathered across microbatches, and why."""
        scheduler = self.scheduler
        wanted, budget = scheduler.keep_units, scheduler.memory_budget_bytes
        count = units_to_keep([unit.gathered_nbytes for unit in order], budget, scheduler.prefetch_depth, wanted)
        by = ("OVERLAP_KEEP_UNITS" if wanted is not None else "the planner: all fit the memory budget"
              if count == len(order) else f"the planner: the first {count} fit the memory budget of "
              f"{budget / 2**20:.0f} MB")
        rest = "" if count == len(order) else "; the others are gathered again for each microbatch"
        return count, f"kept gathered across a step's microbatches: {count} of {len(order)} units (by {by}){rest}"

    def parameter_count(self, trainable_only: bool = False) -> int:
        """The model's parameters counted whole (a tied one once), the same on every rank;
        `sum(p.numel() for p in model.parameters())` counts this rank's parts."""
        return sum(group.global_shape(index).numel() for unit in self.scheduler.all_units for group in unit.groups
                   if group.requires_grad or not trainable_only for index in range(len(group.slots)))

    @torch.no_grad()
    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
        """Clip the gradients of all parameters together; returns the total norm, the same on
        every rank. The one way a norm of sharded gradients is taken: torch's
        `clip_grad_norm_` over the parameters, whose `.grad` combine their norms over the
        ranks ([Note: norms of sharded gradients]) in one all-reduce per device and dtype."""
        return torch.nn.utils.clip_grad_norm_(list(self.parameters()), max_norm, norm_type)

    def full_state_dict(self, rank0_only: bool = False) -> dict[str, torch.Tensor]:
        """The wrapped module's state dict with full (unsharded) CPU tensors, on every rank,
        or with `rank0_only` on rank 0 alone (the others return {}). Gathers one flat group
        at a time, so a rank holds at most one unit's parameters beyond its shards (plus the
        result on the ranks that keep it)."""
        keep = not rank0_only or self.collectives.rank == 0
        parts: dict[tuple[FlatGroup, int], torch.Tensor] = {}
        for unit in self.scheduler.all_units:
            for group in unit.groups:
                if any(tp is not None for tp in group.tensor_parallel):
                    # Split over tp too: gathered whole over tp and dp by their DTensors, one at a time.
                    for index, param in enumerate(group.params):
                        whole = group.dtensor(master_part(param), index).full_tensor()
                        if keep:
                            parts[(group, index)] = whole.cpu().clone()
                    continue
                flat = group.full_values()
                experts = group.experts is not None
                if keep or experts:
                    for index, slot in enumerate(group.slots):
                        value = group.whole_of_flat(flat, index)
                        if experts:         # every expert-parallel rank's experts, in order
                            value = all_experts(value, group.experts)
                        if keep:
                            parts[(group, index)] = value.cpu().clone()
                del flat
        if not keep:
            return {}
        others = self._module_state_dict()
        out: dict[str, torch.Tensor] = {}
        for key, where in self._state_dict_layout:
            if where is not None:
                out[key] = parts[where]
            else:
                value = others[key]
                out[key] = value.detach().cpu().clone() if isinstance(value, torch.Tensor) else value
        return out

    def reset_compression_errors(self) -> None:
        """Forget the quantisation errors that int4 gradient compression carries from step to
        step (error feedback): call it after skipping a step for non-finite gradients, whose
        error would otherwise hold NaN. Does nothing without compression."""
        self.collectives.reset_compression_errors()

    def overlap_report(self) -> OverlapReport:
        """How much communication ran under compute, per step and per unit, measured so far,
        with the runtime's choices that a user can override."""
        decisions = (self.scheduler.keep_decision, self.scheduler.schedule_decision,
                     self.scheduler.backward_gather_decision())
        return self.overlap_monitor.report([decision for decision in decisions if decision is not None])

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

    def __getstate__(self) -> Any:
        """Refused: `copy.deepcopy(model)` and `torch.save(model)` would copy this rank's parts
        of the parameters and hooks holding the process groups."""
        raise TypeError(refused_copy("ShardedModule", "model.full_state_dict()"))

    def _module_state_dict(self) -> dict[str, Any]:
        """The wrapped module's own state dict, parameters as their local parts."""
        self._raw_module_state = True
        try:
            return self.module.state_dict()
        finally:
            self._raw_module_state = False

    def _module_state_dict_hook(self, module: nn.Module, state_dict: dict[str, Any], prefix: str,
                                local_metadata: Any) -> Optional[dict[str, Any]]:
        """`model.module.state_dict()` refuses at the call ([Note: a one-rank save of a sharded
        state]); inside a larger module's state dict, each parameter is in the sharded form of
        `state_dict()`."""
        if self._raw_module_state or self.collectives.world_size == 1:
            return None
        if not prefix:
            raise PartialStateError(
                f"model.module.state_dict() under ShardedModule (rank {self.collectives.rank}) would hold this rank's "
                f"part of each parameter only, and a file saved from it a partial checkpoint. Call {FULL_MODEL} on "
                f"every rank and save its result on rank 0, call model.state_dict() for the sharded form "
                f"(DTensors, for torch.distributed.checkpoint), or save with {SHARDED}")
        for key, value in self.state_dict().items():
            if isinstance(value, DTensor) and prefix + key in state_dict:
                state_dict[prefix + key] = value
        return None

    def save_pretrained(self, save_directory: str, **kwargs: Any) -> None:
        """A Hugging Face model's `save_pretrained`, of the whole model: called on every rank,
        the full state is gathered and rank 0 writes it (`model.module.save_pretrained` sees
        the sharded form, which safetensors cannot write)."""
        save = getattr(self.module, "save_pretrained", None)
        if save is None:
            raise AttributeError(f"{type(self.module).__name__} has no save_pretrained")
        state = self.full_state_dict(rank0_only=True)
        if dist.get_rank(self.collectives.all_group) == 0:        # a shard group's rank 0 holds the state
            save(save_directory, state_dict=state, **kwargs)
        dist.barrier(group=self.collectives.all_group)

    def full_optim_state_dict(self, optimizer: torch.optim.Optimizer, rank0_only: bool = False) -> dict[str, Any]:
        """`optimizer.state_dict()` as one process would have it: state of each parameter's
        shape gathered whole (CPU tensors), on every rank, or with `rank0_only` on rank 0
        alone (the others return {}). Called on every rank; loads into an optimizer of the
        plain model, or into this one at any world size (resharded: see [Note: optimizers
        built before wrapping])."""
        return self.optimizer_link.full_state(optimizer, keep=not rank0_only or self.collectives.rank == 0)

    def state_dict(self) -> dict[str, Any]:  # type: ignore[override]
        """The wrapped module's state dict, sharded: each parameter a DTensor of its full shape
        whose local tensor is a view of this rank's rows (as FSDP2 gives them; see
        `overlap.runtime.row_dtensors`), buffers as they are; under expert parallelism an expert
        parameter's DTensor is of every expert ([Note: expert parameters in state dicts]).
        `torch.distributed.checkpoint` saves it without gathering and loads into it in place, at
        any world size (and expert-parallel size) and from FSDP2's checkpoints;
        `overlap.checkpoint` does both, with the optimizer."""
        others = self._module_state_dict()
        out: dict[str, Any] = {}
        for key, where in self._state_dict_layout:
            if where is None:
                out[key] = others[key]
            else:
                group, index = where
                out[key] = group.dtensor(master_part(group.params[index]), index)
        return out

    def load_state_dict(self, state_dict: Mapping[str, Any], strict: bool = True,
                        assign: bool = False) -> Any:
        """Load a state dict: each parameter a DTensor of its full shape (as `state_dict()`
        gives it, FSDP2's, or any other sharding: resharded, a collective) or a full tensor
        (as `full_state_dict()` gives it); every rank calls it."""
        if assign:
            raise ValueError("ShardedModule.load_state_dict: assign=True would replace the views of the flat shards")
        if strict and not any(isinstance(value, DTensor) for value in state_dict.values()):
            self.load_full_state_dict(state_dict)
            return _IncompatibleKeys([], [])
        mine = self.state_dict()
        missing = [key for key in mine if key not in state_dict]
        unexpected = [key for key in state_dict if key not in mine]
        if strict and (missing or unexpected):
            raise RuntimeError(strict_load_error("load_state_dict", missing, unexpected))
        slots = dict(self._state_dict_layout)
        parts = {}
        for key, value in state_dict.items():
            target = mine.get(key)
            if not isinstance(target, DTensor):
                continue
            if not isinstance(value, torch.Tensor) or value.shape != target.shape:
                raise ValueError(f"load_state_dict: {key} is not a tensor of this model's parameter's shape "
                                 f"{tuple(target.shape)}; load a DTensor or the full value, or a checkpoint with "
                                 "overlap.checkpoint.load")
            if isinstance(value, DTensor):
                parts[key] = local_rows(value, target)
            else:
                group, index = slots[key]
                parts[key] = group.oriented(index, group.local_of_global(index, value))
        self._write_parts(mine, parts)
        others = {key: value for key, value in state_dict.items() if not isinstance(mine.get(key), DTensor)}
        if others:
            _load_unsharded(self.module, others)
        return _IncompatibleKeys(missing, unexpected)

    def _write_parts(self, mine: dict[str, Any], parts: dict[str, torch.Tensor]) -> None:
        """Write this rank's part of each parameter in `parts` into its shard (`mine`: `state_dict()`)."""
        groups = [group for unit in self.scheduler.all_units for group in unit.groups]
        disk = self.overlap_config.offload == "disk"
        if disk:
            wait_for_saves(groups)
        with torch.no_grad():
            for key, part in parts.items():
                local_part(mine[key])[0].copy_(part.reshape(local_part(mine[key])[0].shape))
        if disk:
            refresh_resident(groups)

    def load_full_state_dict(self, state_dict: Mapping[str, torch.Tensor]) -> None:
        """Load full tensors (as `full_state_dict` returns them); every rank passes the same.
        Under expert parallelism each rank keeps its experts' rows of the experts' parameters,
        so a state saved at one expert-parallel size (or by one process) loads at another."""
        expected = [key for key, _ in self._state_dict_layout]
        missing = [key for key in expected if key not in state_dict]
        unexpected = sorted(set(state_dict) - set(expected))
        if missing or unexpected:
            raise RuntimeError(strict_load_error("load_full_state_dict", missing, unexpected))
        per_group: dict[FlatGroup, list[Optional[torch.Tensor]]] = {}
        others = {}
        for key, where in self._state_dict_layout:
            value = state_dict[key]
            if where is None:
                others[key] = value
                continue
            group, index = where
            if tuple(value.shape) != tuple(group.global_shape(index)):
                raise ValueError(f"load_full_state_dict: {key} has shape {tuple(value.shape)}, "
                                 f"expected {tuple(group.global_shape(index))}")
            per_group.setdefault(group, [None] * len(group.slots))[index] = group.slot_whole(index, value)
        if self.overlap_config.offload == "disk":
            # The fp32 masters live in the state file: written as the sharded form is.
            self._write_parts(self.state_dict(), {key: where[0].local_of_global(where[1], state_dict[key])
                                                  for key, where in self._state_dict_layout if where is not None})
        else:
            for group, tensors in per_group.items():
                group.load_full(tensors)
        if others:
            _load_unsharded(self.module, others)


def _load_unsharded(module: nn.Module, state: Mapping[str, Any]) -> None:
    """Buffers, extra state and parameters left out of sharding, loaded as torch loads them:
    `nn.Module`'s own load, not the override of a `fully_shard` root (which calls back here)."""
    nn.Module.load_state_dict(module, state, strict=False)


def refused_copy(wrapper: str, full_state: str) -> str:
    """Why a sharded model is not deep-copied or pickled, and what to do instead."""
    return (f"{wrapper}: copy.deepcopy and pickling (torch.save(model)) of a sharded model are not supported: "
            "its parameters are this rank's parts and its hooks hold the process groups. Copy the model before "
            f"sharding it, or build the copy (an EMA, say) from {full_state}; save with state dicts")


def strict_load_error(call: str, missing: Sequence[str], unexpected: Sequence[str],
                      owner: str = "ShardedModule") -> str:
    """The error of a strict load, worded as `nn.Module.load_state_dict` words it; `owner`
    names the module loaded into."""
    parts = [f"Missing key(s) in state_dict: {', '.join(repr(k) for k in missing)}." if missing else "",
             f"Unexpected key(s) in state_dict: {', '.join(repr(k) for k in unexpected)}." if unexpected else ""]
    return f"Error(s) in {call} of {owner}: " + " ".join(part for part in parts if part)


def register_forward_method(module: nn.Module, method_name: str) -> None:
    """FSDP2's `register_fsdp_forward_method(module, method_name)`: `module` is a ShardedModule,
    the module it wraps or a module of one of its units (see
    `ShardedModule.register_forward_method`). As FSDP2's does for a module it did not shard,
    it does nothing for any other module, so that the same script runs without wrapping."""
    owner = module if isinstance(module, ShardedModule) else _owner_of(module)
    if isinstance(owner, ShardedModule):
        owner.register_forward_method(module, method_name)
    elif owner is not None:
        _run_in_unit(module, method_name, owner, module)


def _owner_of(module: nn.Module) -> Any:
    """The ShardedModule that wraps `module`, or the scheduler of the unit `module` is a
    member of, found by the forward pre-hooks they registered on it; None for neither."""
    for hook in module._forward_pre_hooks.values():
        target = getattr(hook, "runtime_hook", None)
        if isinstance(target, functools.partial):        # a unit's hook: the scheduler's method
            target = target.func
        owner = getattr(target, "__self__", None)
        if isinstance(owner, ShardedModule) or (isinstance(owner, Scheduler) and owner.unit_of(module) is not None):
            return owner
    return None


def _method(module: nn.Module, method_name: str) -> Callable[..., Any]:
    if method_name == "forward":
        raise ValueError(f"register_forward_method: {type(module).__name__}.forward gathers its parameters already "
                         "(its hooks run at every call); register the other methods that compute with them")
    method = getattr(module, method_name, None)
    if not callable(method):
        raise AttributeError(f"register_forward_method: {type(module).__name__} has no method {method_name!r}")
    return method


def _run_in_unit(module: nn.Module, method_name: str, scheduler: Scheduler, member: nn.Module) -> None:
    """`module.<method_name>` made to run between the forward hooks of `member`'s unit
    (`member` is `module` or holds it)."""
    method = _method(module, method_name)
    unit = scheduler.unit_of(member)

    def run(*args: Any, **kwargs: Any) -> Any:
        return scheduler.call_as_forward(unit, member, method, args, kwargs)

    module.__dict__[method_name] = functools.wraps(method)(run)
