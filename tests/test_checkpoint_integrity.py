"""Checkpoints prove their integrity: damaged, truncated or missing data files are one
CorruptCheckpoint on every rank naming the file and the item, at the saving world size and
at another; a checkpoint written without checksums loads with a warning."""
from __future__ import annotations

import logging
import os
import pickle
import shutil

import pytest
import torch

from distributed import RankError, run_distributed
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

    logging.getLogger("overlap").addHandler(Collect(logging.WARNING))
    model = _build(seed=1)              # other values: everything must come from the files
    extra = checkpoint.load(path, model, _optimizer("adamw_groups", model))
    return {"state": model.full_state_dict(), "extra": extra, "warnings": warnings}


@pytest.fixture(scope="module")
def saved(tmp_path_factory) -> tuple[str, dict]:
    path = str(tmp_path_factory.mktemp("integrity") / "clean")
    return path, run_distributed(_train_and_save, SAVE_WORLD, path)[0]


def _copy(saved: tuple[str, dict], tmp_path) -> str:
    path = str(tmp_path / "copy")
    shutil.copytree(saved[0], path)
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


def _refused(path: str, world: int) -> list[str]:
    with pytest.raises(RankError) as info:
        run_distributed(_load, world, path, timeout=180)
    assert set(info.value.errors) == set(range(world))
    return [error.splitlines()[0] for error in info.value.errors.values()]


def _assert_one_error(messages: list[str], path: str, file: str, items: list[str], problem: str) -> None:
    assert len(set(messages)) == 1, messages          # the same error on every rank
    message = messages[0]
    assert message.startswith(f"CorruptCheckpoint: checkpoint {path} is damaged: {file} {problem}"), message
    assert any(message.endswith(f"(item {item})") for item in items), (message, items)


@pytest.mark.timeout(300)
@pytest.mark.parametrize("world", [SAVE_WORLD, 3], ids=["same-world", "resharded"])
def test_flipped_bytes_are_refused_on_every_rank(saved, tmp_path, world: int) -> None:
    path = _copy(saved, tmp_path)
    file = _largest_file(path)
    with open(os.path.join(path, file), "r+b") as f:
        middle = os.path.getsize(os.path.join(path, file)) // 2
        f.seek(middle)
        damaged = bytes(b ^ 0xFF for b in f.read(64))
        f.seek(middle)
        f.write(damaged)
    items = _items_overlapping(path, file, middle, middle + 64)
    assert items
    _assert_one_error(_refused(path, world), path, file, items, "holds other bytes than were written")


@pytest.mark.timeout(300)
def test_a_truncated_file_is_refused_on_every_rank(saved, tmp_path) -> None:
    path = _copy(saved, tmp_path)
    file = _largest_file(path)
    size = os.path.getsize(os.path.join(path, file)) // 2
    os.truncate(os.path.join(path, file), size)
    first_cut = _items_overlapping(path, file, size, 2**62)[0]
    _assert_one_error(_refused(path, SAVE_WORLD), path, file, [first_cut], f"is truncated: it ends at byte {size}")


@pytest.mark.timeout(300)
def test_a_missing_file_is_refused_on_every_rank(saved, tmp_path) -> None:
    path = _copy(saved, tmp_path)
    file = _largest_file(path)
    os.remove(os.path.join(path, file))
    first = _items_overlapping(path, file, 0, 2**62)[0]
    _assert_one_error(_refused(path, SAVE_WORLD), path, file, [first], "is missing")


@pytest.mark.timeout(300)
def test_a_checkpoint_without_checksums_loads_with_one_warning(saved, tmp_path) -> None:
    from overlap.checkpoint.integrity import CHECKSUM

    path = _copy(saved, tmp_path)
    metadata_file = os.path.join(path, ".metadata")
    with open(metadata_file, "rb") as f:
        metadata = pickle.load(f)
    assert all(hasattr(info, CHECKSUM) for info in metadata.storage_data.values())
    for info in metadata.storage_data.values():         # as written before checksums were recorded
        delattr(info, CHECKSUM)
    with open(metadata_file, "wb") as f:
        pickle.dump(metadata, f)
    for result in run_distributed(_load, SAVE_WORLD, path, timeout=180):
        assert result["extra"] == {"step": 1}
        for key, value in saved[1].items():
            assert torch.equal(result["state"][key], value), key
        assert len(result["warnings"]) == 1 and "cannot be verified" in result["warnings"][0], result["warnings"]
        assert path in result["warnings"][0]


@pytest.mark.timeout(300)
def test_a_clean_checkpoint_loads_without_warnings(saved) -> None:
    for result in run_distributed(_load, 3, saved[0], timeout=180):
        assert not [w for w in result["warnings"] if "cannot be verified" in w], result["warnings"]
        for key, value in saved[1].items():
            assert torch.equal(result["state"][key], value), key
