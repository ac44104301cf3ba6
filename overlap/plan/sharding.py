"""Which sharding a multi-node job should use (full, hybrid or hpZ), from a replay of the step
on both link levels and the memory each option holds per rank. Arithmetic only: the runtime
(`overlap.control.auto_sharding`) and `overlap simulate` feed it their own link models.

Per rank, each option holds its share of the model states, `STATE_COPIES` times the master
parameters (the parameters, their gradient and Adam's two moments; `overlap.plan.memory`),
plus the gathered units in flight (the replay's peak). Full sharding and hpZ spread the states
over every rank, hybrid sharding over the ranks of a node only; hpZ also keeps a node copy of
every unit between its forward and its backward (1/LOCAL_WORLD_SIZE of the gathered model).
Among the options that fit the memory limit, the fastest predicted step wins; one within
`STEP_TOLERANCE` of it that holds less memory wins instead (the model cannot tell them apart,
and memory is certain).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence

from overlap.base.choices import SHARDINGS
from overlap.plan.cost_model import CommLayout, GroupLink, Prediction, Profile, UnitCost
from overlap.plan.memory import state_copies
from overlap.plan.prefetch import choose_bucket_bytes, choose_depths, merge_costs
from overlap.plan.links import LinkModel

STATE_COPIES = state_copies("adamw")
STEP_TOLERANCE = 0.05


@dataclass(frozen=True)
class Levels:
    """The two links of a cluster of `nodes` nodes with `local` ranks each: `node` among one
    node's ranks, `network` among one rank per node (the replicas of a shard), `world` among
    every rank (a ring that crosses the network)."""

    nodes: int
    local: int
    node: LinkModel
    network: LinkModel
    world: LinkModel

    @property
    def ranks(self) -> int:
        return self.nodes * self.local

    def describe(self) -> str:
        return (f"{self.nodes} nodes × {self.local}: node {self.node.describe()}, network "
                f"{self.network.describe()}, all ranks {self.world.describe()}")


def layout_for(sharding: str, levels: Levels) -> CommLayout:
    """Which group (and so which link) each collective of `sharding` runs on."""
    wire = "node" if levels.nodes == 1 else "network"
    world = GroupLink(levels.ranks, levels.world, wire)
    node = GroupLink(levels.local, levels.node, "node")
    if sharding == "full":
        return CommLayout("full", world, world, world)
    if sharding == "hybrid":
        return CommLayout("hybrid", node, node, node, GroupLink(levels.nodes, levels.network, wire))
    if sharding == "hpz":
        return CommLayout("hpz", world, node, world)
    raise ValueError(f"unknown sharding {sharding!r}; expected one of {', '.join(SHARDINGS)}")


def shard_ranks(sharding: str, levels: Levels) -> int:
    return levels.local if sharding == "hybrid" else levels.ranks


@dataclass(frozen=True)
class Option:
    sharding: str
    depth: int
    bucket_bytes: int
    prediction: Prediction
    memory_bytes: int            # model states + gathered units in flight (+ hpZ's node copies)

    def describe(self) -> str:
        return (f"{self.sharding} {self.prediction.step_s * 1e3:.3g} ms "
                f"({self.prediction.comm_s * 1e3:.3g} ms comm), {self.memory_bytes / 2**20:.3g} MB")


def evaluate(sharding: str, units: Sequence[UnitCost], levels: Levels, gathered_budget: Optional[int],
             other_s: float = 0.0, root: Optional[UnitCost] = None) -> Option:
    """The planner's bucket and depth for `sharding`, the predicted step and memory per rank."""
    layout = layout_for(sharding, levels)
    ranks = shard_ranks(sharding, levels)
    bucket = choose_bucket_bytes(units, layout.gather.link, layout.gather.ranks, gathered_budget)
    profile = Profile(tuple(merge_costs(units, bucket)), ranks, root, other_s)
    depth, _, prediction = choose_depths(profile, layout, gathered_budget)
    everything = [*units, *([root] if root else [])]
    states = STATE_COPIES * sum(u.nbytes for u in everything) / ranks
    copies = sum(u.gather_bytes for u in everything) / levels.local if sharding == "hpz" else 0.0
    return Option(sharding, depth, bucket, prediction, int(states + prediction.peak_gathered_bytes + copies))


@dataclass(frozen=True)
class ShardingChoice:
    pick: Option
    options: tuple[Option, ...]
    memory_limit: int
    levels: Levels

    def describe(self) -> str:
        fits = ", ".join(o.describe() + ("" if o.memory_bytes <= self.memory_limit else " (over the limit)")
                         for o in self.options)
        return (f"sharding {self.pick.sharding}: predicted {fits}; memory limit {self.memory_limit / 2**20:.0f} MB "
                f"per rank, least memory within {STEP_TOLERANCE:.0%} of the fastest step; {self.levels.describe()}")


def choose_sharding(units: Sequence[UnitCost], levels: Levels, gathered_budget: Optional[int], memory_limit: int,
                    other_s: float = 0.0, root: Optional[UnitCost] = None,
                    shardings: Sequence[str] = SHARDINGS) -> ShardingChoice:
    options = tuple(evaluate(s, units, levels, gathered_budget, other_s, root) for s in shardings)
    fits = [o for o in options if o.memory_bytes <= memory_limit] or [min(options, key=lambda o: o.memory_bytes)]
    fastest = min(o.prediction.step_s for o in fits)
    close = [o for o in fits if o.prediction.step_s <= fastest * (1 + STEP_TOLERANCE)]
    return ShardingChoice(min(close, key=lambda o: o.memory_bytes), options, memory_limit, levels)
