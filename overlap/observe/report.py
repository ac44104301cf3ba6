"""The overlap report: how much of each step's communication ran under compute, per step and
per unit, read from the runtime's record of each step (`overlap.base.step_record`).

What each number means and how it is measured
---------------------------------------------
Every time is measured by the runtime; nothing is modelled. On CPU a time is a host clock
reading; on CUDA it is a CUDA event on the stream that did the work (see [Note: clocks] in
overlap/base/step_record.py), so "compute" is when the device computed, not when the host
launched. A training step runs from its first event or collective to the end of its
backward (the optimizer step is not part of it). Evaluation forwards are steps too (see
[Note: what a step is]) but the report counts training steps only.

- compute: time inside a unit's own work, less any time blocked on a collective within.
  Forward: from a unit's `pre_forward` (parameters ready) to its `post_forward`. Backward:
  from its `pre_backward` to its `post_backward` (its gradients complete); a unit with no
  trainable parameters ends where the next unit's backward starts, or with the backward pass.
  The root unit (parameters outside every unit: embeddings, head, loss) is charged whatever
  remains of its own forward and backward once the other units, the waits and the runtime's
  work are taken out. The runtime's work: from a `hit`/`miss` to the unit's pre-hook mark,
  from a unit's `post_forward` to its `free` right after, from its `post_backward` through
  the `reduce`/`free` right after, and from issuing a collective (`prefetch`, `gather`,
  `reduce`) to the next mark.
- runtime: time in the step that is neither compute nor a wait: issuing collectives, casting
  shards, the hooks themselves (on CUDA: the compute stream idle, waiting for the host). On
  a loaded CPU it also holds time the host thread lost to gloo's threads.
- gather wait / reduce wait: time blocked on all-gathers and on reduce-scatters (the
  end-of-backward flush included): on CPU the host in `Pending.wait` (which also covers the
  work done on completion, summing all-to-all chunks on gloo), on CUDA the compute stream
  stalled on the collective's event.
- communication (per step): the time during which at least one all-gather or reduction was
  in flight or being waited on; concurrent collectives count once.
- hidden (per step): the part of that time that ran under unit compute.
- exposed (per step): communication - hidden: a wait, or runtime, while communication ran.
- per unit: `comm` sums each collective's own time in flight (a collective queued behind
  another counts its queueing time on CPU, so units can add up to more than the step) and
  `hidden` sums the part of each spent under compute.
- in flight: on CPU from issue to completion (a future callback on gloo's thread stamps
  the moment the transfer finished); on CUDA from when its side stream reached it to its end.
- hits / misses: a unit whose all-gather was already in flight (prefetched) when it was
  needed, or that had to be gathered on demand. The root is gathered at every step start and
  counts as neither.
- bytes moved: bytes each rank sends per collective ((N-1)/N of the gathered or reduced
  buffer), summed; with compression, what it sends compressed, and `uncompressed_bytes`
  what the same collectives would have sent without it.
- peak gathered bytes: the most gathered (full-size) parameter bytes held at once, replayed
  from the gather and free marks with each unit's gathered size.
- all-to-all (expert parallelism only; the numbers above leave it out): the calls (each
  layer's count exchange, and each half's expert ids, tokens and results in forward, its
  results' and tokens' gradients in backward), the bytes this rank sent the other ranks, the
  time at least one was in flight or waited on, `exposed`: the time the caller was blocked
  waiting for one (its `wait()` on CPU, the compute stream stalled on CUDA), and `hidden`:
  the rest, in flight while the caller went on. On CUDA an all-to-all's time in flight ends
  with its wait (NCCL's work on its own stream gives no end to stamp). Its waits are cut out
  of compute as the gathers' are.

On a CPU machine gloo moves data with CPU threads: communication the report calls hidden did
not block the host, but it still competed with compute for the same cores.
"""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field, fields
from typing import Optional, Sequence

from overlap.base.intervals import Interval, length, overlap, overlap_each, subtract, union
from overlap.base.step_record import ALL_TO_ALL, Collective, Mark, StepKind, StepRecord, UnitEvent

# Gradient reductions: the reduce-scatter, and with hybrid sharding the all-reduce across replicas.
REDUCTION_KINDS = ("reduce_scatter", "all_reduce")


@dataclass(frozen=True)
class Segment:
    """A stretch of the step: a unit's `forward` or `backward` compute, a `wait` on one of
    its collectives, or `runtime` (everything else in the step)."""

    unit: str
    kind: str
    start: float
    end: float


def _runtime_spans(events: Sequence[UnitEvent]) -> list[Interval]:
    """The runtime's own work between marks (see the module notes)."""
    spans: list[Interval] = []
    requested: dict[str, float] = {}
    for i, event in enumerate(events):
        following = events[i + 1:]
        if event.mark in (Mark.HIT, Mark.MISS):
            requested[event.unit] = event.time
        elif event.mark in (Mark.PRE_FORWARD, Mark.PRE_BACKWARD) and event.unit in requested:
            spans.append((requested.pop(event.unit), event.time))
        elif event.mark is Mark.POST_FORWARD and following and following[0].mark is Mark.FREE \
                and following[0].unit == event.unit:
            spans.append((event.time, following[0].time))
        elif event.mark is Mark.POST_BACKWARD:
            end = event.time
            for later in following:
                if later.unit != event.unit or later.mark not in (Mark.REDUCE, Mark.FREE):
                    break
                end = later.time
            spans.append((event.time, end))
        if event.mark in (Mark.PREFETCH, Mark.GATHER, Mark.REDUCE) and following:
            spans.append((event.time, following[0].time))
    return spans


def _compute_spans(record: StepRecord) -> list[tuple[str, str, Interval]]:
    """(unit, forward|backward, interval) of every unit's own work, waits not yet cut out."""
    spans: list[tuple[str, str, Interval]] = []
    forward_open: dict[str, float] = {}
    backward_open: dict[str, float] = {}
    for event in record.events:
        if event.mark is Mark.PRE_FORWARD:
            forward_open[event.unit] = event.time
        elif event.mark is Mark.POST_FORWARD and event.unit in forward_open:
            spans.append((event.unit, "forward", (forward_open.pop(event.unit), event.time)))
        elif event.mark is Mark.PRE_BACKWARD:
            backward_open[event.unit] = event.time
        elif event.mark is Mark.POST_BACKWARD and event.unit in backward_open:
            spans.append((event.unit, "backward", (backward_open.pop(event.unit), event.time)))
    # A unit whose gradients never completed (no trainable parameters) ends where the next
    # unit's backward starts, or with the backward pass.
    later_starts = sorted([e.time for e in record.events if e.mark is Mark.PRE_BACKWARD]
                          + [e.time for e in record.events if e.mark is Mark.END_BACKWARD])
    for unit, start in backward_open.items():
        ends = [t for t in later_starts if t > start]
        if ends:
            spans.append((unit, "backward", (start, ends[0])))
    return spans


def segments(record: StepRecord) -> list[Segment]:
    """Split one step into compute, wait and runtime segments (see module notes)."""
    root = record.root
    own = [(unit, kind, interval) for unit, kind, interval in _compute_spans(record) if unit != root]
    root_spans = [(kind, interval) for unit, kind, interval in _compute_spans(record) if unit == root]
    waits = [(c.unit, c.wait) for c in record.collectives if c.wait is not None]
    wait_intervals = [i for _, i in waits]
    result = [Segment(unit, kind, s, e) for unit, kind, interval in own
              for s, e in subtract([interval], wait_intervals)]
    taken = [i for _, _, i in own] + wait_intervals + _runtime_spans(record.events)
    result += [Segment(root, kind, s, e) for kind, interval in root_spans for s, e in subtract([interval], taken)]
    result += [Segment(unit, "wait", s, e) for unit, (s, e) in waits if e > s]
    busy = [(s.start, s.end) for s in result]
    result += [Segment("", "runtime", s, e) for s, e in subtract([record.bounds()], busy)]
    return sorted(result, key=lambda s: s.start)


def peak_gathered_bytes(record: StepRecord) -> int:
    """Replay gathers and frees: the most gathered bytes held at once in the step."""
    unit_bytes = record.unit_bytes
    held: set[str] = set()
    peak = current = 0
    for event in record.events:
        if event.mark in (Mark.PREFETCH, Mark.GATHER) and event.unit not in held:
            held.add(event.unit)
            current += unit_bytes.get(event.unit, 0)
            peak = max(peak, current)
        elif event.mark is Mark.FREE and event.unit in held:
            held.discard(event.unit)
            current -= unit_bytes.get(event.unit, 0)
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
    uncompressed_bytes: float = 0
    # Expert parallelism's all-to-alls (see the module notes): calls, bytes sent to other
    # ranks, time in flight or waited on, the part of it waited on, and the rest.
    all_to_alls: float = 0
    all_to_all_bytes: float = 0
    all_to_all_s: float = 0
    all_to_all_exposed_s: float = 0
    all_to_all_hidden_s: float = 0

    @property
    def hidden_fraction(self) -> float:
        return self.hidden_s / self.comm_s if self.comm_s > 0 else 1.0

    @property
    def all_to_all_hidden_fraction(self) -> float:
        return self.all_to_all_hidden_s / self.all_to_all_s if self.all_to_all_s > 0 else 1.0

    @property
    def bytes_moved(self) -> float:
        return self.gathered_bytes + self.reduced_bytes


def _compute_intervals(parts: Sequence[Segment]) -> list[Interval]:
    return union((s.start, s.end) for s in parts if s.kind in ("forward", "backward"))


def _unit_stats(unit: str, mine: Sequence[Collective], parts: Sequence[Segment], marks: Sequence[Mark],
                compute: Sequence[Interval]) -> UnitStats:
    """One unit's statistics from its own collectives, compute segments and marks."""
    gathers = [c for c in mine if c.kind == "all_gather"]
    reduces = [c for c in mine if c.kind in REDUCTION_KINDS]
    return UnitStats(
        unit=unit,
        forward_s=sum(s.end - s.start for s in parts if s.kind == "forward"),
        backward_s=sum(s.end - s.start for s in parts if s.kind == "backward"),
        gather_wait_s=sum(c.waited for c in gathers),
        reduce_wait_s=sum(c.waited for c in reduces),
        comm_s=sum(c.duration for c in mine),
        hidden_s=overlap_each([c.in_flight for c in mine], compute),
        gathers=len(gathers),
        hits=marks.count(Mark.HIT),
        misses=marks.count(Mark.MISS),
        bytes_moved=sum(c.nbytes for c in mine),
    )


def _by_unit(items: Sequence, unit_of) -> dict[str, list]:
    grouped: dict[str, list] = {}
    for item in items:
        grouped.setdefault(unit_of(item), []).append(item)
    return grouped


def _all_to_all_times(exchanges: Sequence[Collective]) -> tuple[float, float]:
    """(time at least one of `exchanges` was in flight or waited on, time one was waited on)."""
    waits = [c.wait for c in exchanges if c.wait is not None]
    return length([c.in_flight for c in exchanges] + waits), length(waits)


def analyse_step(record: StepRecord) -> StepStats:
    """The statistics of one step."""
    parts = segments(record)
    exchanges = [c for c in record.collectives if c.kind == ALL_TO_ALL]
    zero3 = [c for c in record.collectives if c.kind != ALL_TO_ALL]     # gathers and reductions
    in_flight = [c.in_flight for c in zero3]
    waits = [c.wait for c in zero3 if c.wait is not None]
    compute = _compute_intervals(parts)
    communication = length(in_flight + waits)
    hidden = overlap(in_flight, compute)
    all_to_all_s, all_to_all_exposed_s = _all_to_all_times(exchanges)
    units = list(dict.fromkeys([e.unit for e in record.events if e.unit] + [c.unit for c in zero3]))
    marks = [e.mark for e in record.events]
    collectives = _by_unit(zero3, lambda c: c.unit)
    unit_parts = _by_unit(parts, lambda s: s.unit)
    unit_marks = {unit: [e.mark for e in events] for unit, events in _by_unit(record.events, lambda e: e.unit).items()}
    start, end = record.bounds()
    return StepStats(
        step=record.step,
        span_s=end - start,
        compute_s=length(compute),
        runtime_s=sum(s.end - s.start for s in parts if s.kind == "runtime"),
        comm_s=communication,
        hidden_s=hidden,
        exposed_s=communication - hidden,
        gather_wait_s=sum(c.waited for c in record.collectives if c.kind == "all_gather"),
        reduce_wait_s=sum(c.waited for c in record.collectives if c.kind in REDUCTION_KINDS),
        prefetches=marks.count(Mark.PREFETCH),
        hits=marks.count(Mark.HIT),
        misses=marks.count(Mark.MISS),
        gathered_bytes=sum(c.nbytes for c in record.collectives if c.kind == "all_gather"),
        reduced_bytes=sum(c.nbytes for c in record.collectives if c.kind in REDUCTION_KINDS),
        peak_gathered_bytes=peak_gathered_bytes(record),
        uncompressed_bytes=sum(c.raw_nbytes for c in record.collectives
                               if c.kind == "all_gather" or c.kind in REDUCTION_KINDS),
        units=tuple(_unit_stats(u, collectives.get(u, []), unit_parts.get(u, []), unit_marks.get(u, []), compute)
                    for u in units),
        all_to_alls=len(exchanges),
        all_to_all_bytes=sum(c.nbytes for c in exchanges),
        all_to_all_s=all_to_all_s,
        all_to_all_exposed_s=all_to_all_exposed_s,
        all_to_all_hidden_s=all_to_all_s - all_to_all_exposed_s,
    )


class ClosedStep:
    """What every step-end controller and observer is handed when a step ends: its record,
    and for a training step its statistics. The analysis costs far more host time than
    recording the step, and most steps are read by no one (the re-planner measures a few
    steps before each decision, the report is read when asked for), so it runs the first
    time `stats` is read, once for all readers."""

    def __init__(self, record: StepRecord, stats: Optional[StepStats] = None) -> None:
        self.record = record
        self._stats = stats

    @property
    def stats(self) -> Optional[StepStats]:
        """None when the step is not a training step."""
        if self._stats is None and self.record.kind is StepKind.TRAIN:
            self._stats = analyse_step(self.record)
        return self._stats

    @classmethod
    def of(cls, record: StepRecord) -> "ClosedStep":
        return cls(record)


def _mean(items: Sequence, **fixed):
    """Field-by-field mean of numeric dataclass fields (the others taken from `fixed`)."""
    kind = type(items[0])
    values = dict(fixed)
    for f in fields(kind):
        if f.name not in values:
            values[f.name] = sum(getattr(i, f.name) for i in items) / len(items)
    return kind(**values)


def _before_compression(stats: StepStats) -> str:
    """' (X MB before compression)' when compression changed the bytes moved, else ''."""
    if abs(stats.uncompressed_bytes - stats.bytes_moved) < 0.5:
        return ""
    return f" ({stats.uncompressed_bytes / 2**20:.2f} MB before compression)"


def format_seconds(seconds: float) -> str:
    return f"{seconds:.2f} s" if seconds >= 0.1 else f"{seconds * 1e3:.1f} ms"


def _all_to_all_line(stats: StepStats) -> str:
    """e.g. 'all-to-all: 22.0 calls, 0.05 MB/step, in flight 31.2 ms, exposed 12.0 ms, 62% hidden'."""
    return (f"all-to-all: {stats.all_to_alls:.1f} calls, {stats.all_to_all_bytes / 2**20:.2f} MB/step, "
            f"in flight {format_seconds(stats.all_to_all_s)}, exposed {format_seconds(stats.all_to_all_exposed_s)}, "
            f"{100 * stats.all_to_all_hidden_fraction:.0f}% hidden")


@dataclass
class OverlapReport:
    """Per-step statistics; averages leave out the first `warmup_steps` steps when later
    ones exist (the first step learns the execution order and cannot prefetch in forward)."""

    steps: list[StepStats] = field(default_factory=list)
    warmup_steps: int = 1
    # Explicit schedule requests the runtime took as hints (`fully_shard`'s prefetch lists, say).
    hints: list[str] = field(default_factory=list)
    # Choices the runtime made that a user can override (which units stay gathered across
    # microbatches, say), each with how it was made.
    decisions: list[str] = field(default_factory=list)

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
            f"prefetch hits {mean.hits:.1f}, misses {mean.misses:.1f}; moved {mean.bytes_moved / 2**20:.2f} MB/step"
            f"{_before_compression(mean)}; peak gathered {mean.peak_gathered_bytes / 2**20:.2f} MB",
            *([_all_to_all_line(mean)] if mean.all_to_alls else []),
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
        if self.decisions:
            lines += ["", "decided:", *(f"  {d}" for d in self.decisions)]
        if self.hints:
            lines += ["", "taken as hints (the runtime's own schedule decides):", *(f"  {h}" for h in self.hints)]
        return "\n".join(lines)


class OverlapMonitor:
    """Collects an overlap report from the closed steps it is handed (a step-end observer,
    see `overlap.control.step_end`). Training steps only (see [Note: what a step is]); the
    last `history` of them are kept, as records, and analysed when the report is read."""

    def __init__(self, history: int = 200, warmup_steps: int = 1) -> None:
        self._steps: deque[ClosedStep] = deque(maxlen=history)
        self._seen = 0
        self.warmup_steps = warmup_steps
        self.hints: list[str] = []

    def on_step_end(self, step: ClosedStep) -> None:
        if step.record.kind is not StepKind.TRAIN:
            return
        self._seen += 1
        self._steps.append(step)

    @property
    def last(self) -> Optional[StepStats]:
        """The last training step's statistics (None before the first)."""
        return self._steps[-1].stats if self._steps else None

    def report(self, decisions: Sequence[str] = ()) -> OverlapReport:
        dropped = self._seen - len(self._steps)
        return OverlapReport([step.stats for step in self._steps], max(self.warmup_steps - dropped, 0),
                             list(self.hints), list(decisions))
