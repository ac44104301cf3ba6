"""The extension point for compressed collectives: what a codec does to the bytes of an
all-gather and of a reduce-scatter.

`Collectives` (overlap.runtime.collectives) takes a codec at construction, issues the
collectives, owns their buffers and runs every step on the right stream; a codec only says
which buffers it compresses and in what wire format, and encodes and decodes them. overlap.runtime.compression's `QuantizedCodec` is the implementation.

All-gather of a shard of n elements: every rank encodes its shard into `gather_bytes(n)`
bytes (`gather_format(n).nbytes`), an all-gather brings every rank's message in rank order, and they are decoded into
the gathered buffer (the owner's part too, so that all ranks compute with the same values).
Reduce-scatter with shard chunks of n elements: each rank encodes the chunk destined to every
other rank into `reduce_format(n).nbytes` bytes, an all-to-all delivers them, and the receiver adds
its own chunk exact and the decoded ones (in fp32) into its reduced chunk.
"""
from __future__ import annotations

from typing import Protocol

import torch


class WireFormat(Protocol):
    """How one rank's part of a collective is encoded, fixed when the collective is issued
    (a codec may change mode before the consumer waits and decodes)."""

    @property
    def nbytes(self) -> int:
        """Bytes of one encoded part on the wire."""


class Codec(Protocol):
    def gathers(self, out: torch.Tensor) -> bool:
        """Whether the all-gather into `out` is encoded."""

    def reduces(self, grad: torch.Tensor) -> bool:
        """Whether the reduction of `grad` is encoded."""

    def gather_format(self, numel: int) -> WireFormat:
        """The format of one rank's encoded shard of `numel` elements."""

    def encode_shard(self, shard: torch.Tensor, send: torch.Tensor, wire: WireFormat) -> None:
        """Encode `shard` into the uint8 buffer `send` (`wire.nbytes`)."""

    def decode_gathered(self, out: torch.Tensor, received: torch.Tensor, wire: WireFormat, world: int) -> None:
        """Decode the `world` parts of `received` (rank order) into `out`, one shard each."""

    def reduce_format(self, numel: int) -> WireFormat:
        """The format of one encoded gradient chunk of `numel` elements."""

    def encode_chunks(self, source: torch.Tensor, send: torch.Tensor, wire: WireFormat, rank: int, world: int,
                      reduced_into: torch.Tensor) -> None:
        """Encode every chunk of `source` (`world` chunks) but chunk `rank` into `send`, in rank
        order. `reduced_into` is the sharded gradient the result ends up in: a codec that
        keeps state across steps (error feedback) keeps it per such tensor."""

    def decode_accumulate(self, target: torch.Tensor, received: torch.Tensor, wire: WireFormat, count: int) -> None:
        """target (fp32) += the sum of the `count` decoded chunks in `received`."""

    def reset_errors(self) -> None:
        """Forget state kept across steps (after a step skipped for non-finite gradients)."""
