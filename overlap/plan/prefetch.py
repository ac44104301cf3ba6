"""Prefetch depth and bucket size from the link's α-β model, unit sizes and compute times.

Bucket size is fixed when the module is wrapped (it sets the flat layout the optimizer
sees), before any compute has been timed, so it follows the latency rule alone: a bucket
must be large enough that α is at most `LATENCY_SHARE` of its collective's time. Depth is
chosen by replaying the step (`overlap.plan.cost_model`) at each candidate depth; it can change
at run time (`overlap.control.replanner`).
"""
from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING, Optional, Sequence

from overlap.plan.cost_model import CommLayout, Prediction, Profile, UnitCost, predict_step, wire_bytes
from overlap.base.rules import bucket_name, bucket_runs
from overlap.base.mixed_precision import MixedPrecision
from overlap.plan.links import LinkModel
from overlap.plan.memory import gathered_in_flight

if TYPE_CHECKING:
    from overlap.base.units import UnitSpec

logger = logging.getLogger("overlap")

# A collective's latency should be at most this share of its time.
LATENCY_SHARE = 0.10
MAX_DEPTH = 4
# A deeper prefetch must beat the shallower one by this share of the step to be chosen:
# within it the model cannot tell them apart and the shallower holds less memory.
DEPTH_TOLERANCE = 0.01
# Bucketing never leaves fewer buckets than this (when there are that many units).
MIN_BUCKETS = 4


@dataclass(frozen=True)
class Plan:
    forward_depth: int
    backward_depth: int
    bucket_bytes: int
    reason: str
    prediction: Optional[Prediction] = None

    @property
    def bucket_mb(self) -> float:
        return self.bucket_bytes / 2**20


# ---- choices --------------------------------------------------------------------------------

def latency_bucket_bytes(link: LinkModel, world_size: int, wire_per_byte: float = 1.0) -> int:
    """Smallest bucket (in the bytes bucketing counts) whose collective keeps α within
    LATENCY_SHARE of its time; `wire_per_byte` converts bucket bytes to gathered bytes.

    α <= s·(α + w/β)  <=>  w >= α·β·(1 - s)/s, with w the wire bytes.
    """
    if world_size < 2:
        return 0
    wire = link.alpha * link.beta * (1 - LATENCY_SHARE) / LATENCY_SHARE
    return int(wire * world_size / (world_size - 1) / wire_per_byte)


def merge_costs(units: Sequence[UnitCost], bucket_bytes: int) -> list[UnitCost]:
    """Consecutive units merged by the merge rule (`overlap.base.rules.bucket_runs`)."""
    merged = []
    for run in bucket_runs([u.nbytes for u in units], bucket_bytes):
        members = [units[i] for i in run]
        merged.append(members[0] if len(members) == 1 else UnitCost(
            bucket_name([u.name for u in members]), sum(u.nbytes for u in members),
            sum(u.gather_bytes for u in members), sum(u.reduce_bytes for u in members),
            sum(u.forward_s for u in members), sum(u.backward_s for u in members)))
    return merged


def choose_bucket_bytes(units: Sequence[UnitCost], link: LinkModel, world_size: int,
                        memory_budget_bytes: Optional[int] = None) -> int:
    """Bucket size by the latency rule.

    Merging stops when the next unit would overflow the bucket, so a cap of twice the
    threshold T guarantees that a closed bucket below T is followed by a unit of at least T
    (two parts both under T fit under 2T): small units always reach T together. Capped so
    that two buckets (one computing, one arriving) fit the memory budget, and so that the
    units form at least MIN_BUCKETS buckets: a model merged into one bucket has nothing to
    compute while its gather runs, and latency saved there costs all of the overlap.
    """
    total = sum(u.nbytes for u in units)
    ratio = sum(u.gather_bytes for u in units) / total if total else 1.0
    bucket = 2 * latency_bucket_bytes(link, world_size, ratio)
    if memory_budget_bytes is not None:
        bucket = min(bucket, int(memory_budget_bytes / 2 / ratio))
    if len(units) >= MIN_BUCKETS:
        bucket = min(bucket, total // MIN_BUCKETS)
    return max(bucket, 1)


def choose_depths(profile: Profile, link: "LinkModel | CommLayout", memory_budget_bytes: Optional[int],
                  shared: bool = True, max_depth: int = MAX_DEPTH) -> tuple[int, int, Prediction]:
    """Forward and backward depths with the shortest predicted step (equal when `shared`).

    A deeper choice must beat the best shallower one by DEPTH_TOLERANCE of the step.
    """
    pairs = [(d, d) for d in range(max_depth + 1)] if shared else \
        [(f, b) for f in range(max_depth + 1) for b in range(max_depth + 1)]
    best: Optional[tuple[int, int, Prediction]] = None
    for forward_depth, backward_depth in pairs:
        prediction = predict_step(profile, link, forward_depth, backward_depth, memory_budget_bytes)
        if best is None or prediction.step_s < best[2].step_s * (1 - DEPTH_TOLERANCE):
            best = (forward_depth, backward_depth, prediction)
    assert best is not None
    return best


def _gathered_at_most(largest_gather_bytes: int, depth: int) -> float:
    """Gathered bytes in flight at `depth` when every unit is as large as the largest."""
    return gathered_in_flight([largest_gather_bytes] * (depth + 1), depth)


def depth_within_budget(largest_gather_bytes: int, memory_budget_bytes: Optional[int], wanted: int) -> int:
    """`wanted`, lowered until the computing unit plus the prefetched ones fit the budget."""
    if memory_budget_bytes is None or largest_gather_bytes <= 0:
        return wanted
    depth = max(wanted, 0)
    while depth > 0 and _gathered_at_most(largest_gather_bytes, depth) > memory_budget_bytes:
        depth -= 1
    return depth


def initial_plan(units: Sequence[UnitCost], link: LinkModel, world_size: int,
                 memory_budget_bytes: Optional[int]) -> Plan:
    """The plan before any step has run: bucket by the latency rule; depth by link class
    (within a node one unit ahead hides a gather; across nodes a gather can match a unit's
    compute, so two), capped by the budget. The first measured steps refine the depth."""
    bucket = choose_bucket_bytes(units, link, world_size, memory_budget_bytes)
    buckets = merge_costs(units, bucket)
    largest = max((u.gather_bytes for u in buckets), default=0)
    depth = depth_within_budget(largest, memory_budget_bytes, 1 if link.link == "nvlink" else 2)
    gather_s = link.time(wire_bytes(largest, world_size)) if largest else 0.0
    budget = "no budget" if memory_budget_bytes is None else f"{memory_budget_bytes / 2**20:.0f} MB budget"
    reason = (f"{link.describe()}; {len(units)} units in {len(buckets)} buckets, largest gather "
              f"{gather_s * 1e3:.1f} ms → depth {depth}, bucket {bucket / 2**20:.3g} MB, peak gathered "
              f"{_gathered_at_most(largest, depth) / 2**20:.1f} MB of {budget} (until compute is measured)")
    return Plan(depth, depth, bucket, reason)


def explain(profile: Profile, link: "LinkModel | CommLayout", plan: Plan, memory_budget_bytes: Optional[int]) -> str:
    """One line with the figures behind a measured plan."""
    layout = link if isinstance(link, CommLayout) else CommLayout.single(link, profile.world_size)
    link = layout.gather.link
    n = max(len(profile.units), 1)
    forward = sum(u.forward_s for u in profile.units) / n
    backward = sum(u.backward_s for u in profile.units) / n
    gather = sum(layout.gather.time(u.gather_bytes) for u in profile.units) / n
    p = plan.prediction
    budget = "no budget" if memory_budget_bytes is None else f"{memory_budget_bytes / 2**20:.0f} MB budget"
    depth = (f"depth {plan.forward_depth}" if plan.forward_depth == plan.backward_depth
             else f"depth {plan.forward_depth} forward / {plan.backward_depth} backward")
    return (f"{link.describe()}; unit compute {forward * 1e3:.1f} ms fwd / {backward * 1e3:.1f} ms bwd "
            f"vs gather {gather * 1e3:.1f} ms → {depth}, bucket {plan.bucket_mb:.3g} MB, predicted step "
            f"{p.step_s * 1e3:.0f} ms ({p.exposed_s * 1e3:.0f} ms exposed), peak gathered "
            f"{p.peak_gathered_bytes / 2**20:.1f} MB of {budget}")


def cost_of_spec(spec: "UnitSpec", mp: MixedPrecision) -> UnitCost:
    """Sizes of a unit before it is built (padding ignored)."""
    gather = sum(p.numel() * mp.gather_dtype(p.dtype).itemsize for _, p, _ in spec.params)
    reduce = sum(p.numel() * mp.grad_reduce_dtype(p.dtype).itemsize for _, p, _ in spec.params
                 if p.requires_grad)
    return UnitCost(spec.name, spec.nbytes, gather, reduce)
