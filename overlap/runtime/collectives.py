"""The two collectives of ZeRO-3 (all-gather of parameters, reduce-scatter of gradients),
issued so that they run under compute (overlap.runtime.issue), uncompressed or through a
codec (overlap.runtime.codec), with the bytes and times of each recorded.

On CUDA each collective is issued on a side stream and completes by an event the compute
stream waits on. On CPU (gloo) each is an asynchronous work handle that gloo's own threads
complete while the caller computes.

[Note: reducing a gradient]
Every reduction is the same three steps, whatever carries it: the full gradient is
pre-divided by every rank taking part, folded into the cast to the reduce dtype so that
low-precision sums do not overflow; a collective inside the shard group (reduce-scatter,
gloo's all-to-all, or the codec's all-to-all) leaves this rank's summed chunk in a buffer;
with hybrid sharding an all-reduce across the replicas sums that buffer before it is added
into the shard gradient. Where nothing follows the sum on gloo, it goes straight into the
shard gradient.

[Note: the all-reduce stream]
With hybrid sharding, the all-reduce across replicas crosses the slow link between nodes:
hiding it under the rest of backward is what hybrid sharding is for. On CUDA it runs on its
own side stream, after the reduce-scatter it sums (that stream waits on the reduce-scatter
stream), so that the next reduce-scatters are not queued behind it and the compute stream
does not wait for it when it waits for a reduce-scatter: only the end of backward waits for
the all-reduces (overlap.runtime.grad_reduction), as FSDP2's HSDP does with its all-reduce
stream. Until then each holds its reduced chunk: at most one shard gradient in all.

[Note: the flags stay on the host]
Which parameters got a gradient on any rank decides which get a `.grad`, and the optimizer
reads that as soon as backward returns, so the host needs the answer before it returns. The
flags are host values (set by gradient hooks), so they are OR-ed between hosts over gloo
(the group itself where its CPU backend is gloo, else a gloo group over the same ranks,
made once): an NCCL all-reduce would need a copy to the device and a synchronising copy back,
making the host wait for every kernel queued so far, so the optimizer step and the next
forward could not be queued while the GPU still runs backward. The host waits only for the
other hosts, which normally reach the end of backward at about the same time, long before
their GPUs do.
"""
from __future__ import annotations

import contextlib
import threading
from typing import TYPE_CHECKING, Callable, Optional

import torch
import torch.distributed as dist

from overlap.kernels.backends import KernelBackend
from overlap.runtime.codec import Codec, WireFormat
from overlap.runtime.issue import CollectiveCall, issue
from overlap.runtime.pending import COMPLETED, Pending, wait_watched
from overlap.runtime.process_group import all_gather_flat, device_backend, level_group_counts, reduce_scatter_flat
from overlap.runtime.timing import StepLog, clock_for

if TYPE_CHECKING:
    from overlap.runtime.order_check import OrderCheck

# The scheduler, units and flat groups take `Pending` and `all_gather_flat` from here.
__all__ = ["Collectives", "Pending", "all_gather_flat", "host_group"]


def host_group(group: dist.ProcessGroup) -> dist.ProcessGroup:
    """A group over `group`'s ranks that all-reduces CPU tensors with gloo: `group` itself when
    it can (or has one rank), else a new one, made by every rank of `group` (and only them) at the same point.
    See [Note: the flags stay on the host]."""
    if dist.get_world_size(group) == 1 or device_backend(group, "cpu") == "gloo":
        return group                       # one rank: `any_rank` communicates nothing
    level_group_counts(group)          # see [Note: groups made by some ranks only]
    made = dist.new_group(dist.get_process_group_ranks(group), backend="gloo", use_local_synchronization=True)
    dist.barrier(group=made)            # every rank connected before any goes on (see order_check's)
    return made


class Collectives:
    """All-gather and reduce-scatter over one process group, on the right streams, through
    `codec` where it compresses a buffer."""

    # One rank and no replicas: gathers and reductions are local copies, nothing is issued or
    # recorded (a process group's call costs far more host time than the copy), and flat groups
    # computing in the master dtype gather nothing at all (see flat_group.py). Read when a
    # model is built; checks that time or delay the collectives on a single device build theirs
    # with it off.
    local_when_alone = True

    def __init__(self, group: dist.ProcessGroup, device: torch.device, kernels: KernelBackend,
                 replicate_group: Optional[dist.ProcessGroup] = None,
                 all_group: Optional[dist.ProcessGroup] = None, codec: Optional[Codec] = None) -> None:
        self.group = group                      # the ranks whose shards make up the parameters
        # Hybrid sharding: ranks holding the same shard, whose reduced gradients are averaged.
        self.replicate_group = replicate_group
        self.replicas = 1 if replicate_group is None else dist.get_world_size(replicate_group)
        self.all_group = all_group if all_group is not None else group       # every rank taking part
        # Whose group combines the norms of gradients sharded here ([Note: norms of sharded
        # gradients]): these collectives', or the whole model's where the shards of several
        # groups partition one set of ranks' parameters (expert parallelism's experts).
        self.norm_collectives: Collectives = self
        self.world_size = dist.get_world_size(group)
        # What the summed gradients are divided by; None: every rank taking part (the mean).
        self.gradient_divide_factor: Optional[float] = None
        self.rank = dist.get_rank(group)
        self.backend = device_backend(group, device.type)
        self.device = device
        self.kernels = kernels
        self.codec = codec
        # This step's collectives, with the scheduler's marks (see overlap.base.step_record).
        self.log = StepLog(clock_for(device))
        # Set by the scheduler when ranks can diverge (world size > 1).
        self.watch: Optional["OrderCheck"] = None
        # gloo has no native reduce-scatter: it emulates one, slower than an all-to-all of
        # the gradient chunks followed by a local sum (measured in benchmarks/collectives.py),
        # and the all-to-all moves the same (N-1)/N bytes a ring reduce-scatter does.
        self.reduce_with_all_to_all = self.backend == "gloo"
        self.local_when_alone = Collectives.local_when_alone      # as it was when the model was built
        self.use_streams = device.type == "cuda"
        # None on CPU: gloo's work runs on its own threads.
        self.all_gather_stream: Optional[torch.cuda.Stream] = None
        self.reduce_scatter_stream: Optional[torch.cuda.Stream] = None
        if self.use_streams:
            # All-gathers of upcoming units run here so they overlap the unit computing on the
            # default stream (prefetch).
            self.all_gather_stream = torch.cuda.Stream(device=device, priority=-1)
            # Gradient reduce-scatters (and the accumulation into sharded gradients) run here so
            # they overlap the rest of backward.
            self.reduce_scatter_stream = torch.cuda.Stream(device=device, priority=-1)
        # Hybrid sharding's all-reduces across replicas (None: full sharding, or gloo). See
        # [Note: the all-reduce stream].
        self.all_reduce_stream: Optional[torch.cuda.Stream] = None
        if self.use_streams and replicate_group is not None:
            self.all_reduce_stream = torch.cuda.Stream(device=device, priority=-1)
        # The end-of-backward flags travel between hosts. See [Note: the flags stay on the host].
        self.flags_group = host_group(self.all_group)

    def reset_compression_errors(self) -> None:
        """Forget the codec's state kept across steps (int4 error feedback): call it after a
        step skipped for non-finite gradients. Nothing to do without a codec."""
        if self.codec is not None:
            self.codec.reset_errors()

    def _issue(self, kind: str, unit: str, nbytes: int, stream: Optional[torch.cuda.Stream],
               uncompressed: Optional[int] = None) -> contextlib.AbstractContextManager[CollectiveCall]:
        return issue(self.log, self.device, kind, unit, nbytes, stream, self.watch, uncompressed)

    # ---- all-gather -----------------------------------------------------------------------

    def all_gather(self, out: torch.Tensor, shard: torch.Tensor, unit: str,
                   group: Optional[dist.ProcessGroup] = None) -> Pending:
        """Gather every rank's `shard` into `out` (world_size * shard.numel() elements), casting
        the shard to out.dtype first; over `group` instead of the shard group if given (hpZ's
        node copies, see overlap.runtime.node_copy: those stay uncompressed, inside the node)."""
        if group is None and self.codec is not None and self.codec.gathers(out):
            return self._all_gather_encoded(out, shard, unit)
        if group is None and self.gathers_locally(out):
            out.copy_(shard)                   # its shard is the whole; cast in the copy
            return COMPLETED
        world = self.world_size if group is None else dist.get_world_size(group)
        group = self.group if group is None else group
        nbytes = out.numel() * out.element_size() * (world - 1) // world
        with self._issue("all_gather", unit, nbytes, self.all_gather_stream) as call:
            source = self._cast(shard, out.dtype)
            version = out._version
            call.launch(lambda async_op: all_gather_flat(out, source, group=group, async_op=async_op))
            # gloo bumps `out`'s autograd version from its own thread when the work completes:
            # set it back (see flat_group.py's note on freeing `full`). On CUDA the bump
            # happened at the launch and this changes nothing.
            call.then_run(lambda: torch._C._autograd._unsafe_set_version_counter((out,), (version,)))
            call.keep(source, shard, out)
        return call.pending

    def gathers_locally(self, out: torch.Tensor) -> bool:
        """Whether a gather into `out` over the shard group is a copy on the current stream
        (one rank, uncompressed) rather than a collective on the all-gather stream."""
        return (self.world_size == 1 and self.local_when_alone
                and not (self.codec is not None and self.codec.gathers(out)))

    def _cast(self, shard: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        if shard.dtype == dtype:
            return shard.detach()
        out = torch.empty(shard.numel(), dtype=dtype, device=shard.device)
        self.kernels.pack([shard.detach()], out, [0])
        return out

    def _all_gather_encoded(self, out: torch.Tensor, shard: torch.Tensor, unit: str) -> Pending:
        """As `all_gather`, each rank's shard encoded by the codec and every part decoded into
        `out`: every rank, the shard's owner included, computes with the decoded values."""
        codec, world = self.codec, self.world_size
        wire = codec.gather_format(shard.numel())
        uncompressed = out.numel() * out.element_size() * (world - 1) // world
        with self._issue("all_gather", unit, wire.nbytes * (world - 1), self.all_gather_stream, uncompressed) as call:
            send = torch.empty(wire.nbytes, dtype=torch.uint8, device=self.device)
            received = torch.empty(wire.nbytes * world, dtype=torch.uint8, device=self.device)
            codec.encode_shard(shard, send, wire)
            call.launch(lambda async_op: all_gather_flat(received, send, group=self.group, async_op=async_op))
            call.then_run(lambda: codec.decode_gathered(out, received, wire, world))
            call.keep(send, received, shard, out)
        return call.pending

    # ---- reduce-scatter: see [Note: reducing a gradient] ------------------------------------

    def reduce_scatter(self, grad_full: torch.Tensor, shard_grad: torch.Tensor, reduce_dtype: torch.dtype,
                       unit: str, grad_shard: Optional[torch.Tensor] = None) -> Pending:
        """Average `grad_full` over ranks and add this rank's chunk into `shard_grad` (fp32),
        in `reduce_dtype` on the wire, or through the codec where it compresses `grad_full`.
        `grad_shard`: the gradient shard the sum ends up in when `shard_grad` is only a device
        buffer staging it (offload, overlap.runtime.host_tier); the codec keeps its state per
        gradient shard."""
        world = self.world_size
        nbytes = uncompressed = grad_full.numel() * reduce_dtype.itemsize * (world - 1) // world
        wire = None
        if self.codec is not None and self.codec.reduces(grad_full):
            wire = self.codec.reduce_format(shard_grad.numel())
            nbytes = wire.nbytes * (world - 1)
        elif world == 1 and self.replicate_group is None and self.local_when_alone:
            # The sum is this rank's gradient, in the reduce dtype as on the wire.
            self.kernels.accumulate(shard_grad, self._pre_divided(grad_full, reduce_dtype))
            return COMPLETED
        with self._issue("reduce_scatter", unit, nbytes, self.reduce_scatter_stream,
                         None if wire is None else uncompressed) as call:
            source = self._pre_divided(grad_full, reduce_dtype)
            call.keep(grad_full, source, shard_grad)
            if wire is not None:
                reduced = self._reduce_encoded(call, source, shard_grad, wire,
                                               shard_grad if grad_shard is None else grad_shard)
            elif self.reduce_with_all_to_all and not call.on_stream:
                reduced = self._reduce_by_all_to_all(call, source, shard_grad)
            else:
                reduced = torch.empty(shard_grad.numel(), dtype=reduce_dtype, device=self.device)
                call.launch(lambda async_op: reduce_scatter_flat(reduced, source, op=dist.ReduceOp.SUM,
                                                                 group=self.group, async_op=async_op))
                call.keep(reduced)
            self._add_into_shard_grad(call, reduced, shard_grad)
        return call.pending

    def _pre_divided(self, grad: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """`grad` / (every rank taking part) in `dtype`: the reduce-scatter sums over the shard
        group, the all-reduce across replicas (hybrid sharding) over the replicas."""
        scale = 1.0 / (self.gradient_divide_factor or self.world_size * self.replicas)
        if grad.dtype == dtype:
            # The full gradient is the runtime's own buffer: divide it in place.
            if scale != 1.0:
                self.kernels.pack([grad], grad, [0], scale)
            return grad
        out = torch.empty(grad.numel(), dtype=dtype, device=grad.device)
        self.kernels.pack([grad], out, [0], scale)
        return out

    def _sum_target(self, call: CollectiveCall, shard_grad: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """Where this rank's chunk is summed: `shard_grad` itself where nothing follows the sum
        (gloo, no replicas, the same dtype), else a zeroed buffer of `dtype`."""
        if not call.on_stream and self.replicate_group is None and shard_grad.dtype == dtype:
            return shard_grad
        target = torch.zeros(shard_grad.numel(), dtype=dtype, device=self.device)
        call.keep(target)
        return target

    def _add_into_shard_grad(self, call: CollectiveCall, reduced: torch.Tensor, shard_grad: torch.Tensor) -> None:
        """After the reduction into `reduced`: with replicas, sum it across them; then add it
        into `shard_grad` (unless the reduction summed into it already)."""
        if reduced is shard_grad:
            return

        def add() -> None:
            self.kernels.accumulate(shard_grad, reduced)

        if self.replicate_group is None:
            call.then_run(add)
            return
        nbytes = 2 * reduced.numel() * reduced.element_size() * (self.replicas - 1) // self.replicas
        call.then_collective("all_reduce", nbytes,
                             lambda async_op: dist.all_reduce(reduced, group=self.replicate_group, async_op=async_op),
                             add, keep=(reduced, shard_grad), stream=self.all_reduce_stream)

    def _all_to_all(self, received: torch.Tensor, send: torch.Tensor, sizes: list[int],
                    async_op: bool) -> Optional[dist.Work]:
        if self.world_size == 1:
            return None
        return dist.all_to_all_single(received, send, output_split_sizes=sizes, input_split_sizes=sizes,
                                      group=self.group, async_op=async_op)

    def _reduce_by_all_to_all(self, call: CollectiveCall, source: torch.Tensor,
                              shard_grad: torch.Tensor) -> torch.Tensor:
        """Each rank sends every other rank that rank's chunk of `source` and sums what it
        receives with its own chunk; returns where the sum goes.

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
        call.launch(lambda async_op: self._all_to_all(received, send, sizes, async_op))
        target = self._sum_target(call, shard_grad, shard_grad.dtype)

        def add_chunks() -> None:
            if keeps_own:
                self.kernels.accumulate(target, own)
            if received.numel():
                self.kernels.accumulate(target, received, 1.0, received.numel() // shard)

        call.then_run(add_chunks)
        call.keep(received)
        return target

    def _reduce_encoded(self, call: CollectiveCall, source: torch.Tensor, shard_grad: torch.Tensor,
                        wire: WireFormat, grad_shard: torch.Tensor) -> torch.Tensor:
        """The codec's reduction: each rank encodes the chunk of `source` destined to every
        other rank, an all-to-all delivers them, and the receiver sums its own exact chunk and
        the decoded ones in fp32; returns where the sum goes."""
        world, rank, shard = self.world_size, self.rank, shard_grad.numel()
        sizes = [0 if r == rank else wire.nbytes for r in range(world)]
        send = torch.empty(wire.nbytes * (world - 1), dtype=torch.uint8, device=self.device)
        self.codec.encode_chunks(source, send, wire, rank, world, grad_shard)
        received = torch.empty_like(send)
        call.launch(lambda async_op: self._all_to_all(received, send, sizes, async_op))
        # fp32, as the fused decode-accumulate wants.
        target = self._sum_target(call, shard_grad, torch.float32)
        codec = self.codec

        def add_chunks() -> None:
            self.kernels.accumulate(target, source.narrow(0, rank * shard, shard))
            codec.decode_accumulate(target, received, wire, world - 1)

        call.then_run(add_chunks)
        call.keep(send, received)
        return target

    # ---- the flags of the end of backward -------------------------------------------------

    def any_rank(self, flags: list[bool], words: list[int] = ()
                 ) -> Callable[[], tuple[list[bool], list[int], list[int]]]:
        """Start an element-wise OR of `flags` and the maximum and minimum of each of `words`
        over the ranks, in one all-reduce between the hosts (see [Note: the flags stay on
        the host]); the returned function waits for it and gives the three. A few bytes, so
        it is not recorded as traffic."""
        words = list(words)
        if dist.get_world_size(self.all_group) == 1 or not (flags or words):
            return lambda: (list(flags), words, words)
        if self.watch is not None and self.all_group is self.group:
            self.watch.before_issue("any_rank", "", len(flags))   # ranks agree on it before it is issued
        values = list(map(int, flags)) + words + [-w for w in words]
        tensor = torch.tensor(values, dtype=torch.int64)
        work = dist.all_reduce(tensor, op=dist.ReduceOp.MAX, group=self.flags_group, async_op=True)
        finished = threading.Event()
        work.get_future().add_done_callback(lambda _future: finished.set())

        def result() -> tuple[list[bool], list[int], list[int]]:
            wait_watched(work, self.watch, finished.is_set, finished.wait)
            out = tensor.tolist()
            n, k = len(flags), len(words)
            return list(map(bool, out[:n])), out[n:n + k], [-v for v in out[n + k:]]

        return result
