"""Where a flat group's master shard and gradient shard live, and the copies between the
device and host memory when they are offloaded (`offload="cpu"`).

A flat group asks its `ShardPlace`:
- `place_master(shard)` / `zeros_like(master)`: the tensors that hold the master shard (the
  user's parameters are views of it, so a user's torch.optim optimizer steps it where it
  lives) and the gradient shard (the `.grad` views);
- `gather_source(master, dtype, encoded, local)`: a device tensor an all-gather sends,
  holding the master's values (cast to `dtype` where the place keeps a copy in the gather
  dtype; `local`: the gather is a copy on the current stream); `on_device(master)`: the same
  in the master dtype, for a state dict's gather;
- `reduce_target(grad_shard, zeros)`: the device tensor a reduction adds into, holding what
  the gradient shard holds now (zeros: nothing), so reduced gradients accumulate exactly as
  they would in place;
and tells it `reduction_issued(pending)`: a reduction into that target was issued; once it
(and what it chains: hybrid's all-reduce) completes, its sum belongs in the gradient shard.
`grads_ready()` waits until it is there, before `.grad` is published.

`ShardPlace` itself keeps both shards on the device (offload="none"): each answer is the
tensor given. `HostShard` keeps them in host memory (pinned where CUDA is available, so the copies
are asynchronous DMA) and copies them in and out; on a machine without CUDA host and device
are one memory and the copies are plain synchronous copies between separate buffers, so the
same logic runs and is tested.

[Note: the offload copies and their streams]
Host -> device (what a gather sends) runs on the all-gather stream, queued right before the
gather that reads it: the gather cannot start before its copy ends, and that stream already
runs ahead of compute (prefetch), so a stream of its own would add an event and hide nothing
more (offload="disk" copies its 16-bit shard on that stream too, bucket by bucket during the
optimizer step: [Note: the disk tier on a device] in disk_tier). Its buffer is held by the gather's `Pending` until the consumer waited, as every
collective's input is (see [Note: keeping buffers alive until the consumer waited]). Where
the gather is a copy on the compute stream (one rank, uncompressed), so is its source's.
Device -> host (a reduced gradient) runs on the download stream, which exists so that these
copies overlap the rest of backward and the next reductions, instead of queueing behind
reductions on the reduce-scatter stream: it waits on the event that ends the reduction (or
hybrid's all-reduce that follows it), copies into the pinned gradient shard and records an
event of its own. That event is what `grads_ready()` synchronises the host on (the optimizer
reads the host gradient), and what frees the device buffer early: each new reduction and the
end of backward drop the buffers whose copies completed. On gloo (no streams) a reduction's
completion work runs on the host when it is waited for; the copy is added as the last of that
work.

[Note: the persistent gather copy]
With mixed precision the device keeps one copy of the shard in the gather dtype, the one the
all-gather sends, as the offload estimate's table has it (overlap.plan.offload): refreshing
it costs one host -> device copy of the master and one cast per optimizer step, where a
transient buffer would copy the master again for every gather (forward and backward). It is
refreshed only when the master may have changed: a reduction produced gradients since the
last refresh (an optimizer step follows them; one that writes through raw pointers, as C++
CPU optimizers do, changes no `_version`), or the master's `_version` (which every in-place
torch write of the master or of a parameter view of it bumps: a state dict or checkpoint
loaded) differs from the one last copied. Forward passes with neither in between (no_sync
micro-batches, evaluation) copy nothing. A codec that encodes the master itself (int8
gathers) is sent a transient copy in the master dtype, as without offload. In the master
dtype nothing persistent is kept: the transient copy is freed when its gather's consumer has
waited.
"""
from __future__ import annotations

import contextlib
from typing import TYPE_CHECKING, Any, Callable, NamedTuple, Optional

import torch

if TYPE_CHECKING:
    from overlap.kernels.backends import KernelBackend
    from overlap.runtime.pending import Pending

# The offload tiers this runtime can hold state in; a tier missing here is refused at start-up
# with the reason given.
UNAVAILABLE_TIERS: dict[str, str] = {}


def offload_error(offload: str) -> Optional[str]:
    """Why `offload` cannot be used here, or None when it can."""
    return UNAVAILABLE_TIERS.get(offload)


class ShardPlace:
    """Where one flat group's shards live (module docstring); on the device itself."""

    offloaded = False

    def place_master(self, shard: torch.Tensor) -> torch.Tensor:
        return shard

    def zeros_like(self, master: torch.Tensor) -> torch.Tensor:
        return torch.zeros_like(master)

    def gather_source(self, master: torch.Tensor, dtype: torch.dtype, encoded: bool, local: bool) -> torch.Tensor:
        return master           # the collective casts it

    def on_device(self, master: torch.Tensor) -> torch.Tensor:
        return master

    def reduce_target(self, grad_shard: torch.Tensor, zeros: bool) -> torch.Tensor:
        if zeros:
            grad_shard.zero_()
        return grad_shard

    def reduction_issued(self, pending: "Pending") -> None:
        pass

    def grads_ready(self) -> None:
        pass

    # `group` is the FlatGroup (not imported: flat_group imports this module).
    def adopt(self, group: Any) -> None:
        """The group is built (its parameters made and registered on their modules)."""

    def part_written(self, group: Any, index: int, part: torch.Tensor) -> None:
        """`part` (in the master dtype) was written as this rank's part of parameter `index`."""


class _Download(NamedTuple):
    """One reduced gradient on its way to the host (CUDA): the event recorded on the download
    stream after the copy, and the device buffer it reads, held until that event completed."""

    event: torch.cuda.Event
    staging: torch.Tensor


class HostTier:
    """The copies of one `ShardedModule`'s offloaded groups: the device, the kernels that cast,
    and on CUDA the download stream. See [Note: the offload copies and their streams]."""

    def __init__(self, device: torch.device, kernels: "KernelBackend",
                 gather_stream: Optional[torch.cuda.Stream]) -> None:
        self.device = device
        self.kernels = kernels
        self.use_streams = device.type == "cuda"
        # Host -> device copies run on the all-gather stream, before the gather that reads them.
        self.upload_stream = gather_stream
        # Device -> host copies of reduced gradients, beside the reductions and compute.
        self.download_stream: Optional[torch.cuda.Stream] = None
        if self.use_streams:
            self.download_stream = torch.cuda.Stream(device=device, priority=-1)

    def host_empty(self, numel: int, dtype: torch.dtype) -> torch.Tensor:
        """A host buffer, pinned where CUDA can copy from it asynchronously.

        [Note: one pinned buffer per shard]
        Each shard is its own pinned allocation. CUDA's caching host allocator rounds each to
        a power of two and keeps it, so the pinned footprint can reach twice the planner's
        figure, and each cudaHostAlloc is slow (start-up only). One arena per tier, sliced,
        needs the tier's total before its first shard is placed, which the unit builder
        knows and this class is not given; it waits for a GPU run that measures the
        footprint against the estimate (written, not yet run on a GPU)."""
        return torch.empty(numel, dtype=dtype, pin_memory=torch.cuda.is_available())

    def on(self, stream: Optional[torch.cuda.Stream]):
        """The context a copy is queued in: `stream` once it waited for the compute stream
        (which last wrote the master's device buffers and may still read old ones), or the
        current stream on a machine without one."""
        if stream is None:
            return contextlib.nullcontext()
        stream.wait_stream(torch.cuda.current_stream(self.device))
        return torch.cuda.stream(stream)

    def upload(self, device_out: torch.Tensor, host_in: torch.Tensor) -> Optional[torch.cuda.Event]:
        """Copy `host_in` into `device_out` on the upload stream, after what the compute stream
        queued so far; the event that ends the copy (CUDA), or None where the copy was a
        synchronous one (no streams). offload="disk" refreshes its device shard this way
        (overlap.runtime.disk_tier)."""
        with self.on(self.upload_stream):
            device_out.copy_(host_in, non_blocking=True)
            if not self.use_streams:
                return None
            event = torch.cuda.Event()
            event.record(self.upload_stream)
        return event

    def place(self) -> "HostShard":
        return HostShard(self)


class HostShard(ShardPlace):
    """A flat group's master and gradient shards in host memory (module docstring)."""

    offloaded = True

    def __init__(self, tier: HostTier) -> None:
        self.tier = tier
        # See [Note: the persistent gather copy]: the shard in the gather dtype on the device,
        # the master's `_version` it was copied at (None: never), and whether a reduction ran
        # since (an optimizer step may have changed the master without a version).
        self.sent: Optional[torch.Tensor] = None
        self.sent_version: Optional[int] = None
        self.reduced_since_refresh = False
        # The device buffer this group's reductions add into, from the first reduction of a
        # backward until the copy of the latest one to the host completed; `issued` and
        # `copied` count those reductions and copies.
        self.staging: Optional[torch.Tensor] = None
        self.issued = 0
        self.copied = 0
        # The host gradient shard the copies go to (the flat group's; set at its first reduction).
        self.grad_shard: Optional[torch.Tensor] = None
        # CUDA: copies queued on the download stream and not yet seen complete.
        self.downloads: list[_Download] = []

    def place_master(self, shard: torch.Tensor) -> torch.Tensor:
        host = self.tier.host_empty(shard.numel(), shard.dtype)
        host.copy_(shard)
        return host

    def zeros_like(self, master: torch.Tensor) -> torch.Tensor:
        return self.tier.host_empty(master.numel(), master.dtype).zero_()

    def on_device(self, master: torch.Tensor) -> torch.Tensor:
        """A copy of the master on the device, on the current stream (not a hot path)."""
        return master.to(self.tier.device, copy=True)

    # ---- host -> device ---------------------------------------------------------------------

    def gather_source(self, master: torch.Tensor, dtype: torch.dtype, encoded: bool, local: bool) -> torch.Tensor:
        """The device tensor a gather sends: the persistent copy in the gather dtype, refreshed
        if the master changed, or a transient one in the master dtype. Queued on the
        all-gather stream (called before the gather is issued on it), or on the current
        stream where the gather is a `local` copy there (one rank)."""
        persistent = dtype != master.dtype and not encoded
        fresh = self.sent_version == master._version and not self.reduced_since_refresh
        if persistent and self.sent is not None and fresh:
            return self.sent
        with self.tier.on(None if local else self.tier.upload_stream):
            copy = torch.empty(master.numel(), dtype=master.dtype, device=self.tier.device)
            copy.copy_(master, non_blocking=True)
            if not persistent:
                return copy
            if self.sent is None:
                self.sent = torch.empty(master.numel(), dtype=dtype, device=self.tier.device)
            self.tier.kernels.pack([copy], self.sent, [0])
        self.sent_version, self.reduced_since_refresh = master._version, False
        return self.sent

    # ---- device -> host ---------------------------------------------------------------------

    def reduce_target(self, grad_shard: torch.Tensor, zeros: bool) -> torch.Tensor:
        """The device buffer the next reduction adds into, holding `grad_shard`'s values (the
        host gradient shard, as `.grad` holds it), or zeros where `.grad` holds nothing."""
        self.grad_shard = grad_shard
        self.reduced_since_refresh = True
        self._drop_finished()
        if self.staging is None:
            if zeros:
                staging = torch.zeros(grad_shard.numel(), dtype=grad_shard.dtype, device=self.tier.device)
            else:
                staging = torch.empty(grad_shard.numel(), dtype=grad_shard.dtype, device=self.tier.device)
                staging.copy_(grad_shard, non_blocking=True)
            self.staging = staging
        elif self.downloads:
            # A second reduction of this group in one backward while the copy of the first still
            # reads the buffer: the reduction may not write it before that copy ended.
            torch.cuda.current_stream(self.tier.device).wait_event(self.downloads[-1].event)
        self.issued += 1
        return self.staging

    def reduction_issued(self, pending: "Pending") -> None:
        """Copy the buffer to the host gradient shard once `pending` (and what it chains) is done."""
        ticket, staging = self.issued, self.staging
        if not self.tier.use_streams:
            after_all(pending, lambda: self._copy_home(ticket, staging))
            return
        stream = self.tier.download_stream
        signal = (pending.follow_up or pending).signal
        if signal is not None:
            stream.wait_event(signal.event)
        else:                         # completed on the compute stream (one rank)
            stream.wait_stream(torch.cuda.current_stream(self.tier.device))
        with torch.cuda.stream(stream):
            self.grad_shard.copy_(staging, non_blocking=True)
            event = torch.cuda.Event()
            event.record(stream)
        self.downloads.append(_Download(event, staging))
        self.copied = ticket

    def _copy_home(self, ticket: int, staging: torch.Tensor) -> None:
        self.grad_shard.copy_(staging)
        self.copied = ticket
        if ticket == self.issued:
            self.staging = None       # no later reduction adds into it: a new one starts from the host

    def _drop_finished(self) -> None:
        """CUDA: forget the copies that completed, and the buffer once its latest copy did."""
        while self.downloads and self.downloads[0].event.query():
            self.downloads.pop(0)
        if self.tier.use_streams and not self.downloads and self.copied == self.issued:
            self.staging = None

    def grads_ready(self) -> None:
        """Block the host until every gradient copy of this group reached host memory."""
        for download in self.downloads:
            download.event.synchronize()
        self.downloads.clear()
        if self.copied == self.issued:
            self.staging = None


def after_all(pending: "Pending", work: Callable[[], None]) -> None:
    """Run `work` once `pending` and the collective it chains (gloo's all-reduce across replicas,
    issued when `pending` is waited for) completed: at once if that already happened."""
    if pending.done:
        follow_up = pending.follow_up
        if follow_up is not None and not follow_up.done:
            follow_up.then_run(work)
        else:
            work()
    elif pending.chained is not None or pending.follow_up is not None:
        pending.then_run_chained(work)
    else:
        pending.then_run(work)
