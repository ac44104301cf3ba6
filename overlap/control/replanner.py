"""Re-planning the prefetch depth from measured steps, the same decision on every rank."""
from __future__ import annotations

import logging
from dataclasses import dataclass, field, replace
from typing import Optional, Sequence

import torch
import torch.distributed as dist

from overlap.plan.cost_model import CommLayout, Profile, predict_step
from overlap.plan.prefetch import Plan, choose_depths, explain
from overlap.control.startup_plan import StartupPlan, cost_of_unit
from overlap.observe.report import analyse_step
from overlap.runtime.scheduler import Scheduler
from overlap.base.step_record import StepKind, StepRecord
from overlap.plan.links import LinkModel

logger = logging.getLogger("overlap")

# Re-planning: first decision after this step, then a check every REPLAN_EVERY steps (steps
# as the scheduler counts them, evaluation forwards included, so that a decision step is
# never skipped); the first training step warms up and is not measured. A re-plan needs
# compute or communication to have drifted by DRIFT and the new depth to be predicted
# faster than the current one by MIN_GAIN (hysteresis).
FIRST_DECISION_STEP = 2
REPLAN_EVERY = 10
DRIFT = 0.20
MIN_GAIN = 0.03


def base_profile(scheduler: Scheduler, group: dist.ProcessGroup) -> Profile:
    """The scheduler's units and root with their sizes and no compute times yet."""
    return Profile(tuple(cost_of_unit(u) for u in scheduler.units), dist.get_world_size(group),
                   cost_of_unit(scheduler.root) if scheduler.root is not None else None,
                   reshard_after_forward=scheduler.reshard_after_forward)


def replanner_for(scheduler: Scheduler, startup: StartupPlan, bucket_bytes: int, group: dist.ProcessGroup,
                  device: torch.device) -> "Replanner":
    return Replanner(base_profile(scheduler, group), startup.layout or startup.link, bucket_bytes,
                     startup.memory_budget_bytes, group, device)


# ---- measurement and re-planning at run time ---------------------------------------------------

def measure_profile(record: StepRecord, base: Profile) -> Optional[Profile]:
    """`base` with the compute times of a training step of one forward and one backward
    (None for other steps, or when a unit did not run): each unit's forward and backward
    compute as the overlap report measures them, and as `other_s` the rest of the step that
    is not a wait (the root's compute and the runtime's own work)."""
    if record.kind is not StepKind.TRAIN or (record.forwards, record.backwards) != (1, 1):
        return None
    stats = analyse_step(record)
    measured = {u.unit: u for u in stats.units}
    if any(unit.name not in measured for unit in base.units):
        return None
    units = tuple(replace(unit, forward_s=measured[unit.name].forward_s, backward_s=measured[unit.name].backward_s)
                  for unit in base.units)
    waits = stats.gather_wait_s + stats.reduce_wait_s
    other = max(stats.span_s - waits - sum(u.forward_s + u.backward_s for u in units), 0.0)
    return replace(base, units=units, other_s=other)


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
    or not anything changed. Between decisions each rank only records its own timings. Called
    at the end of every step, training or evaluation (see [Note: what a step is]).
    """

    base: Profile
    link: LinkModel | CommLayout           # CommLayout: collectives on two link levels
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
    _trained: int = 0

    def is_decision_step(self, step: int) -> bool:
        return step == self.first_step or (step > self.first_step and (step - self.first_step) % self.every == 0)

    def __call__(self, scheduler: Scheduler) -> None:
        record = scheduler.last_step
        if record is not None and record.kind is StepKind.TRAIN:
            self._trained += 1
            measured = measure_profile(record, self.base) if self._trained > 1 or self.first_step == 1 else None
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
