"""How every collective is issued so that it runs under compute: written once, for CUDA side
streams and for gloo's asynchronous work alike.

    with issue(log, device, "all_gather", unit, nbytes, stream, watch) as call:
        source = ...                                   # prepare the input
        call.launch(lambda async_op: all_gather_flat(out, source, async_op=async_op))
        call.then_run(lambda: ...)                     # completion work
        call.keep(source, out)                         # buffers held until the consumer waited
    return call.pending

CUDA (`stream` given): the body runs on the side stream once that stream has waited for the
compute stream (where the inputs were written and the outputs' memory last used); the
collective runs synchronously on the side stream, completion work is queued right behind
it, then the end is stamped and an event recorded that the consumer's compute stream waits
on. gloo (`stream` None): the collective is asynchronous work whose end gloo's thread
stamps; completion work runs on the host when the consumer waits. Expert parallelism's
all-to-alls take the `stream` None path on CUDA too (NCCL's own stream, the compute stream
waiting on the work); their end is the end of their wait.
"""
from __future__ import annotations

import contextlib
import threading
from typing import TYPE_CHECKING, Callable, Iterator, Optional

import torch
import torch.distributed as dist

from overlap.base.profiling import phase
from overlap.runtime.pending import HostWork, Pending, StreamHandoff
from overlap.runtime.timing import CollectiveStamps, CudaClock, StepLog

if TYPE_CHECKING:
    from overlap.runtime.order_check import OrderCheck

# `start(async_op)` issues one collective: synchronously on the current (side) stream when
# False, as asynchronous work when True, returning its handle (None: nothing to wait for).
Start = Callable[[bool], Optional[dist.Work]]

# [Note: collectives synchronous on their side stream]
# On CUDA a collective is issued with async_op=False while the side stream is current: NCCL
# then orders its kernel after the side stream's work and the side stream's later work after
# it, with no handle for the host to wait on; the consumer waits on an event recorded
# behind it. Under TORCH_NCCL_BLOCKING_WAIT=1, torch turns such a call into a host wait for
# the collective's end, and async_op=True would not help (its `wait()` blocks the host
# too): no collective would overlap. Start-up warns of it (`check_backend_env` in
# overlap/runtime/process_group.py) rather than refusing a setting that keeps results right.


class CollectiveCall:
    """One collective being issued (see the module's docstring); `pending` once issued."""

    def __init__(self, log: StepLog, device: torch.device, record: CollectiveStamps,
                 stream: Optional[torch.cuda.Stream], watch: Optional["OrderCheck"]) -> None:
        self.log = log
        self.device = device
        self.record = record
        self.stream = stream
        self.watch = watch
        self.pending: Optional[Pending] = None
        self._launched = False
        self._buffers: list[torch.Tensor] = []
        self._host_work: Optional[tuple[dist.Work, threading.Event]] = None
        self._callbacks: list[Callable[[], None]] = []          # gloo: run at the wait
        self._chained: Optional[Callable[[], Pending]] = None   # gloo: issued at the wait
        self._follow_up: Optional[Pending] = None               # CUDA: issued on its own stream

    @property
    def on_stream(self) -> bool:
        return self.stream is not None

    def launch(self, start: Start) -> None:
        """Issue the collective (once per call)."""
        if self._launched:
            raise RuntimeError(f"the {self.record.kind} of {self.record.unit} was launched twice")
        self._launched = True
        if self.on_stream:
            start(False)
            return
        work = start(True)
        if work is None:
            return
        finished = threading.Event()
        record, clock = self.record, self.log.clock
        # Asynchronous work on a CUDA device (expert parallelism's NCCL all-to-alls, issued
        # without a side stream): a completion callback has no stream of the work to record an
        # event on, so its end is left to the end of its wait (overlap.runtime.timing).
        stamps_end = not isinstance(clock, CudaClock)

        def stamp(_future) -> None:
            if stamps_end:
                record.end = clock.stamp()
            finished.set()

        work.get_future().add_done_callback(stamp)
        self._host_work = (work, finished)

    def keep(self, *buffers: torch.Tensor) -> None:
        """Hold `buffers` until the consumer has waited. See [Note: keeping buffers alive until
        the consumer waited] in overlap.runtime.pending."""
        self._buffers.extend(buffers)

    def then_run(self, work: Callable[[], None]) -> None:
        """Completion work, after the collective and the work added before it: on CUDA queued
        now on the side stream, on gloo run on the host when the consumer waits."""
        if not self._launched:
            raise RuntimeError(f"completion work for the {self.record.kind} of {self.record.unit} before its launch")
        if self.on_stream:
            work()
        else:
            self._callbacks.append(work)

    def then_collective(self, kind: str, nbytes: int, start: Start, finish: Callable[[], None],
                        keep: tuple[torch.Tensor, ...], stream: Optional[torch.cuda.Stream] = None) -> None:
        """A second collective on what this one produced, with its own entry in the step log,
        then `finish`; `keep`: the buffers it uses. It is left in `Pending.follow_up` for the
        caller to wait on later, after more of backward. On CUDA it is issued now on `stream`
        (its own side stream, which waits for everything queued on this one so far); on gloo
        it is issued when this one has been waited for."""
        if not self._launched:
            raise RuntimeError(f"{kind} chained to the {self.record.kind} of {self.record.unit} before its launch")
        log, device, watch, unit = self.log, self.device, self.watch, self.record.unit

        def chained(on: Optional[torch.cuda.Stream]) -> Pending:
            with issue(log, device, kind, unit, nbytes, on, watch) as call:
                call.launch(start)
                call.then_run(finish)
                call.keep(*keep)
            return call.pending

        if self.on_stream:
            if stream is None:
                raise RuntimeError(f"{kind} chained to the {self.record.kind} of {unit} on CUDA without a stream")
            # Issued from inside this call's stream context: `issue` orders `stream` after it.
            self._follow_up = chained(stream)
            return
        self._chained = lambda: chained(None)

    def seal(self, event: Optional[torch.cuda.Event]) -> Pending:
        """The consumer's handle, once the body has run (`issue` calls it): on CUDA, `event`
        marks the end of everything queued on the side stream."""
        if self.on_stream:
            self.pending = Pending(self.record, self.log.clock, StreamHandoff(event, self.device, tuple(self._buffers)),
                                   follow_up=self._follow_up)
            return self.pending
        signal = None
        if self._host_work is not None:
            work, finished = self._host_work
            signal = HostWork(work, finished, self.watch, tuple(self._buffers))
        self.pending = Pending(self.record, self.log.clock, signal, self._callbacks, self._chained)
        return self.pending


@contextlib.contextmanager
def issue(log: StepLog, device: torch.device, kind: str, unit: str, nbytes: int,
          stream: Optional[torch.cuda.Stream], watch: Optional["OrderCheck"],
          uncompressed: Optional[int] = None, ordered: bool = True) -> Iterator[CollectiveCall]:
    """Issue one collective of `nbytes` on the wire (`uncompressed`: before compression) on
    `stream` (CUDA) or as gloo work (`stream` None); the body launches it. `watch` is the
    order check for the wait (None with one rank). `ordered=False`: the caller exchanged the
    order word itself (expert parallelism's all-to-alls, whose sizes differ between ranks)."""
    if watch is not None and ordered:
        watch.before_issue(kind, unit, nbytes)   # ranks agree on it before it is issued
    with phase(f"overlap::{kind}::{unit}"):
        if stream is None:
            call = CollectiveCall(log, device, log.collective(kind, unit, nbytes, uncompressed=uncompressed),
                                  None, watch)
            yield call
            call.seal(None)
            return
        stream.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(stream):
            record = log.collective(kind, unit, nbytes, stream, uncompressed=uncompressed)
            call = CollectiveCall(log, device, record, stream, watch)
            yield call
            record.end = log.clock.stamp(stream)
            event = torch.cuda.Event()
            event.record(stream)
        call.seal(event)
