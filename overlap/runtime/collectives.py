"""The two collectives of ZeRO-3 (all-gather of parameters, reduce-scatter of gradients),
issued so that they run under compute, with the bytes and times of each recorded.

On CUDA each collective is issued on a side stream and completes by an event the compute
stream waits on. On CPU (gloo) each is an asynchronous work handle that gloo's own threads
complete while the caller computes.
"""
from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable, Optional

import torch
import torch.distributed as dist

from overlap.kernels import KernelBackend
from overlap.runtime.process_group import all_gather_flat, device_backend, reduce_scatter_flat
from overlap.base.profiling import phase
from overlap.runtime.timing import CollectiveStamps, HostClock, CudaClock, StepLog, clock_for, polling

if TYPE_CHECKING:
    from overlap.runtime.compression import QuantizedCollectives
    from overlap.runtime.order_check import OrderCheck

@dataclass
class Pending:
    """An issued collective: its completion signal and the tensors it must keep alive.

    `keep_alive` holds the input (and on CUDA, every buffer the side stream touches) until the
    consumer has waited, so the caching allocator cannot hand the memory to another stream
    while the collective still reads or writes it; no `record_stream` is needed.
    """

    record: CollectiveStamps
    clock: HostClock | CudaClock
    work: Optional[dist.Work] = None
    # Set from gloo's thread when `work` completes, so that a wait can give up on it in time.
    finished: Optional[threading.Event] = None
    event: Optional[torch.cuda.Event] = None
    # The device whose compute stream (its current stream) waits on `event`: the collective's
    # own, whichever device is current when the wait runs.
    device: Optional[torch.device] = None
    keep_alive: tuple = ()
    on_complete: Optional[Callable[[], None]] = None
    # Output whose autograd version counter must not move (see flat_group.py's note), with
    # its version before the collective was issued: gloo bumps it from its own thread when
    # the work completes, so it is set back after the wait.
    preserve_version_of: Optional[tuple[torch.Tensor, int]] = None
    # Turns a wait that never ends because ranks diverged into an error (overlap.runtime.order_check).
    watch: Optional["OrderCheck"] = None
    # A second collective to issue once this one has completed (hybrid sharding's all-reduce
    # across replicas after the reduce-scatter); `wait()` issues it and leaves it in
    # `follow_up` for the caller to wait on later.
    then: Optional[Callable[[], "Pending"]] = None
    follow_up: Optional["Pending"] = None
    done: bool = False

    def wait(self) -> None:
        if self.done:
            return
        self.record.wait_start = self.clock.stamp()
        if self.work is not None:
            if self.watch is not None and self.finished is not None:
                self.watch.block(self.finished.is_set, self.finished.wait)
            try:
                self.work.wait()
            except RuntimeError:
                if self.watch is not None:
                    self.watch.after_error()
                raise
            if self.preserve_version_of is not None:
                tensor, version = self.preserve_version_of
                torch._C._autograd._unsafe_set_version_counter((tensor,), (version,))
        if self.event is not None:
            torch.cuda.current_stream(self.device).wait_event(self.event)
        if self.on_complete is not None:
            self.on_complete()
        if self.then is not None:
            self.follow_up = self.then()
        self.record.wait_end = self.clock.stamp()
        self.keep_alive = ()
        self.done = True


class Collectives:
    """All-gather and reduce-scatter over one process group, on the right streams."""

    def __init__(self, group: dist.ProcessGroup, device: torch.device, kernels: KernelBackend,
                 replicate_group: Optional[dist.ProcessGroup] = None,
                 all_group: Optional[dist.ProcessGroup] = None) -> None:
        self.group = group                      # the ranks whose shards make up the parameters
        # Hybrid sharding: ranks holding the same shard, whose reduced gradients are averaged.
        self.replicate_group = replicate_group
        self.replicas = 1 if replicate_group is None else dist.get_world_size(replicate_group)
        self.all_group = all_group if all_group is not None else group       # every rank taking part
        self.world_size = dist.get_world_size(group)
        self.rank = dist.get_rank(group)
        self.backend = device_backend(group, device.type)
        self.device = device
        self.kernels = kernels
        # This step's collectives, with the scheduler's marks (see overlap.base.step_record).
        self.log = StepLog(clock_for(device))
        # Set by the scheduler when ranks can diverge (world size > 1).
        self.watch: Optional["OrderCheck"] = None
        # Set by ShardedModule when compression is on: it takes the buffers it compresses.
        self.quantized: Optional["QuantizedCollectives"] = None
        # gloo has no native reduce-scatter: it emulates one, slower than an all-to-all of
        # the gradient chunks followed by a local sum (measured in benchmarks/collectives.py),
        # and the all-to-all moves the same (N-1)/N bytes a ring reduce-scatter does.
        self.reduce_with_all_to_all = self.backend == "gloo"
        self.use_streams = device.type == "cuda"
        if self.use_streams:
            # All-gathers of upcoming units run here so they overlap the unit computing on the
            # default stream (prefetch).
            self.all_gather_stream = torch.cuda.Stream(device=device, priority=-1)
            # Gradient reduce-scatters (and the accumulation into sharded gradients) run here so
            # they overlap the rest of backward.
            self.reduce_scatter_stream = torch.cuda.Stream(device=device, priority=-1)

    def _pending(self, record: CollectiveStamps, work: Optional[dist.Work], **fields) -> Pending:
        """A host-side collective (gloo); gloo's thread stamps its completion."""
        if work is None:
            return Pending(record, self.log.clock, **fields)
        finished = threading.Event()
        clock = self.log.clock

        def stamp(_future) -> None:
            record.end = clock.stamp()
            finished.set()

        pending = Pending(record, clock, work=work, finished=finished, watch=self.watch, **fields)
        work.get_future().add_done_callback(stamp)
        return pending

    def all_gather(self, out: torch.Tensor, shard: torch.Tensor, unit: str,
                   group: Optional[dist.ProcessGroup] = None) -> Pending:
        """Gather every rank's `shard` into `out` (world_size * shard.numel() elements), casting
        the shard to out.dtype first; over `group` instead of the shard group if given (hpZ's
        node copies, see overlap.runtime.node_copy: those stay uncompressed, inside the node)."""
        if group is None and self.quantized is not None and self.quantized.gathers(out):
            return self.quantized.all_gather(out, shard, unit)
        group = self.group if group is None else group
        world = dist.get_world_size(group)
        nbytes = out.numel() * out.element_size() * (world - 1) // world
        with phase(f"overlap::all_gather::{unit}"):
            if self.use_streams:
                # The gather may only start once the optimizer has written the shard and the
                # output memory's previous user has finished: both are on the current stream.
                stream = self.all_gather_stream
                stream.wait_stream(torch.cuda.current_stream(self.device))
                with torch.cuda.stream(stream):
                    record = self.log.collective("all_gather", unit, nbytes, stream)
                    source = self._cast(shard, out.dtype)
                    all_gather_flat(out, source, group=group)
                    record.end = self.log.clock.stamp(stream)
                    event = torch.cuda.Event()
                    event.record(stream)
                return Pending(record, self.log.clock, event=event, device=self.device,
                               keep_alive=(source, shard, out))
            record = self.log.collective("all_gather", unit, nbytes)
            source = self._cast(shard, out.dtype)
            version = out._version
            work = all_gather_flat(out, source, group=group, async_op=True)
            return self._pending(record, work, keep_alive=(source,), preserve_version_of=(out, version))

    def reduce_scatter(self, grad_full: torch.Tensor, shard_grad: torch.Tensor, reduce_dtype: torch.dtype,
                       unit: str) -> Pending:
        """Average `grad_full` over ranks and add this rank's chunk into `shard_grad` (fp32).

        The average is a pre-division by the world size folded into the cast to
        `reduce_dtype`, so low-precision reductions do not overflow.
        """
        if self.quantized is not None and self.quantized.reduces(grad_full):
            return self.quantized.reduce_scatter(grad_full, shard_grad, reduce_dtype, unit)
        world = self.world_size
        nbytes = grad_full.numel() * reduce_dtype.itemsize * (world - 1) // world
        # Pre-divided by every rank taking part: the reduce-scatter sums over the shard group,
        # the all-reduce across replicas (hybrid sharding) over the replicas.
        scale = 1.0 / (world * self.replicas)
        with phase(f"overlap::reduce_scatter::{unit}"):
            if self.use_streams:
                stream = self.reduce_scatter_stream
                stream.wait_stream(torch.cuda.current_stream(self.device))
                with torch.cuda.stream(stream):
                    record = self.log.collective("reduce_scatter", unit, nbytes, stream)
                    source = self._scaled(grad_full, reduce_dtype, scale)
                    out = torch.empty(shard_grad.numel(), dtype=reduce_dtype, device=self.device)
                    reduce_scatter_flat(out, source, op=dist.ReduceOp.SUM, group=self.group)
                    event = self.finish_on_stream(record, out, shard_grad, unit, stream)
                return Pending(record, self.log.clock, event=event, device=self.device,
                               keep_alive=(grad_full, source, out, shard_grad))
            record = self.log.collective("reduce_scatter", unit, nbytes)
            source = self._scaled(grad_full, reduce_dtype, scale)
            # With replicas the reduced chunk goes to a buffer of its own, all-reduced across
            # them before it is added to the shard gradient.
            target = shard_grad if self.replicate_group is None else torch.zeros_like(shard_grad)
            if self.reduce_with_all_to_all:
                pending = self._reduce_by_all_to_all(record, source, target)
            else:
                out = torch.empty(shard_grad.numel(), dtype=reduce_dtype, device=self.device)
                work = reduce_scatter_flat(out, source, op=dist.ReduceOp.SUM, group=self.group, async_op=True)
                pending = self._pending(record, work, keep_alive=(source, out),
                                        on_complete=lambda: self.kernels.accumulate(target, out))
            if self.replicate_group is not None:
                pending.then = lambda: self._all_reduce_into(target, shard_grad, unit)
            return pending

    def finish_on_stream(self, record: CollectiveStamps, reduced: torch.Tensor, shard_grad: torch.Tensor, unit: str,
                         stream: torch.cuda.Stream) -> torch.cuda.Event:
        """On `stream`, after a reduction into `reduced`: sum it across replicas (hybrid
        sharding), add it into `shard_grad`, stamp the end; the event that marks it done."""
        if self.replicate_group is not None:
            across = self.log.collective("all_reduce", unit, self._all_reduce_bytes(reduced), stream)
            dist.all_reduce(reduced, group=self.replicate_group)
            across.end = self.log.clock.stamp(stream)
        self.kernels.accumulate(shard_grad, reduced)
        record.end = self.log.clock.stamp(stream)
        event = torch.cuda.Event()
        event.record(stream)
        return event

    def _all_reduce_bytes(self, tensor: torch.Tensor) -> int:
        return 2 * tensor.numel() * tensor.element_size() * (self.replicas - 1) // self.replicas

    def _all_reduce_into(self, partial: torch.Tensor, shard_grad: torch.Tensor, unit: str) -> Pending:
        """Sum `partial` over the replicas, asynchronously, then add it into `shard_grad`."""
        record = self.log.collective("all_reduce", unit, self._all_reduce_bytes(partial))
        with phase(f"overlap::all_reduce::{unit}"):
            work = dist.all_reduce(partial, group=self.replicate_group, async_op=True)
        return self._pending(record, work, keep_alive=(partial,),
                             on_complete=lambda: self.kernels.accumulate(shard_grad, partial))

    def _reduce_by_all_to_all(self, record: CollectiveStamps, source: torch.Tensor,
                              shard_grad: torch.Tensor) -> Pending:
        """Each rank sends every other rank that rank's chunk of `source` and sums what it
        receives with its own chunk.

        The all-to-all sends contiguous runs of `source`, so the first and the last rank can
        leave their own chunk out of it (they read it in place) and receive (N-1)/N of the
        gradient; ranks in between send their own chunk to themselves.
        """
        world, rank, shard = self.world_size, self.rank, shard_grad.numel()
        keeps_own = rank in (0, world - 1)
        own = source.narrow(0, rank * shard, shard)
        sizes = [0 if r == rank and keeps_own else shard for r in range(world)]
        received = torch.empty(sum(sizes), dtype=source.dtype, device=source.device)
        send = source.narrow(0, shard if rank == 0 else 0, sum(sizes)) if keeps_own else source

        def finish() -> None:
            if keeps_own:
                self.kernels.accumulate(shard_grad, own)
            if received.numel():
                self.kernels.accumulate(shard_grad, received, 1.0, received.numel() // shard)

        work = None
        if world > 1:
            work = dist.all_to_all_single(received, send, output_split_sizes=sizes, input_split_sizes=sizes,
                                          group=self.group, async_op=True)
        return self._pending(record, work, keep_alive=(source, received), on_complete=finish)

    def any_rank(self, flags: list[bool], words: list[int] = ()
                 ) -> Callable[[], tuple[list[bool], list[int], list[int]]]:
        """Start an element-wise OR of `flags` and the maximum and minimum of each of `words`
        over the ranks, in one all-reduce; the returned function waits for it and gives the
        three. A few bytes, so it is not recorded as traffic."""
        words = list(words)
        if dist.get_world_size(self.all_group) == 1 or not (flags or words):
            return lambda: (list(flags), words, words)
        values = [int(f) for f in flags] + words + [-w for w in words]
        tensor = torch.tensor(values, dtype=torch.int64).to(self.device)
        work = dist.all_reduce(tensor, op=dist.ReduceOp.MAX, group=self.all_group, async_op=True)
        finished = threading.Event()
        if self.use_streams:
            work.wait()                          # orders the current stream after the all-reduce
            event = torch.cuda.Event()
            event.record(torch.cuda.current_stream(self.device))
            done = event.query
            sleep = polling(done)
        else:
            work.get_future().add_done_callback(lambda _future: finished.set())
            done, sleep = finished.is_set, finished.wait

        def result() -> tuple[list[bool], list[int], list[int]]:
            if self.watch is not None:
                self.watch.block(done, sleep)
            try:
                work.wait()
            except RuntimeError:
                if self.watch is not None:
                    self.watch.after_error()
                raise
            out = tensor.tolist()
            n, k = len(flags), len(words)
            return [bool(v) for v in out[:n]], out[n:n + k], [-v for v in out[n + k:]]

        return result

    def _cast(self, shard: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        if shard.dtype == dtype:
            return shard.detach()
        out = torch.empty(shard.numel(), dtype=dtype, device=shard.device)
        self.kernels.pack([shard.detach()], out, [0])
        return out

    def _scaled(self, grad: torch.Tensor, dtype: torch.dtype, scale: float) -> torch.Tensor:
        if grad.dtype == dtype:
            # The full gradient is the runtime's own buffer: divide it in place.
            self.kernels.pack([grad], grad, [0], scale)
            return grad
        out = torch.empty(grad.numel(), dtype=dtype, device=grad.device)
        self.kernels.pack([grad], out, [0], scale)
        return out
