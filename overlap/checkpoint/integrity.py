"""Checksums of every stored item, recorded at save and checked at load.

DCP stores each item (one chunk of a tensor, or one pickled value) as a byte range of a rank's
data file and records the range in the metadata's `storage_data` as a `_StorageInfo`. The
writer here hashes each range once its file is written and adds the checksum to that record,
as one more attribute (`checksum`, "crc32:<hex>"): the record stays DCP's own class, so DCP's
own readers and `dcp_to_torch_save` read these checkpoints as before and ignore it.

The reader checks what it reads, range by range as written, not tensor by tensor: a load at
another world size reads whole stored chunks written by other ranks and cuts its parts out of
them, so each chunk is checked against its own checksum before it is cut. A missing file, a
file shorter than the ranges it should hold, or a range whose bytes differ is a
`CorruptCheckpoint` naming the checkpoint, the file and the item.

Why crc32 (zlib): it detects any damage up to 32 bits long and random damage with
probability 1 - 2^-32, which is what is asked of it (damage on disk or in transit, not an
adversary), and it is the cheaper: 1.01 GiB/s per rank against 0.20 GiB/s for blake2b, both
ranks hashing at once (`benchmarks/checkpoint.py`, docs/results/checkpoint.json).
"""
from __future__ import annotations

import io
import os
import zlib
from collections import defaultdict
from typing import IO, Any, Iterable, Optional

from torch.distributed.checkpoint.metadata import Metadata, MetadataIndex
from torch.distributed.checkpoint.planner import LoadPlan, LoadPlanner, SavePlan, SavePlanner
from torch.distributed.checkpoint.storage import WriteResult
from torch.futures import Future

from overlap.checkpoint.safe_files import SafeReader
from overlap.checkpoint.staging import StagingWriter

CHECKSUM = "checksum"       # the attribute added to DCP's per-item storage record
_ALGORITHM = "crc32"
_CHUNK = 4 * 2**20          # bytes hashed at a time when reading a file back


class CorruptCheckpoint(Exception):
    """A checkpoint's file is missing, shorter than its metadata says, or holds other bytes
    than were written. Raised by `load` on every rank with the same message."""

    def __init__(self, checkpoint: str, file: str, item: str, problem: str) -> None:
        self.checkpoint, self.file, self.item, self.problem = checkpoint, file, item, problem
        super().__init__(f"checkpoint {checkpoint} is damaged: {file} {problem} (item {item})")

    def __reduce__(self) -> tuple:
        # DCP sends a rank's exception to the others pickled.
        return type(self), (self.checkpoint, self.file, self.item, self.problem)


def _crc32(chunks: Iterable[bytes | memoryview]) -> str:
    value = 0
    for chunk in chunks:
        value = zlib.crc32(chunk, value)
    return f"{_ALGORITHM}:{value:08x}"


def describe_item(index: MetadataIndex) -> str:
    """'key' for a whole value, 'key at offset (a, b)' for one chunk of a tensor."""
    return repr(index.fqn) if not index.offset else f"{index.fqn!r} at offset {tuple(index.offset)}"


def has_checksums(metadata: Metadata) -> bool:
    """Whether the checkpoint was written with checksums (by `ChecksumWriter`); if so, an
    item without one is damage too."""
    return any(hasattr(info, CHECKSUM) for info in metadata.storage_data.values())


def _read_range(file: IO[bytes], offset: int, length: int, buffer: bytearray) -> Iterable[memoryview]:
    """The bytes [offset, offset + length) of `file`, a chunk at a time (fewer if it ends first)."""
    file.seek(offset)
    view = memoryview(buffer)
    while length > 0:
        got = file.readinto(view[:min(length, len(buffer))])
        if not got:
            return
        length -= got
        yield view[:got]


class ChecksumWriter(StagingWriter):
    """DCP's file writer, plus a checksum of each item's bytes in its storage record.

    The bytes are hashed by reading each file back once it is written and synced: the
    writer's results give each item's range, and DCP writes a file in one pass through its
    own serialiser, so reading back needs no knowledge of how DCP writes."""

    def write_data(self, plan: SavePlan, planner: SavePlanner) -> Future[list[WriteResult]]:
        results = super().write_data(plan, planner).wait()
        by_file: dict[str, list[WriteResult]] = defaultdict(list)
        for result in results:
            by_file[result.storage_data.relative_path].append(result)
        buffer = bytearray(_CHUNK)
        for relative_path, in_file in by_file.items():
            with open(os.path.join(self.path, relative_path), "rb") as file:
                for result in sorted(in_file, key=lambda r: r.storage_data.offset):
                    info = result.storage_data
                    setattr(info, CHECKSUM, _crc32(_read_range(file, info.offset, info.length, buffer)))
        done: Future[list[WriteResult]] = Future()
        done.set_result(results)
        return done


class VerifyingReader(SafeReader):
    """`SafeReader` that refuses a missing or short file, and, when `verify`, an item whose
    bytes do not match their checksum, with a `CorruptCheckpoint`.

    Files are checked for presence and length before anything is read; then each item is
    read whole into memory, checked, and handed to DCP's deserialiser from there (a
    transient copy of one item)."""

    def __init__(self, path: str | os.PathLike, verify: bool) -> None:
        super().__init__(path)
        self.verify = verify
        self._index_of: dict[int, MetadataIndex] = {}
        self._items_read = 0

    def set_up_storage_reader(self, metadata: Metadata, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        super().set_up_storage_reader(metadata, is_coordinator, *args, **kwargs)
        # DCP hands `_slice_file` the storage record only; the item it belongs to is for the message.
        self._index_of = {id(info): index for index, info in self.storage_data.items()}

    def _corrupt(self, relative_path: str, index: Optional[MetadataIndex], problem: str) -> CorruptCheckpoint:
        item = describe_item(index) if index is not None else "unknown"
        return CorruptCheckpoint(os.fspath(self.path), relative_path, item, problem)

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future[None]:
        # Every file, not only those this rank reads: each rank finds the same first fault,
        # so every rank reports the same one, and a stat per file costs nothing.
        in_file: dict[str, list[MetadataIndex]] = defaultdict(list)
        for index, info in self.storage_data.items():
            in_file[info.relative_path].append(index)
        for relative_path, indices in sorted(in_file.items()):
            indices.sort(key=lambda index: self.storage_data[index].offset)
            full_path = os.path.join(self.path, relative_path)
            if not os.path.isfile(full_path):
                raise self._corrupt(relative_path, indices[0], "is missing")
            size = os.path.getsize(full_path)
            for index in indices:
                info = self.storage_data[index]
                if info.offset + info.length > size:
                    raise self._corrupt(relative_path, index, f"is truncated: it ends at byte {size}, the item "
                                        f"spans bytes {info.offset}-{info.offset + info.length}")
        self._items_read = 0
        done = super().read_data(plan, planner)
        # The checks live in `_slice_file`, a private method of DCP's reader: should a torch
        # release stop calling it, this says so rather than loading unchecked.
        if self._items_read != len(plan.items):
            raise RuntimeError(f"DCP's FileSystemReader read {len(plan.items)} items but only {self._items_read} "
                               "through _slice_file; overlap cannot check checkpoints with this torch version")
        return done

    def _slice_file(self, file: Any, sinfo: Any) -> IO[bytes]:
        # Called by FileSystemReader.read_data for each item it reads.
        self._items_read += 1
        file.seek(sinfo.offset)
        data = file.read(sinfo.length)
        index = self._index_of.get(id(sinfo))
        if len(data) != sinfo.length:
            raise self._corrupt(sinfo.relative_path, index, f"is truncated: it ends before byte "
                                f"{sinfo.offset + sinfo.length}, where the item ends")
        if self.verify:
            expected = getattr(sinfo, CHECKSUM, None)
            if expected is None:
                raise self._corrupt(sinfo.relative_path, index, "has an item without a checksum where other "
                                    "items have one")
            if _crc32([data]) != expected:
                raise self._corrupt(sinfo.relative_path, index, f"holds other bytes than were written "
                                    f"(bytes {sinfo.offset}-{sinfo.offset + sinfo.length} do not match their checksum)")
        return io.BytesIO(data)
