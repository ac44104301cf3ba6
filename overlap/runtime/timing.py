"""The record of the step in progress: marks and collectives with raw time stamps, turned
into a `StepRecord` when the step ends. See [Note: clocks] in overlap/base/step_record.py.

[Note: reading CUDA times one step late]
A CUDA event can be read only once it has completed. Reading a step's events when it closes
would make the host wait for the device to finish the step: the GPU would idle while the
host queued the optimizer step and the next forward. So the record of step k is read when
step k+1 closes: by then its events have normally completed (`Event.query`, no wait); if
the host has run more than a step ahead, waiting for step k's last event leaves step k+1's
work queued behind it, so the device does not idle. On CUDA `StepLog.close` therefore gives
the previous step's record (None at the first close); on CPU it gives the step's own.
`StepLog.flush` reads the step still unread, for a caller that needs every step's record
now (a check comparing records with counters, the last step's report).

[Note: the late host clock]
Code that reads step records (checks, controllers, the report) must work with records that
arrive one step late, and a CPU machine would never run that path. `LateHostClock` takes
host times and delivers them as the CUDA clock does: sealed at the close, read at the next
close or a flush. `records_one_step_late()` makes models built inside it use it on CPU (the
GPU check's rehearsal, tests).
"""
from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass
from typing import Any, Callable, Iterator, Mapping, NamedTuple, Optional

import torch

from overlap.base.step_record import Collective, Mark, StepKind, StepRecord, UnitEvent

# A stamp is a host time (float) or a recorded CUDA event, read when the step ends.
Stamp = Any
_new_event = tuple.__new__
# How often a wait on something nothing signals (a CUDA event) looks again.
POLL_S = 20e-6


def polling(done: Callable[[], bool]) -> Callable[[float], bool]:
    """`sleep(seconds)`: wait at most that long for `done()`, looking every POLL_S; returns
    `done()`. For a CUDA event, whose own `synchronize()` cannot give up."""
    def sleep(seconds: float) -> bool:
        deadline = time.monotonic() + seconds
        while not done():
            if time.monotonic() >= deadline:
                return False
            time.sleep(POLL_S)
        return True

    return sleep


class HostClock:
    """Host times: a stamp is the time itself, nothing to read when the step closes."""

    name = "host"
    # The record of a step is given when the step closes.
    deferred = False

    def stamp(self, stream: Optional[torch.cuda.Stream] = None) -> float:
        return time.perf_counter()

    def seal(self) -> None:
        return None


class SealedEvents(NamedTuple):
    """The events one step recorded, in order, and `last`, recorded on the compute stream
    when the step closed: once it has completed, every event of the step has."""

    events: list[torch.cuda.Event]
    last: torch.cuda.Event


class CudaClock:
    """Timing-enabled events recorded on the stream where the work runs. See [Note: reading
    CUDA times one step late]. Events are reused once read (creating one costs more than
    recording it)."""

    name = "cuda"
    deferred = True

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self._free: list[torch.cuda.Event] = []
        self._recorded: list[torch.cuda.Event] = []     # this step's, in order

    def _event(self) -> torch.cuda.Event:
        return self._free.pop() if self._free else torch.cuda.Event(enable_timing=True)

    def stamp(self, stream: Optional[torch.cuda.Stream] = None) -> torch.cuda.Event:
        event = self._event()
        event.record(stream if stream is not None else torch.cuda.current_stream(self.device))
        self._recorded.append(event)
        return event

    def seal(self) -> SealedEvents:
        """End this step's events: everything the step did is ordered before an event
        recorded now on the compute stream (which waited for every collective)."""
        last = self._event()
        last.record(torch.cuda.current_stream(self.device))
        sealed, self._recorded = SealedEvents(self._recorded, last), []
        return sealed

    def read(self, sealed: SealedEvents, stamps: list[Stamp], wait: Callable[[Callable[[], bool]], None]
             ) -> list[float]:
        """Seconds since the sealed step's first event, once its last one has completed
        (`wait` waits for it, with the order check; the host polls on, without a CUDA
        synchronisation, if that returned early). Its events are then free for reuse."""
        done = sealed.last.query
        if not done():
            wait(done)
            polling(done)(float("inf"))
        values = [sealed.events[0].elapsed_time(event) / 1e3 for event in stamps] if stamps else []
        self._free += sealed.events + [sealed.last]
        return values


class LateHostClock:
    """Host times delivered one step late, as CudaClock delivers its events. See [Note: the
    late host clock]."""

    name = "host"
    deferred = True

    def stamp(self, stream: Optional[torch.cuda.Stream] = None) -> float:
        return time.perf_counter()

    def seal(self) -> float:
        return time.perf_counter()

    def read(self, sealed: float, stamps: list[Stamp], wait: Callable[[Callable[[], bool]], None]) -> list[float]:
        """The stamps as they are: a host time is its own value, and the step sealed before
        this read, so there is nothing to wait for."""
        return list(stamps)


Clock = HostClock | CudaClock | LateHostClock
# See [Note: the late host clock]; read when a model is built.
_late_on_cpu = False


@contextlib.contextmanager
def records_one_step_late() -> Iterator[None]:
    """Models built inside take CPU step records with LateHostClock, one step late as on CUDA."""
    global _late_on_cpu
    saved, _late_on_cpu = _late_on_cpu, True
    try:
        yield
    finally:
        _late_on_cpu = saved


def clock_for(device: torch.device) -> Clock:
    if device.type == "cuda":
        return CudaClock(device)
    return LateHostClock() if _late_on_cpu else HostClock()


@dataclass
class CollectiveStamps:
    """A collective of the step in progress; `end` and the wait are stamped when they happen
    (`end` from gloo's own thread on CPU)."""

    kind: str
    unit: str
    nbytes: int
    start: Stamp
    end: Optional[Stamp] = None
    wait_start: Optional[Stamp] = None
    wait_end: Optional[Stamp] = None
    uncompressed_nbytes: Optional[int] = None   # with compression: `nbytes` before it


@dataclass
class ClosedLog:
    """A closed step whose times are not read yet: what the record needs, the stamps as they
    were when the step closed, and the clock's handle on them."""

    step: int
    kind: StepKind
    root: Optional[str]
    unit_bytes: dict[str, int]
    forwards: int
    backwards: int
    events: list[UnitEvent]                 # times: stamps, not read yet
    collectives: list[tuple[CollectiveStamps, tuple[Stamp, Stamp, Stamp, Stamp]]]
    sealed: Any                             # the clock's seal: SealedEvents on CUDA


class StepLog:
    """What the scheduler and the collectives note during a step, with raw stamps."""

    def __init__(self, clock: Clock) -> None:
        self.clock = clock
        self.events: list[UnitEvent] = []      # times: stamps, read when the step closes
        self.collectives: list[CollectiveStamps] = []
        # CUDA: the closed step whose record is read when the next one closes.
        self._unread: Optional[ClosedLog] = None

    def mark(self, mark: Mark, unit: str) -> None:
        # The event's time is the clock's stamp until the step's times are read. Made as a
        # tuple is (the named tuple's own constructor is a Python call): several per unit and step.
        self.events.append(_new_event(UnitEvent, (mark, unit, self.clock.stamp())))

    def collective(self, kind: str, unit: str, nbytes: int,
                   stream: Optional[torch.cuda.Stream] = None, uncompressed: Optional[int] = None
                   ) -> CollectiveStamps:
        entry = CollectiveStamps(kind, unit, nbytes, self.clock.stamp(stream), uncompressed_nbytes=uncompressed)
        self.collectives.append(entry)
        return entry

    def close(self, step: int, kind: StepKind, root: Optional[str], unit_bytes: Mapping[str, int],
              forwards: int, backwards: int, wait: Callable[[Callable[[], bool]], None]) -> Optional[StepRecord]:
        """Close the step; the log starts empty again. Returns a record with its times read
        from the clock: this step's on the host clock, the previous step's on CUDA (None at
        the first close; see [Note: reading CUDA times one step late])."""
        closed = ClosedLog(step, kind, root, dict(unit_bytes), forwards, backwards, self.events,
                           [(c, (c.start, c.end, c.wait_start, c.wait_end)) for c in self.collectives],
                           self.clock.seal())
        self.events, self.collectives = [], []
        if self.clock.deferred:
            closed, self._unread = self._unread, closed
        return None if closed is None else self._record(closed, wait)

    def flush(self, wait: Callable[[Callable[[], bool]], None]) -> Optional[StepRecord]:
        """The record of the closed step not yet read (deferred clocks), None if there is none.
        The next close then gives no record again: records still come once each, in order."""
        closed, self._unread = self._unread, None
        return None if closed is None else self._record(closed, wait)

    def _record(self, closed: ClosedLog, wait: Callable[[Callable[[], bool]], None]) -> StepRecord:
        fours = [four for _, four in closed.collectives]
        if self.clock.deferred:
            stamps = [event.time for event in closed.events] + [t for four in fours for t in four]
            values = iter(self.clock.read(closed.sealed, [s for s in stamps if s is not None], wait))
            times = [None if s is None else next(values) for s in stamps]
            events = tuple(UnitEvent(mark, unit, time) for (mark, unit, _), time in zip(closed.events, times))
            fours = [tuple(times[len(events) + 4 * i:len(events) + 4 * i + 4]) for i in range(len(fours))]
        else:
            events = tuple(closed.events)          # host stamps are the times already
        collectives = []
        for (c, _), (start, end, wait_start, wait_end) in zip(closed.collectives, fours):
            end = end if end is not None else (wait_end if wait_end is not None else start)
            waited = (wait_start, wait_end) if wait_start is not None and wait_end is not None else None
            collectives.append(Collective(c.kind, c.unit, c.nbytes, start, end, waited, c.uncompressed_nbytes))
        return StepRecord(closed.step, closed.kind, self.clock.name, events, tuple(collectives), closed.root,
                          closed.unit_bytes, closed.forwards, closed.backwards)
