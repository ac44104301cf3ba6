"""Sharded checkpoints of a `ShardedModule` and its optimizer through
`torch.distributed.checkpoint` (DCP): each rank writes only its own parts, and a checkpoint
loads at any world size, bucket size or prefetch depth; the files are FSDP2's (torchtitan's)
for the same model and optimizer, so checkpoints interchange with FSDP2 both ways
(overlap.checkpoint.state).

A save writes into `<path>.partial` and rank 0 renames it to `<path>` once DCP has written
every rank's files and the metadata, so `<path>` exists only complete: a save that dies
midway leaves the previous checkpoint as it was and nothing that looks loadable. Every item
written carries a checksum in the metadata, and `load` checks what it reads
(overlap.checkpoint.integrity).
"""
from __future__ import annotations

import atexit
import dataclasses
import logging
import math
import os
import shutil
from concurrent import futures
from concurrent.futures import Future
from typing import Any, Mapping, Optional

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import CheckpointException, DefaultSavePlanner
from torch.distributed.checkpoint.metadata import Metadata
from torch.distributed.checkpoint.planner import SavePlan

from overlap.checkpoint.integrity import ChecksumWriter, CorruptCheckpoint, VerifyingReader, has_checksums
from overlap.checkpoint.pretrained import load_pretrained
from overlap.checkpoint.staging import StagingWriter
from overlap.checkpoint.safe_files import METADATA_FILE, SafeLoadPlanner, UnsafeCheckpoint, read_metadata
from overlap.checkpoint.state import (EXTRA, MODEL, PARAM_GROUPS, CheckpointMismatch, check_model, load_optimizer,
                                      model_items, optimizer_items, optimizer_targets, stored_shape,
                                      streamed_keys)
from overlap.optim.paged import PagedAdamW, paged_of
from overlap.runtime.process_group import level_group_counts
from overlap.sharded_module import ShardedModule

__all__ = ["CheckpointMismatch", "CorruptCheckpoint", "IncompleteCheckpoint", "PendingSave", "UnsafeCheckpoint",
           "async_save", "async_save_items", "latest_checkpoint", "load", "load_items", "load_pretrained", "save",
           "saved_keys"]

PARTIAL_SUFFIX = ".partial"

logger = logging.getLogger("overlap")


class IncompleteCheckpoint(FileNotFoundError):
    """No complete checkpoint at the path (its save did not finish, or there is none)."""


# One gloo group per training group's ranks, for DCP's own collectives: an asynchronous save
# runs them on a background thread, and sharing the training group would interleave them
# with the training's all-gathers and reductions. Only the model's ranks call save and load,
# so only they take part in making it (`use_local_synchronization`, named by its ranks):
# `new_group` as WORLD makes groups expects every rank to call it, and made by some ranks
# only it waits for the others (TORCH_DIST_INIT_BARRIER=1) or leaves their counts of groups
# out of step, so that the next group made anywhere never connects. Keyed by the default
# group too, since a new `init_process_group` makes every earlier group unusable.
_CHECKPOINT_GROUPS: dict[tuple[Any, tuple[int, ...]], dist.ProcessGroup] = {}


def _checkpoint_group(model: ShardedModule) -> dist.ProcessGroup:
    if not isinstance(model, ShardedModule):
        raise TypeError(f"overlap.checkpoint saves and loads a ShardedModule, not a {type(model).__name__}: a model "
                        "sharded with fully_shard is checkpointed as under FSDP2, with torch.distributed.checkpoint "
                        "over model.state_dict() and get_optimizer_state_dict(model, optimizer) (docs/checkpoint.md)")
    return _gloo_group(model.collectives.all_group)


def _gloo_group(parent: dist.ProcessGroup) -> dist.ProcessGroup:
    """The checkpoint group over `parent`'s ranks, made by them at their first call."""
    ranks = tuple(dist.get_process_group_ranks(parent))
    key = (dist.group.WORLD, ranks)
    if key not in _CHECKPOINT_GROUPS:
        level_group_counts(parent)          # see [Note: groups made by some ranks only]
        group = dist.new_group(list(ranks), backend="gloo", use_local_synchronization=True)
        # Every rank leaves only once all are connected: a rank that raises right after (a
        # refused checkpoint) must not close its side while another is still connecting.
        dist.barrier(group=group)
        _CHECKPOINT_GROUPS[key] = group
    return _CHECKPOINT_GROUPS[key]


def _world_group() -> dist.ProcessGroup:
    """The gloo group of `async_save_items` and `load_items`, which every rank calls: made as
    WORLD makes groups, in step on every rank. (Named by its ranks, it would share its name,
    and so its keys in the store, with any group over all ranks that a device mesh made.)"""
    key = (dist.group.WORLD, ())
    if key not in _CHECKPOINT_GROUPS:
        _CHECKPOINT_GROUPS[key] = dist.new_group(backend="gloo")
    return _CHECKPOINT_GROUPS[key]


class PendingSave:
    """An asynchronous save whose files are still being written; `wait()` returns once the
    checkpoint is complete (on rank 0: renamed into place)."""

    def __init__(self, future: Future, path: str) -> None:
        self.future = future
        self.path = path

    def done(self) -> bool:
        return self.future.done()

    def wait(self) -> None:
        self.future.result()


_in_flight: dict[Any, PendingSave] = {}


def _report_unfinished_saves() -> None:
    """At exit: an asynchronous save nobody waited for, and that did not complete (its last
    step is a collective, which `destroy_process_group()` ends), would otherwise be lost in
    silence; say so, naming the checkpoint and what to do."""
    for pending in _in_flight.values():
        failed = pending.future.exception() if pending.done() else None
        if not pending.done() or failed is not None:
            logger.error("overlap.checkpoint: the asynchronous save to %s did not complete (%s): call wait() on "
                         "what async_save returned before destroy_process_group() and exit",
                         pending.path, failed if failed is not None else "still being written at exit")


atexit.register(_report_unfinished_saves)


def _paged_engines(model: ShardedModule) -> list[PagedAdamW]:
    """The state files (offload="disk") the model's parameters live in."""
    engines = {id(where.engine): where.engine for where in map(paged_of, model.parameters()) if where is not None}
    return list(engines.values())


def _items(model: ShardedModule, optimizer: Optional[torch.optim.Optimizer],
           extra: Optional[Mapping[str, Any]]) -> dict[str, Any]:
    for engine in _paged_engines(model):
        engine.check_consistent()           # never save a state that is part one step, part another
    items = model_items(model)
    if optimizer is not None:
        items.update(optimizer_items(model, optimizer))
    for key, value in (extra or {}).items():
        items[EXTRA + key] = value
    return items


def _prepare(path: str, group: dist.ProcessGroup) -> str:
    """Wait for the group's previous asynchronous save, clear a stale partial directory."""
    previous = _in_flight.pop(group, None)
    if previous is not None:
        previous.wait()
    partial = os.fspath(path) + PARTIAL_SUFFIX
    if dist.get_rank(group) == 0:
        shutil.rmtree(partial, ignore_errors=True)
    # Nobody writes into the partial directory before rank 0 has cleared it.
    dist.barrier(group)
    return partial


def _publish(partial: str, path: str) -> None:
    """Rank 0, once DCP finished: replace any old checkpoint at `path` by the new one."""
    if os.path.exists(path):
        old = path + ".old"
        shutil.rmtree(old, ignore_errors=True)
        os.rename(path, old)
        os.rename(partial, path)
        shutil.rmtree(old)
    else:
        os.rename(partial, path)


class _SavePlanner(DefaultSavePlanner):
    """DCP's planner on flat keys, leaving out the empty chunks of ranks that hold none of a
    parameter's rows: DCP would store them, no load would ever read them, and so no checksum
    would ever check their bytes."""

    def __init__(self) -> None:
        super().__init__(flatten_state_dict=False)

    def create_local_plan(self) -> SavePlan:
        plan = super().create_local_plan()
        kept = [item for item in plan.items if item.tensor_data is None
                or math.prod(item.tensor_data.chunk.sizes) > 0 or math.prod(item.tensor_data.size) == 0]
        self.plan = dataclasses.replace(plan, items=kept)
        return self.plan


def _writer(partial: str, checksums: bool, streamed: frozenset[str] = frozenset()) -> StagingWriter:
    return ChecksumWriter(partial, streamed=streamed) if checksums else StagingWriter(partial, streamed=streamed)


def save(path: str | os.PathLike, model: ShardedModule, optimizer: Optional[torch.optim.Optimizer] = None,
         extra: Optional[Mapping[str, Any]] = None, *, checksums: bool = True) -> None:
    """Write the model's (and optimizer's) state to the directory `path`, every rank its own
    parts, no gather. `extra`: tensors and plain values (numbers, strings, lists, dicts),
    the same on every rank, returned by `load`. `checksums`: record a checksum of every item
    written, which `load` checks. Called on every rank."""
    path = os.fspath(path)
    group = _checkpoint_group(model)
    partial = _prepare(path, group)
    dcp.save(_items(model, optimizer, extra), storage_writer=_writer(partial, checksums), process_group=group,
             planner=_SavePlanner())
    if dist.get_rank(group) == 0:
        _publish(partial, path)
    dist.barrier(group)


def async_save(path: str | os.PathLike, model: ShardedModule, optimizer: Optional[torch.optim.Optimizer] = None,
               extra: Optional[Mapping[str, Any]] = None, *, checksums: bool = True) -> PendingSave:
    """Like `save`, but returns once the state is copied (staged) to host memory; the files
    are written by a background thread while training goes on. The next save, a load, or
    `wait()` waits for it. Holds a copy of this rank's state until written, except the masters
    and moments of offload="disk", which are written from the state file: the second
    optimizer step after the save waits for it (see [Note: saves streamed from the state file]
    in overlap.optim.paged)."""
    path = os.fspath(path)
    group = _checkpoint_group(model)
    partial = _prepare(path, group)
    items = _items(model, optimizer, extra)
    pins = [engine.pin() for engine in _paged_engines(model)]
    return _async_save(path, partial, group, items, checksums, streamed_keys(model, optimizer), pins)


def async_save_items(path: str | os.PathLike, items: Mapping[str, Any], extra: Optional[Mapping[str, Any]] = None,
                     *, checksums: bool = True) -> PendingSave:
    """`async_save` of state that is no one model's: `items` (tensors, DTensors and plain
    values, under keys the caller chooses; pipeline stages use the whole model's names),
    every rank of the world its own. Written and published as `async_save` writes, read back
    with `load_items`. Called on every rank."""
    path = os.fspath(path)
    group = _world_group()
    partial = _prepare(path, group)
    items = {**items, **{EXTRA + key: value for key, value in (extra or {}).items()}}
    return _async_save(path, partial, group, items, checksums, frozenset(), [])


def _async_save(path: str, partial: str, group: dist.ProcessGroup, items: dict[str, Any], checksums: bool,
                streamed: frozenset[str], pins: list) -> PendingSave:
    def release() -> None:
        for pin in pins:
            pin.release()
    try:
        response = dcp.async_save(items, storage_writer=_writer(partial, checksums, streamed), process_group=group,
                                  planner=_SavePlanner())
    except BaseException:
        release()
        raise
    upload: Future = getattr(response, "upload_completion", response)
    finished: Future = Future()
    is_coordinator = dist.get_rank(group) == 0

    def on_upload(done: Future) -> None:
        try:
            done.result()
            release()
            if is_coordinator:
                _publish(partial, path)
            finished.set_result(None)
        except BaseException as exc:  # noqa: BLE001 - handed to whoever waits
            release()
            finished.set_exception(exc)

    upload.add_done_callback(on_upload)
    pending = PendingSave(finished, path)
    _in_flight[group] = pending
    return pending


def _complete_metadata(path: str):
    if not os.path.isfile(os.path.join(path, METADATA_FILE)):
        if os.path.isdir(path + PARTIAL_SUFFIX):
            raise IncompleteCheckpoint(f"checkpoint {path} is incomplete: its save did not finish "
                                       f"({path + PARTIAL_SUFFIX} holds what was written)")
        if not os.path.isdir(path):
            raise IncompleteCheckpoint(f"no checkpoint at {path}: the directory does not exist")
        if not os.listdir(path):
            raise IncompleteCheckpoint(f"no checkpoint at {path}: the directory is empty")
        raise IncompleteCheckpoint(f"no complete checkpoint at {path}: {METADATA_FILE} is missing")
    return read_metadata(path)


def _read(items: dict[str, Any], path: str, metadata: Metadata, group: dist.ProcessGroup, verify: bool) -> None:
    """`dcp.load` into `items`; a damaged file is one CorruptCheckpoint on every rank.

    A rank's error reaches every rank through DCP, as a CheckpointException (a
    BaseException) holding each failed rank's; the first rank's CorruptCheckpoint is raised
    on every rank in its place."""
    if not has_checksums(metadata):
        logger.warning("checkpoint %s holds no checksums (written before they were recorded, or with "
                       "checksums=False): its files cannot be verified", path)
        verify = False
    try:
        dcp.load(items, storage_reader=VerifyingReader(path, verify), planner=SafeLoadPlanner(), process_group=group)
    except CheckpointException as exc:
        corrupt = [error for _, (error, _) in sorted(exc.failures.items()) if isinstance(error, CorruptCheckpoint)]
        if corrupt:
            raise corrupt[0] from None
        raise


def load(path: str | os.PathLike, model: ShardedModule, optimizer: Optional[torch.optim.Optimizer] = None,
         *, verify: bool = True) -> dict[str, Any]:
    """Load a checkpoint written by `save` (at any world size or layout) into `model` and
    `optimizer` in place; returns the `extra` values saved with it. Called on every rank.

    The checkpoint is checked against the model before anything is read: a missing, extra
    or differently shaped key raises CheckpointMismatch naming it, on every rank. A missing
    or truncated file, or (when `verify`) bytes that do not match their checksum, raise
    CorruptCheckpoint naming the file and the item, on every rank."""
    path = os.fspath(path)
    metadata = _complete_metadata(path)
    check_model(path, metadata, model)
    group = _checkpoint_group(model)
    previous = _in_flight.get(group)
    if previous is not None:
        # Its files may still be written from the state this load replaces (offload="disk");
        # its outcome stays for whoever waits on it, the next save, or the report at exit.
        futures.wait([previous.future])
    items = model_items(model)
    parts: dict[str, torch.Tensor] = {}
    if optimizer is not None:
        targets, parts = optimizer_targets(path, metadata, model)
        if not any(key.startswith(PARAM_GROUPS) for key in metadata.state_dict_metadata):
            raise CheckpointMismatch(f"checkpoint {path} holds no optimizer state")
        items.update(targets)
    items.update(_extra_targets(metadata))
    engines = _paged_engines(model)
    for engine in engines:
        engine.abandon()          # a step taken ahead from the state being replaced never commits
    try:
        _read(items, path, metadata, group, verify)
        if optimizer is not None:
            # Masters and moments were all written from the checkpoint (a moment without saved
            # state is zeroed by the optimizer's load, as torch starts it).
            for engine in engines:
                engine.mark_consistent()
        model.load_state_dict({key[len(MODEL):]: value for key, value in items.items() if key.startswith(MODEL)})
        if optimizer is not None:
            load_optimizer(path, items, parts, model, optimizer)
    except BaseException as exc:
        # offload="disk": DCP writes into the state file as it reads, so a load that fails
        # midway leaves some parameters loaded and others not.
        for engine in engines:
            engine.mark_inconsistent(f"loading checkpoint {path} failed: {type(exc).__name__}: {exc}")
        raise
    return _extras(items)


def saved_keys(path: str | os.PathLike) -> list[str]:
    """The keys of the complete checkpoint at `path` (IncompleteCheckpoint if there is none)."""
    return list(_complete_metadata(os.fspath(path)).state_dict_metadata)


def load_items(path: str | os.PathLike, items: dict[str, Any], *, verify: bool = True) -> dict[str, Any]:
    """Load what `async_save_items` wrote into `items` in place (tensors copied into, other
    values replaced); returns the `extra` values saved with it. Every rank's keys must be in
    the checkpoint at their shapes, and every key of the checkpoint some rank's: else
    CheckpointMismatch names the first that is not, on every rank. Called on every rank of the
    world."""
    path = os.fspath(path)
    metadata = _complete_metadata(path)
    saved = metadata.state_dict_metadata
    group = _world_group()
    _check_items(path, saved, items, group)
    previous = _in_flight.get(group)
    if previous is not None:
        futures.wait([previous.future])
    targets = {**items, **_extra_targets(metadata)}
    _read(targets, path, metadata, group, verify)
    items.update((key, targets[key]) for key in items)
    return _extras(targets)


def _extra_targets(metadata: Metadata) -> dict[str, Any]:
    """Where DCP loads the saved `extra` values: tensors of their size, None for the rest."""
    targets: dict[str, Any] = {}
    for key, entry in metadata.state_dict_metadata.items():
        if key.startswith(EXTRA):
            size = getattr(entry, "size", None)
            targets[key] = None if size is None else torch.empty(size, dtype=entry.properties.dtype)
    return targets


def _extras(items: Mapping[str, Any]) -> dict[str, Any]:
    """The `extra` values among loaded items, by the names they were saved under."""
    return {key[len(EXTRA):]: value for key, value in items.items() if key.startswith(EXTRA)}


def _check_items(path: str, saved: Mapping[str, Any], items: Mapping[str, Any], group: dist.ProcessGroup) -> None:
    """Raise CheckpointMismatch on every rank of `group` where any rank's items do not fit
    the checkpoint or together leave some of it unread."""
    problem = None
    for key, value in items.items():
        if key not in saved:
            problem = f"checkpoint {path} has no {key!r}"
        elif stored_shape(value) != stored_shape(saved[key]):
            problem = (f"checkpoint {path} does not fit: {key!r} has shape {stored_shape(saved[key])} in the "
                       f"checkpoint and {stored_shape(value)} here")
        if problem is not None:
            break
    everyone: list = [None] * dist.get_world_size(group)
    dist.all_gather_object(everyone, (list(items), problem), group=group)
    problems = [problem for _, problem in everyone if problem is not None]
    if problems:
        raise CheckpointMismatch(problems[0])
    loaded = {key for keys, _ in everyone for key in keys}
    unread = [key for key in saved if not key.startswith(EXTRA) and key not in loaded]
    if unread:
        raise CheckpointMismatch(f"checkpoint {path} holds {unread[0]!r} (shape {stored_shape(saved[unread[0]])}), "
                                 f"which no rank has ({len(unread)} such keys)")


def latest_checkpoint(directory: str | os.PathLike) -> Optional[str]:
    """The complete checkpoint under `directory` whose name sorts last (the train job names
    them step-00000100 and so on), or None."""
    if not os.path.isdir(directory):
        return None
    complete = [name for name in sorted(os.listdir(directory))
                if not name.endswith((PARTIAL_SUFFIX, ".old"))
                and os.path.isfile(os.path.join(directory, name, METADATA_FILE))]
    return os.path.join(os.fspath(directory), complete[-1]) if complete else None
