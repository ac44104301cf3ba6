"""Compressed communication: weights all-gathered as int8, gradients reduced as int8 or int4
through an all-to-all of quantised chunks (ZeRO++'s qwZ and qgZ), on the kernels of
:mod:`overlap.kernels.quantized`.

Only what crosses the wire is quantised. Master shards, optimizer state and the sharded
gradient stay exact; a rank's own chunk of a gradient never leaves it and is added exact.

[Note: one message per quantised collective]
A rank's quantised chunk travels as one byte record: the values (int8, or int4 two per
byte), padded to a multiple of 4 bytes, then the chunk's fp32 scales. The all-gather and the
all-to-all each move one uint8 buffer of such records, so a compressed collective costs one
latency like the uncompressed one, and the receiving side reads the values and scales of
record `c` as views (the padding keeps the scales 4-byte aligned; its bytes are sent
uninitialised and never read).

[Note: error feedback]
int4 gradients keep the quantisation error of every chunk a rank sends (fp32, one value per
element sent: (N-1)/N of the unit's padded gradient) and add it to the next step's gradient
before quantising it, so the error does not accumulate over steps: the sum of what was sent
over k steps differs from the sum of the true gradients by one step's error, not k. It costs
4 bytes per parameter times (N-1)/N per rank on top of ZeRO-3's 16/N (at N = 8, 3.5 bytes:
more than the model states themselves), so it is used only where int4 needs it; int8
gradients go without. A block whose gradient overflowed leaves NaN in its error (see [Note:
non-finite values] in overlap.kernels.quantized): `reset_errors()` clears them.

[Note: callbacks drop their buffers]
A gloo collective's completion callback reads the received records; the `Pending` that holds
the callback lives until the unit's next collective. The callback drops its references once
it has run, so the records are freed when the wait ends rather than a step later (measured:
the int8 step's peak memory stayed 4.6 MiB above the uncompressed one's without this).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
import torch.distributed as dist
from torch.utils.weak import WeakIdKeyDictionary

from overlap.runtime.collectives import Collectives, Pending, all_gather_flat
from overlap.kernels.quantized import DEFAULT_BLOCK, num_blocks, quantized_bytes
from overlap.base.profiling import phase

# mode -> (bits of gathered weights, bits of reduced gradients); None: not compressed.
MODES: dict[str, tuple[Optional[int], Optional[int]]] = {
    "none": (None, None),
    "int8": (8, 8),
    "int8-int4": (8, 4),
}


@dataclass(frozen=True)
class Compression:
    """What is quantised on the wire, and in blocks of how many elements."""

    mode: str = "none"
    block: int = DEFAULT_BLOCK

    @property
    def weight_bits(self) -> Optional[int]:
        return MODES[self.mode][0]

    @property
    def grad_bits(self) -> Optional[int]:
        return MODES[self.mode][1]

    @property
    def error_feedback(self) -> bool:
        return self.grad_bits == 4


@dataclass(frozen=True)
class RecordLayout:
    """One quantised chunk of `numel` elements as a byte record. See [Note: one message per
    quantised collective]."""

    numel: int
    block: int
    bits: int

    @property
    def value_bytes(self) -> int:
        return -(-quantized_bytes(self.numel, self.bits) // 4) * 4

    @property
    def nbytes(self) -> int:
        return self.value_bytes + 4 * num_blocks(self.numel, self.block)

    def views(self, records: torch.Tensor, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(values, scales) of record `index` in the uint8 buffer `records`."""
        record = records.narrow(0, index * self.nbytes, self.nbytes)
        values = record.narrow(0, 0, quantized_bytes(self.numel, self.bits))
        if self.bits == 8:
            values = values.view(torch.int8)
        return values, record.narrow(0, self.value_bytes, self.nbytes - self.value_bytes).view(torch.float32)


class QuantizedCollectives:
    """The compressed all-gather and reduce-scatter of one `Collectives`, which calls them
    when `settings` compress that kind of buffer. Set `settings` to change mode (the
    planner's `auto` does, at the same step on every rank)."""

    def __init__(self, collectives: Collectives, settings: Compression) -> None:
        self.collectives = collectives
        self.settings = settings
        # Error feedback, per shard gradient (one per trainable flat group), kept as long as
        # that gradient. See [Note: error feedback].
        self._errors = WeakIdKeyDictionary()

    def gathers(self, out: torch.Tensor) -> bool:
        return self.settings.weight_bits is not None and out.is_floating_point()

    def reduces(self, grad: torch.Tensor) -> bool:
        return self.settings.grad_bits is not None and grad.is_floating_point()

    @property
    def error_bytes(self) -> int:
        """Memory held for error feedback on this rank."""
        return sum(e.numel() * e.element_size() for e in self._errors.values())

    def reset_errors(self) -> None:
        """Forget the kept quantisation errors (after a step skipped for non-finite gradients)."""
        for error in self._errors.values():
            error.zero_()

    # ---- all-gather -----------------------------------------------------------------------

    def all_gather(self, out: torch.Tensor, shard: torch.Tensor, unit: str) -> Pending:
        """As `Collectives.all_gather`, with every rank's shard quantised to int8 and the
        gathered records dequantised into `out`. Every rank, the shard's owner included,
        computes with the dequantised values, so that all ranks run the same weights."""
        c = self.collectives
        layout = RecordLayout(shard.numel(), self.settings.block, 8)
        nbytes = layout.nbytes * (c.world_size - 1)
        uncompressed = out.numel() * out.element_size() * (c.world_size - 1) // c.world_size
        with phase(f"overlap::all_gather::{unit}"):
            if c.use_streams:
                stream = c.all_gather_stream
                stream.wait_stream(torch.cuda.current_stream(c.device))
                with torch.cuda.stream(stream):
                    record = c.log.collective("all_gather", unit, nbytes, stream, uncompressed=uncompressed)
                    send, received = self._quantize_shard(shard, layout)
                    all_gather_flat(received, send, group=c.group)
                    self._dequantize_gathered(out, received, layout)
                    record.end = c.log.clock.stamp(stream)
                    event = torch.cuda.Event()
                    event.record(stream)
                return Pending(record, c.log.clock, event=event, device=c.device,
                               keep_alive=(send, received, shard, out))
            record = c.log.collective("all_gather", unit, nbytes, uncompressed=uncompressed)
            send, received = self._quantize_shard(shard, layout)
            work = all_gather_flat(received, send, group=c.group, async_op=True)
            held = [received]       # See [Note: callbacks drop their buffers].

            def finish() -> None:
                self._dequantize_gathered(out, held.pop(), layout)

            return c._pending(record, work, keep_alive=(send, received), on_complete=finish)

    def _quantize_shard(self, shard: torch.Tensor, layout: RecordLayout) -> tuple[torch.Tensor, torch.Tensor]:
        c = self.collectives
        send = torch.empty(layout.nbytes, dtype=torch.uint8, device=c.device)
        received = torch.empty(layout.nbytes * c.world_size, dtype=torch.uint8, device=c.device)
        values, scales = layout.views(send, 0)
        c.kernels.quantize_int8(shard.detach(), values, scales, layout.block)
        return send, received

    def _dequantize_gathered(self, out: torch.Tensor, received: torch.Tensor, layout: RecordLayout) -> None:
        # `out` is the gathered leaf's storage: writing it must not look like an in-place
        # change to autograd (see flat_group.py's note on freeing `full`).
        with torch.autograd._unsafe_preserve_version_counter(out):
            for rank in range(self.collectives.world_size):
                values, scales = layout.views(received, rank)
                self.collectives.kernels.dequantize_into(out.narrow(0, rank * layout.numel, layout.numel),
                                                         values, scales, layout.block, 8)

    # ---- reduce-scatter -------------------------------------------------------------------

    def reduce_scatter(self, grad_full: torch.Tensor, shard_grad: torch.Tensor, reduce_dtype: torch.dtype,
                       unit: str) -> Pending:
        """As `Collectives.reduce_scatter`: each rank quantises the chunk of `grad_full`
        (pre-divided, in `reduce_dtype`) destined to every other rank, an all-to-all delivers
        them, and the receiver sums its own exact chunk and the dequantised ones in fp32.
        Hybrid sharding's all-reduce across replicas then runs uncompressed on that sum."""
        c = self.collectives
        world, rank, shard = c.world_size, c.rank, shard_grad.numel()
        layout = RecordLayout(shard, self.settings.block, self.settings.grad_bits)
        nbytes = layout.nbytes * (world - 1)
        uncompressed = grad_full.numel() * reduce_dtype.itemsize * (world - 1) // world
        scale = 1.0 / (world * c.replicas)
        sizes = [0 if r == rank else layout.nbytes for r in range(world)]
        with phase(f"overlap::reduce_scatter::{unit}"):
            if c.use_streams:
                stream = c.reduce_scatter_stream
                stream.wait_stream(torch.cuda.current_stream(c.device))
                with torch.cuda.stream(stream):
                    record = c.log.collective("reduce_scatter", unit, nbytes, stream, uncompressed=uncompressed)
                    source = c._scaled(grad_full, reduce_dtype, scale)
                    send = self._quantize_chunks(source, shard_grad, layout)
                    received = torch.empty_like(send)
                    if world > 1:
                        dist.all_to_all_single(received, send, output_split_sizes=sizes, input_split_sizes=sizes,
                                               group=c.group)
                    summed = torch.zeros(shard, dtype=torch.float32, device=c.device)
                    self._sum_chunks(summed, source, received, layout)
                    event = c.finish_on_stream(record, summed, shard_grad, unit, stream)
                return Pending(record, c.log.clock, event=event, device=c.device,
                               keep_alive=(grad_full, source, send, received, summed, shard_grad))
            record = c.log.collective("reduce_scatter", unit, nbytes, uncompressed=uncompressed)
            source = c._scaled(grad_full, reduce_dtype, scale)
            send = self._quantize_chunks(source, shard_grad, layout)
            received = torch.empty_like(send)
            # fp32, as the fused dequantise-accumulate wants; with replicas, a buffer of its own
            # that the all-reduce across them sums before it joins the shard gradient.
            direct = shard_grad.dtype == torch.float32 and c.replicate_group is None
            target = shard_grad if direct else torch.zeros(shard, dtype=torch.float32, device=c.device)

            held = [source, received]       # See [Note: callbacks drop their buffers].

            def finish() -> None:
                self._sum_chunks(target, *held, layout)
                held.clear()
                if not direct and c.replicate_group is None:
                    c.kernels.accumulate(shard_grad, target)

            work = None
            if world > 1:
                work = dist.all_to_all_single(received, send, output_split_sizes=sizes, input_split_sizes=sizes,
                                              group=c.group, async_op=True)
            pending = c._pending(record, work, keep_alive=(source, send, received), on_complete=finish)
            if c.replicate_group is not None:
                pending.then = lambda: c._all_reduce_into(target, shard_grad, unit)
            return pending

    def _quantize_chunks(self, source: torch.Tensor, shard_grad: torch.Tensor, layout: RecordLayout) -> torch.Tensor:
        """Records of `source`'s chunks for every other rank, in rank order (see [Note: error
        feedback] for the kept error)."""
        c = self.collectives
        world, rank, shard, bits = c.world_size, c.rank, layout.numel, layout.bits
        send = torch.empty(layout.nbytes * (world - 1), dtype=torch.uint8, device=c.device)
        error = self._error_for(shard_grad, (world - 1) * shard) if self.settings.error_feedback else None
        quantize = c.kernels.quantize_int8 if bits == 8 else c.kernels.quantize_int4
        for index, dest in enumerate(r for r in range(world) if r != rank):
            values, scales = layout.views(send, index)
            chunk_error = None if error is None else error.narrow(0, index * shard, shard)
            quantize(source.narrow(0, dest * shard, shard), values, scales, layout.block, chunk_error)
        return send

    def _sum_chunks(self, target: torch.Tensor, source: torch.Tensor, received: torch.Tensor,
                    layout: RecordLayout) -> None:
        """target (fp32) += this rank's own chunk of `source` + the received chunks, dequantised."""
        c = self.collectives
        shard = layout.numel
        c.kernels.accumulate(target, source.narrow(0, c.rank * shard, shard))
        for index in range(c.world_size - 1):
            values, scales = layout.views(received, index)
            c.kernels.dequantize_accumulate(target, values, scales, layout.block, layout.bits)

    def _error_for(self, shard_grad: torch.Tensor, numel: int) -> torch.Tensor:
        error = self._errors.get(shard_grad)
        if error is None:
            error = torch.zeros(numel, dtype=torch.float32, device=shard_grad.device)
            self._errors[shard_grad] = error
        return error
