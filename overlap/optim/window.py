"""The disk tier's read-ahead window: buckets' fp32 master and moments held in host memory
from the backward that reads them ahead to the write behind the step that updates them.

[Note: reading ahead and writing behind]
A step needs each bucket's master and moments and the step's final gradient. A step taken
during backward ([Note: the speculative step] in speculation.py) hides the state file's IO
only while the gradient stays as backward left it; a clip that binds changes every gradient
after backward, and the step is then taken again in `optimizer.step()`, reading and writing
the whole state with nothing to hide it behind. As ZeRO-Infinity does, the window splits the
IO off the gradient instead:
- reading ahead: during backward, from the first reduction of a shard that reads ahead, its
  buckets' current slots and then those of the other shards that read ahead (in the order
  backward reduces them) are read into window buffers on the engine's reader thread: the
  state does not wait for the gradient, so the groups reduced last are not read after
  backward. A bucket whose write behind is still in flight is read once that write finished;
- the step takes each bucket held, steps it in place with the final gradient (clipped or
  not), writes its 16-bit copy as any step does, and queues the bucket's write into its spare
  slot on the writer thread; the slot flips at the step, as every step's do, and the write
  runs after `optimizer.step()` returned, under the next forward;
- `flush()` waits for the writes behind and puts their buffers back in the pool. Every reader
  of the file flushes first (state dicts, checkpoint saves and loads, the pins of an
  asynchronous save, the step's own pipeline, close), and a speculative step waits for the
  writes behind of its own buckets, so nothing reads a slot whose write is in flight. A write
  behind that failed leaves its current slot part written: the engine then marks the state
  inconsistent, as after a failed step.
A bucket that finds no room (the window is smaller than the state) or whose read failed is
stepped through the pipeline, read and written inside the step, as without a window.

The buffers are allocated as buckets first need them, up to `capacity` bytes, and reused from
step to step: a bucket's buffer is free again once its write behind finished. Which shards
read ahead and which speculate is the engine's choice ([Note: choosing between them] in
paged.py). Only the thread that steps (the main one) calls this class.
"""
from __future__ import annotations

from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Optional, Sequence

import torch

from .state_file import Bucket, StateFile, aligned_buffer


@dataclass(frozen=True)
class _Held:
    """A bucket read ahead: its buffer, and the read that fills it with the current slot."""

    buffer: torch.Tensor
    ready: Future


class StateWindow:
    """Up to `capacity` bytes of buckets held in host memory between their read ahead and the
    end of their write behind (see [Note: reading ahead and writing behind])."""

    def __init__(self, file: StateFile, reader: ThreadPoolExecutor, writer: ThreadPoolExecutor,
                 capacity: int) -> None:
        self.file = file
        self.capacity = max(0, int(capacity))
        self._reader, self._writer = reader, writer
        # Buffers that hold no bucket, by size, kept for the next read ahead: allocating and
        # first touching the state's size again every step would cost more than the read.
        self._free: dict[int, list[torch.Tensor]] = {}
        self._allocated = 0
        self._held: dict[int, _Held] = {}
        # Writes behind in flight, by bucket index, with the buffer each writes from.
        self._behind: dict[int, tuple[Future, torch.Tensor]] = {}
        # Bytes read ahead and written behind since creation (the tests and benchmarks read them).
        self.read_bytes = self.written_bytes = 0

    def holds(self, index: int) -> bool:
        """Whether bucket `index` was read ahead and not yet taken or dropped."""
        return index in self._held

    def read_ahead(self, index: int, bucket: Bucket) -> bool:
        """Start reading bucket `index`'s current slot into a window buffer; False when the
        window has no room for it."""
        if index in self._held:
            return True
        buffer = self._buffer(bucket.nbytes)
        if buffer is None:
            return False
        behind = self._behind.get(index)
        self._held[index] = _Held(buffer, self._reader.submit(self._read, bucket, buffer,
                                                              None if behind is None else behind[0]))
        self.read_bytes += bucket.nbytes
        return True

    def _read(self, bucket: Bucket, buffer: torch.Tensor, behind: Optional[Future]) -> None:
        if behind is not None:
            behind.result()             # the slot being read is the one that write fills
        self.file.read(bucket, buffer)

    def held(self) -> list[int]:
        """The buckets held, in the order their reads were submitted."""
        return list(self._held)

    def take(self, index: int) -> Optional[torch.Tensor]:
        """Bucket `index`'s buffer once its read finished (the caller steps it and then calls
        `write_behind`); None if it is not held or its read failed (its buffer is freed)."""
        held = self._held.pop(index, None)
        if held is None:
            return None
        if held.ready.exception() is not None:
            self._release(held.buffer)
            return None
        return held.buffer

    def write_behind(self, index: int, bucket: Bucket, buffer: torch.Tensor, slot: int) -> None:
        """Queue the write of `buffer` (taken from `take`) into slot `slot` of bucket `index`."""
        assert index not in self._behind, "a bucket was stepped twice before its write behind was flushed"
        self._behind[index] = (self._writer.submit(self.file.write, bucket, buffer, slot=slot), buffer)
        self.written_bytes += bucket.nbytes

    def pending(self, indices: Sequence[int]) -> list[Future]:
        """The writes behind in flight among buckets `indices` (a speculative step waits for them)."""
        return [self._behind[k][0] for k in indices if k in self._behind]

    def drop(self, indices: Optional[Sequence[int]] = None) -> None:
        """Forget the buckets read ahead among `indices` (all when None), once their reads ended."""
        for index in list(self._held) if indices is None else indices:
            held = self._held.pop(index, None)
            if held is not None:
                held.ready.exception()
                self._release(held.buffer)

    def flush(self) -> Optional[BaseException]:
        """Wait for every write behind and free its buffer; the first error among them."""
        error = None
        for future, buffer in self._behind.values():
            failed = future.exception()
            error = error or failed
            self._release(buffer)
        self._behind.clear()
        return error

    def _buffer(self, nbytes: int) -> Optional[torch.Tensor]:
        """A free buffer of `nbytes`, from the pool or newly allocated within `capacity`
        (freeing pooled buffers of other sizes to make room); None when there is none."""
        self._reap()
        pool = self._free.get(nbytes)
        if pool:
            return pool.pop()
        for size, others in self._free.items():
            while others and self._allocated + nbytes > self.capacity:
                others.pop()
                self._allocated -= size
        if self._allocated + nbytes > self.capacity:
            return None
        self._allocated += nbytes
        return aligned_buffer(nbytes)

    def _reap(self) -> None:
        """Free the buffers of the writes behind that finished well (a failed one waits for `flush`)."""
        for index, (future, buffer) in list(self._behind.items()):
            if future.done() and future.exception() is None:
                del self._behind[index]
                self._release(buffer)

    def _release(self, buffer: torch.Tensor) -> None:
        self._free.setdefault(buffer.numel(), []).append(buffer)
