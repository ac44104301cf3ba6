"""Bad input is refused with an error naming it, on every rank, and nothing hangs: settings
from OVERLAP_* variables and the launcher's, `ShardedModule`'s arguments, checkpoints that
cannot be loaded, `OverlapTrainer`'s refusals, and copies of a sharded model.

[Note: one launch for every case]
Every case runs on the same two ranks, one after the other: a refused wrap raises on every
rank at the same point (its start-up agreement), so the ranks stay in step for the next case.
Each rank writes down what each case raised; the parent asserts per case, so a failing case
is named by its test id. One launch instead of one per case: a process group per launch is
most of each case's time.
"""
from __future__ import annotations

import copy
import io
import math
import os
from typing import Callable

import pytest
import torch
from torch import nn

from distributed import run_distributed

WORLD = 2

pytestmark = pytest.mark.timeout(300)

# case -> what every rank's message must contain
CASES: dict[str, tuple[str, ...]] = {
    "env OVERLAP_SHARDING": ("OVERLAP_SHARDING='zero2'", "full|hybrid|hpz|auto"),
    "env OVERLAP_ORDER_CHECK": ("OVERLAP_ORDER_CHECK='never'", "collective|step"),
    "env OVERLAP_PROBE": ("OVERLAP_PROBE='yes'", "0|1"),
    "env OVERLAP_HOST_GBPS": ("OVERLAP_HOST_GBPS='-1'", "number > 0"),
    "env OVERLAP_COMPILE": ("OVERLAP_COMPILE='no'", "0|1"),
    "env LOCAL_WORLD_SIZE": ("LOCAL_WORLD_SIZE='two'", "integer >= 1"),
    "env LOCAL_RANK": ("LOCAL_RANK='first'", "integer >= 0"),
    "env LOCAL_WORLD_SIZE on rank 1 only": ("rank 1", "LOCAL_WORLD_SIZE='0'"),
    "sharding='zero2'": ("sharding='zero2'", "full, hybrid, hpz, auto"),
    "bucket_mb=-1": ("bucket_mb=-1", "number > 0"),
    "bucket_mb=nan": ("bucket_mb=nan", "number > 0"),
    "compile='no'": ("compile='no'", "True or False"),
    "reshard_after_forward='no'": ("reshard_after_forward='no'", "True or False"),
    "mesh of 3 dimensions": ("mesh has 3 dimensions",),
    "mesh dimensions misnamed": ("mesh dimensions ('shard', 'replicate')", "('replicate', 'shard')"),
    "mesh not a DeviceMesh": ("mesh=(1, 2) is not a DeviceMesh",),
    "mesh and process_group": ("either process_group or mesh",),
    "load from a missing directory": ("IncompleteCheckpoint", "no checkpoint at", "missing: the directory does not exist"),
    "load from an empty directory": ("IncompleteCheckpoint", "no checkpoint at", "empty: the directory is empty"),
    "load optimizer state a checkpoint lacks": ("CheckpointMismatch", "model_only holds no optimizer state"),
    "OverlapTrainer(fp16=True)": ("fp16=True", "bf16=True"),
    "resume an HF run without overlap_sharded/": ("FileNotFoundError", "checkpoint-1 holds no overlap_sharded/"),
    "copy.deepcopy(ShardedModule)": ("TypeError: ShardedModule: copy.deepcopy and pickling", "model.full_state_dict()"),
    "torch.save(ShardedModule)": ("TypeError: ShardedModule: copy.deepcopy and pickling", "Copy the model before"),
    "copy.deepcopy(a fully_shard model)": ("TypeError: fully_shard: copy.deepcopy and pickling",
                                           "get_model_state_dict(full_state_dict=True)"),
}


def _fully_sharded() -> nn.Module:
    from overlap import fully_shard

    model = _model()
    for child in model.children():
        fully_shard(child)
    fully_shard(model)
    model(torch.ones(1, 4))
    return model


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 3), nn.Linear(3, 2))


def _with_env(values: dict[str, str], rank: int, ranks: tuple[int, ...] | None) -> Callable[[], object]:
    def wrap() -> object:
        from overlap import ShardedModule

        saved = {name: os.environ.get(name) for name in values}
        if ranks is None or rank in ranks:
            os.environ.update(values)
        try:
            return ShardedModule(_model())
        finally:
            for name, value in saved.items():
                if value is None:
                    os.environ.pop(name, None)
                else:
                    os.environ[name] = value
    return wrap


def _wrap_with(**kwargs: object) -> Callable[[], object]:
    def wrap() -> object:
        from overlap import ShardedModule

        return ShardedModule(_model(), **kwargs)
    return wrap


def _mesh(shape: tuple[int, ...], names: tuple[str, ...] | None = None) -> Callable[[], object]:
    def wrap() -> object:
        from torch.distributed.device_mesh import init_device_mesh

        from overlap import ShardedModule

        return ShardedModule(_model(), mesh=init_device_mesh("cpu", shape, mesh_dim_names=names))
    return wrap


def _load(directory: str, *, make: bool = False, save_model_only: bool = False) -> Callable[[], object]:
    def load() -> object:
        import torch.distributed as dist

        from overlap import ShardedModule, checkpoint

        model = ShardedModule(_model())
        optimizer = torch.optim.AdamW(model.parameters())
        if make and dist.get_rank() == 0:
            os.makedirs(directory, exist_ok=True)
        if save_model_only:
            checkpoint.save(directory, model)
        dist.barrier()
        return checkpoint.load(directory, model, optimizer if save_model_only else None)
    return load


def _trainer(directory: str, **arguments: object):
    import transformers
    from transformers import GPT2Config, GPT2LMHeadModel, TrainingArguments

    from overlap.integrations.hf import OverlapTrainer

    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(vocab_size=11, n_positions=8, n_embd=8, n_layer=1, n_head=2))
    args = TrainingArguments(output_dir=directory, max_steps=1, report_to=[], use_cpu=True,
                             per_device_train_batch_size=1, disable_tqdm=True, save_strategy="no", **arguments)
    rows = [{"input_ids": torch.arange(4), "labels": torch.arange(4)}] * 2
    return OverlapTrainer(model=model, args=args, train_dataset=rows,
                          unit_types=(transformers.models.gpt2.modeling_gpt2.GPT2Block,))


def _resume_without_sharded_copy(directory: str) -> Callable[[], object]:
    def resume() -> object:
        import torch.distributed as dist

        written_elsewhere = os.path.join(directory, "checkpoint-1")
        if dist.get_rank() == 0:
            os.makedirs(written_elsewhere, exist_ok=True)
        dist.barrier()
        return _trainer(os.path.join(directory, "run")).train(resume_from_checkpoint=written_elsewhere)
    return resume


# Variables set on every rank before wrapping, one case each.
ENV_CASES = {"OVERLAP_SHARDING": "zero2", "OVERLAP_ORDER_CHECK": "never", "OVERLAP_PROBE": "yes",
             "OVERLAP_HOST_GBPS": "-1", "OVERLAP_COMPILE": "no", "LOCAL_WORLD_SIZE": "two", "LOCAL_RANK": "first"}


def _cases(rank: int, directory: str) -> dict[str, Callable[[], object]]:
    from torch.distributed.device_mesh import init_device_mesh

    cases = {f"env {name}": _with_env({name: value}, rank, None) for name, value in ENV_CASES.items()}
    cases["env LOCAL_WORLD_SIZE on rank 1 only"] = _with_env({"LOCAL_WORLD_SIZE": "0"}, rank, (1,))
    cases.update({
        "sharding='zero2'": _wrap_with(sharding="zero2"),
        "bucket_mb=-1": _wrap_with(bucket_mb=-1),
        "bucket_mb=nan": _wrap_with(bucket_mb=math.nan),
        "compile='no'": _wrap_with(compile="no"),
        "reshard_after_forward='no'": _wrap_with(reshard_after_forward="no"),
        "mesh of 3 dimensions": _mesh((1, 1, WORLD)),
        "mesh dimensions misnamed": _mesh((1, WORLD), ("shard", "replicate")),
        "mesh not a DeviceMesh": _wrap_with(mesh=(1, WORLD)),
        "mesh and process_group": lambda: _wrap_with(
            mesh=init_device_mesh("cpu", (WORLD,)), process_group=torch.distributed.group.WORLD)(),
        "load from a missing directory": _load(os.path.join(directory, "missing")),
        "load from an empty directory": _load(os.path.join(directory, "empty"), make=True),
        "load optimizer state a checkpoint lacks": _load(os.path.join(directory, "model_only"), save_model_only=True),
        "OverlapTrainer(fp16=True)": lambda: _trainer(os.path.join(directory, "fp16"), fp16=True),
        "resume an HF run without overlap_sharded/": _resume_without_sharded_copy(os.path.join(directory, "hf")),
        "copy.deepcopy(ShardedModule)": lambda: copy.deepcopy(_wrap_with()()),
        "torch.save(ShardedModule)": lambda: torch.save(_wrap_with()(), io.BytesIO()),
        "copy.deepcopy(a fully_shard model)": lambda: copy.deepcopy(_fully_sharded()),
    })
    return cases


def _run_every_case(rank: int, world: int, directory: str) -> dict[str, str]:
    """What each case raised on this rank ("no error" when it raised nothing)."""
    raised = {}
    for name, case in _cases(rank, directory).items():
        try:
            case()
            raised[name] = "no error"
        except Exception as exc:  # noqa: BLE001 - each case's error is the result
            raised[name] = f"{type(exc).__name__}: {exc}"
    return raised


@pytest.fixture(scope="module")
def raised(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, str]]:
    directory = str(tmp_path_factory.mktemp("bad_input"))
    return run_distributed(_run_every_case, WORLD, directory, env={"HF_HUB_OFFLINE": "1"}, timeout=240)


def test_every_case_runs(raised: list[dict[str, str]]) -> None:
    for per_rank in raised:
        assert set(per_rank) == set(CASES)


@pytest.mark.parametrize("case", list(CASES))
def test_refused_on_every_rank_naming_the_input(raised: list[dict[str, str]], case: str) -> None:
    expected = CASES[case]
    for rank, per_rank in enumerate(raised):
        message = per_rank[case]
        for words in expected:
            assert words in message, f"rank {rank}, {case}: {message}"
