"""The start-up plan: the link model (probed on the real group unless settings say otherwise),
the memory budget every rank shares (rank 0's), and the initial prefetch depth and bucket size
(`overlap.plan.prefetch`).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Optional, Sequence

import torch
import torch.distributed as dist

from overlap.base.config import Config, local_world_size_from_env
from overlap.plan.cost_model import CommLayout, UnitCost
from overlap.base.mixed_precision import MixedPrecision
from overlap.base.device_memory import device_memory_bytes
from overlap.plan.budget import disk_window, gathered_budget
from overlap.plan.prefetch import Plan, cost_of_spec, initial_plan
from overlap.control.agreement import decided_by_rank0
from overlap.control.probe import probe_link
from overlap.plan.links import LINK_DEFAULTS, LinkModel

if TYPE_CHECKING:
    from overlap.runtime.unit import Unit
    from overlap.base.units import UnitSpec


def default_memory_budget(device: torch.device) -> int:
    """The gathered-parameter budget of `overlap.plan.budget` for this rank's memory."""
    return gathered_budget(device_memory_bytes(device))


def disk_window_bytes(config: Config) -> int:
    """Host bytes offload="disk" may hold its state in between backward and the write behind
    the step: the setting, or the planner's share of the host memory available now to each of
    this host's ranks."""
    if config.disk_window_mb is not None:
        return int(config.disk_window_mb * 2**20)
    ranks = local_world_size_from_env() or 1
    return disk_window(device_memory_bytes(torch.device("cpu"), ranks))


def cost_of_unit(unit: "Unit") -> UnitCost:
    """Sizes of a built unit (or bucket), padding included."""
    nbytes = sum(g.padded_numel * g.master_dtype.itemsize for g in unit.groups)
    reduce = sum(g.padded_numel * g.reduce_dtype.itemsize for g in unit.trainable_groups)
    return UnitCost(unit.name, nbytes, unit.gathered_nbytes, reduce)


@dataclass(frozen=True)
class StartupPlan:
    plan: Plan
    link: LinkModel
    memory_budget_bytes: int
    # Every collective's group and link, when the sharding was chosen on both levels.
    layout: Optional[CommLayout] = None


def plan_at_startup(group: dist.ProcessGroup, device: torch.device, link: str, config: Config,
                    unit_specs: Sequence["UnitSpec"], mp: MixedPrecision) -> StartupPlan:
    """Link model (probed unless OVERLAP_PROBE=0 or both knobs are fixed), memory budget
    (rank 0's, so that every rank plans alike) and the initial plan. sharding="auto" plans
    with what it probed instead (`overlap.control.auto_sharding.AutoSharding.startup_plan`)."""
    model = LINK_DEFAULTS[link]
    if config.probe and (config.prefetch_depth is None or config.bucket_mb is None):
        model = probe_link(group, device, model, config.probe_cache)
    if config.memory_budget_mb is not None:
        budget = int(config.memory_budget_mb * 2**20)
    else:
        budget = decided_by_rank0(group, lambda: default_memory_budget(device))
    costs = [cost_of_spec(spec, mp) for spec in unit_specs]
    return StartupPlan(initial_plan(costs, model, dist.get_world_size(group), budget), model, budget)
