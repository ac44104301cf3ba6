"""Reading a checkpoint without unpickling arbitrary objects.

DCP's file reader unpickles the `.metadata` file with `pickle.load` and its default load
planner reads non-tensor values with `torch.load(weights_only=False)`: a checkpoint from an
untrusted place could run code. Here the metadata goes through an unpickler that knows only
DCP's own metadata records and a few builtins, and values through `torch.load(weights_only=True)`
(tensors, numbers, strings, lists, dicts, tuples).
"""
from __future__ import annotations

import io
import os
import pickle
from typing import Any

import torch
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta
from torch.distributed.checkpoint.planner import ReadItem

METADATA_FILE = ".metadata"

# Everything DCP's metadata pickles refer to: its own records, paths, sizes, dtypes and
# layouts. A dotted name would let a pickle reach attributes of these modules, so none is.
_ALLOWED = {
    ("torch.distributed.checkpoint.metadata", name) for name in (
        "Metadata", "MetadataIndex", "StorageMeta", "TensorProperties", "TensorStorageMetadata",
        "BytesStorageMetadata", "ChunkStorageMetadata", "_MEM_FORMAT_ENCODING")
} | {
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"), ("torch.serialization", "_get_layout"),
    ("pathlib", "PosixPath"), ("pathlib", "WindowsPath"), ("pathlib", "PurePosixPath"), ("torch", "Size"),
    ("collections", "OrderedDict"),
}


class UnsafeCheckpoint(pickle.UnpicklingError):
    """The checkpoint's metadata names something other than DCP's own records."""


class _MetadataUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        allowed = (module, name) in _ALLOWED or (
            module == "torch" and "." not in name and isinstance(getattr(torch, name, None), torch.dtype))
        if not allowed:
            raise UnsafeCheckpoint(f"checkpoint metadata refers to {module}.{name}, which a checkpoint "
                                   "never needs; refusing to load it")
        return super().find_class(module, name)


def read_metadata(path: str | os.PathLike) -> Metadata:
    with open(os.path.join(path, METADATA_FILE), "rb") as f:
        metadata = _MetadataUnpickler(f).load()
    if not isinstance(metadata, Metadata):
        raise UnsafeCheckpoint(f"{path}: {METADATA_FILE} holds a {type(metadata).__name__}, not DCP metadata")
    return metadata


class SafeReader(FileSystemReader):
    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        metadata = read_metadata(self.path)
        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata


class SafeLoadPlanner(DefaultLoadPlanner):
    """DCP's default planner, with non-tensor values read by `torch.load(weights_only=True)`.
    Keys are flat already (see overlap.checkpoint), so nothing is flattened."""

    def __init__(self) -> None:
        super().__init__(flatten_state_dict=False)

    def load_bytes(self, read_item: ReadItem, value: io.BytesIO) -> None:
        # Into the caller's dict: the planner's own is a copy when sharded tensors are present.
        self.original_state_dict[read_item.dest_index.fqn] = torch.load(value, weights_only=True)
