"""A run killed right after a checkpoint taken with offloaded state resumes from it to the
losses of the run that was never interrupted: the check every offload tier's tests make."""
from __future__ import annotations

import os

import pytest
import torch
from torch.multiprocessing import ProcessExitedException

from distributed import run_distributed
from parity import _optimizer, _slice, token_batches
from parity_cases import SMALL_GPT

from overlap import MixedPrecision
from overlap.models import GPT

STEPS, SAVED_AT = 5, 2


def _model(offload: str):
    from overlap import ShardedModule

    bf16 = MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    return ShardedModule(GPT(SMALL_GPT), offload=offload, mixed_precision=bf16)


def _train(model, optimizer, rank: int, world: int, steps: range, save=None) -> list[float]:
    batches = token_batches(SMALL_GPT.vocab_size, 12, steps=STEPS)()
    losses = []
    for step in steps:
        if save is not None and step == SAVED_AT:
            save()
        loss = model(*_slice(batches[step], rank, world))
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(float(loss))
    return losses


def save_and_die(rank: int, world: int, path: str, kill: bool, offload: str, optimizer_kind: str) -> dict:
    """Two steps, a checkpoint taken from offloaded state, then either the process exits at once
    (kill) or training goes on to the end (the uninterrupted run)."""
    from overlap import checkpoint

    torch.manual_seed(0)
    model = _model(offload)
    optimizer = _optimizer(optimizer_kind, model)

    def save() -> None:
        checkpoint.save(path, model, optimizer, extra={"step": SAVED_AT})
        if kill:
            torch.distributed.barrier()
            os._exit(3)        # killed: no clean shutdown, nothing after the save

    return {"losses": _train(model, optimizer, rank, world, range(STEPS), save)}


def resume(rank: int, world: int, path: str, offload: str, optimizer_kind: str) -> dict:
    from overlap import checkpoint

    torch.manual_seed(1)               # other initial values: everything must come from the file
    model = _model(offload)
    optimizer = _optimizer(optimizer_kind, model)
    first = int(checkpoint.load(path, model, optimizer)["step"])
    return {"losses": _train(model, optimizer, rank, world, range(first, STEPS))}


def check_killed_run_resumes(tmp_path, offload: str, optimizer_kind: str) -> None:
    killed = str(tmp_path / "killed")
    # The killed run's ranks leave with status 3 right after the save, as a killed job would.
    with pytest.raises(ProcessExitedException) as exited:
        run_distributed(save_and_die, 2, killed, True, offload, optimizer_kind, timeout=200)
    assert exited.value.exit_code == 3, exited.value
    assert os.path.exists(os.path.join(killed, ".metadata")), os.listdir(killed)
    uninterrupted = run_distributed(save_and_die, 2, str(tmp_path / "whole"), False, offload, optimizer_kind,
                                    timeout=200)
    resumed = run_distributed(resume, 2, killed, offload, optimizer_kind, timeout=200)
    for whole, again in zip(uninterrupted, resumed):
        assert all(torch.isfinite(torch.tensor(whole["losses"])))
        assert again["losses"] == whole["losses"][SAVED_AT:], (again["losses"], whole["losses"])
