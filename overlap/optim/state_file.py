"""One rank's AdamW state on disk: the file layout (which bytes hold which bucket) and the
reads and writes of one bucket, each a single system call on one contiguous range.

Flat shards (one per flat group of the model) are cut into buckets of at most
`bucket_params` elements. A bucket's fp32 master, exp_avg and exp_avg_sq lie one after the
other in the file, so a bucket is one read and one write:

    file:    | bucket 0 slot 0: master | exp_avg | exp_avg_sq | pad | bucket 0 slot 1 | bucket 1 ...
    buffer:  | master | exp_avg | exp_avg_sq | pad |      (one host buffer per bucket in flight)

[Note: two slots per bucket]
Each bucket has two regions of the same size, its current slot and its spare one. Reads,
ordinary writes and the memory maps (`map`, `map_elements`) are of the current slot; a
speculative step (overlap.optim.paged, [Note: the speculative step]) writes the spare slot,
so the state it started from stays intact until the step is validated, and committing it is
`flip`: the spare becomes current, with no IO. The file is therefore twice the state's size
(plan/offload.py counts it so). Which slot is current lives in this object only: a file is
never reopened, its state is saved and loaded through checkpoints.

[Note: direct IO]
The file is opened with O_DIRECT where the file system takes it (ext4 and xfs do, tmpfs does
not): the state is read and written once per step, so the page cache would only hold a second
copy of it in host memory (the memory disk offload exists to save) and make the bandwidth
reached depend on what else the machine caches. Direct IO needs the buffer address, the file
offset and the length aligned to the logical block size; every region is therefore padded to
`ALIGN` bytes and every buffer starts on an `ALIGN` boundary. Without O_DIRECT the same calls
go through the page cache.

Space for the whole file is reserved when it is created (`posix_fallocate`), so a full disk
is an error at creation, naming the directory and the bytes it needed, and not a write that
fails halfway through a step.
"""
from __future__ import annotations

import errno
import itertools
import mmap
import multiprocessing.util
import os
import shutil
import tempfile
from dataclasses import dataclass
from typing import Optional, Sequence

import torch

ALIGN = 4096            # bytes: a logical block on every drive we target, and a page
FLOAT_BYTES = 4
STATE_NAMES = ("master", "exp_avg", "exp_avg_sq")
SLOTS = 2               # current and spare: see [Note: two slots per bucket]
# Linux moves at most this many bytes per read or write call (0x7ffff000); longer buckets
# take several calls, each continuing where the last one stopped.
_MAX_IO = 0x7FFFF000


_FILE_NUMBERS = itertools.count()


class StateFileError(RuntimeError):
    """The state file cannot be created, read or written as the layout says."""


@dataclass(frozen=True)
class Bucket:
    """Elements [start, stop) of flat shard `shard`, stored at byte `offset` of the file."""

    shard: int
    start: int
    stop: int
    offset: int

    @property
    def numel(self) -> int:
        return self.stop - self.start

    @property
    def nbytes(self) -> int:
        """Bytes of one of its slots in the file, and of a buffer (padded to ALIGN)."""
        return region_bytes(self.numel)

    def slot_offset(self, slot: int) -> int:
        """Where slot 0 or 1 of the bucket begins in the file (see [Note: two slots per bucket])."""
        return self.offset + slot * self.nbytes


def region_bytes(numel: int) -> int:
    """Bytes of a bucket of `numel` elements: three fp32 tensors, padded to ALIGN."""
    raw = len(STATE_NAMES) * FLOAT_BYTES * numel
    return -(-raw // ALIGN) * ALIGN


def plan_buckets(shard_sizes: Sequence[int], bucket_params: int,
                 param_starts: Optional[Sequence[Sequence[int]]] = None, *, first_shard: int = 0,
                 offset: int = 0) -> list[Bucket]:
    """Cut each shard into buckets of at most `bucket_params` elements, laid out in order.

    With `param_starts` (per shard, the offsets where its parameters begin) buckets are cut on
    parameter boundaries wherever that keeps them within `bucket_params`: consecutive
    parameters share a bucket up to that size, and only a parameter longer than a bucket is
    cut, into chunks of its own. A parameter that fits a bucket then lies in one bucket, one
    contiguous range of the file (`StateFile.map`). Without it, fixed chunks. Shards are
    numbered from `first_shard` and laid out from byte `offset` (a shard added to a file).
    """
    if isinstance(bucket_params, bool) or not isinstance(bucket_params, int) or bucket_params < 1:
        raise ValueError(f"bucket_params={bucket_params!r} is invalid; expected an integer >= 1")
    if param_starts is not None and len(param_starts) != len(shard_sizes):
        raise ValueError(f"param_starts has {len(param_starts)} entries for {len(shard_sizes)} shards")
    buckets: list[Bucket] = []
    for shard, size in enumerate(shard_sizes):
        if isinstance(size, bool) or not isinstance(size, int) or size < 0:
            raise ValueError(f"shard {shard} has size {size!r}; expected an integer >= 0")
        if param_starts is None:
            ranges = [(start, min(size, start + bucket_params)) for start in range(0, size, bucket_params)]
        else:
            given = list(param_starts[shard])
            if any(isinstance(x, bool) or not isinstance(x, int) or not 0 <= x <= size for x in given):
                raise ValueError(f"param_starts[{shard}]={given!r} must lie in [0, {size}]")
            # a parameter with no elements in this shard starts at its end: nothing to cut
            starts = sorted({x for x in given if x < size} | {0})
            ranges = _cut_on_boundaries(starts if size else [], size, bucket_params)
        for start, stop in ranges:
            buckets.append(Bucket(first_shard + shard, start, stop, offset))
            offset += SLOTS * buckets[-1].nbytes
    return buckets


def _cut_on_boundaries(starts: list[int], size: int, bucket_params: int) -> list[tuple[int, int]]:
    ranges, open_at = [], 0
    for lo, hi in zip(starts, starts[1:] + [size]):
        if hi - lo > bucket_params:                  # a parameter longer than a bucket: chunks
            if lo > open_at:
                ranges.append((open_at, lo))
            ranges.extend((c, min(hi, c + bucket_params)) for c in range(lo, hi, bucket_params))
            open_at = hi
        elif hi - open_at > bucket_params:           # the next parameter starts a new bucket
            ranges.append((open_at, lo))
            open_at = lo
    if size > open_at:
        ranges.append((open_at, size))
    return ranges


def aligned_buffer(nbytes: int) -> torch.Tensor:
    """A uint8 CPU tensor of `nbytes` whose first byte is ALIGN-aligned (direct IO needs it)."""
    raw = torch.empty(nbytes + ALIGN, dtype=torch.uint8)
    skip = (-raw.data_ptr()) % ALIGN
    return raw[skip:skip + nbytes]


def bucket_views(buffer: torch.Tensor, numel: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The master, exp_avg and exp_avg_sq of a bucket of `numel` elements inside `buffer`."""
    floats = buffer[:region_bytes(numel)].view(torch.float32)
    return floats[:numel], floats[numel:2 * numel], floats[2 * numel:3 * numel]


class StateFile:
    """The file of one rank: created at its full size under `directory` (a fresh temporary
    directory, removed by `close()`, when None), read and written a bucket at a time."""

    def __init__(self, buckets: Sequence[Bucket], directory: Optional[str] = None, *, rank: int = 0,
                 direct: bool = True) -> None:
        self.buckets = tuple(buckets)
        self.size = sum(SLOTS * b.nbytes for b in self.buckets)
        # The current slot of each bucket that is not in slot 0, by the bucket's offset.
        self._current: dict[int, int] = {}
        self._own_dir = directory is None
        if directory is None:
            directory = tempfile.mkdtemp(prefix=f"overlap-offload-rank{rank}-")
        elif not os.path.isdir(directory):
            raise StateFileError(f"rank {rank}: offload directory {directory!r} does not exist or is not a "
                                 "directory (OVERLAP_OFFLOAD_DIR); create it first")
        self.directory = directory
        # A name no other file has: several models, ranks or runs may share the directory.
        self.path = os.path.join(directory, f"rank{rank}-{os.getpid()}-{next(_FILE_NUMBERS)}.state")
        self.rank = rank
        self.fd = -1
        self.direct = False
        # Removes the file (and a directory made here) if close() was not called: when this object
        # is collected, or when the process exits. multiprocessing's finalizers run at exit in the
        # main process and in processes it started (which leave through os._exit, past atexit).
        self._finalizer = multiprocessing.util.Finalize(
            self, _remove, (self.path, directory if self._own_dir else None), exitpriority=0)
        try:
            self._open(direct)
            self._reserve()
        except BaseException:
            self.close()
            raise

    def _open(self, direct: bool) -> None:
        flags = os.O_RDWR | os.O_CREAT | os.O_EXCL | getattr(os, "O_CLOEXEC", 0)
        if direct and hasattr(os, "O_DIRECT"):
            try:
                self.fd = os.open(self.path, flags | os.O_DIRECT, 0o600)
                self.direct = True
                return
            except OSError as e:
                if e.errno != errno.EINVAL:      # EINVAL: the file system has no direct IO
                    raise self._error("cannot create", e) from e
                if os.path.exists(self.path):   # created before the flag was refused
                    os.remove(self.path)
        try:
            self.fd = os.open(self.path, flags, 0o600)
        except OSError as e:
            raise self._error("cannot create", e) from e

    def grow(self, buckets: Sequence[Bucket]) -> None:
        """Add buckets laid out after the current end of the file, reserving their space."""
        size = self.size + sum(SLOTS * b.nbytes for b in buckets)
        self._reserve(self.size, size)
        self.buckets += tuple(buckets)
        self.size = size

    def _reserve(self, start: int = 0, end: Optional[int] = None) -> None:
        end = self.size if end is None else end
        if end <= start:
            return
        try:
            os.posix_fallocate(self.fd, start, end - start)
        except OSError as e:
            if e.errno == errno.ENOSPC:
                free = shutil.disk_usage(self.directory).free
                raise StateFileError(
                    f"rank {self.rank}: the offload state needs {end / 2**30:.2f} GiB in {self.directory!r} "
                    f"but {free / 2**30:.2f} GiB are free; point OVERLAP_OFFLOAD_DIR at a larger disk") from e
            if e.errno not in (errno.EOPNOTSUPP, errno.EINVAL):
                raise self._error("cannot reserve space for", e) from e
            os.ftruncate(self.fd, end)           # a file system without fallocate: sparse file

    def _error(self, what: str, e: OSError) -> StateFileError:
        return StateFileError(f"rank {self.rank}: {what} the offload state file {self.path!r}: {e.strerror or e}")

    def slot(self, bucket: Bucket) -> int:
        """The bucket's current slot, 0 or 1."""
        return self._current.get(bucket.offset, 0)

    def flip(self, bucket: Bucket) -> None:
        """Make the bucket's spare slot its current one (a speculative step is committed)."""
        self._current[bucket.offset] = 1 - self.slot(bucket)

    def read(self, bucket: Bucket, buffer: torch.Tensor) -> None:
        """Fill `buffer` (aligned, at least bucket.nbytes) with the bucket's current slot."""
        self._io(bucket.slot_offset(self.slot(bucket)), bucket.nbytes, buffer, os.preadv, "read")

    def write(self, bucket: Bucket, buffer: torch.Tensor, *, spare: bool = False, slot: Optional[int] = None) -> None:
        """Write the bucket's current slot (its spare one with `spare`, or `slot` where given:
        a write behind, which runs after the step flipped the slots) from `buffer`."""
        if slot is None:
            slot = 1 - self.slot(bucket) if spare else self.slot(bucket)
        self._io(bucket.slot_offset(slot), bucket.nbytes, buffer, os.pwritev, "write")

    def _io(self, offset: int, nbytes: int, buffer: torch.Tensor, call, verb: str) -> None:
        if self.fd < 0:
            raise StateFileError(f"rank {self.rank}: the offload state file {self.path!r} is closed")
        view = memoryview(buffer.numpy()).cast("B")[:nbytes]
        done = 0
        while done < nbytes:
            try:
                n = call(self.fd, [view[done:done + _MAX_IO]], offset + done)
            except OSError as e:
                if e.errno == errno.EINTR:
                    continue
                raise self._error(f"cannot {verb} bucket at byte {offset + done} of", e) from e
            if n == 0:
                raise StateFileError(
                    f"rank {self.rank}: the offload state file {self.path!r} is shorter than its layout: {verb} "
                    f"of bytes {offset}..{offset + nbytes} stopped at {offset + done} "
                    f"(file size {os.fstat(self.fd).st_size}); was it truncated?")
            done += n

    def _mmap(self, bucket: Bucket) -> mmap.mmap:
        """The bucket's current slot, mapped shared (writes to the map are writes to the file).
        Slots start on ALIGN boundaries, which mmap's offsets need."""
        length = len(STATE_NAMES) * FLOAT_BYTES * bucket.numel
        with open(self.path, "r+b") as f:
            return mmap.mmap(f.fileno(), length, offset=bucket.slot_offset(self.slot(bucket)),
                             access=mmap.ACCESS_WRITE)

    def map(self, bucket: Bucket) -> torch.Tensor:
        """The bucket's master, exp_avg and exp_avg_sq (current slot), one after the other, as a
        float32 tensor that maps the file."""
        return torch.frombuffer(self._mmap(bucket), dtype=torch.float32)

    def map_elements(self, bucket: Bucket, start: int, stop: int) -> tuple[torch.Tensor, ...]:
        """Elements [start, stop) of the bucket (counted from its first) of the master,
        exp_avg and exp_avg_sq, each a float32 tensor that maps the file and whose storage is
        those elements alone. DCP's file writer copies a tensor whose storage is larger than
        it before saving it, and keeps every such copy until the file is written: a view of a
        whole bucket's map would make a save hold this rank's state in memory."""
        if start == stop:
            return tuple(torch.zeros(0) for _ in STATE_NAMES)
        mapped, n = self._mmap(bucket), bucket.numel
        return tuple(torch.frombuffer(mapped, dtype=torch.float32, count=stop - start,
                                      offset=FLOAT_BYTES * (i * n + start)) for i in range(len(STATE_NAMES)))

    def close(self) -> None:
        """Close the file; remove it (and the directory this object created) too."""
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1
        self._finalizer()


def _remove(path: str, own_dir: Optional[str]) -> None:
    if os.path.exists(path):
        os.remove(path)
    if own_dir is not None:
        shutil.rmtree(own_dir, ignore_errors=True)
