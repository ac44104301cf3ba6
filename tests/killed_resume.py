"""A run killed right after a checkpoint taken with offloaded state resumes from it to the
losses of the run that was never interrupted: the check every offload tier's tests make."""
from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import torch

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


_KILLED_RUN = textwrap.dedent("""
    import sys
    sys.path.insert(0, {tests!r})
    from distributed import run_distributed
    import killed_resume
    if __name__ == "__main__":
        run_distributed(killed_resume.save_and_die, 2, {path!r}, True, {offload!r}, {kind!r}, timeout=200)
""")


def check_killed_run_resumes(tmp_path, offload: str, optimizer_kind: str) -> None:
    tests = os.path.dirname(os.path.abspath(__file__))
    killed = str(tmp_path / "killed")
    # The killed run is a process of its own whose ranks exit right after the save.
    script = _KILLED_RUN.format(tests=tests, path=killed, offload=offload, kind=optimizer_kind)
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert done.returncode != 0, done.stdout + done.stderr
    assert os.path.exists(os.path.join(killed, ".metadata")), os.listdir(killed)
    uninterrupted = run_distributed(save_and_die, 2, str(tmp_path / "whole"), False, offload, optimizer_kind,
                                    timeout=200)
    resumed = run_distributed(resume, 2, killed, offload, optimizer_kind, timeout=200)
    for whole, again in zip(uninterrupted, resumed):
        assert all(torch.isfinite(torch.tensor(whole["losses"])))
        assert again["losses"] == whole["losses"][SAVED_AT:], (again["losses"], whole["losses"])
