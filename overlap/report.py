"""The overlap report: how much of each step's communication ran under compute, per step and
per unit, measured from the scheduler's events and the collectives' records.

What each number means and how it is measured
---------------------------------------------
Every time is a host clock reading (`time.perf_counter`) taken by the runtime; nothing is
modelled. A step runs from the first collective issued or event logged after the wrapped
module's forward starts to the end of its backward (the optimizer step is not part of it).

- compute: host time inside a unit's own work, less any time blocked on a collective within.
  Forward: a member module's pre-forward hook (logged once its parameters are ready) to its
  post-forward hook. Backward: the unit's pre-backward hook to its last gradient's arrival
  (its last `reduce` event, else its `free`). The root unit (parameters outside every unit:
  embeddings, head, loss) is charged whatever remains of its own forward and backward once
  the other units, the waits and the runtime's work (issuing each collective: from its issue
  to the next event; the hooks around each unit) are taken out.
- runtime: host time in the step that is neither compute nor a wait: issuing collectives,
  casting shards, the hooks themselves. On a loaded CPU it also holds time the host thread
  lost to gloo's threads.
- gather wait / reduce wait: host time blocked in `Pending.wait` (CommRecord.wait_start to
  wait_end) on all-gathers and on reduce-scatters (the end-of-backward flush included). A
  wait also covers the work done on completion (summing all-to-all chunks on gloo).
- communication (per step): the time during which at least one collective was in flight
  (issue to completion) or being waited on; concurrent collectives count once.
- hidden (per step): the part of that time during which the host was running unit compute.
- exposed (per step): communication - hidden: the host was blocked in a wait, or busy in the
  runtime (issuing a collective, hooks) while communication ran.
- per unit: `comm` sums each collective's own issue-to-completion time (a collective queued
  behind another counts its queueing time, so units can add up to more than the step) and
  `hidden` sums the part of each collective's issue-to-completion time spent in compute.
- completion: on CUDA a collective is complete when its wait returns (the host does not see
  the side stream's event fire earlier); on CPU gloo a future callback on gloo's thread stamps
  the moment the transfer finished.
- hits / misses: a unit whose all-gather was already in flight (prefetched) when it was
  needed, or that had to be gathered on demand. The root is gathered at every step start and
  counts as neither.
- bytes moved: bytes each rank sends per collective ((N-1)/N of the gathered or reduced
  buffer), summed.
- peak gathered bytes: the most gathered (full-size) parameter bytes held at once, replayed
  from the gather and free events with each unit's gathered size.

On a CPU machine gloo moves data with CPU threads: communication the report calls hidden did
not block the host, but it still competed with compute for the same cores.
"""
from __future__ import annotations

import bisect
from collections import deque
from dataclasses import dataclass, field, fields
from typing import TYPE_CHECKING, Optional, Sequence

from overlap.collectives import CommRecord
from overlap.intervals import Interval, length, overlap, subtract, union

if TYPE_CHECKING:
    from overlap.scheduler import Scheduler

Event = tuple[str, str, float]


@dataclass(frozen=True)
class Segment:
    """A stretch of host time: a unit's `forward` or `backward` compute, a `wait` on one of
    its collectives, or `runtime` (everything else in the step)."""

    unit: str
    kind: str
    start: float
    end: float


def _record_end(record: CommRecord) -> float:
    return record.issued + record.duration


def step_bounds(events: Sequence[Event], records: Sequence[CommRecord]) -> Interval:
    starts = [t for _, _, t in events[:1]] + [r.issued for r in records]
    ends = [t for _, _, t in events[-1:]] + [_record_end(r) for r in records]
    ends += [r.wait_end for r in records if r.wait_end is not None]
    if not starts:
        return (0.0, 0.0)
    return (min(starts), max(ends))


def _wait_intervals(records: Sequence[CommRecord]) -> list[Interval]:
    return [(r.wait_start, r.wait_end) for r in records if r.wait_start is not None and r.wait_end is not None]


def host_segments(events: Sequence[Event], records: Sequence[CommRecord],
                  root: Optional[str]) -> list[Segment]:
    """Split one step's host time into compute, wait and runtime segments (see module notes)."""
    own: list[tuple[str, str, Interval]] = []          # non-root compute, before waits are cut out
    hooks: list[Interval] = []                         # runtime work around each unit
    root_spans: list[tuple[str, Interval]] = []
    forward_open: dict[str, float] = {}
    forward_closed: dict[str, float] = {}               # post-forward time, until the unit is freed
    backward_open: dict[str, float] = {}
    last_reduce: dict[str, float] = {}
    gather_requested: dict[str, float] = {}
    backward_started: list[float] = []
    end_backward: Optional[float] = None

    for name, unit, t in events:
        if name in ("hit", "miss"):
            gather_requested[unit] = t
        elif name in ("pre_forward", "pre_backward"):
            if unit in gather_requested:
                hooks.append((gather_requested.pop(unit), t))
            forward_closed.pop(unit, None)
            if name == "pre_backward":
                backward_started.append(t)
                backward_open[unit] = t
                last_reduce.pop(unit, None)
            else:
                forward_open[unit] = t
        elif name == "post_forward" and unit in forward_open:
            start = forward_open.pop(unit)
            forward_closed[unit] = t
            if unit == root:
                root_spans.append(("forward", (start, t)))
            else:
                own.append((unit, "forward", (start, t)))
        elif name == "reduce":
            last_reduce[unit] = t
        elif name == "free" and unit in forward_closed:
            hooks.append((forward_closed.pop(unit), t))
        elif name == "free" and unit in backward_open:
            start = backward_open.pop(unit)
            done = last_reduce.pop(unit, t)
            hooks.append((done, t))
            if unit == root:
                root_spans.append(("backward", (start, done)))
            else:
                own.append((unit, "backward", (start, done)))
        elif name == "end_backward":
            end_backward = t
    # A unit whose backward never freed it (no trainable parameters) ends where the next
    # unit's backward starts, or with the backward pass.
    for unit, start in backward_open.items():
        later = [t for t in backward_started if t > start] + ([end_backward] if end_backward is not None else [])
        if later:
            span = ("backward", (start, min(later)))
            if unit == root:
                root_spans.append(span)
            else:
                own.append((unit, *span))

    # Issuing a collective ends at the first event logged after it (`prefetch`, `gather`,
    # or the unit's `free` after a reduce): runtime work, not the root's compute.
    times = [t for _, _, t in events]
    for r in records:
        after = bisect.bisect_left(times, r.issued)
        if after < len(times):
            hooks.append((r.issued, times[after]))

    waits = [(r.unit, (r.wait_start, r.wait_end)) for r in records
             if r.wait_start is not None and r.wait_end is not None]
    wait_intervals = [i for _, i in waits]
    segments = [Segment(unit, kind, s, e) for unit, kind, interval in own
                for s, e in subtract([interval], wait_intervals)]
    taken = [i for _, _, i in own] + wait_intervals + hooks
    segments += [Segment(root, kind, s, e) for kind, interval in root_spans for s, e in subtract([interval], taken)]
    segments += [Segment(unit, "wait", s, e) for unit, (s, e) in waits if e > s]
    busy = [(s.start, s.end) for s in segments]
    segments += [Segment("", "runtime", s, e) for s, e in subtract([step_bounds(events, records)], busy)]
    return sorted(segments, key=lambda s: s.start)


def peak_gathered_bytes(events: Sequence[Event], unit_bytes: dict[str, int], root: Optional[str]) -> int:
    """Replay gathers and frees: the most gathered bytes held at once in the step."""
    held: set[str] = {root} if root is not None and root in unit_bytes else set()
    peak = current = sum(unit_bytes[u] for u in held)
    for name, unit, _ in events:
        if name in ("prefetch", "gather") and unit not in held:
            held.add(unit)
            current += unit_bytes.get(unit, 0)
            peak = max(peak, current)
        elif name == "free" and unit in held:
            held.discard(unit)
            current -= unit_bytes.get(unit, 0)
    return peak


@dataclass(frozen=True)
class UnitStats:
    """One unit in one step (or the mean over steps); times in seconds."""

    unit: str
    forward_s: float = 0.0
    backward_s: float = 0.0
    gather_wait_s: float = 0.0
    reduce_wait_s: float = 0.0
    comm_s: float = 0.0
    hidden_s: float = 0.0
    gathers: float = 0
    hits: float = 0
    misses: float = 0
    bytes_moved: float = 0


@dataclass(frozen=True)
class StepStats:
    """One training step; times in seconds, see the module notes for each definition."""

    step: int
    span_s: float
    compute_s: float
    runtime_s: float
    comm_s: float
    hidden_s: float
    exposed_s: float
    gather_wait_s: float
    reduce_wait_s: float
    prefetches: float
    hits: float
    misses: float
    gathered_bytes: float
    reduced_bytes: float
    peak_gathered_bytes: float
    units: tuple[UnitStats, ...] = ()

    @property
    def hidden_fraction(self) -> float:
        return self.hidden_s / self.comm_s if self.comm_s > 0 else 1.0

    @property
    def bytes_moved(self) -> float:
        return self.gathered_bytes + self.reduced_bytes


def _compute_intervals(segments: Sequence[Segment]) -> list[Interval]:
    return union((s.start, s.end) for s in segments if s.kind in ("forward", "backward"))


def _unit_stats(unit: str, events: Sequence[Event], records: Sequence[CommRecord],
                segments: Sequence[Segment]) -> UnitStats:
    mine = [r for r in records if r.unit == unit]
    gathers = [r for r in mine if r.kind == "all_gather"]
    reduces = [r for r in mine if r.kind == "reduce_scatter"]
    return UnitStats(
        unit=unit,
        forward_s=sum(s.end - s.start for s in segments if s.unit == unit and s.kind == "forward"),
        backward_s=sum(s.end - s.start for s in segments if s.unit == unit and s.kind == "backward"),
        gather_wait_s=sum(r.exposed for r in gathers),
        reduce_wait_s=sum(r.exposed for r in reduces),
        comm_s=sum(r.duration for r in mine),
        hidden_s=sum(overlap([(r.issued, _record_end(r))], _compute_intervals(segments)) for r in mine),
        gathers=len(gathers),
        hits=sum(1 for name, u, _ in events if name == "hit" and u == unit),
        misses=sum(1 for name, u, _ in events if name == "miss" and u == unit),
        bytes_moved=sum(r.nbytes for r in mine),
    )


def analyse_step(step: int, events: Sequence[Event], records: Sequence[CommRecord],
                 unit_bytes: dict[str, int], root: Optional[str]) -> StepStats:
    """Turn one step's events and records into its statistics."""
    segments = host_segments(events, records, root)
    in_flight = [(r.issued, _record_end(r)) for r in records]
    compute = _compute_intervals(segments)
    communication = length(in_flight + _wait_intervals(records))
    hidden = overlap(in_flight, compute)
    units = list(dict.fromkeys([u for _, u, _ in events if u] + [r.unit for r in records]))
    count = lambda name: sum(1 for e, _, _ in events if e == name)  # noqa: E731
    start, end = step_bounds(events, records)
    return StepStats(
        step=step,
        span_s=end - start,
        compute_s=length(compute),
        runtime_s=sum(s.end - s.start for s in segments if s.kind == "runtime"),
        comm_s=communication,
        hidden_s=hidden,
        exposed_s=communication - hidden,
        gather_wait_s=sum(r.exposed for r in records if r.kind == "all_gather"),
        reduce_wait_s=sum(r.exposed for r in records if r.kind == "reduce_scatter"),
        prefetches=count("prefetch"),
        hits=count("hit"),
        misses=count("miss"),
        gathered_bytes=sum(r.nbytes for r in records if r.kind == "all_gather"),
        reduced_bytes=sum(r.nbytes for r in records if r.kind == "reduce_scatter"),
        peak_gathered_bytes=peak_gathered_bytes(events, unit_bytes, root),
        units=tuple(_unit_stats(u, events, records, segments) for u in units),
    )


def _mean(items: Sequence, **fixed):
    """Field-by-field mean of numeric dataclass fields (the others taken from `fixed`)."""
    kind = type(items[0])
    values = dict(fixed)
    for f in fields(kind):
        if f.name not in values:
            values[f.name] = sum(getattr(i, f.name) for i in items) / len(items)
    return kind(**values)


def format_seconds(seconds: float) -> str:
    return f"{seconds:.2f} s" if seconds >= 0.1 else f"{seconds * 1e3:.1f} ms"


@dataclass
class OverlapReport:
    """Per-step statistics; averages leave out the first `warmup_steps` steps when later
    ones exist (the first step learns the execution order and cannot prefetch in forward)."""

    steps: list[StepStats] = field(default_factory=list)
    warmup_steps: int = 1

    @property
    def steady_steps(self) -> list[StepStats]:
        return self.steps[self.warmup_steps:] if len(self.steps) > self.warmup_steps else list(self.steps)

    def mean_step(self) -> Optional[StepStats]:
        steady = self.steady_steps
        if not steady:
            return None
        return _mean(steady, step=steady[-1].step, units=tuple(self.per_unit()))

    def per_unit(self) -> list[UnitStats]:
        """Each unit's mean over the steady steps, in the order units first appear."""
        steady = self.steady_steps
        names = list(dict.fromkeys(u.unit for s in steady for u in s.units))
        out = []
        for name in names:
            rows = [u for s in steady for u in s.units if u.unit == name]
            total = _mean(rows, unit=name)
            # Average over all steady steps, counting a step the unit skipped as zero.
            scale = len(rows) / len(steady)
            out.append(UnitStats(name, *(getattr(total, f.name) * scale for f in fields(UnitStats)[1:])))
        return out

    def summary(self) -> str:
        """e.g. 'communication 1.31 s/step, 87% hidden, exposed 0.17 s'."""
        mean = self.mean_step()
        if mean is None:
            return "no step measured"
        return (f"communication {format_seconds(mean.comm_s)}/step, {100 * mean.hidden_fraction:.0f}% hidden, "
                f"exposed {format_seconds(mean.exposed_s)}")

    def to_text(self, last_steps: int = 5) -> str:
        """The summary, the mean step, a per-unit table and the last few steps, as text."""
        mean = self.mean_step()
        if mean is None:
            return self.summary()
        ms = lambda s: f"{s * 1e3:9.1f}"  # noqa: E731
        steady = self.steady_steps
        lines = [
            f"overlap report (mean of {len(steady)} step{'s' * (len(steady) != 1)}"
            f"{f', first {self.warmup_steps} left out' if len(self.steps) > len(steady) else ''})",
            self.summary(),
            f"step {format_seconds(mean.span_s)} (forward+backward): compute {format_seconds(mean.compute_s)}, "
            f"runtime {format_seconds(mean.runtime_s)}, gather wait {format_seconds(mean.gather_wait_s)}, "
            f"reduce wait {format_seconds(mean.reduce_wait_s)}",
            f"prefetch hits {mean.hits:.1f}, misses {mean.misses:.1f}; moved {mean.bytes_moved / 2**20:.2f} MB/step; "
            f"peak gathered {mean.peak_gathered_bytes / 2**20:.2f} MB",
            "",
            f"{'unit':<24}{'fwd ms':>9}{'bwd ms':>9}{'comm ms':>9}{'hidden':>9}{'g-wait':>9}{'r-wait':>9}"
            f"{'hits':>6}{'miss':>6}{'MB':>8}",
        ]
        for u in self.per_unit():
            lines.append(f"{u.unit[:23]:<24}{ms(u.forward_s)}{ms(u.backward_s)}{ms(u.comm_s)}{ms(u.hidden_s)}"
                         f"{ms(u.gather_wait_s)}{ms(u.reduce_wait_s)}{u.hits:6.1f}{u.misses:6.1f}"
                         f"{u.bytes_moved / 2**20:8.2f}")
        lines += ["", f"{'step':>6}{'span ms':>10}{'compute':>10}{'comm':>10}{'hidden':>10}{'exposed':>10}"
                      f"{'hidden %':>10}"]
        for s in self.steps[-last_steps:]:
            lines.append(f"{s.step:>6}{ms(s.span_s):>10}{ms(s.compute_s):>10}{ms(s.comm_s):>10}{ms(s.hidden_s):>10}"
                         f"{ms(s.exposed_s):>10}{100 * s.hidden_fraction:>9.0f}%")
        return "\n".join(lines)


class OverlapMonitor:
    """Collects an overlap report from a scheduler: add `on_step_end` to
    `scheduler.step_end_callbacks`. A step is one forward and backward pass (each
    micro-batch of gradient accumulation is one); the last `history` steps are kept."""

    def __init__(self, history: int = 1000, warmup_steps: int = 1) -> None:
        self._steps: deque[StepStats] = deque(maxlen=history)
        self._seen = 0
        self.warmup_steps = warmup_steps
        self.last: Optional[StepStats] = None

    def on_step_end(self, scheduler: "Scheduler") -> None:
        root = scheduler.root.name if scheduler.root is not None else None
        unit_bytes = {unit.name: unit.gathered_nbytes for unit in scheduler.all_units}
        # Steps are numbered by backward passes seen: forwards without backward (evaluation)
        # also advance `scheduler.step`.
        self._seen += 1
        self.last = analyse_step(self._seen, list(scheduler.events), list(scheduler.collectives.records),
                                 unit_bytes, root)
        self._steps.append(self.last)

    def report(self) -> OverlapReport:
        dropped = self._seen - len(self._steps)
        return OverlapReport(list(self._steps), max(self.warmup_steps - dropped, 0))
