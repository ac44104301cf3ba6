"""`ShardedModule`'s start-up, in order:

1. resolve: each rank reads its settings (argument > OVERLAP_* > planner), device and kernels;
2. agree: every rank checks it wraps rank 0's model with rank 0's settings, and any rank's
   error is raised on every rank, before anything else communicates; a model split by torch's
   tensor parallelism then has its DTensor parameters replaced by their TP-local tensors
   (`overlap.runtime.tensor_parallel`);
3. decide: choose the sharding (the planner's, for sharding="auto" on several nodes), detect
   and probe the link, plan the prefetch depth, bucket size and memory budget, frozen in one
   `StartupDecision`;
4. build: the units over flat shards, the collectives and the scheduler;
5. attach: the step-end controllers (depth re-planner, automatic compression) and the overlap
   report, behind one step-end callback (`overlap.control.step_end`);
6. compile: with compile=True (or blocks compiled before wrapping), each unit's compute
   (`overlap.runtime.compiled`).
"""
from __future__ import annotations

import dataclasses

import logging
from dataclasses import dataclass
from typing import Optional

import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor
from torch import nn

from overlap.base.choices import SHARDINGS
from overlap.base.mixed_precision import MixedPrecision
from overlap.base.profiling import enable_nvtx
from overlap.base.units import UnitSpec, discover_units
from overlap.runtime.expert_parallel import (DEFAULT_CHUNKS, EXPERT_CLASS_NAMES, ExpertGroups, cap_routing,
                                              expert_collectives, expert_modules, make_groups, split_experts,
                                              units_with_experts)
from overlap.control.agreement import check_ranks_agree, decided_by_rank0, model_signature
from overlap.control.auto_sharding import AutoSharding, choose_at_startup, wants_auto_sharding
from overlap.control.compression_auto import chooser_for
from overlap.control.decision import StartupDecision
from overlap.control.replanner import base_profile, replanner_for
from overlap.control.settings import RankSettings, StartupRequest, resolve_settings
from overlap.control.startup_plan import disk_window_bytes, plan_at_startup
from overlap.control.step_end import PrefetchDepths, StepEndController, StepEndControllers
from overlap.control.topology import detect_link
from overlap.control.unit_builder import BuiltUnits, ExpertUnits, StateDictLayout, build_units
from overlap.observe.report import OverlapMonitor
from overlap.runtime.collectives import Collectives
from overlap.runtime.compiled import CompileTimeLog, compile_modules, compiled_by_user
from overlap.runtime.compression import Compression, QuantizedCodec
from overlap.runtime.disk_tier import DiskTier
from overlap.runtime.host_tier import HostTier
from overlap.runtime.mesh import ShardingGroups, resolve_sharding
from overlap.runtime.optimizer_link import OptimizerLink
from overlap.runtime.process_group import check_backend_env
from overlap.runtime.scheduler import Scheduler
from overlap.runtime.tensor_parallel import take_tensor_parallel, tensor_parallel_error

logger = logging.getLogger("overlap")


@dataclass(frozen=True)
class Started:
    """What start-up made: its decision and the runtime built on it."""

    decision: StartupDecision
    collectives: Collectives
    scheduler: Scheduler
    step_end: StepEndControllers            # the controllers and observers, in the order called
    monitor: OverlapMonitor                 # the overlap report's measurements
    state_dict_layout: StateDictLayout
    optimizer_link: OptimizerLink           # what optimizers are told about the model
    expert_groups: Optional[ExpertGroups] = None         # expert parallelism's groups, if any


def start_up(module: nn.Module, request: StartupRequest) -> Started:
    """Shard `module` as `request` asks (collective: every rank of the group calls it)."""
    if not dist.is_initialized():
        raise RuntimeError("ShardedModule needs torch.distributed to be initialised "
                           "(dist.init_process_group(), launched with torchrun)")
    if isinstance(request.mesh, DeviceMesh):
        request = request.for_module(module)
    settings = resolve_settings(request)
    ignored = frozenset(id(param) for param in request.ignored_params)
    root_spec, unit_specs = discover_units(module, request.unit_types, request.unit_modules, ignored)
    error = settings.error or tensor_parallel_error(module, request.mesh, request.process_group, settings.config)
    check_ranks_agree(request.all_group, error, model_signature(root_spec, unit_specs), settings.config)
    # Expert parallelism: this rank's experts kept, each expert module a unit sharded over the
    # ranks holding the same experts; see overlap.runtime.expert_parallel.
    expert_groups, experts = None, []
    if request.expert_parallel is not None:
        experts = expert_modules(module, request.expert_types)
        if not experts:
            raise ValueError(f"expert_parallel={request.expert_parallel}: the model has no expert module (known: "
                             f"{', '.join(EXPERT_CLASS_NAMES)}); name its class with expert_types=(MyExperts,)")
        if any(isinstance(param, DTensor) for param in module.parameters()):
            raise ValueError(f"expert_parallel={request.expert_parallel} with tensor parallelism (the model holds "
                             "DTensor parameters) is not supported yet")
        if request.expert_capacity_factor is not None:
            cap_routing(experts, request.expert_capacity_factor)
        chunks = settings.config.expert_chunks
        expert_groups = make_groups(request.expert_parallel, request.all_group,
                                    DEFAULT_CHUNKS if chunks is None else chunks, stage=request.stage)
        split_experts(experts, expert_groups)
        request = dataclasses.replace(request, unit_merge_key=None, unit_modules=units_with_experts(
            module, [spec.modules for spec in unit_specs], experts))
        root_spec, unit_specs = discover_units(module, None, request.unit_modules, ignored)
    # DTensor parameters of torch's tensor parallelism become their local tensors, the units'
    # parameters from here on; see overlap.runtime.tensor_parallel.
    # What optimizers are told about this model; see overlap.runtime.optimizer_link.
    link = OptimizerLink()
    tensor_parallel = take_tensor_parallel(module, request.mesh, settings.device, link)
    if tensor_parallel is not None:
        root_spec, unit_specs = discover_units(module, request.unit_types, request.unit_modules, ignored)
    decision = decide(request, settings, unit_specs)
    check_backend_env(request.all_group)           # before the gloo side groups are made
    collectives = _collectives(decision)
    # offload="cpu": master and gradient shards in host memory, and the copies to and from it.
    host = None
    if decision.config.offload == "cpu":
        host = HostTier(decision.device, decision.kernels, collectives.all_gather_stream)
    elif decision.config.offload == "disk":
        # offload="disk": fp32 masters and moments in a state file; see overlap.runtime.disk_tier.
        # The 16-bit shard's copies to the device and the gradients' to the host are offload="cpu"'s.
        host = DiskTier(decision.config.offload_dir, dist.get_rank(),
                        HostTier(decision.device, decision.kernels, collectives.all_gather_stream),
                        link.next_step_settings, disk_window_bytes(decision.config))
    by_experts = None if expert_groups is None else ExpertUnits(
        expert_collectives(collectives, expert_groups, request.all_group), {id(m) for m in experts}, expert_groups)
    if expert_groups is not None:
        expert_groups.watched.collectives = collectives     # their all-to-alls go through its order check
    built = build_units(module, root_spec, unit_specs, collectives, decision, request.param_init_fn, link, host,
                        tensor_parallel, merge=request.unit_modules is None or request.unit_merge_key is not None,
                        merge_key=request.unit_merge_key, dtensor_params=request.dtensor_params, stage=request.stage,
                        initialise_meta=request.initialise_meta, experts=by_experts,
                        unit_mixed_precision=request.unit_mixed_precision, shard_dims=request.shard_dims)
    scheduler = Scheduler(built.root, built.units, collectives, decision.config.prefetch_depth,
                          decision.memory_budget_bytes, request.reshard_after_forward, link, decision.config.order_check,
                          decision.mixed_precision.param_dtype if request.cast_forward_inputs else None,
                          decision.config.keep_units)
    # Per-step timings of compute and communication for `overlap_report()`.
    monitor = OverlapMonitor()
    controllers = _controllers(decision, built, collectives, PrefetchDepths(scheduler), request.reshard_after_forward)
    step_end = StepEndControllers([*controllers, monitor])
    scheduler.step_end_callbacks.append(step_end)
    # Units' compute compiled with their hooks outside; see overlap.runtime.compiled.
    members = [module for unit in built.units for module in unit.modules]
    to_compile = [module for module in members if decision.config.compile or compiled_by_user(module)]
    if to_compile:
        compile_modules(to_compile)
        scheduler.step_end_callbacks.append(CompileTimeLog(dist.get_rank()))
    return Started(decision, collectives, scheduler, step_end, monitor, built.state_dict_layout, link, expert_groups)


def decide(request: StartupRequest, settings: RankSettings, unit_specs: list[UnitSpec]) -> StartupDecision:
    """Sharding, link and plan, once the ranks agree on `settings` (collective)."""
    config, device, mp = settings.config, settings.device, request.mixed_precision or MixedPrecision()
    sharding, auto = _sharding(request, settings, unit_specs, mp)
    logger.info("%s", sharding.describe())
    enable_nvtx(config.nvtx)
    if auto is not None:
        link, startup = auto.link.link, auto.startup_plan(unit_specs, mp)
    else:
        link = detect_link(sharding.shard, config.link, settings.local_world_size)
        startup = plan_at_startup(sharding.shard, device, link, config, unit_specs, mp)
    planned = config.with_overrides(
        prefetch_depth=startup.plan.forward_depth if config.prefetch_depth is None else None,
        bucket_mb=startup.plan.bucket_mb if config.bucket_mb is None else None,
        memory_budget_mb=startup.memory_budget_bytes / 2**20 if config.memory_budget_mb is None else None)
    if dist.get_world_size(sharding.shard) < dist.get_world_size(request.all_group):
        # Each shard group planned on its own link measurements; replicas must hold the
        # same layout (their gradient shards are summed element by element), and the
        # end-of-backward check compares every rank's collectives (the shard groups of each tp
        # rank too), so every rank takes rank 0's plan.
        planned = decided_by_rank0(request.all_group, lambda: planned)
    logger.info("plan: %s; using depth %d, bucket %.3g MB", startup.plan.reason, planned.prefetch_depth,
                planned.bucket_mb)
    return StartupDecision(request.all_group, device, settings.kernels, mp, sharding,
                           None if auto is None else auto.choice, link, startup, planned,
                           # One rank communicates nothing: no depth to re-plan.
                           replan_depth=config.prefetch_depth is None and dist.get_world_size(request.all_group) > 1)


def _sharding(request: StartupRequest, settings: RankSettings, unit_specs: list[UnitSpec],
              mp: MixedPrecision) -> tuple[ShardingGroups, Optional[AutoSharding]]:
    """The groups to shard over: the planner's choice for sharding="auto" on several nodes
    (with what it probed), else as `overlap.runtime.mesh.resolve_sharding` builds them."""
    config, local = settings.config, settings.local_world_size
    if wants_auto_sharding(request.process_group, request.mesh, config, local):
        # Expert parallelism refuses hpZ (overlap.runtime.expert_parallel.expert_parallel_error).
        shardings = [s for s in SHARDINGS if s != "hpz" or request.expert_parallel is None]
        auto = choose_at_startup(settings.device, config, local, unit_specs, mp, shardings)
        return auto.groups, auto
    return resolve_sharding(request.process_group, request.mesh, config.sharding, request.node_copy_ranks or local,
                            settings.device.type), None


def _collectives(decision: StartupDecision) -> Collectives:
    sharding, config = decision.sharding, decision.config
    codec = None
    if config.compress != "none":
        # "auto" starts uncompressed; overlap.plan.compression switches it on if worth it.
        mode = "none" if config.compress == "auto" else config.compress
        codec = QuantizedCodec(Compression(mode, config.compress_block), decision.kernels)
    return Collectives(sharding.shard, decision.device, decision.kernels, sharding.replicate, decision.all_group,
                       codec=codec)


def _controllers(decision: StartupDecision, built: BuiltUnits, collectives: Collectives, depths: PrefetchDepths,
                 reshard_after_forward: bool) -> list[StepEndController]:
    controllers: list[StepEndController] = []
    if decision.replan_depth:
        # Depth follows measured steps; see overlap.control.replanner.Replanner. The step is
        # priced over the shard group, but rank 0 of all ranks decides for every rank: with
        # hybrid sharding, shard groups that chose depths of their own would issue their gathers
        # at different points of the step, and the end-of-backward check, which compares every
        # rank's collectives, could not tell that from ranks that parted.
        shard = decision.sharding.shard
        base = base_profile(built.root, built.units, dist.get_world_size(shard), reshard_after_forward)
        controllers.append(replanner_for(base, decision.startup_plan, decision.bucket_bytes, collectives.flags_group,
                                         depths))
    if decision.config.compress == "auto":
        # Every rank, replicas included, must compress alike: the choice is rank 0's.
        group = decision.all_group
        base = base_profile(built.root, built.units, dist.get_world_size(group), reshard_after_forward)
        controllers.append(chooser_for(collectives.codec, built.all_units, base, decision.startup_plan,
                                       collectives.flags_group, depths, decision.device))
    return controllers
