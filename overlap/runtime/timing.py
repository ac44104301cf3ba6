"""The record of the step in progress: marks and collectives with raw time stamps, turned
into a `StepRecord` when the step ends. See [Note: clocks] in overlap/step_record.py.
"""
from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any, Callable, Mapping, Optional

import torch

from overlap.base.step_record import Collective, Mark, StepKind, StepRecord, UnitEvent

# A stamp is a host time (float) or a recorded CUDA event, read when the step ends.
Stamp = Any
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
    name = "host"

    def stamp(self, stream: Optional[torch.cuda.Stream] = None) -> float:
        return time.perf_counter()

    def read(self, stamps: list[Stamp], wait: Callable[[Callable[[], bool]], None]) -> list[float]:
        return list(stamps)


class CudaClock:
    """Timing-enabled events recorded on the stream where the work runs, read once per step
    after one wait for the last of them. The events of a step are reused by the next
    (creating one costs more than recording it)."""

    name = "cuda"

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self._pool: list[torch.cuda.Event] = []
        self._used = 0

    def stamp(self, stream: Optional[torch.cuda.Stream] = None) -> torch.cuda.Event:
        if self._used == len(self._pool):
            self._pool.append(torch.cuda.Event(enable_timing=True))
        event = self._pool[self._used]
        self._used += 1
        event.record(stream if stream is not None else torch.cuda.current_stream(self.device))
        return event

    def read(self, stamps: list[Stamp], wait: Callable[[Callable[[], bool]], None]) -> list[float]:
        """Seconds since the step's first event. Everything the step did is ordered before an
        event recorded now on the compute stream (which waited for every collective), so
        waiting for that one makes every event readable."""
        if not stamps:
            return []
        last = self.stamp()
        wait(last.query)
        last.synchronize()
        origin = self._pool[0]
        values = [origin.elapsed_time(event) / 1e3 for event in stamps]
        self._used = 0
        return values


def clock_for(device: torch.device) -> HostClock | CudaClock:
    return CudaClock(device) if device.type == "cuda" else HostClock()


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


class StepLog:
    """What the scheduler and the collectives note during a step, with raw stamps."""

    def __init__(self, clock: HostClock | CudaClock) -> None:
        self.clock = clock
        self.events: list[tuple[Mark, str, Stamp]] = []
        self.collectives: list[CollectiveStamps] = []

    def mark(self, mark: Mark, unit: str) -> None:
        self.events.append((mark, unit, self.clock.stamp()))

    def collective(self, kind: str, unit: str, nbytes: int,
                   stream: Optional[torch.cuda.Stream] = None, uncompressed: Optional[int] = None
                   ) -> CollectiveStamps:
        entry = CollectiveStamps(kind, unit, nbytes, self.clock.stamp(stream), uncompressed_nbytes=uncompressed)
        self.collectives.append(entry)
        return entry

    def close(self, step: int, kind: StepKind, root: Optional[str], unit_bytes: Mapping[str, int],
              forwards: int, backwards: int, wait: Callable[[Callable[[], bool]], None]) -> StepRecord:
        """The step's record, times read from the clock; the log starts empty again."""
        stamps = [t for _, _, t in self.events]
        for c in self.collectives:
            stamps += [c.start, c.end, c.wait_start, c.wait_end]
        present = [s for s in stamps if s is not None]
        values = iter(self.clock.read(present, wait))
        times = [None if s is None else next(values) for s in stamps]
        events = tuple(UnitEvent(mark, unit, times[i]) for i, (mark, unit, _) in enumerate(self.events))
        collectives = []
        for i, c in enumerate(self.collectives):
            start, end, wait_start, wait_end = times[len(events) + 4 * i:len(events) + 4 * i + 4]
            end = end if end is not None else (wait_end if wait_end is not None else start)
            waited = (wait_start, wait_end) if wait_start is not None and wait_end is not None else None
            collectives.append(Collective(c.kind, c.unit, c.nbytes, start, end, waited, c.uncompressed_nbytes))
        self.events, self.collectives = [], []
        return StepRecord(step, kind, self.clock.name, events, tuple(collectives), root, dict(unit_bytes),
                          forwards, backwards)
