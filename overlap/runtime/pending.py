"""An issued collective as its consumer sees it: what signals its completion, the buffers it
keeps alive until then, and the completion work that runs when the consumer waits.

[Note: keeping buffers alive until the consumer waited]
Every buffer a collective reads or writes (its input, the side stream's temporaries, the
received records) is held by its `Pending` until the consumer has waited. On CUDA the side
stream may still use them when the issuing code returns; holding them, instead of
`record_stream`, keeps the caching allocator from handing their memory to another stream
before the compute stream has waited on the collective's event, and frees them at the wait,
not at some later point the allocator picks. On gloo, gloo's threads read and write them
until the work completes.

[Note: completion work drops its buffers]
Completion work is a list of callbacks that compose: each path adds its own (a compressed
gather's dequantisation, then hpZ's node copy of the result) and none replaces another's.
When the wait has run them, the `Pending` drops the callbacks, the chained issue and the kept
buffers, so received records are freed when the wait ends rather than when the `Pending`
itself goes (measured: a compressed step's peak memory stayed 4.6 MiB above the
uncompressed one's while finished callbacks kept their records).
"""
from __future__ import annotations

import threading
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Callable, NamedTuple, Optional

import torch
import torch.distributed as dist

from overlap.runtime.timing import CollectiveStamps, CudaClock, HostClock

if TYPE_CHECKING:
    from overlap.runtime.order_check import OrderCheck


def wait_watched(work: dist.Work, watch: Optional["OrderCheck"], done: Callable[[], bool],
                 sleep: Callable[[float], bool]) -> None:
    """`work.wait()`, with `watch` (if any) turning a wait that never ends because ranks ran
    different units, or a failure that follows from it, into an error that says so (see
    overlap.runtime.order_check). `done` and `sleep` as `OrderCheck.block` takes them."""
    if watch is not None:
        watch.block(done, sleep)
    try:
        work.wait()
    except RuntimeError:
        if watch is not None:
            watch.after_error()
        raise


class StreamHandoff(NamedTuple):
    """A collective issued on a CUDA side stream: the event recorded there after its last
    kernel, the device whose compute stream (its current stream when the wait runs) waits on
    it, and every buffer the side stream touched. See [Note: keeping buffers alive until the
    consumer waited]."""

    event: torch.cuda.Event
    device: torch.device
    buffers: tuple[torch.Tensor, ...]

    def wait(self) -> None:
        torch.cuda.current_stream(self.device).wait_event(self.event)


class HostWork(NamedTuple):
    """A collective gloo runs on its own threads: its work handle; `finished`, set from gloo's
    thread when the work completes so that a wait can give up on it in time; the order check
    watching the wait (None with one rank); the buffers gloo reads and writes."""

    work: dist.Work
    finished: threading.Event
    watch: Optional["OrderCheck"]
    buffers: tuple[torch.Tensor, ...]

    def wait(self) -> None:
        wait_watched(self.work, self.watch, self.finished.is_set, self.finished.wait)


@dataclass
class Pending:
    """An issued collective. `wait()` waits for it (the host for gloo work; the compute stream
    for a CUDA side stream's event), runs its completion work in the order it was added,
    issues the collective chained after it (hybrid sharding's all-reduce across replicas, on
    gloo) into `follow_up`, and drops what it held. A second `wait()` returns at once. On
    CUDA the chained collective was issued with this one, on its own stream, and is in
    `follow_up` from the start."""

    # This collective's entry in the step log; the wait is stamped into it.
    record: CollectiveStamps
    clock: HostClock | CudaClock
    # What signals completion; None when nothing is in flight (one rank, or waited).
    signal: StreamHandoff | HostWork | None = None
    # Completion work. See [Note: completion work drops its buffers].
    callbacks: list[Callable[[], None]] = field(default_factory=list)
    # gloo: issues the chained collective once this one has completed. What it issued (or,
    # on CUDA, what was issued with this one) is `follow_up`, for the caller to wait on later.
    chained: Optional[Callable[[], "Pending"]] = None
    follow_up: Optional["Pending"] = None
    done: bool = False
    # gloo: completion work for the chained collective, added to it once it is issued.
    after_chained: list[Callable[[], None]] = field(default_factory=list)

    def then_run(self, work: Callable[[], None]) -> None:
        """Run `work` when the consumer waits, after the collective and after the completion
        work added before it (on CUDA: on the compute stream, once it has waited). Adds to
        the list; never replaces."""
        if self.done:
            raise RuntimeError(f"completion work added to the {self.record.kind} of {self.record.unit} "
                               "after it was waited for")
        self.callbacks.append(work)

    def then_run_chained(self, work: Callable[[], None]) -> None:
        """Run `work` as the completion work of the collective chained to this one (hybrid's
        all-reduce across replicas), after its own: on CUDA it was issued with this one, on
        gloo it is issued when this one is waited for."""
        if self.follow_up is not None:
            self.follow_up.then_run(work)
        elif self.chained is not None:
            self.after_chained.append(work)
        else:
            raise RuntimeError(f"the {self.record.kind} of {self.record.unit} chains no collective")

    def wait(self) -> None:
        if self.done:
            return
        self.record.wait_start = self.clock.stamp()
        if self.signal is not None:
            self.signal.wait()
        while self.callbacks:
            self.callbacks.pop(0)()
        if self.chained is not None:
            chained, self.chained = self.chained, None
            self.follow_up = chained()
            for work in self.after_chained:
                self.follow_up.then_run(work)
            self.after_chained.clear()
        self.record.wait_end = self.clock.stamp()
        self.signal = None
        self.done = True


# What a gather or reduction that needs no communication returns (one rank): nothing in flight,
# nothing to wait for.
COMPLETED = Pending(CollectiveStamps("none", "", 0, 0.0), HostClock(), done=True)
