"""Checkpoints prove their integrity: damaged, truncated or missing data files are one
CorruptCheckpoint on every rank naming the file and the item, at the saving world size and
at another; a checkpoint written without checksums loads with a warning."""
from __future__ import annotations

import logging
import os
import pickle
import shutil
from typing import Any, NamedTuple

import pytest
import torch

from distributed import CaseLaunch, RankCase
from parity import _optimizer, _slice, token_batches
from parity_cases import SMALL_GPT

SAVE_WORLD = 2


def _build(seed: int):
    from overlap import ShardedModule
    from overlap.models import GPT

    torch.manual_seed(seed)
    return ShardedModule(GPT(SMALL_GPT))


def _train_and_save(rank: int, world: int, path: str) -> dict:
    from overlap import checkpoint

    model = _build(seed=0)
    optimizer = _optimizer("adamw_groups", model)
    inputs, targets = _slice(token_batches(SMALL_GPT.vocab_size, 12, steps=1)()[0], rank, world)
    model(inputs, targets).backward()
    optimizer.step()
    checkpoint.save(path, model, optimizer, extra={"step": 1})
    return model.full_state_dict()


def _load(rank: int, world: int, path: str) -> dict:
    from overlap import checkpoint

    warnings: list[str] = []

    class Collect(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            warnings.append(record.getMessage())

    handler = Collect(logging.WARNING)
    logging.getLogger("overlap").addHandler(handler)
    try:
        model = _build(seed=1)              # other values: everything must come from the files
        extra = checkpoint.load(path, model, _optimizer("adamw_groups", model))
    finally:
        logging.getLogger("overlap").removeHandler(handler)
    return {"state": model.full_state_dict(), "extra": extra, "warnings": warnings}


def _copy(clean: str, directory: str, name: str) -> str:
    path = os.path.join(directory, name)
    shutil.copytree(clean, path)
    return path


def _storage(path: str) -> dict:
    from overlap.checkpoint.safe_files import read_metadata

    return read_metadata(path).storage_data


def _largest_file(path: str) -> str:
    return max((name for name in os.listdir(path) if name.endswith(".distcp")),
               key=lambda name: os.path.getsize(os.path.join(path, name)))


def _items_overlapping(path: str, file: str, start: int, end: int) -> list[str]:
    """The items stored in `file` that overlap bytes [start, end), in file order."""
    from overlap.checkpoint.integrity import describe_item

    return [describe_item(index) for index, info in sorted(_storage(path).items(), key=lambda kv: kv[1].offset)
            if info.relative_path == file and info.offset < end and start < info.offset + info.length]


def _flip_bytes(path: str) -> tuple[str, list[str]]:
    """64 bytes inverted in the middle of the largest file: the file and the items they hit."""
    file = _largest_file(path)
    with open(os.path.join(path, file), "r+b") as f:
        middle = os.path.getsize(os.path.join(path, file)) // 2
        f.seek(middle)
        damaged = bytes(b ^ 0xFF for b in f.read(64))
        f.seek(middle)
        f.write(damaged)
    return file, _items_overlapping(path, file, middle, middle + 64)


def _truncate(path: str) -> tuple[str, list[str], int]:
    file = _largest_file(path)
    size = os.path.getsize(os.path.join(path, file)) // 2
    os.truncate(os.path.join(path, file), size)
    return file, _items_overlapping(path, file, size, 2**62)[:1], size


def _remove(path: str) -> tuple[str, list[str]]:
    file = _largest_file(path)
    first = _items_overlapping(path, file, 0, 2**62)[:1]
    os.remove(os.path.join(path, file))
    return file, first


def _drop_checksums(path: str) -> bool:
    """The metadata as written before checksums were recorded; whether it had them all."""
    from overlap.checkpoint.integrity import CHECKSUM

    metadata_file = os.path.join(path, ".metadata")
    with open(metadata_file, "rb") as f:
        metadata = pickle.load(f)
    had_them = all(hasattr(info, CHECKSUM) for info in metadata.storage_data.values())
    for info in metadata.storage_data.values():
        delattr(info, CHECKSUM)
    with open(metadata_file, "wb") as f:
        pickle.dump(metadata, f)
    return had_them


def _damage_copies(rank: int, world: int, directory: str) -> dict[str, Any]:
    """Rank 0 copies the clean checkpoint once per kind of damage and damages each copy."""
    if rank != 0:
        return {}
    clean = os.path.join(directory, "clean")
    return {"flipped": _flip_bytes(_copy(clean, directory, "flipped")),
            "truncated": _truncate(_copy(clean, directory, "truncated")),
            "missing": _remove(_copy(clean, directory, "missing")),
            "had_checksums": _drop_checksums(_copy(clean, directory, "unchecked"))}


class Launches(NamedTuple):
    directory: str                      # the clean checkpoint and the damaged copies
    by_world: dict[int, CaseLaunch]


@pytest.fixture(scope="module")
def launches(tmp_path_factory) -> Launches:
    """The save, the damaged copies and the loads at the saving world size in one launch, the
    loads at another world size in a second (tests/distributed.py's [Note: many cases on one
    launch])."""
    directory = str(tmp_path_factory.mktemp("integrity"))

    def load(name: str) -> RankCase:
        return RankCase(_load, (os.path.join(directory, name),))

    saving = CaseLaunch({"save": RankCase(_train_and_save, (os.path.join(directory, "clean"),)),
                         "damage": RankCase(_damage_copies, (directory,)),
                         **{name: load(name) for name in ("flipped", "truncated", "missing", "unchecked")}},
                        world_size=SAVE_WORLD, timeout=400)
    resharded = CaseLaunch({name: load(name) for name in ("flipped", "clean")}, world_size=3, timeout=400,
                           after=[saving])
    return Launches(directory, {SAVE_WORLD: saving, 3: resharded})


def _damage(launches: Launches) -> dict[str, Any]:
    return launches.by_world[SAVE_WORLD]["damage"][0].result()


def _saved_state(launches: Launches) -> dict:
    return launches.by_world[SAVE_WORLD]["save"][0].result()


def _refused(launches: Launches, name: str, world: int) -> list[str]:
    return [outcome.error().splitlines()[0] for outcome in launches.by_world[world][name]]


def _assert_one_error(messages: list[str], path: str, file: str, items: list[str], problem: str) -> None:
    assert len(set(messages)) == 1, messages          # the same error on every rank
    message = messages[0]
    assert message.startswith(f"CorruptCheckpoint: checkpoint {path} is damaged: {file} {problem}"), message
    assert any(message.endswith(f"(item {item})") for item in items), (message, items)


@pytest.mark.timeout(600)
@pytest.mark.parametrize("world", [SAVE_WORLD, 3], ids=["same-world", "resharded"])
def test_flipped_bytes_are_refused_on_every_rank(launches: Launches, world: int) -> None:
    file, items = _damage(launches)["flipped"]
    assert items
    _assert_one_error(_refused(launches, "flipped", world), os.path.join(launches.directory, "flipped"), file, items,
                      "holds other bytes than were written")


@pytest.mark.timeout(600)
def test_a_truncated_file_is_refused_on_every_rank(launches: Launches) -> None:
    file, first_cut, size = _damage(launches)["truncated"]
    _assert_one_error(_refused(launches, "truncated", SAVE_WORLD), os.path.join(launches.directory, "truncated"), file,
                      first_cut, f"is truncated: it ends at byte {size}")


@pytest.mark.timeout(600)
def test_a_missing_file_is_refused_on_every_rank(launches: Launches) -> None:
    file, first = _damage(launches)["missing"]
    _assert_one_error(_refused(launches, "missing", SAVE_WORLD), os.path.join(launches.directory, "missing"), file, first,
                      "is missing")


@pytest.mark.timeout(600)
def test_a_checkpoint_without_checksums_loads_with_one_warning(launches: Launches) -> None:
    assert _damage(launches)["had_checksums"]
    path = os.path.join(launches.directory, "unchecked")
    for result in (outcome.result() for outcome in launches.by_world[SAVE_WORLD]["unchecked"]):
        assert result["extra"] == {"step": 1}
        for key, value in _saved_state(launches).items():
            assert torch.equal(result["state"][key], value), key
        assert len(result["warnings"]) == 1 and "cannot be verified" in result["warnings"][0], result["warnings"]
        assert path in result["warnings"][0]


@pytest.mark.timeout(600)
def test_a_clean_checkpoint_loads_without_warnings(launches: Launches) -> None:
    for result in (outcome.result() for outcome in launches.by_world[3]["clean"]):
        assert not [w for w in result["warnings"] if "cannot be verified" in w], result["warnings"]
        for key, value in _saved_state(launches).items():
            assert torch.equal(result["state"][key], value), key
