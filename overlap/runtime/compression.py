"""Compressed communication: weights all-gathered as int8, gradients reduced as int8 or int4
through an all-to-all of quantised chunks (ZeRO++'s qwZ and qgZ), on the kernels of
:mod:`overlap.kernels.quantized`. `QuantizedCodec` is the codec (overlap.runtime.codec) that
`Collectives` issues them with.

Only what crosses the wire is quantised. Master shards, optimizer state and the sharded
gradient stay exact; a rank's own chunk of a gradient never leaves it and is added exact.

[Note: one message per quantised collective]
A rank's quantised chunk travels as one byte record: the values (int8, or int4 two per
byte), padded to a multiple of 4 bytes, then the chunk's fp32 scales. The all-gather and the
all-to-all each move one uint8 buffer of such records, so a compressed collective costs one
latency like the uncompressed one, and the receiving side reads the values and scales of
record `c` as views (the padding keeps the scales 4-byte aligned; its bytes are sent
uninitialised and never read).

[Note: a constant number of kernels per collective]
Records are of equal size, so the values and the scales of all records are two 2-D strided
views of the message (`RecordLayout.columns`), and each side of a collective is a fixed
number of kernels whatever the number of ranks (one per record would be ~3 x world launches
per unit and step, ~190 at 64 ranks): the chunks to send are quantised as one buffer (two
runs around this rank's own chunk) and copied into the records' columns; the received
columns are copied out contiguous and decoded by one chunked call. A chunk that is not a
whole number of blocks is first zero-padded to one (zeros leave a block's absmax, hence its
scale and values, unchanged, and quantise to 0, as the last high nibble of an odd int4 chunk
must be), at the cost of a padded copy of what is sent. The bytes sent are the same as
record by record; the receiver sums the decoded chunks first and then adds the total (the
chunked kernel's order).

[Note: error feedback]
int4 gradients keep the quantisation error of every chunk a rank sends (fp32, one value per
element sent: (N-1)/N of the unit's padded gradient) and add it to the next step's gradient
before quantising it, so the error does not accumulate over steps: the sum of what was sent
over k steps differs from the sum of the true gradients by one step's error, not k. It costs
4 bytes per parameter times (N-1)/N per rank on top of ZeRO-3's 16/N (at N = 8, 3.5 bytes:
more than the model states themselves), so it is used only where int4 needs it; int8
gradients go without. A block whose gradient overflowed leaves NaN in its error (see [Note:
non-finite values] in overlap.kernels.quantized): `reset_errors()` clears them.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
from torch.utils.weak import WeakIdKeyDictionary

from overlap.kernels.backends import KernelBackend
from overlap.base.choices import COMPRESSION_BITS
from overlap.kernels.quantized import DEFAULT_BLOCK, Q_DTYPES, num_blocks, quantized_bytes

@dataclass(frozen=True)
class Compression:
    """What is quantised on the wire, and in blocks of how many elements."""

    mode: str = "none"
    block: int = DEFAULT_BLOCK

    @property
    def weight_bits(self) -> Optional[int]:
        return COMPRESSION_BITS[self.mode][0]

    @property
    def grad_bits(self) -> Optional[int]:
        return COMPRESSION_BITS[self.mode][1]

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

    @property
    def whole_numel(self) -> int:
        """The chunk padded to whole blocks."""
        return num_blocks(self.numel, self.block) * self.block

    def columns(self, records: torch.Tensor, count: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(values [count, value bytes], scales fp32 [count, blocks]) of the first `count`
        records of `records`, as strided views. See [Note: a constant number of kernels per
        collective]."""
        rows = records.narrow(0, 0, count * self.nbytes).view(count, self.nbytes)
        values = rows[:, :quantized_bytes(self.numel, self.bits)]
        if self.bits == 8:
            values = values.view(torch.int8)
        return values, rows[:, self.value_bytes:].view(torch.float32)

    def views(self, records: torch.Tensor, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(values, scales) of record `index` in the uint8 buffer `records`."""
        record = records.narrow(0, index * self.nbytes, self.nbytes)
        values = record.narrow(0, 0, quantized_bytes(self.numel, self.bits))
        if self.bits == 8:
            values = values.view(torch.int8)
        return values, record.narrow(0, self.value_bytes, self.nbytes - self.value_bytes).view(torch.float32)


class QuantizedCodec:
    """Block-quantised messages for `Collectives` (see overlap.runtime.codec for what each
    step does), in the mode of `settings`. `set_mode` changes it (`compression="auto"` does,
    at the same step on every rank)."""

    def __init__(self, settings: Compression, kernels: KernelBackend) -> None:
        self._settings = settings
        self.kernels = kernels
        # Error feedback, per shard gradient (one per trainable flat group), kept as long as
        # that gradient. See [Note: error feedback].
        self._errors = WeakIdKeyDictionary()

    @property
    def settings(self) -> Compression:
        return self._settings

    def set_mode(self, mode: str) -> None:
        """Compress as `mode` ("none", "int8", "int8-int4") from the next collective on; every
        rank must switch at the same step."""
        self._settings = Compression(mode, self._settings.block)

    def gathers(self, out: torch.Tensor) -> bool:
        return self._settings.weight_bits is not None and out.is_floating_point()

    def reduces(self, grad: torch.Tensor) -> bool:
        return self._settings.grad_bits is not None and grad.is_floating_point()

    @property
    def error_bytes(self) -> int:
        """Memory held for error feedback on this rank."""
        return sum(e.numel() * e.element_size() for e in self._errors.values())

    def reset_errors(self) -> None:
        """Forget the kept quantisation errors (after a step skipped for non-finite gradients:
        see [Note: error feedback])."""
        for error in self._errors.values():
            error.zero_()

    # ---- all-gather: int8 weights -----------------------------------------------------------

    def gather_format(self, numel: int) -> RecordLayout:
        return RecordLayout(numel, self._settings.block, self._settings.weight_bits)

    def encode_shard(self, shard: torch.Tensor, send: torch.Tensor, wire: RecordLayout) -> None:
        values, scales = wire.views(send, 0)
        self.kernels.quantize_int8(shard.detach(), values, scales, wire.block)

    def decode_gathered(self, out: torch.Tensor, received: torch.Tensor, wire: RecordLayout, world: int) -> None:
        """See [Note: a constant number of kernels per collective]."""
        values, scales = wire.columns(received, world)
        # `out` is the gathered leaf's storage: writing it must not look like an in-place
        # change to autograd (see flat_group.py's note on freeing `full`).
        with torch.autograd._unsafe_preserve_version_counter(out):
            if wire.whole_numel == wire.numel:
                self.kernels.dequantize_into(out, values.contiguous().view(-1), scales.contiguous().view(-1),
                                             wire.block, wire.bits)
                return
            whole = wire.whole_numel
            q_padded = torch.zeros(world, quantized_bytes(whole, wire.bits), dtype=values.dtype, device=out.device)
            q_padded[:, :values.shape[1]].copy_(values)
            decoded = torch.empty(world * whole, dtype=out.dtype, device=out.device)
            self.kernels.dequantize_into(decoded, q_padded.view(-1), scales.contiguous().view(-1),
                                         wire.block, wire.bits)
            out.view(world, wire.numel).copy_(decoded.view(world, whole)[:, :wire.numel])

    # ---- reduce-scatter: int8 or int4 gradient chunks -----------------------------------------

    def reduce_format(self, numel: int) -> RecordLayout:
        return RecordLayout(numel, self._settings.block, self._settings.grad_bits)

    def encode_chunks(self, source: torch.Tensor, send: torch.Tensor, wire: RecordLayout, rank: int, world: int,
                      reduced_into: torch.Tensor) -> None:
        """See [Note: error feedback] for the error kept per `reduced_into`, and [Note: a
        constant number of kernels per collective] for the kernels."""
        count, shard, whole = world - 1, wire.numel, wire.whole_numel
        if count == 0:
            return
        error = self._error_for(reduced_into, count * shard, send.device) if self._settings.error_feedback else None
        quantize = self.kernels.quantize_int8 if wire.bits == 8 else self.kernels.quantize_int4
        q = torch.empty(count * quantized_bytes(whole, wire.bits), dtype=Q_DTYPES[wire.bits], device=send.device)
        scales = torch.empty(count * num_blocks(whole, wire.block), dtype=torch.float32, device=send.device)
        # The chunks for the other ranks, in rank order: two runs, before and after this rank's.
        runs = [(0, rank), (rank + 1, world)]
        if whole == shard:
            for first, end in runs:
                if end > first:
                    index = first - (first > rank)          # the run's first record
                    quantize(source.narrow(0, first * shard, (end - first) * shard),
                             q.narrow(0, index * quantized_bytes(shard, wire.bits),
                                      (end - first) * quantized_bytes(shard, wire.bits)),
                             scales.narrow(0, index * num_blocks(shard, wire.block),
                                           (end - first) * num_blocks(shard, wire.block)),
                             wire.block,
                             None if error is None else error.narrow(0, index * shard, (end - first) * shard))
        else:
            chunks = source.view(world, shard)
            padded = torch.zeros(count, whole, dtype=source.dtype, device=source.device)
            padded[:rank, :shard].copy_(chunks[:rank])
            padded[rank:, :shard].copy_(chunks[rank + 1:])
            padded_error = None
            if error is not None:
                padded_error = torch.zeros(count, whole, dtype=torch.float32, device=error.device)
                padded_error[:, :shard].copy_(error.view(count, shard))
            quantize(padded.view(-1), q, scales, wire.block, None if padded_error is None else padded_error.view(-1))
            if error is not None:
                error.view(count, shard).copy_(padded_error[:, :shard])
        values, record_scales = wire.columns(send, count)
        values.copy_(q.view(values.dtype).view(count, -1)[:, :values.shape[1]])
        record_scales.copy_(scales.view(count, -1))

    def decode_accumulate(self, target: torch.Tensor, received: torch.Tensor, wire: RecordLayout, count: int) -> None:
        """See [Note: a constant number of kernels per collective]."""
        if count == 0:
            return
        values, scales = wire.columns(received, count)
        self.kernels.dequantize_accumulate(target, values.contiguous().view(-1), scales.contiguous().view(-1),
                                           wire.block, wire.bits, count)

    def _error_for(self, reduced_into: torch.Tensor, numel: int, device: torch.device) -> torch.Tensor:
        # Keyed by the gradient shard, on the device that quantises (the shard may be in host
        # memory: overlap.runtime.host_tier).
        error = self._errors.get(reduced_into)
        if error is None:
            error = torch.zeros(numel, dtype=torch.float32, device=device)
            self._errors[reduced_into] = error
        return error
