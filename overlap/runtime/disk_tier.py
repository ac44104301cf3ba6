"""offload="disk": each trainable flat group's fp32 master shard and AdamW moments live in
one state file per rank (overlap.optim.paged), and what stays in memory is the 16-bit copy of
the shard that the all-gather sends (on the device) and the one the parameters are views of
(in host memory, where the paged step writes it).

[Note: the disk tier's shards]
Each group is paged as soon as it is built (`DiskShard.adopt`): its fp32 shard (rank 0's
values, broadcast) is streamed into the state file bucket by bucket, and the group's shard
becomes its 16-bit copy, which the user's parameters (the same objects) are views of (with
dtype = the gather dtype, as ZeRO-Infinity exposes its 16-bit weights). A model on the meta
device is materialised afterwards, one module at a time, each part written into the file
(through its memory map) and into the 16-bit copy, so a rank never holds more than one
group's fp32 shard. Their `grad_dtype` is set to fp32, so `.grad` stays a view of
the fp32 gradient shard, as without offload: gradient accumulation, `no_sync` and clipping
run unchanged. `overlap.optim.AdamW` recognises the parameters by the `PagedParam` each one
carries (`overlap.optim.paged.register_paged`) and steps them through the file, writing each
updated bucket's 16-bit copy into the shard.

[Note: the disk tier on a device]
The paged step runs on the host, so it writes the 16-bit shard in host memory (pinned where
CUDA is available): that host shard is what the parameters are views of, and `.grad` is a
view of the fp32 gradient shard beside it in host memory, as under offload="cpu" (torch
refuses a `.grad` on another device than its parameter, and the gradient must be on the host
for the step to read it). The device holds its own copy of the 16-bit shard, `sent`, the one
the all-gather sends: 2 bytes per parameter of the shard, the device column of
overlap.plan.offload's table. The copies between the two use offload="cpu"'s `HostTier`, one
place for the stream rules (see [Note: the offload copies and their streams] in host_tier):
- gradients: each reduction adds into a device buffer and is downloaded into the host
  gradient shard on the download stream (`HostShard`, unchanged), and `.grad` is published
  once the downloads completed;
- the 16-bit shard: each bucket the step wrote is copied to `sent` on the upload stream (the
  all-gather stream) as soon as it is written (`PagedParam.on_bucket`), so the copy of bucket
  k runs while bucket k+1 is updated. The latest copy's event is what the compute stream
  waits on before the next gather (side streams wait for the compute stream before their
  collective; a local gather runs on it), and what the host waits on before it writes the
  host shard again (the next step, a load).
A load or a materialisation writes the host shard outside a step; `sent` is then copied whole
before the next gather. On a machine without CUDA host and device are one memory, and a
second 16-bit copy would only cost 2 bytes per parameter of the shard, a third of what stays
in memory: `sent` is the host shard itself and nothing is copied. The tests set
`SEPARATE_COPY_WITHOUT_DEVICE` to run the device path there with a separate buffer and
synchronous copies.

[Note: when the disk tier speculates]
A group's step may start during backward (see [Note: the speculative step] in
overlap.optim.speculation), once its gradient is final: on gloo when its reduction (and
hybrid's all-reduce) completed and was copied into the host gradient shard, which happens
when the reduction is waited for (`GradReduction`'s bound on reductions in flight, or the end
of backward); on CUDA as soon as the reduction is issued, the worker first waiting for the
event that ends the gradient's download. Only the parameters an `overlap.optim.AdamW` linked
to the model holds are stepped ahead, with its settings, which the model's optimizer link
asks it for ([Note: the optimizer link]): an optimizer not linked before the first backward
takes its first step in `step()`. It speculates in a backward that reduced the group's
gradient only if that is the first reduction since the group's last step and the step before
followed exactly one reduction (the first step speculates where the optimizer is linked): a loop that accumulates without
no_sync would otherwise compute, then restore, a step per micro-batch. A speculation no
step settled is dropped before the group's next gather (which then sends the restored
shard, copied whole) and when a load writes the state. Where the step recomputed a group's
speculation (a clip that binds), the engine reads that group's state ahead at the same moment
instead, and writes it behind the step ([Note: choosing between them] in overlap.optim.paged);
the disk tier's part is the same call.

Any other write of the 16-bit shard (another optimizer stepping the parameters, an
in-place init) would part it from the master on disk, and the next step would overwrite it;
the shard's version counter, recorded after each paged step, is checked before each gather
and a change is an error naming overlap.optim.AdamW.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Callable, Optional

import torch

from overlap.optim.paged import (DEFAULT_BUCKET_PARAMS, Hyper, PagedAdamW, PagedParam, Segment, paged_of,
                                 register_paged)
from overlap.optim.state_file import Bucket
from overlap.runtime.host_tier import HostShard, HostTier, ShardPlace, after_all
from overlap.runtime.param_identity import rebind

# True: keep `sent` a buffer of its own and copy into it even where the device is the host
# (see [Note: the disk tier on a device]); the tests set it to run the device path on CPU.
SEPARATE_COPY_WITHOUT_DEVICE = False

if TYPE_CHECKING:
    from overlap.base.config import Config
    from overlap.base.mixed_precision import MixedPrecision
    from overlap.runtime.flat_group import FlatGroup
    from overlap.runtime.pending import Pending


def disk_offload_error(config: "Config", mixed_precision: Optional["MixedPrecision"],
                       device: torch.device) -> Optional[str]:
    """Why offload="disk" cannot run with these settings, or None (and None for other tiers)."""
    if config.offload != "disk":
        return None
    param_dtype = None if mixed_precision is None else mixed_precision.param_dtype
    if param_dtype not in (torch.bfloat16, torch.float16):
        return ("offload='disk' keeps only the 16-bit copy of each shard (the one the all-gather sends) in "
                "memory, the fp32 master in the state file: it needs mixed_precision=MixedPrecision("
                f"param_dtype=torch.bfloat16 or torch.float16), got param_dtype={param_dtype}")
    if config.compress != "none":
        return (f"offload='disk' with compression={config.compress!r} is not supported: the codecs encode the "
                "fp32 master shard, which is on disk; use compression='none'")
    if device.type not in ("cpu", "cuda"):
        return (f"offload='disk' runs on CPU and CUDA devices (this rank computes on {device}); "
                "use offload='none'")
    return None


class DiskShard(ShardPlace):
    """One flat group's place under offload="disk": paged once built (`adopt`) when it is
    trainable fp32 gathered in 16 bits; frozen and non-float groups stay as they are."""

    def __init__(self, tier: "DiskTier") -> None:
        self.tier = tier
        self.engine: Optional[PagedAdamW] = None
        self.index = -1                   # the group's shard in the engine
        self.version: Optional[int] = None
        # See [Note: the disk tier on a device]. The gradient path of offload="cpu": the fp32
        # gradient shard in pinned host memory, each reduction's sum downloaded into it.
        self.grads = HostShard(tier.host)
        # The 16-bit shard in (pinned) host memory: the parameters are views of it, and the
        # paged step writes it, bucket by bucket.
        self.host_shard: Optional[torch.Tensor] = None
        # The device copy of the 16-bit shard, the one the all-gather sends; the host shard's
        # `_version` it holds (None: stale, copied whole before the next gather); the event
        # that ends the latest copy into it (CUDA; None once the host saw it complete).
        self.sent: Optional[torch.Tensor] = None
        self.shares_shard = False              # `sent` is the host shard (no device: see the note)
        self.sent_version: Optional[int] = None
        self.refreshed: Optional[torch.cuda.Event] = None
        # Parts of the shard copied to the device so far (bucket by bucket after each step,
        # whole after a load): the tests read it to see that the copies ran.
        self.uploads = 0
        # The paged parameters and where each lies; reductions of the gradient since the last
        # step, and before the step ahead of it (see [Note: when the disk tier speculates]).
        self.paged: list[tuple[torch.Tensor, PagedParam]] = []
        self.reductions = 0
        self.reductions_before_step = 1

    @property
    def offloaded(self) -> bool:          # type: ignore[override]
        return self.engine is not None

    def adopt(self, group: "FlatGroup") -> None:
        """Page the group (see [Note: the disk tier's shards]): its fp32 shard into the state
        file, the 16-bit copy in its place (host memory, with its device copy), new parameters
        over that copy."""
        if not (group.requires_grad and group.master_dtype == torch.float32
                and group.gather_dtype in (torch.bfloat16, torch.float16)):
            return
        engine = self.tier.engine
        starts = [_local_start(group, index) for index in range(len(group.slots))]
        # Every parameter's part in one bucket, so that it is one memory map of the file (state
        # dicts and checkpoints read and write it in place): buckets grow to the largest part.
        largest = max((end - start for start, end in group.parts), default=0)
        self.index = engine.add_shard(group.shard_numel, starts, max(DEFAULT_BUCKET_PARAMS, largest))
        self.engine = engine
        if torch.count_nonzero(group.shard):           # a new file already reads as zeros
            engine.write_shard(self.index, group.shard)
        host = self.tier.host
        resident = host.host_empty(group.shard_numel, group.gather_dtype)
        resident.copy_(group.shard)
        self.shares_shard = host.device.type == "cpu" and not SEPARATE_COPY_WITHOUT_DEVICE
        self.sent = resident if self.shares_shard else torch.empty(group.shard_numel, dtype=group.gather_dtype,
                                                                   device=host.device)
        group.shard = resident
        for slot_index, slot in enumerate(group.slots):
            # The parameter (the same object: [Note: parameters keep their identity]) over the
            # 16-bit shard; it shares the shard's version counter, which the check in
            # `gather_source` reads.
            param = rebind(group.params[slot_index], group._shard_view(resident, slot_index), slot.name)
            param.grad_dtype = torch.float32
            group.params[slot_index] = param
            for module, attr in slot.owners:
                module._parameters[attr] = param
            start = starts[slot_index]
            where = PagedParam(engine, self.index, start, start + param.numel(), resident, _grad_shard_of(group),
                               self.stepped, self.bucket_written, self.wait_refreshed)
            register_paged(param, where)
            self.paged.append((param, where))
        self.loaded(resident)

    def part_written(self, group: "FlatGroup", index: int, part: torch.Tensor) -> None:
        """A parameter materialised from the meta device: its fp32 part goes to the file too."""
        where = paged_of(group.params[index])
        if where is not None:
            where.engine.map_range(where.shard, where.start, where.stop)[0].copy_(part.reshape(-1))
            self.loaded(group.shard)

    # ---- gradients: offload="cpu"'s download path -------------------------------------------

    def zeros_like(self, master: torch.Tensor) -> torch.Tensor:
        if self.engine is None:
            return super().zeros_like(master)
        # The gradient shard stays fp32 while the shard itself is 16-bit.
        return self.tier.host.host_empty(master.numel(), torch.float32).zero_()

    def reduce_target(self, grad_shard: torch.Tensor, zeros: bool) -> torch.Tensor:
        if self.engine is None:
            return super().reduce_target(grad_shard, zeros)
        return self.grads.reduce_target(grad_shard, zeros)

    def reduction_issued(self, pending: "Pending") -> None:
        if self.engine is None:
            return
        self.grads.reduction_issued(pending)
        self.reductions += 1
        if self.reductions != 1 or self.reductions_before_step != 1:
            return
        if self.tier.host.use_streams:
            # The download of the sum into the host gradient shard is queued: the worker waits for it.
            self._speculate(self.grads.downloads[-1].event.synchronize)
        else:
            after_all(pending, self._speculate)         # after the copy home, added before it

    def _speculate(self, ready=None) -> None:
        """Start this group's step on the engine's worker (see [Note: when the disk tier speculates])."""
        segments = [Segment(self.index, where.start, where.stop, hyper)
                    for param, where in self.paged if (hyper := self.tier.next_step_settings(param)) is not None]
        if segments and self.grads.grad_shard is not None:
            self.engine.speculate(self.index, self.grads.grad_shard, segments, self.host_shard,
                                  on_bucket=self.bucket_written, before_write=self.wait_refreshed,
                                  restored=self.restored, ready=ready)

    def grads_ready(self) -> None:
        if self.engine is not None:
            self.grads.grads_ready()

    # ---- the 16-bit shard: host -> device -----------------------------------------------------

    def gather_source(self, master: torch.Tensor, dtype: torch.dtype, encoded: bool, local: bool) -> torch.Tensor:
        if self.engine is None:
            return master
        if self.engine.speculating(self.index):
            self.engine.abandon(self.index)       # no step came between: restore the shard
        if master._version != self.version:
            raise RuntimeError(
                "offload='disk': the parameters of this model were changed in place by something other than "
                "overlap.optim.AdamW (another optimizer, an in-place init, a state dict loaded into them). "
                "Their fp32 masters live in the offload state file, and only overlap.optim.AdamW steps them; "
                "use overlap.optim.AdamW(model.parameters(), ...)")
        if self.sent_version != master._version:
            self.wait_refreshed()
            self._upload(0, master.numel())
            self.sent_version = master._version
        if self.refreshed is not None:
            # The compute stream waits for the copies, and every gather waits for the compute
            # stream (a local one runs on it).
            torch.cuda.current_stream(self.tier.host.device).wait_event(self.refreshed)
        return self.sent

    def bucket_written(self, bucket: Bucket) -> None:
        """overlap.optim.AdamW wrote this bucket of the host shard: copy it to the device while
        the next bucket is updated."""
        self._upload(bucket.start, bucket.stop)

    def _upload(self, start: int, stop: int) -> None:
        assert self.sent is not None and self.host_shard is not None
        if self.shares_shard:
            return
        event = self.tier.host.upload(self.sent[start:stop], self.host_shard[start:stop])
        if event is not None:
            self.refreshed = event
        self.uploads += 1

    def wait_refreshed(self) -> None:
        """Block the host until the latest copy to the device read the host shard: before a
        step or a load writes the host shard again (the copies of a step are long done by
        the next one, after a forward and backward that waited for them)."""
        if self.refreshed is not None:
            self.refreshed.synchronize()
            self.refreshed = None

    def on_device(self, master: torch.Tensor) -> torch.Tensor:
        """The fp32 master from the state file (for full state dicts)."""
        if self.engine is None:
            return master
        out = torch.empty(master.numel(), dtype=torch.float32)
        outputs: list[Optional[torch.Tensor]] = [None] * len(self.engine.shard_sizes)
        outputs[self.index] = out
        self.engine.copy_masters_to(outputs)
        return out.to(self.tier.host.device)

    def stepped(self, resident: torch.Tensor) -> None:
        """overlap.optim.AdamW wrote the shard, and queued each bucket it wrote to the device:
        this version is the legitimate one, and the device copy holds it where it held the
        previous one (buckets the step left alone are unchanged)."""
        fresh = self.sent_version is not None and self.sent_version == self.version
        self.version = resident._version
        if fresh:
            self.sent_version = self.version
        self.reductions_before_step, self.reductions = self.reductions, 0

    def restored(self) -> None:
        """A speculation was dropped and the engine restored the shard from the masters (or a
        load is about to write it): this version is the legitimate one, and the device copy is
        refreshed whole before the next gather."""
        self.version = self.host_shard._version
        self.sent_version = None

    def loaded(self, resident: torch.Tensor) -> None:
        """The shard was written by a load or a materialisation: this version is the legitimate
        one, and the device copy is refreshed whole before the next gather."""
        if self.engine is not None:
            self.engine.abandon(self.index, restore=False)
        self.host_shard = resident
        self.version = resident._version
        self.sent_version = None


class DiskTier:
    """The state file of one `ShardedModule` on this rank, which its groups are paged into as
    they are built, and the copies between host and device (offload="cpu"'s `HostTier`)."""

    def __init__(self, directory: Optional[str], rank: int, host: HostTier,
                 next_step_settings: Callable[[torch.Tensor], Optional[Hyper]], window_bytes: int = 0) -> None:
        # One state file per rank and model, each paged group one shard of it, so that one
        # optimizer step is one pipelined pass over the file; removed when the process exits.
        # `window_bytes` of host memory may hold buckets read ahead during backward and written
        # behind the step ([Note: reading ahead and writing behind] in overlap.optim.window).
        self.engine = PagedAdamW([], directory=directory, rank=rank, window_bytes=window_bytes)
        self.host = host
        # The settings of a parameter's next step, from the optimizer that holds it (the
        # model's optimizer link): None where none can say them, and then no step is taken
        # during backward.
        self.next_step_settings = next_step_settings

    def place(self) -> DiskShard:
        return DiskShard(self)


def _local_start(group: "FlatGroup", index: int) -> int:
    """Where parameter `index`'s part begins in this rank's shard (as `FlatGroup._shard_view`)."""
    start, _ = group.parts[index]
    offset = group.slots[index].offset + start - group.collectives.rank * group.shard_numel
    return min(max(offset, 0), group.shard_numel)


def _grad_shard_of(group: "FlatGroup"):
    return lambda: group.grad_shard


def master_part(param: torch.Tensor) -> torch.Tensor:
    """A parameter's fp32 master, shaped like it: a memory map of the state file where it is
    paged (writes to it are writes to the file; `refresh_resident` then updates the 16-bit
    copy), the parameter itself otherwise."""
    where = paged_of(param)
    if where is None:
        return param
    where.engine.flush()                      # the map is read: the step's writes behind land first
    return where.engine.map_range(where.shard, where.start, where.stop)[0].view(param.shape)


def wait_for_saves(groups: list["FlatGroup"]) -> None:
    """Before a load writes the masters in place: wait for the asynchronous saves still
    reading them from the state file ([Note: saves streamed from the state file] in
    overlap.optim.paged)."""
    for engine in {id(g.place.engine): g.place.engine for g in groups
                   if isinstance(g.place, DiskShard) and g.place.engine is not None}.values():
        engine.wait_pins()


def refresh_resident(groups: list["FlatGroup"]) -> None:
    """Copy the masters in the state file into the 16-bit shards (after a load wrote them)."""
    paged = [g for g in groups if isinstance(g.place, DiskShard) and g.place.engine is not None]
    by_engine: dict[PagedAdamW, list[Optional[torch.Tensor]]] = {}
    for group in paged:
        outputs = by_engine.setdefault(group.place.engine, [None] * len(group.place.engine.shard_sizes))
        outputs[group.place.index] = group.shard
    for group in paged:
        group.place.engine.abandon(group.place.index, restore=False)
        group.place.wait_refreshed()              # the host shard is about to be written
    for engine, outputs in by_engine.items():
        engine.copy_masters_to(outputs)
    for group in paged:
        group.place.loaded(group.shard)
