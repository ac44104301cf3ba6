"""What start-up decided for one `ShardedModule`, frozen: the groups it shards over, the link,
the plan, the settings with the planner's choices filled in, and where the shards live.
Every rank of a shard group holds the same decision; with replicas, every rank holds rank 0's
settings (see `overlap.control.startup`).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
import torch.distributed as dist

from overlap.base.config import Config
from overlap.base.mixed_precision import MixedPrecision
from overlap.control.startup_plan import StartupPlan
from overlap.kernels.backends import KernelBackend
from overlap.plan.sharding import ShardingChoice
from overlap.runtime.mesh import ShardingGroups


@dataclass(frozen=True)
class StartupDecision:
    all_group: dist.ProcessGroup                 # every rank taking part
    device: torch.device
    kernels: KernelBackend
    mixed_precision: MixedPrecision
    sharding: ShardingGroups
    sharding_choice: Optional[ShardingChoice]    # sharding="auto" on several nodes: the options compared
    link: str                                    # link class of the shard group
    startup_plan: StartupPlan                    # the initial plan, its link model and memory budget
    config: Config                               # settings, with the planner's depth, bucket and budget
    replan_depth: bool                           # no depth given: it follows measured steps

    @property
    def bucket_bytes(self) -> int:
        return int(self.config.bucket_mb * 2**20)

    @property
    def memory_budget_bytes(self) -> Optional[int]:
        return None if self.config.memory_budget_mb is None else int(self.config.memory_budget_mb * 2**20)
