"""Re-planning the prefetch depth from measured steps, the same decision on every rank."""
from __future__ import annotations

import logging
from collections import Counter
from dataclasses import dataclass, field, replace
from typing import Optional, Sequence

import torch.distributed as dist

from overlap.plan.cost_model import CommLayout, Profile, UnitCost, predict_step
from overlap.plan.prefetch import Plan, choose_depths, explain
from overlap.control.agreement import decided_by_rank0
from overlap.control.startup_plan import StartupPlan, cost_of_unit
from overlap.control.step_end import PrefetchDepths
from overlap.observe.report import ClosedStep
from overlap.runtime.unit import Unit
from overlap.base.step_record import StepKind, StepRecord
from overlap.plan.links import LinkModel

logger = logging.getLogger("overlap")

# Re-planning: first decision after this step, then a check every REPLAN_EVERY steps (steps
# as the scheduler counts them, evaluation forwards included, so that a decision step is
# never skipped); the first training step warms up and is not measured. A re-plan needs
# compute or communication to have drifted by DRIFT and the new depth to be predicted
# faster than the current one by MIN_GAIN (hysteresis). A decision reads the training steps
# among the MEASURED_STEPS steps that end with it: analysing a step costs host time, and
# steps further back describe the workload no better. Each decision that finds nothing to
# re-plan doubles the interval to the next, up to MAX_REPLAN_EVERY; one that re-plans brings it
# back to REPLAN_EVERY (a steady workload stops paying for checks that change nothing).
FIRST_DECISION_STEP = 2
REPLAN_EVERY = 10
MAX_REPLAN_EVERY = 160
MEASURED_STEPS = 3
DRIFT = 0.20
MIN_GAIN = 0.03


def base_profile(root: Optional[Unit], units: Sequence[Unit], world_size: int, reshard_after_forward: bool) -> Profile:
    """The built units and root with their sizes and no compute times yet."""
    return Profile(tuple(cost_of_unit(u) for u in units), world_size,
                   cost_of_unit(root) if root is not None else None, reshard_after_forward=reshard_after_forward)


def replanner_for(base: Profile, startup: StartupPlan, bucket_bytes: int, group: dist.ProcessGroup,
                  depths: PrefetchDepths) -> "Replanner":
    """`group`: every rank, host-side (the end-of-backward flags' gloo group). See [Note: step-end
    decisions on the host] in overlap/control/agreement.py."""
    return Replanner(base, startup.layout or startup.link, bucket_bytes, startup.memory_budget_bytes, group, depths)


# ---- measurement and re-planning at run time ---------------------------------------------------

def measure_profile(step: ClosedStep, base: Profile) -> Optional[Profile]:
    """`base` with the compute times of a training step, per micro-batch (None for other
    steps, or when a unit did not run): each unit's forward and backward compute as the
    overlap report measures them, and as `other_s` the rest of the step that is not a wait
    (the root's compute and the runtime's own work).

    A step of k micro-batches (k forwards and k backwards, gradient accumulation) is taken as
    k steps of one: its times divided by k, and each unit's reduction bytes scaled by the
    reductions it made over k (under `no_sync` one per step, so 1/k of a reduction per
    micro-batch), which is what the cost model's one-forward-one-backward step then replays."""
    record, stats = step.record, step.stats
    micro_batches = record.forwards
    if stats is None or micro_batches < 1 or record.backwards != micro_batches:
        return None
    measured = {u.unit: u for u in stats.units}
    if any(unit.name not in measured for unit in base.units):
        return None
    units = tuple(replace(unit, forward_s=measured[unit.name].forward_s / micro_batches,
                          backward_s=measured[unit.name].backward_s / micro_batches)
                  for unit in base.units)
    waits = stats.gather_wait_s + stats.reduce_wait_s
    other = max(stats.span_s - waits, 0.0) / micro_batches - sum(u.forward_s + u.backward_s for u in units)
    profile = replace(base, units=units, other_s=max(other, 0.0))
    return profile if micro_batches == 1 else _reductions_per_micro_batch(profile, record, micro_batches)


def _reductions_per_micro_batch(profile: Profile, record: StepRecord, micro_batches: int) -> Profile:
    """`profile` with each unit's (and the root's) reduction bytes times the share of its
    micro-batches whose backward reduced it."""
    reduced = Counter(c.unit for c in record.collectives if c.kind == "reduce_scatter")

    def share(unit: UnitCost) -> UnitCost:
        return replace(unit, reduce_bytes=int(unit.reduce_bytes * min(reduced[unit.name] / micro_batches, 1.0)))

    return replace(profile, units=tuple(share(u) for u in profile.units),
                   root=None if profile.root is None else share(profile.root))


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
    """Step-end controller (`overlap.control.step_end`) that sets the forward and backward
    prefetch depths from measured steps.

    Rank 0 decides; the decision is broadcast at steps every rank computes alike
    (FIRST_DECISION_STEP, then intervals from REPLAN_EVERY to MAX_REPLAN_EVERY that follow the
    broadcast decisions), so every rank makes the same collective calls at the same points
    whether or not anything changed. Between decisions each rank only analyses the few steps
    the next decision reads. Called
    at the end of every step, training or evaluation (see [Note: what a step is]).
    """

    base: Profile
    link: LinkModel | CommLayout           # CommLayout: collectives on two link levels
    bucket_bytes: int
    memory_budget_bytes: Optional[int]
    group: dist.ProcessGroup
    depths: PrefetchDepths
    first_step: int = FIRST_DECISION_STEP
    every: int = REPLAN_EVERY               # steps from a decision that re-planned to the next
    history: list[Decision] = field(default_factory=list)
    _measured: list[Profile] = field(default_factory=list)
    _planned_on: Optional[Profile] = None
    _trained: int = 0
    _next_decision: Optional[int] = None
    _interval: int = 0

    @property
    def next_decision_step(self) -> int:
        return self.first_step if self._next_decision is None else self._next_decision

    def on_step_end(self, step: ClosedStep) -> None:
        number = step.record.step
        if step.record.kind is StepKind.TRAIN:
            self._trained += 1
            wanted = self.next_decision_step - number < MEASURED_STEPS
            if wanted and (self._trained > 1 or self.first_step == 1):
                measured = measure_profile(step, self.base)
                if measured is not None:
                    self._measured.append(measured)
        if number < self.next_decision_step:
            return
        current = self.depths.current
        proposal = decided_by_rank0(self.group, lambda: self.decide(current))
        self._measured = []
        # A decision that found nothing to re-plan doubles the interval to the next.
        steady = proposal is None and self._next_decision is not None
        self._interval = min(2 * self._interval, MAX_REPLAN_EVERY) if steady else self.every
        self._next_decision = number + self._interval
        if proposal is None:
            return
        forward_depth, backward_depth, reason = proposal
        self.depths.set(forward_depth, backward_depth)
        self.history.append(Decision(number, forward_depth, backward_depth, reason))
        logger.info("plan at step %d: %s", number, reason)

    def decide(self, current: tuple[int, int]) -> Optional[tuple[int, int, str]]:
        """Rank 0's proposal from its measurements, or None to keep the current depths."""
        if not self._measured:
            return None
        profile = average_profiles(self._measured)
        first = self._planned_on is None
        if not first and not drifted(self._planned_on, profile):
            return None
        forward_depth, backward_depth, prediction = choose_depths(
            profile, self.link, self.memory_budget_bytes, shared=False)
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
