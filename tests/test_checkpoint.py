"""Sharded checkpoints through torch.distributed.checkpoint: resume at other world sizes and
layouts, asynchronous saves, interrupted saves, other models, and no unpickling on load."""
from __future__ import annotations

import io
import math
import os
import pickle
import signal

import pytest
import torch

import torch.multiprocessing as mp

from distributed import CaseLaunch, RankCase
from parity import _optimizer, _slice
from parity import token_batches
from parity_cases import SMALL_GPT

SAVE_AFTER = 2          # steps before the checkpoint
STEPS = 5               # steps in all
SAVE_WORLD = 2


def _build(wrap: dict, seed: int, config=SMALL_GPT):
    from overlap import ShardedModule
    from overlap.models import GPT

    torch.manual_seed(seed)
    return ShardedModule(GPT(config), **wrap)


def _steps(model, optimizer, first: int, last: int, rank: int, world: int) -> None:
    batches = token_batches(SMALL_GPT.vocab_size, 12, steps=STEPS)()
    for step in range(first, last):
        inputs, targets = _slice(batches[step], rank, world)
        model(inputs, targets).backward()
        optimizer.step()
        optimizer.zero_grad()


def _train_and_save(rank: int, world: int, kind: str, path: str) -> dict:
    """The uninterrupted run, saving after SAVE_AFTER steps on the way."""
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    from overlap import checkpoint

    model = _build({}, seed=0)
    optimizer = _optimizer(kind, model)
    _steps(model, optimizer, 0, SAVE_AFTER, rank, world)
    checkpoint.save(path, model, optimizer, extra={"step": SAVE_AFTER, "note": "first"})
    at_save = model.full_state_dict()
    _steps(model, optimizer, SAVE_AFTER, STEPS, rank, world)
    plain = {}
    if rank == 0:
        # The files name and shape every tensor as the plain model does.
        dcp_to_torch_save(path, path + ".pt")
        plain = torch.load(path + ".pt", weights_only=True)
    return {"final": model.full_state_dict(), "at_save": at_save, "plain": plain}


def _resume(rank: int, world: int, kind: str, path: str, wrap: dict) -> dict:
    from overlap import checkpoint

    model = _build(wrap, seed=1)            # other initial values: everything must come from the file
    optimizer = _optimizer(kind, model)
    extra = checkpoint.load(path, model, optimizer)
    _steps(model, optimizer, int(extra["step"]), STEPS, rank, world)
    return {"final": model.full_state_dict(), "extra": extra}


def _relative_error(got: dict, expected: dict) -> float:
    """‖got − expected‖ / ‖expected‖ over the whole model."""
    diff = math.sqrt(sum(float((got[k] - v).double().pow(2).sum()) for k, v in expected.items()))
    norm = math.sqrt(sum(float(v.double().pow(2).sum()) for v in expected.values()))
    return diff / norm


# Another world size changes the order in which gradients are summed, so the continued run
# differs from the uninterrupted one by rounding (an uninterrupted run at that world size
# differs as much); the same world size with another bucket size and depth is exact.
RESUMES = [(1, {}), (3, {}), (4, {}), (2, {"bucket_mb": 1.0, "prefetch_depth": 0})]
TOLERANCE = {"sgd": 1e-6, "adamw_groups": 1e-5}


KINDS = ["sgd", "adamw_groups"]


@pytest.mark.timeout(900)
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("world,wrap", RESUMES, ids=["world1", "world3", "world4", "world2-other-layout"])
def test_resume_continues_like_the_uninterrupted_run(kind: str, world: int, wrap: dict, launches: dict) -> None:
    reference = launches[SAVE_WORLD][f"save-{kind}"][0].result()
    for result in (outcome.result() for outcome in launches[world][f"resume-{kind}"]):
        assert result["extra"] == {"step": SAVE_AFTER, "note": "first"}
        error = _relative_error(result["final"], reference["final"])
        assert error <= (0.0 if world == SAVE_WORLD else TOLERANCE[kind]), error
    # The check can fail: the state at the save is far from the final one.
    assert _relative_error(reference["at_save"], reference["final"]) > 1e-3


@pytest.mark.timeout(900)
def test_files_hold_the_plain_models_names_and_shapes(launches: dict) -> None:
    reference = launches[SAVE_WORLD]["save-adamw_groups"][0].result()
    plain = reference["plain"]
    for key, value in reference["at_save"].items():
        assert torch.equal(plain[f"model.{key}"], value), key
    exp_avg = plain["optimizer.state.blocks.0.fc.weight.exp_avg"]
    assert exp_avg.shape == reference["at_save"]["blocks.0.fc.weight"].shape
    assert [plain[f"optimizer.param_groups.{i}.weight_decay"] for i in range(2)] == [0.1, 0.0]


def _async(rank: int, world: int, path: str) -> dict:
    from overlap import checkpoint

    model = _build({}, seed=0)
    optimizer = _optimizer("sgd", model)
    _steps(model, optimizer, 0, 1, rank, world)
    at_save = model.full_state_dict()
    pending = checkpoint.async_save(path, model, optimizer, extra={"step": 1})
    _steps(model, optimizer, 1, 3, rank, world)     # training goes on and changes every parameter
    pending.wait()
    after = model.full_state_dict()
    checkpoint.load(path, model, optimizer)
    return {"at_save": at_save, "after": after, "loaded": model.full_state_dict()}


@pytest.mark.timeout(900)
def test_async_save_keeps_the_state_of_its_step(launches: dict) -> None:
    for result in (outcome.result() for outcome in launches[2]["async"]):
        assert _relative_error(result["after"], result["at_save"]) > 1e-3
        for key, value in result["at_save"].items():
            assert torch.equal(result["loaded"][key], value), key


def _save_then_die(rank: int, world: int, directory: str) -> None:
    from torch.distributed.checkpoint import FileSystemWriter

    from overlap import checkpoint

    model = _build({}, seed=0)
    optimizer = _optimizer("sgd", model)
    _steps(model, optimizer, 0, 1, rank, world)
    checkpoint.save(os.path.join(directory, "first"), model, optimizer)
    if rank == 1:
        write = FileSystemWriter.write_data

        def write_then_die(self, plan, planner):
            write(self, plan, planner).wait()
            os.kill(os.getpid(), signal.SIGKILL)        # after its files, before the metadata

        FileSystemWriter.write_data = write_then_die
    _steps(model, optimizer, 1, 2, rank, world)
    checkpoint.save(os.path.join(directory, "second"), model, optimizer)


def _load_both(rank: int, world: int, directory: str) -> dict:
    from overlap import checkpoint

    model = _build({}, seed=1)
    optimizer = _optimizer("sgd", model)
    checkpoint.load(os.path.join(directory, "first"), model, optimizer)
    try:
        checkpoint.load(os.path.join(directory, "second"), model, optimizer)
    except checkpoint.IncompleteCheckpoint as exc:
        return {"error": str(exc), "latest": checkpoint.latest_checkpoint(directory)}
    return {"error": None}


@pytest.mark.timeout(900)
def test_a_save_killed_midway_leaves_the_previous_checkpoint(launches: dict, checkpoint_dir: str) -> None:
    killed = launches["killed"].failure()
    # Rank 1 ended by its own SIGKILL, not by any other failure.
    assert isinstance(killed, mp.ProcessExitedException), repr(killed)
    assert killed.error_index == 1 and killed.signal_name == "SIGKILL", killed
    directory = os.path.join(checkpoint_dir, "killed")
    assert os.path.isdir(os.path.join(directory, "second.partial"))
    assert not os.path.exists(os.path.join(directory, "second"))
    for result in (outcome.result() for outcome in launches[2]["load-after-kill"]):
        assert result["error"] is not None and "incomplete" in result["error"] and "second" in result["error"]
        assert result["latest"] == os.path.join(directory, "first")


def _load_into(rank: int, world: int, path: str, config_changes: dict) -> None:
    from dataclasses import replace

    from overlap import checkpoint

    model = _build({}, seed=0, config=replace(SMALL_GPT, **config_changes))
    checkpoint.load(path, model, _optimizer("sgd", model))


def _save_small(rank: int, world: int, path: str) -> None:
    from overlap import checkpoint

    model = _build({}, seed=0)
    checkpoint.save(path, model, _optimizer("sgd", model))


@pytest.mark.timeout(900)
def test_another_models_checkpoint_is_refused_on_every_rank(launches: dict) -> None:
    assert [outcome.result() for outcome in launches[2]["save-small"]] == [None, None]
    for error in (outcome.error() for outcome in launches[2]["load-wider"]):
        assert "CheckpointMismatch" in error and "'wte.weight'" in error
        assert "(64, 32) in the checkpoint and (64, 48) in the model" in error
    assert all("has no 'blocks.3.ln_1.weight'" in outcome.error() for outcome in launches[2]["load-deeper"])


class _Payload:
    def __reduce__(self):
        return (os.system, ("touch should-not-exist",))


def test_metadata_is_not_unpickled_freely(tmp_path, monkeypatch) -> None:
    from overlap.checkpoint import UnsafeCheckpoint
    from overlap.checkpoint.safe_files import read_metadata

    (tmp_path / ".metadata").write_bytes(pickle.dumps(_Payload()))
    monkeypatch.chdir(tmp_path)             # where the payload's `touch` would write
    with pytest.raises(UnsafeCheckpoint, match="posix.system|os.system"):
        read_metadata(str(tmp_path))
    assert not (tmp_path / "should-not-exist").exists()


def test_values_are_loaded_without_arbitrary_objects() -> None:
    from torch.distributed.checkpoint.metadata import MetadataIndex
    from torch.distributed.checkpoint.planner import LoadItemType, ReadItem

    from overlap.checkpoint.safe_files import SafeLoadPlanner

    planner = SafeLoadPlanner()
    planner.original_state_dict = {}
    item = ReadItem(LoadItemType.BYTE_IO, MetadataIndex("extra/x"), torch.Size(), MetadataIndex("extra/x"),
                    torch.Size(), torch.Size())
    good = io.BytesIO()
    torch.save({"step": 3, "lr": [0.1, 0.2]}, good)
    good.seek(0)
    planner.load_bytes(item, good)
    assert planner.original_state_dict["extra/x"] == {"step": 3, "lr": [0.1, 0.2]}
    bad = io.BytesIO()
    torch.save(_Payload(), bad)
    bad.seek(0)
    with pytest.raises(pickle.UnpicklingError):
        planner.load_bytes(item, bad)


# ---- a model over a subgroup of the world -------------------------------------------------------

SUBGROUP = [1, 2]


def _save_and_load_on_a_subgroup(rank: int, world: int, path: str) -> dict:
    """Ranks 1 and 2 of 4 train a model wrapped over their own group, save and load it; ranks
    0 and 3 never call save or load. Returns what each model rank saw."""
    import torch.distributed as dist

    from overlap import checkpoint

    group = dist.new_group(SUBGROUP)            # collective over WORLD: every rank makes it
    result: dict = {}
    if rank in SUBGROUP:
        member = SUBGROUP.index(rank)
        model = _build({"process_group": group}, seed=0)
        optimizer = _optimizer("sgd", model)
        _steps(model, optimizer, 0, 1, member, len(SUBGROUP))
        checkpoint.save(path, model, optimizer, extra={"step": 1})
        saved = model.full_state_dict()
        fresh = _build({"process_group": group}, seed=1)
        before = fresh.full_state_dict()
        extra = checkpoint.load(path, fresh, _optimizer("sgd", fresh))
        result = {"saved": saved, "before": before, "loaded": fresh.full_state_dict(), "extra": extra}
    # new_group's contract is that every rank of WORLD calls it: had the checkpoint's group
    # been made that way by ranks 1 and 2 alone, their count of groups would be one ahead of
    # ranks 0 and 3, and the next group every rank makes would be named differently on each
    # side and never connect.
    later = dist.new_group(list(range(world)))
    count = torch.ones(1)
    dist.all_reduce(count, group=later)
    result["later_group_sum"] = float(count)
    return result


@pytest.mark.timeout(900)
def test_a_model_on_a_subgroup_saves_and_loads(launches: dict) -> None:
    results = [outcome.result() for outcome in launches[4]["subgroup"]]
    assert [r["later_group_sum"] for r in results] == [4.0] * 4
    for rank in SUBGROUP:
        got = results[rank]
        assert got["extra"] == {"step": 1}
        assert _relative_error(got["before"], got["saved"]) > 1e-3
        for key, value in got["saved"].items():
            assert torch.equal(got["loaded"][key], value), key


# ---- the launches ----------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def checkpoint_dir(tmp_path_factory) -> str:
    return str(tmp_path_factory.mktemp("checkpoints"))


@pytest.fixture(scope="module")
def launches(checkpoint_dir: str) -> dict:
    """One launch per world size, each running its cases in turn (tests/distributed.py's
    [Note: many cases on one launch]), and the launch whose rank 1 is killed mid-save. The
    saves at SAVE_WORLD come first; the resumes at other world sizes read their files."""
    def path(name: str) -> str:
        return os.path.join(checkpoint_dir, name)

    def resumes(world: int) -> dict:
        return {f"resume-{kind}": RankCase(_resume, (kind, path(kind), dict(RESUMES)[world])) for kind in KINDS}

    killed = CaseLaunch({"save-then-die": RankCase(_save_then_die, (path("killed"),))}, world_size=2, timeout=120)
    saves = CaseLaunch({
        **{f"save-{kind}": RankCase(_train_and_save, (kind, path(kind))) for kind in KINDS},
        **resumes(SAVE_WORLD),
        "async": RankCase(_async, (path("async"),)),
        "save-small": RankCase(_save_small, (path("small"),)),
        "load-wider": RankCase(_load_into, (path("small"), {"n_embd": 48})),
        "load-deeper": RankCase(_load_into, (path("small"), {"n_layer": 4})),
        "load-after-kill": RankCase(_load_both, (path("killed"),)),
    }, world_size=SAVE_WORLD, timeout=600, after=[killed])
    return {
        "killed": killed,
        SAVE_WORLD: saves,
        1: CaseLaunch(resumes(1), world_size=1, timeout=400, after=[saves]),
        3: CaseLaunch(resumes(3), world_size=3, timeout=400, after=[saves]),
        4: CaseLaunch({**resumes(4), "subgroup": RankCase(_save_and_load_on_a_subgroup, (path("subgroup"),))},
                      world_size=4, timeout=600, after=[saves]),
    }


def test_saved_optimizer_groups_are_checked_against_the_optimizers_by_name():
    from overlap.checkpoint.state import CheckpointMismatch, saved_groups

    loaded = {"optimizer.param_groups.0.params": ["a.weight", "b.weight"], "optimizer.param_groups.0.lr": 0.1,
              "optimizer.param_groups.1.params": ["a.bias"], "optimizer.param_groups.1.lr": 0.2,
              "model.a.weight": None}
    assert saved_groups("ckpt", loaded, [["a.weight", "b.weight"], ["a.bias"]]) == [
        {"params": ["a.weight", "b.weight"], "lr": 0.1}, {"params": ["a.bias"], "lr": 0.2}]
    with pytest.raises(CheckpointMismatch, match="checkpoint ckpt has 2 optimizer parameter groups, the optimizer "
                                                 "has 1"):
        saved_groups("ckpt", loaded, [["a.weight", "b.weight", "a.bias"]])
    with pytest.raises(CheckpointMismatch, match="optimizer group 0 differs: 'b.weight' in the checkpoint where the "
                                                 "optimizer has 'c.weight'"):
        saved_groups("ckpt", loaded, [["a.weight", "c.weight"], ["a.bias"]])
