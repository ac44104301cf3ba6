"""The models the checks train, and ShardedModule's runs with and without injected races and
the unsharded model's, step by step."""
from __future__ import annotations

import contextlib
import copy
import os
import sys
from collections import Counter
from typing import Callable, Optional

import torch

from gpu_harness import ROOT, all_finite, bf16, collectives_issued_alone, synchronize
from gpu_injection import Injection

sys.path.insert(0, os.path.join(ROOT, "tests"))        # tests/models.py: the awkward model

PARITY_STEPS = 5
REHEARSAL_STEPS = 3           # of the parity and compressed runs, on CPU


def small_gpt(layers: int = 4, width: int = 128) -> torch.nn.Module:
    from overlap.models import GPT, GPTConfig

    return GPT(GPTConfig(vocab_size=512, block_size=64, n_layer=layers, n_head=4, n_embd=width))


def _feature_net() -> torch.nn.Module:
    from models import FeatureNet

    return FeatureNet(vocab=512, d=64, hidden=96)


class OddNet(torch.nn.Module):
    """Parameters of odd sizes: offsets off 16-byte alignment unless the layout rounds them."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(512, 37)
        self.blocks = torch.nn.ModuleList(torch.nn.Sequential(torch.nn.LayerNorm(37), torch.nn.Linear(37, 29),
                                                              torch.nn.GELU(), torch.nn.Linear(29, 37))
                                          for _ in range(3))
        self.head = torch.nn.Linear(37, 512)

    def forward(self, idx: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        x = self.embed(idx)
        for block in self.blocks:
            x = x + block(x)
        return torch.nn.functional.cross_entropy(self.head(x).flatten(0, 1), targets.flatten())


def parity_configs() -> dict[str, dict]:
    return {
        "gpt_fp32_depth2": dict(build=small_gpt, wrap=dict(prefetch_depth=2)),
        "no_sync": dict(build=small_gpt, wrap=dict(prefetch_depth=1), micro_batches=2),
        "tied_frozen_twice_checkpointed": dict(build=_feature_net, wrap=dict(prefetch_depth=1)),
        "bf16_gather_fp32_reduce": dict(build=small_gpt, wrap=dict(prefetch_depth=1, mixed_precision=bf16()),
                                        param_dtype=torch.bfloat16),
        "no_reshard_after_forward": dict(build=small_gpt, wrap=dict(prefetch_depth=1, reshard_after_forward=False)),
        "odd_shapes_bf16": dict(build=OddNet, wrap=dict(prefetch_depth=1, mixed_precision=bf16()),
                                param_dtype=torch.bfloat16),
        "compiled": dict(build=lambda: small_gpt(layers=2), wrap=dict(prefetch_depth=1, compile=True)),
    }


def token_batches(device: torch.device, steps: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    gen = torch.Generator().manual_seed(1)
    return [(torch.randint(0, 512, (8, 64), generator=gen).to(device),
             torch.randint(0, 512, (8, 64), generator=gen).to(device)) for _ in range(steps)]


def parity_steps(device: torch.device) -> int:
    return PARITY_STEPS if device.type == "cuda" else REHEARSAL_STEPS


def train_sharded(config: dict, device: torch.device, injection: Optional[Injection],
                  steps: Optional[int] = None) -> dict:
    """`steps` (default `parity_steps`) steps of ShardedModule under `injection`: losses,
    allocated bytes per step, final state, and the collectives its step records hold."""
    from overlap import ShardedModule

    torch.manual_seed(0)
    with collectives_issued_alone():
        model = ShardedModule(config["build"](), **config["wrap"])
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    micro = config.get("micro_batches", 1)
    losses, allocated = [], []
    records = _delivered_records(model)
    with injection.active() if injection is not None else contextlib.nullcontext():
        for idx, targets in token_batches(device, steps or parity_steps(device)):
            total = _backward_in_parts(model, idx, targets, micro, model.no_sync)
            optimizer.step()
            optimizer.zero_grad()
            synchronize(device)
            losses.append(total.item())
            allocated.append(torch.cuda.memory_allocated(device) if device.type == "cuda" else 0)
        flush_record(model)
    recorded: Counter = Counter()
    for c in (c for record in records for c in record.collectives):
        recorded[c.kind] += 1
        recorded[f"{c.kind} compressed"] += c.uncompressed_nbytes is not None
    if [r.step for r in records] != list(range(1, len(losses) + 1)):
        raise AssertionError(f"step records of steps {[r.step for r in records]} after {len(losses)} steps")
    return dict(losses=losses, allocated=allocated, state=model.full_state_dict(), recorded=recorded)


def _backward_in_parts(model: torch.nn.Module, idx: torch.Tensor, targets: torch.Tensor, parts: int,
                       no_sync: Callable[[], contextlib.AbstractContextManager] = contextlib.nullcontext
                       ) -> torch.Tensor:
    """Forward and backward in `parts` parts (all but the last in `no_sync()`); the summed loss."""
    total = torch.zeros((), device=idx.device)
    for k in range(parts):
        part = slice(k * idx.shape[0] // parts, (k + 1) * idx.shape[0] // parts)
        with no_sync() if k < parts - 1 else contextlib.nullcontext():
            loss = model(idx[part], targets[part]) / parts
            loss.backward()
        total += loss.detach().float()
    return total


def _delivered_records(model) -> list:
    """The step records `model` delivers from now on."""
    records: list = []
    model.scheduler.step_end_callbacks.append(lambda scheduler: records.append(scheduler.last_step))
    return records


def flush_record(model) -> None:
    """Deliver the last step's record, which otherwise comes when the next step closes (see
    [Note: the late host clock] in overlap/runtime/timing.py)."""
    model.scheduler.steps.flush(model.scheduler.order)


def train_plain(config: dict, device: torch.device) -> dict:
    """The unsharded model with fp32 masters (a 16-bit `param_dtype` computes with a copy, as
    ShardedModule's mixed precision does)."""
    torch.manual_seed(0)
    master = config["build"]().to(device)
    optimizer = torch.optim.SGD(master.parameters(), lr=0.05, momentum=0.9)
    dtype = config.get("param_dtype")
    micro = config.get("micro_batches", 1)
    losses = []
    for idx, targets in token_batches(device, parity_steps(device)):
        model = master if dtype is None else copy.deepcopy(master).to(dtype)
        total = _backward_in_parts(model, idx, targets, micro)
        if dtype is not None:
            for ours, theirs in zip(master.parameters(), model.parameters()):
                ours.grad = None if theirs.grad is None else theirs.grad.float()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(total.item())
    return dict(losses=losses, state={k: v.detach().cpu() for k, v in master.state_dict().items()})


def identical_runs(a: dict, b: dict) -> bool:
    return a["losses"] == b["losses"] and all(torch.equal(a["state"][k], b["state"][k]) for k in a["state"])


def worst_parameter(run: dict, reference: dict, rtol: float, atol: float) -> float:
    """The largest |run - reference| in units of atol + rtol * |reference| (<= 1: all within)."""
    return max(float(((run["state"][k].double() - v.double()).abs() / (atol + rtol * v.double().abs())).max())
               for k, v in reference["state"].items() if v.is_floating_point() and v.numel())


def finite_run(run: dict) -> bool:
    return all_finite(run["losses"]) and all(bool(t.isfinite().all()) for t in run["state"].values()
                                             if t.is_floating_point())
