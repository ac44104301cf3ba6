"""Prefetch depth and bucket size from the link's α-β model, unit sizes and compute times.

The cost model replays one training step the way the scheduler runs it: compute runs units
in order on one lane; all-gathers and reduce-scatters queue on one communication lane in the
order they are issued (one process group runs its collectives in issue order). Forward
prefetches the next `depth` units at each unit's start, backward the same in reverse order,
and a unit's reduce-scatter is issued when its backward ends, with at most
`MAX_REDUCES_IN_FLIGHT` outstanding. Prefetch stops at the memory budget, as in the
scheduler. The step time it predicts is compute plus the communication it could not hide.

Bucket size is fixed when the module is wrapped (it sets the flat layout the optimizer
sees), before any compute has been timed, so it follows the latency rule alone: a bucket
must be large enough that α is at most `LATENCY_SHARE` of its collective's time. Depth can
change at run time: `Replanner` measures the first steps and re-plans when they drift.
"""
from __future__ import annotations

import logging
import os
from dataclasses import dataclass, field, replace
from typing import Optional, Sequence

import torch
import torch.distributed as dist

from overlap.config import Config
from overlap.mixed_precision import MixedPrecision
from overlap.probe import probe_link
from overlap.scheduler import MAX_REDUCES_IN_FLIGHT, Scheduler
from overlap.topology import LINK_DEFAULTS, LinkModel
from overlap.unit import Unit
from overlap.units import UnitSpec

logger = logging.getLogger("overlap")

# A collective's latency should be at most this share of its time.
LATENCY_SHARE = 0.10
MAX_DEPTH = 4
# A deeper prefetch must beat the shallower one by this share of the step to be chosen:
# within it the model cannot tell them apart and the shallower holds less memory.
DEPTH_TOLERANCE = 0.01
# Without a budget: this share of device memory (CUDA) or of available RAM (CPU).
BUDGET_FRACTION = 0.10
# Re-planning: first decision after this step (step 1 warms up), then a check every
# REPLAN_EVERY steps; a re-plan needs compute or communication to have drifted by DRIFT and
# the new depth to be predicted faster than the current one by MIN_GAIN (hysteresis).
FIRST_DECISION_STEP = 2
REPLAN_EVERY = 10
DRIFT = 0.20
MIN_GAIN = 0.03


@dataclass(frozen=True)
class UnitCost:
    """One unit (or bucket): `nbytes` as bucketing counts them (master dtype), bytes gathered
    and reduced (whole buffers, in their transfer dtypes), compute seconds per pass."""

    name: str
    nbytes: int
    gather_bytes: int
    reduce_bytes: int
    forward_s: float = 0.0
    backward_s: float = 0.0


@dataclass(frozen=True)
class Profile:
    """What the cost model needs about one step. `root` is gathered at the start of forward
    and reduced at the end of backward; `other_s` is compute outside the units (embedding,
    head, loss), placed between forward and backward."""

    units: tuple[UnitCost, ...]
    world_size: int
    root: Optional[UnitCost] = None
    other_s: float = 0.0
    reshard_after_forward: bool = True

    @property
    def compute_s(self) -> float:
        return self.other_s + sum(u.forward_s + u.backward_s for u in self.units)


@dataclass(frozen=True)
class Span:
    lane: str          # compute | comm
    label: str
    start: float
    end: float


@dataclass(frozen=True)
class Prediction:
    step_s: float
    compute_s: float
    comm_s: float
    peak_gathered_bytes: int
    timeline: tuple[Span, ...] = ()

    @property
    def exposed_s(self) -> float:
        return max(self.step_s - self.compute_s, 0.0)


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


# ---- cost model -----------------------------------------------------------------------------

def wire_bytes(nbytes: float, world_size: int) -> float:
    """Bytes each rank sends in a ring all-gather or reduce-scatter of an `nbytes` buffer."""
    return nbytes * (world_size - 1) / world_size


class _Replay:
    """One step on a compute lane and a first-in-first-out communication lane."""

    def __init__(self, link: LinkModel, world: int, budget: Optional[int]) -> None:
        self.link, self.world, self.budget = link, world, budget
        self.now = 0.0
        self.comm_free_at = 0.0
        self.comm_busy = 0.0
        self.ready: dict[int, float] = {}      # unit index -> gather completion
        self.held: dict[int, int] = {}          # unit index -> gathered bytes held
        self.peak = 0
        self.spans: list[Span] = []

    def collective(self, label: str, nbytes: int) -> float:
        if nbytes <= 0:
            return self.now
        start = max(self.now, self.comm_free_at)
        self.comm_free_at = start + self.link.time(wire_bytes(nbytes, self.world))
        self.comm_busy += self.comm_free_at - start
        self.spans.append(Span("comm", label, start, self.comm_free_at))
        return self.comm_free_at

    def gather(self, index: int, unit: UnitCost, prefetch: bool) -> bool:
        if index in self.held:
            return True
        if prefetch and self.budget is not None and sum(self.held.values()) + unit.gather_bytes > self.budget:
            return False
        self.held[index] = unit.gather_bytes
        self.peak = max(self.peak, sum(self.held.values()))
        self.ready[index] = self.collective(f"gather {unit.name}", unit.gather_bytes)
        return True

    def wait(self, until: float) -> None:
        self.now = max(self.now, until)

    def compute(self, label: str, seconds: float) -> None:
        if seconds > 0:
            self.spans.append(Span("compute", label, self.now, self.now + seconds))
        self.now += seconds

    def free(self, index: int) -> None:
        self.held.pop(index, None)


def _prefetch(replay: _Replay, units: Sequence[UnitCost], order: Sequence[int], position: int, depth: int) -> None:
    for index in order[position + 1:position + 1 + depth]:
        if not replay.gather(index, units[index], prefetch=True):
            break


def predict_step(profile: Profile, link: LinkModel, forward_depth: int, backward_depth: int,
                 memory_budget_bytes: Optional[int] = None) -> Prediction:
    """Step time, exposed communication and peak gathered bytes for one configuration."""
    units = profile.units
    replay = _Replay(link, profile.world_size, memory_budget_bytes)
    root_ready = replay.collective("gather root", profile.root.gather_bytes) if profile.root else 0.0
    forward = list(range(len(units)))
    _prefetch(replay, units, forward, -1, forward_depth)
    replay.wait(root_ready)
    for position, index in enumerate(forward):
        replay.gather(index, units[index], prefetch=False)
        _prefetch(replay, units, forward, position, forward_depth)
        replay.wait(replay.ready[index])
        replay.compute(f"forward {units[index].name}", units[index].forward_s)
        if profile.reshard_after_forward:
            replay.free(index)
    backward = forward[::-1]
    _prefetch(replay, units, backward, -1, backward_depth)
    replay.compute("root", profile.other_s)
    reduces: list[float] = []
    for position, index in enumerate(backward):
        replay.gather(index, units[index], prefetch=False)
        _prefetch(replay, units, backward, position, backward_depth)
        replay.wait(replay.ready[index])
        replay.compute(f"backward {units[index].name}", units[index].backward_s)
        reduces.append(replay.collective(f"reduce {units[index].name}", units[index].reduce_bytes))
        replay.free(index)
        while len(reduces) > MAX_REDUCES_IN_FLIGHT:
            replay.wait(reduces.pop(0))
    if profile.root:
        reduces.append(replay.collective("reduce root", profile.root.reduce_bytes))
    replay.wait(max(reduces, default=0.0))
    root_bytes = profile.root.gather_bytes if profile.root else 0
    return Prediction(replay.now, profile.compute_s, replay.comm_busy, replay.peak + root_bytes,
                      tuple(replay.spans))


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
    """Consecutive units merged as `overlap.units.merge_into_buckets` merges them."""
    merged: list[UnitCost] = []
    for unit in units:
        last = merged[-1] if merged else None
        if bucket_bytes and last is not None and last.nbytes + unit.nbytes <= bucket_bytes:
            merged[-1] = UnitCost(f"{last.name.split('..')[0]}..{unit.name}", last.nbytes + unit.nbytes,
                                  last.gather_bytes + unit.gather_bytes, last.reduce_bytes + unit.reduce_bytes,
                                  last.forward_s + unit.forward_s, last.backward_s + unit.backward_s)
        else:
            merged.append(unit)
    return merged


def choose_bucket_bytes(units: Sequence[UnitCost], link: LinkModel, world_size: int,
                        memory_budget_bytes: Optional[int] = None) -> int:
    """Bucket size by the latency rule.

    Merging stops when the next unit would overflow the bucket, so a cap of twice the
    threshold T guarantees that a closed bucket below T is followed by a unit of at least T
    (two parts both under T fit under 2T): small units always reach T together. Capped so
    that two buckets (one computing, one arriving) fit the memory budget.
    """
    total = sum(u.nbytes for u in units)
    ratio = sum(u.gather_bytes for u in units) / total if total else 1.0
    bucket = 2 * latency_bucket_bytes(link, world_size, ratio)
    if memory_budget_bytes is not None:
        bucket = min(bucket, int(memory_budget_bytes / 2 / ratio))
    return max(bucket, 1)


def choose_depths(profile: Profile, link: LinkModel, memory_budget_bytes: Optional[int],
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


def depth_within_budget(largest_gather_bytes: int, memory_budget_bytes: Optional[int], wanted: int) -> int:
    """`wanted`, lowered until the computing unit plus the prefetched ones fit the budget."""
    if memory_budget_bytes is None or largest_gather_bytes <= 0:
        return wanted
    return max(0, min(wanted, memory_budget_bytes // largest_gather_bytes - 1))


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
              f"{(depth + 1) * largest / 2**20:.1f} MB of {budget} (until compute is measured)")
    return Plan(depth, depth, bucket, reason)


def explain(profile: Profile, link: LinkModel, plan: Plan, memory_budget_bytes: Optional[int]) -> str:
    """One line with the figures behind a measured plan."""
    n = max(len(profile.units), 1)
    forward = sum(u.forward_s for u in profile.units) / n
    backward = sum(u.backward_s for u in profile.units) / n
    gather = sum(link.time(wire_bytes(u.gather_bytes, profile.world_size)) for u in profile.units) / n
    p = plan.prediction
    budget = "no budget" if memory_budget_bytes is None else f"{memory_budget_bytes / 2**20:.0f} MB budget"
    depth = (f"depth {plan.forward_depth}" if plan.forward_depth == plan.backward_depth
             else f"depth {plan.forward_depth} forward / {plan.backward_depth} backward")
    return (f"{link.describe()}; unit compute {forward * 1e3:.1f} ms fwd / {backward * 1e3:.1f} ms bwd "
            f"vs gather {gather * 1e3:.1f} ms → {depth}, bucket {plan.bucket_mb:.3g} MB, predicted step "
            f"{p.step_s * 1e3:.0f} ms ({p.exposed_s * 1e3:.0f} ms exposed), peak gathered "
            f"{p.peak_gathered_bytes / 2**20:.1f} MB of {budget}")


def default_memory_budget(device: torch.device) -> int:
    """BUDGET_FRACTION of the device's memory (CUDA) or of the RAM available now (CPU)."""
    if device.type == "cuda":
        return int(BUDGET_FRACTION * torch.cuda.get_device_properties(device).total_memory)
    return int(BUDGET_FRACTION * os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE"))


# ---- wiring into the runtime -------------------------------------------------------------------

def _element_size(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


def cost_of_spec(spec: UnitSpec, mp: MixedPrecision) -> UnitCost:
    """Sizes of a unit before it is built (padding ignored)."""
    gather = sum(p.numel() * _element_size(mp.gather_dtype(p.dtype)) for _, p, _ in spec.params)
    reduce = sum(p.numel() * _element_size(mp.grad_reduce_dtype(p.dtype)) for _, p, _ in spec.params
                 if p.requires_grad)
    return UnitCost(spec.name, spec.nbytes, gather, reduce)


def cost_of_unit(unit: Unit) -> UnitCost:
    """Sizes of a built unit (or bucket), padding included."""
    nbytes = sum(g.padded_numel * _element_size(g.master_dtype) for g in unit.groups)
    reduce = sum(g.padded_numel * _element_size(g.reduce_dtype) for g in unit.trainable_groups)
    return UnitCost(unit.name, nbytes, unit.gathered_nbytes, reduce)


@dataclass(frozen=True)
class StartupPlan:
    plan: Plan
    link: LinkModel
    memory_budget_bytes: int


def plan_at_startup(group: dist.ProcessGroup, device: torch.device, link: str, config: Config,
                    unit_specs: Sequence[UnitSpec], mp: MixedPrecision) -> StartupPlan:
    """Link model (probed unless OVERLAP_PROBE=0 or both knobs are fixed), memory budget
    (rank 0's, so that every rank plans alike) and the initial plan."""
    model = LINK_DEFAULTS[link]
    if config.probe and (config.prefetch_depth is None or config.bucket_mb is None):
        model = probe_link(group, device, model, config.probe_cache)
    if config.memory_budget_mb is not None:
        budget = int(config.memory_budget_mb * 2**20)
    else:
        shared = [default_memory_budget(device)]
        dist.broadcast_object_list(shared, src=dist.get_global_rank(group, 0), group=group)
        budget = shared[0]
    costs = [cost_of_spec(spec, mp) for spec in unit_specs]
    return StartupPlan(initial_plan(costs, model, dist.get_world_size(group), budget), model, budget)


def replanner_for(scheduler: Scheduler, startup: StartupPlan, bucket_bytes: int, group: dist.ProcessGroup,
                  device: torch.device) -> "Replanner":
    base = Profile(tuple(cost_of_unit(u) for u in scheduler.units), dist.get_world_size(group),
                   cost_of_unit(scheduler.root) if scheduler.root is not None else None,
                   reshard_after_forward=scheduler.reshard_after_forward)
    return Replanner(base, startup.link, bucket_bytes, startup.memory_budget_bytes, group, device)


# ---- measurement and re-planning at run time ---------------------------------------------------

def _exposed_within(records, start: float, end: float) -> float:
    """Host time blocked on collectives inside [start, end]."""
    total = 0.0
    for record in records:
        if record.wait_start is not None and record.wait_end is not None:
            total += max(0.0, min(end, record.wait_end) - max(start, record.wait_start))
    return total


def measure_profile(scheduler: Scheduler, base: Profile) -> Optional[Profile]:
    """`base` with the compute times of the step that just ended (None if a unit is missing).

    Forward compute runs from a unit's pre_forward (logged once gathered) to its
    post_forward; backward from pre_backward to its free (gradients complete and reduced);
    waits on collectives inside those spans are removed. The rest of the step is `other_s`.
    """
    records = scheduler.collectives.records
    first: dict[tuple[str, str], float] = {}
    last: dict[tuple[str, str], float] = {}
    for event, name, stamp in scheduler.events:
        first.setdefault((event, name), stamp)
        last[(event, name)] = stamp
    if not scheduler.events or ("end_backward", "") not in last:
        return None

    def span(start_key: tuple[str, str], end_key: tuple[str, str]) -> Optional[float]:
        if start_key not in first or end_key not in last:
            return None
        start, end = first[start_key], last[end_key]
        return max(end - start - _exposed_within(records, start, end), 0.0)

    units = []
    for unit in base.units:
        forward = span(("pre_forward", unit.name), ("post_forward", unit.name))
        backward = span(("pre_backward", unit.name), ("free", unit.name))
        if forward is None or backward is None:
            return None
        units.append(replace(unit, forward_s=forward, backward_s=backward))
    step = scheduler.events[-1][2] - scheduler.events[0][2]
    step_compute = step - _exposed_within(records, scheduler.events[0][2], scheduler.events[-1][2])
    other = max(step_compute - sum(u.forward_s + u.backward_s for u in units), 0.0)
    return replace(base, units=tuple(units), other_s=other)


def average_profiles(profiles: Sequence[Profile]) -> Profile:
    n = len(profiles)
    units = tuple(replace(u, forward_s=sum(p.units[i].forward_s for p in profiles) / n,
                          backward_s=sum(p.units[i].backward_s for p in profiles) / n)
                  for i, u in enumerate(profiles[0].units))
    return replace(profiles[0], units=units, other_s=sum(p.other_s for p in profiles) / n)


def drifted(old: Profile, new: Profile, tolerance: float = DRIFT) -> bool:
    """True when total compute, or a unit's compute that is a material share of it, moved by
    more than `tolerance`."""
    if abs(new.compute_s - old.compute_s) > tolerance * max(old.compute_s, 1e-9):
        return True
    material = 0.05 * old.compute_s / max(len(old.units), 1)
    for a, b in zip(old.units, new.units):
        before, after = a.forward_s + a.backward_s, b.forward_s + b.backward_s
        if abs(after - before) > max(tolerance * before, material):
            return True
    return False


@dataclass
class Decision:
    step: int
    forward_depth: int
    backward_depth: int
    reason: str


@dataclass
class Replanner:
    """Step-end callback that sets the scheduler's forward and backward prefetch depths
    from measured steps.

    Rank 0 decides; the decision is broadcast at fixed steps (FIRST_DECISION_STEP, then every
    REPLAN_EVERY), so every rank makes the same collective calls at the same points whether
    or not anything changed. Between decisions each rank only records its own timings.
    """

    base: Profile
    link: LinkModel
    bucket_bytes: int
    memory_budget_bytes: Optional[int]
    group: dist.ProcessGroup
    device: torch.device
    shared_depth: bool = False
    first_step: int = FIRST_DECISION_STEP
    every: int = REPLAN_EVERY
    history: list[Decision] = field(default_factory=list)
    _measured: list[Profile] = field(default_factory=list)
    _planned_on: Optional[Profile] = None

    def is_decision_step(self, step: int) -> bool:
        return step == self.first_step or (step > self.first_step and (step - self.first_step) % self.every == 0)

    def __call__(self, scheduler: Scheduler) -> None:
        if scheduler.step > 1 or self.first_step == 1:  # step 1 warms up
            measured = measure_profile(scheduler, self.base)
            if measured is not None:
                self._measured.append(measured)
        if not self.is_decision_step(scheduler.step):
            return
        current = (scheduler.prefetch_depth, scheduler.backward_depth)
        proposal = self.decide(current) if dist.get_rank(self.group) == 0 else None
        message = [proposal]
        dist.broadcast_object_list(message, src=dist.get_global_rank(self.group, 0), group=self.group)
        self._measured = []
        if message[0] is None:
            return
        forward_depth, backward_depth, reason = message[0]
        scheduler.prefetch_depth = forward_depth
        scheduler.backward_prefetch_depth = backward_depth
        self.history.append(Decision(scheduler.step, forward_depth, backward_depth, reason))
        logger.info("plan at step %d: %s", scheduler.step, reason)

    def decide(self, current: tuple[int, int]) -> Optional[tuple[int, int, str]]:
        """Rank 0's proposal from its measurements, or None to keep the current depths."""
        if not self._measured:
            return None
        profile = average_profiles(self._measured)
        first = self._planned_on is None
        if not first and not drifted(self._planned_on, profile):
            return None
        forward_depth, backward_depth, prediction = choose_depths(
            profile, self.link, self.memory_budget_bytes, shared=self.shared_depth)
        self._planned_on = profile
        cause = "measured" if first else "drift, re-planned"
        if not first and (forward_depth, backward_depth) != current:
            now = predict_step(profile, self.link, current[0], current[1], self.memory_budget_bytes)
            gain = (now.step_s - prediction.step_s) / now.step_s
            if gain < MIN_GAIN:
                cause = f"drift, re-planned, kept (depth {forward_depth} only {gain:.1%} faster)"
                forward_depth, backward_depth, prediction = current[0], current[1], now
        plan = Plan(forward_depth, backward_depth, self.bucket_bytes, "", prediction)
        return forward_depth, backward_depth, f"{cause}: {explain(profile, self.link, plan, self.memory_budget_bytes)}"
