"""Re-planning the prefetch depth from measured steps, the same decision on every rank."""
from __future__ import annotations

import logging
from dataclasses import dataclass, field, replace
from typing import Optional, Sequence

import torch
import torch.distributed as dist

from overlap.cost_model import Profile, predict_step
from overlap.planner import Plan, StartupPlan, choose_depths, cost_of_unit, explain
from overlap.scheduler import Scheduler
from overlap.topology import LinkModel

logger = logging.getLogger("overlap")

# Re-planning: first decision after this step (step 1 warms up), then a check every
# REPLAN_EVERY steps; a re-plan needs compute or communication to have drifted by DRIFT and
# the new depth to be predicted faster than the current one by MIN_GAIN (hysteresis).
FIRST_DECISION_STEP = 2
REPLAN_EVERY = 10
DRIFT = 0.20
MIN_GAIN = 0.03


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
