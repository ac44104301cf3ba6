"""offload="disk" under a clip that binds at every step, at 2 gloo ranks: the state is read
ahead during backward and written behind the step (overlap/optim/window.py), and training is
what offload="cpu" and torch's AdamW compute.

Both tiers train the same GPT on the same global batches (each rank its half) with bf16
gathers, `overlap.optim.AdamW` and torch's `clip_grad_norm_` before each step, binding every
time. Compared: losses, clip norms, the final fp32 masters (gathered) and every moment, disk
against cpu bit for bit; and both against torch.optim.AdamW stepping fp32 copies of the same
elements with the same clipped global gradient (AdamW is elementwise, so a rank's elements
are what one process computes for them) to fp32 rounding, as tests/test_optim_paged.py
compares the kernel. The disk run's writes are slowed down, so that a state dict or a
checkpoint taken right after a step that did not wait for them would read the old values;
both are taken right after every step (a checkpoint after the last), and must hold the step's.
The engine's counts say where the IO ran: after the first step (whose step taken during
backward the clip makes recompute), the step itself reads and writes nothing.
"""
from __future__ import annotations

import time

import pytest
import torch

from distributed import run_distributed
from parity import _slice, token_batches
from parity_cases import SMALL_GPT, _lm_loss

from overlap import MixedPrecision
from overlap.models import GPT

STEPS = 4
CLIP = 1e-3                                 # far below the gradient's norm: binds at every step
RTOL = 4 * STEPS * torch.finfo(torch.float32).eps
BF16 = MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)


def _train(rank: int, world: int, tier: str, path: str) -> dict:
    """STEPS clipped steps of one tier beside torch's AdamW on this rank's elements."""
    from overlap import ShardedModule, checkpoint
    from overlap.optim import AdamW
    from overlap.optim.paged import paged_of
    from overlap.runtime.disk_tier import master_part

    torch.manual_seed(0)
    model = ShardedModule(GPT(SMALL_GPT), offload=tier, mixed_precision=BF16)
    optimizer = AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    model.optimizer_link.link(optimizer)          # before the first step: it is taken during backward too
    params = list(model.parameters())
    engine = paged_of(params[0]).engine if tier == "disk" else None

    def master(p: torch.Tensor) -> torch.Tensor:
        return (master_part(p) if engine is not None else p).detach().float().clone()

    if engine is not None:
        write = engine.file.write

        def slow_write(*args, **kwargs) -> None:
            time.sleep(0.05)
            write(*args, **kwargs)
        engine.file.write = slow_write
    reference = [torch.nn.Parameter(master(p)) for p in params]
    torch_adamw = torch.optim.AdamW(reference, lr=1e-2, weight_decay=0.1, foreach=False)
    out: dict = {"losses": [], "norms": [], "steps": [], "after_step": []}
    for batch in token_batches(SMALL_GPT.vocab_size, 12, steps=STEPS)():
        loss = _lm_loss(model, _slice(batch, rank, world))
        loss.backward()
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)      # as a training loop calls it
        for mine, p in zip(reference, params):
            mine.grad = p.grad.detach().float().clone()
        before = None if engine is None else (engine.window.read_bytes, engine.window.written_bytes)
        optimizer.step()
        torch_adamw.step()
        if engine is not None:
            out["steps"].append({"step_io_bytes": engine.last_step.io_bytes, "read_aheads": engine.read_aheads,
                                 "recomputes": engine.recomputes, "read_ahead_bytes": engine.window.read_bytes - before[0],
                                 "written_behind_bytes": engine.window.written_bytes - before[1]})
        # Right after the step: the optimizer's state dict, read first, then the model's masters.
        state = optimizer.state_dict()["state"]
        moments = [[_local(state[i][name]).clone() for i in range(len(params))] for name in ("exp_avg", "exp_avg_sq")]
        out["after_step"].append(_differences([master(p) for p in params], *moments, reference, torch_adamw))
        optimizer.zero_grad()
        out["losses"].append(float(loss))
        out["norms"].append(float(norm))
    checkpoint.save(path, model, optimizer)                 # right after the last step
    out["state"] = model.full_state_dict()
    out["moments"] = [torch.cat([optimizer.state[p][name].reshape(-1).float() for p in params])
                      for name in ("exp_avg", "exp_avg_sq")]
    torch.manual_seed(1)
    loaded = ShardedModule(GPT(SMALL_GPT), offload=tier, mixed_precision=BF16)
    loaded_optimizer = AdamW(loaded.parameters(), lr=1e-2, weight_decay=0.1)
    checkpoint.load(path, loaded, loaded_optimizer)
    state = loaded_optimizer.state_dict()["state"]
    loaded_params = list(loaded.parameters())
    out["loaded"] = _differences([master(p) for p in loaded_params],
                                 [state[i]["exp_avg"] for i in range(len(params))],
                                 [state[i]["exp_avg_sq"] for i in range(len(params))], reference, torch_adamw)
    return out


def _differences(masters, exp_avgs, exp_avg_sqs, reference, torch_adamw) -> list[str]:
    """Where the state read differs from torch's AdamW beyond fp32 rounding (empty: nowhere)."""
    wrong = []
    for i, p in enumerate(reference):
        theirs = torch_adamw.state[p]
        for name, ours, expected, atol in (("master", masters[i], p.detach(), 1e-7),
                                            ("exp_avg", exp_avgs[i], theirs["exp_avg"], 1e-12),
                                            ("exp_avg_sq", exp_avg_sqs[i], theirs["exp_avg_sq"], 1e-12)):
            ours = _local(ours).detach().float().reshape(-1)
            if not torch.allclose(ours, expected.reshape(-1), rtol=RTOL, atol=atol):
                wrong.append(f"{name} of parameter {i}: largest difference "
                             f"{(ours - expected.reshape(-1)).abs().max():.3g}")
    return wrong


def _local(tensor: torch.Tensor) -> torch.Tensor:
    """This rank's rows (the sharded optimizer state dict holds DTensors)."""
    from torch.distributed.tensor import DTensor

    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


def _both(rank: int, world: int, directory: str) -> dict:
    return {tier: _train(rank, world, tier, f"{directory}/{tier}") for tier in ("cpu", "disk")}


@pytest.mark.timeout(600)
def test_a_binding_clip_reads_ahead_writes_behind_and_trains_as_cpu_and_torch(tmp_path, monkeypatch) -> None:
    monkeypatch.setenv("OVERLAP_OFFLOAD_DIR", str(tmp_path))
    for rank, result in enumerate(run_distributed(_both, 2, str(tmp_path), timeout=500)):
        cpu, disk = result["cpu"], result["disk"]
        assert all(torch.isfinite(torch.tensor(cpu["losses"] + disk["losses"]))), (rank, disk["losses"])
        assert disk["losses"] == cpu["losses"] and disk["norms"] == cpu["norms"], rank
        assert all(norm > CLIP for norm in disk["norms"]), "the clip must bind at every step"
        for key, value in cpu["state"].items():
            assert torch.equal(disk["state"][key], value), (rank, key)
        assert all(torch.equal(d, c) for d, c in zip(disk["moments"], cpu["moments"])), rank
        for tier in (cpu, disk):
            assert tier["after_step"] == [[]] * STEPS, (rank, tier["after_step"])
            assert tier["loaded"] == [], (rank, tier["loaded"])
        first, *later = disk["steps"]
        assert first["recomputes"] > 0 and first["step_io_bytes"] > 0, first
        groups = first["recomputes"]
        for step, record in enumerate(later, start=2):
            assert record["step_io_bytes"] == 0, (rank, step, record)
            assert record["read_aheads"] == groups * (step - 1), (rank, step, record)
            assert record["written_behind_bytes"] == first["step_io_bytes"] // 2, (rank, step, record)
        # The reads ran before the step, during backward: the step itself started none.
        assert all(record["read_ahead_bytes"] == 0 for record in later), rank
