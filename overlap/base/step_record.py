"""One step as the runtime measured it: the typed record that the scheduler and the
collectives write, and that the overlap report, the re-planner, the trace timeline and the
benchmarks read. Plain data, no torch: anything can read a record without a process group.

[Note: what a step is]
A step ends when a backward pass that reduced gradients finishes, or when a forward pass
finishes that no backward can follow (under `torch.no_grad()`, evaluation, generation). It
holds everything since the previous step ended: micro-batches accumulated under `no_sync`
belong to the step whose backward reduces them. `Scheduler.step` counts steps and is the
only counter: the report, the re-planner and error messages all number steps by it.

[Note: clocks]
On CPU each time is the host's `time.perf_counter()` when the runtime got there. On CUDA the
host runs ahead of the device, so host times would say when work was launched, not when it
ran: times come from timing-enabled CUDA events recorded where the work runs, a unit's marks
on the compute stream, a collective's start and end on its side stream, and a wait as two
events on the compute stream around its `wait_event` (the stall between them). They are read
when the next step ends, as seconds since the step's first event (`overlap.runtime.timing`).
"""
from __future__ import annotations

import enum
from dataclasses import dataclass, replace
from typing import Mapping, NamedTuple, Optional

Interval = tuple[float, float]
# The kind of expert parallelism's all-to-alls (overlap.runtime.expert_parallel): recorded as
# the gathers and reductions are, reported apart from them.
ALL_TO_ALL = "all_to_all"


class Mark(str, enum.Enum):
    """What happened to a unit, in the order the runtime got there."""

    PREFETCH = "prefetch"              # an all-gather issued ahead of need
    GATHER = "gather"                  # an all-gather issued on demand
    HIT = "hit"                        # needed, and its gather was already in flight
    MISS = "miss"                      # needed, and not in flight: gathered on demand
    PRE_FORWARD = "pre_forward"        # parameters ready; the unit's forward starts
    POST_FORWARD = "post_forward"      # the unit's forward returned
    PRE_BACKWARD = "pre_backward"      # parameters ready; the unit's backward starts
    POST_BACKWARD = "post_backward"    # the unit's gradients are complete
    REDUCE = "reduce"                  # a reduce-scatter of its gradients issued
    FREE = "free"                      # its gathered parameters released
    END_BACKWARD = "end_backward"      # the backward pass ended (unit: "")


class StepKind(str, enum.Enum):
    TRAIN = "train"        # ended by a backward that reduced gradients
    FORWARD = "forward"    # ended by a forward that no backward follows


class UnitEvent(NamedTuple):
    """A mark of one unit. A tuple: the runtime writes several per unit and step."""

    mark: Mark
    unit: str
    time: float


@dataclass(frozen=True)
class Collective:
    """One all-gather, reduce-scatter or all-to-all. `start` to `end` is its time in flight:
    from its issue (host clock) or from when its stream reached it (CUDA) to its completion.
    `wait` is the time the caller was blocked on it (host) or the compute stream stalled on
    it (CUDA), None if nothing waited."""

    kind: str              # all_gather | reduce_scatter | all_reduce | all_to_all
    unit: str
    nbytes: int            # what this rank sends others: (N-1)/N of the buffer, compressed or not
    start: float
    end: float
    wait: Optional[Interval] = None
    uncompressed_nbytes: Optional[int] = None   # what it would send uncompressed; None: not compressed

    @property
    def raw_nbytes(self) -> int:
        """Bytes this collective would send without compression."""
        return self.nbytes if self.uncompressed_nbytes is None else self.uncompressed_nbytes

    @property
    def in_flight(self) -> Interval:
        return (self.start, max(self.end, self.start))

    @property
    def duration(self) -> float:
        return max(self.end - self.start, 0.0)

    @property
    def waited(self) -> float:
        return 0.0 if self.wait is None else max(self.wait[1] - self.wait[0], 0.0)


@dataclass(frozen=True)
class StepRecord:
    step: int
    kind: StepKind
    clock: str                            # host | cuda
    events: tuple[UnitEvent, ...]
    collectives: tuple[Collective, ...]
    root: Optional[str]                   # the root unit's name, None without one
    unit_bytes: Mapping[str, int]         # gathered (full-size) bytes of each unit
    forwards: int = 1
    backwards: int = 0

    def bounds(self) -> Interval:
        """From the first event or collective to the last."""
        starts = [e.time for e in self.events[:1]] + [c.start for c in self.collectives]
        ends = [e.time for e in self.events[-1:]] + [c.end for c in self.collectives]
        ends += [c.wait[1] for c in self.collectives if c.wait is not None]
        return (min(starts), max(ends)) if starts else (0.0, 0.0)

    def shifted(self, origin: float) -> "StepRecord":
        """The same record with `origin` as time zero."""
        def at(t: float) -> float:
            return t - origin

        return replace(self, events=tuple(e._replace(time=at(e.time)) for e in self.events),
                       collectives=tuple(replace(c, start=at(c.start), end=at(c.end),
                                                 wait=None if c.wait is None else (at(c.wait[0]), at(c.wait[1])))
                                         for c in self.collectives))
