"""sharding="auto": at start-up, fit both link levels, replay the step under full, hybrid and
hpZ sharding (`overlap.plan.sharding`) and build the process groups of rank 0's choice.

Compute has not run yet when the layout must be fixed (sharding decides the flat buffers the
optimizer sees), so the replay takes compute as zero: each option's predicted step is its
communication alone, on the lanes it can use at once, which is what a step pays when nothing
hides it. The log line says so; the prefetch depth is re-planned from measured steps later,
the sharding is not.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING, Optional, Sequence

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from overlap.base.config import Config
from overlap.base.device_memory import device_memory_bytes
from overlap.plan import budget as budget_rule
from overlap.plan.cost_model import CommLayout
from overlap.runtime.mesh import ShardingGroups, groups_on_mesh
from overlap.base.mixed_precision import MixedPrecision
from overlap.plan.prefetch import cost_of_spec, initial_plan
from overlap.control.agreement import decided_by_rank0
from overlap.control.startup_plan import StartupPlan, default_memory_budget
from overlap.control.probe import probe_link
from overlap.plan.sharding import Levels, ShardingChoice, choose_sharding, layout_for
from overlap.plan.links import LINK_DEFAULTS, LinkModel
from overlap.control.topology import level_links

if TYPE_CHECKING:
    from overlap.base.units import UnitSpec

logger = logging.getLogger("overlap")

# Three groups are probed (a node's ranks, one rank per node, all ranks): each gets this
# budget, so that the three together cost about what one probe at the full budget does.
LEVEL_PROBE_BUDGET_S = 0.3


@dataclass(frozen=True)
class AutoSharding:
    groups: ShardingGroups
    levels: Levels
    choice: ShardingChoice
    gathered_budget: int

    @property
    def layout(self) -> CommLayout:
        return layout_for(self.choice.pick.sharding, self.levels)

    @property
    def link(self) -> LinkModel:
        """The link of the chosen option's forward all-gathers, which set its bucket size."""
        return self.layout.gather.link

    def startup_plan(self, unit_specs: Sequence["UnitSpec"], mp: MixedPrecision) -> StartupPlan:
        """The initial plan on the chosen option's gather link, within the budget rank 0 chose."""
        costs = [cost_of_spec(spec, mp) for spec in unit_specs]
        plan = initial_plan(costs, self.link, dist.get_world_size(self.groups.shard), self.gathered_budget)
        return StartupPlan(plan, self.link, self.gathered_budget, self.layout)


def memory_limit(device: torch.device, local_world_size: int) -> int:
    """`overlap.plan.budget`'s memory limit for a rank sharing its host with a node's ranks."""
    return budget_rule.memory_limit(device_memory_bytes(device, local_world_size))


def _levels(mesh: DeviceMesh, device: torch.device, config: Config, local: int) -> Levels:
    inside, across = level_links(config.link, dist.group.WORLD)
    node = LINK_DEFAULTS[inside]
    network = world = LINK_DEFAULTS[across]
    if config.probe:
        cache = config.probe_cache
        node = probe_link(mesh.get_group(1), device, node, cache, "node", LEVEL_PROBE_BUDGET_S)
        network = probe_link(mesh.get_group(0), device, network, cache, "network", LEVEL_PROBE_BUDGET_S)
        world = probe_link(dist.group.WORLD, device, world, cache, "world", LEVEL_PROBE_BUDGET_S)
    return Levels(dist.get_world_size() // local, local, node, network, world)


def wants_auto_sharding(process_group: Optional[dist.ProcessGroup], mesh: Optional[DeviceMesh], config: Config,
                        local_world_size: Optional[int]) -> bool:
    """Whether the planner chooses the sharding: sharding="auto" over every rank of several
    nodes. Elsewhere "auto" is full sharding (`overlap.runtime.mesh.resolve_sharding`)."""
    several_nodes = local_world_size is not None and dist.get_world_size() > local_world_size
    return config.sharding == "auto" and mesh is None and process_group is None and several_nodes


def choose_at_startup(device: torch.device, config: Config, local: int, unit_specs: Sequence["UnitSpec"],
                      mp: MixedPrecision, shardings: Sequence[str]) -> AutoSharding:
    """Probe, choose among `shardings` on rank 0, and build the chosen groups on every rank
    (collective)."""
    world = dist.get_world_size()
    mesh = init_device_mesh(device.type, (world // local, local), mesh_dim_names=("replicate", "shard"))
    levels = _levels(mesh, device, config, local)
    units = [cost_of_spec(spec, mp) for spec in unit_specs]

    def decide() -> tuple[ShardingChoice, int]:
        gathered = int(config.memory_budget_mb * 2**20) if config.memory_budget_mb is not None \
            else default_memory_budget(device)
        return choose_sharding(units, levels, gathered, memory_limit(device, local), shardings=shardings), gathered

    choice, gathered = decided_by_rank0(dist.group.WORLD, decide)
    groups = groups_on_mesh(choice.pick.sharding, mesh)
    logger.info("%s; compute not measured before the first step: taken as zero, so each step "
                "predicted is its communication alone", choice.describe())
    return AutoSharding(groups, choice.levels, choice, gathered)
