"""What the habits of a script written for DDP do under DDP, FSDP2 and ShardedModule.

Each habit runs at 2 gloo ranks with the wrapping line changed and nothing else, and is
judged against DDP's run of the same habit (same seeds, same batches):

- `optimizer_before`: AdamW built from the model before wrapping, 4 steps;
- `torch_clip`: `torch.nn.utils.clip_grad_norm_(model.parameters(), c)` with a clip that binds;
- `ddp_switch`: `model.require_backward_grad_sync = (micro == last)` for 2 micro-batches;
- `rank0_save`: rank 0 alone `torch.save`s `model.module.state_dict()` and
  `optimizer.state_dict()`; the file is loaded into one process and compared with DDP's;
- `rank0_eval`: a forward on rank 0 alone, then a training step on both, with a 60 s
  process-group deadline;
- `numel`: `sum(p.numel() for p in model.parameters())`.

Each cell is "equal" (DDP's result), "refused" (an error at the call, with its first words
and the seconds it took) or "silent" (another result and no error). `--python` runs the
same habits with the ShardedModule another interpreter imports (run this file with it, e.g.
an environment over an earlier commit's tree), labelled with `--overlap-commit`.

    python benchmarks/dropin_habits.py --out docs/results/dropin_habits.json
"""
from __future__ import annotations

import argparse
import datetime
import os
import sys
import tempfile
import time
from typing import Any, Callable, Optional, Sequence

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn

from common import RunRecord, write_json

IMPLEMENTATIONS = ("ddp", "fsdp2", "overlap")
HABITS = ("optimizer_before", "torch_clip", "ddp_switch", "rank0_save", "rank0_eval", "numel")
TOL = dict(rtol=1e-4, atol=1e-5)


def _model() -> nn.Module:
    from overlap.models import GPT, GPTConfig

    torch.manual_seed(1337)
    return GPT(GPTConfig(vocab_size=97, block_size=16, n_layer=3, n_head=2, n_embd=32))


def _wrap(impl: str, model: nn.Module) -> nn.Module:
    if impl == "ddp":
        return nn.parallel.DistributedDataParallel(model)
    if impl == "fsdp2":
        from torch.distributed.fsdp import fully_shard

        for block in model.blocks:
            fully_shard(block)
        fully_shard(model)

        class Wrapped(nn.Module):          # FSDP2 wraps in place: `model.module` as a DDP script reads it
            def __init__(self, inner: nn.Module) -> None:
                super().__init__()
                self.module = inner

            def forward(self, *args: Any) -> Any:
                return self.module(*args)

        return Wrapped(model)
    from overlap import ShardedModule

    return ShardedModule(model)


def _batch(step: int, micro: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(1000 * step + 10 * micro + rank)
    tokens = (torch.randint(0, 97, (4, 1), generator=generator) + torch.arange(17)) % 97
    return tokens[:, :-1], tokens[:, 1:]


def _train(impl: str, rank: int, *, clip: float = 0.0, switch: bool = False, steps: int = 4) -> list[float]:
    plain = _model()
    optimizer = torch.optim.AdamW(plain.parameters(), lr=3e-3)     # before wrapping, as the script does
    model = _wrap(impl, plain)
    losses = []
    for step in range(steps):
        micros = 2 if switch else 1
        for micro in range(micros):
            if switch:
                model.require_backward_grad_sync = micro == micros - 1
            loss = model(*_batch(step, micro, rank)) / micros
            loss.backward()
            losses.append(loss.item() * micros)
        if clip:
            losses.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), clip)))
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    return losses


def _rank0_save(impl: str, rank: int, out_dir: str) -> Optional[str]:
    plain = _model()
    optimizer = torch.optim.AdamW(plain.parameters(), lr=3e-3)
    model = _wrap(impl, plain)
    model(*_batch(0, 0, rank)).backward()
    optimizer.step()
    path = os.path.join(out_dir, f"{impl}.pt")
    if rank == 0:
        torch.save({"model": model.module.state_dict(), "optimizer": optimizer.state_dict()}, path)
    dist.barrier()
    return path


def _rank0_eval(impl: str, rank: int) -> float:
    """An evaluation under `if rank == 0:`, then the next training step on every rank, as the
    script goes on."""
    model = _wrap(impl, _model())
    model.eval()
    if rank == 0:
        with torch.no_grad():
            model(*_batch(9, 0, rank))
    model.train()
    model(*_batch(10, 0, rank)).backward()
    return 0.0


def _numel(impl: str, rank: int) -> int:
    return sum(p.numel() for p in _wrap(impl, _model()).parameters())


def _attempt(fn: Callable[[], Any]) -> dict[str, Any]:
    start = time.monotonic()
    try:
        return {"ok": True, "value": fn(), "seconds": time.monotonic() - start}
    except Exception as exc:  # noqa: BLE001 - a refusal is a result
        return {"ok": False, "error": f"{type(exc).__name__}: {str(exc)[:300]}", "seconds": time.monotonic() - start}


def _rank(rank: int, port: int, impl: str, habit: str, out_dir: str, result_dir: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE="2",
                      LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE="2")
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=2, timeout=datetime.timedelta(seconds=60))
    work = {"optimizer_before": lambda: _train(impl, rank), "torch_clip": lambda: _train(impl, rank, clip=0.3),
            "ddp_switch": lambda: _train(impl, rank, switch=True),
            "rank0_save": lambda: _rank0_save(impl, rank, out_dir), "rank0_eval": lambda: _rank0_eval(impl, rank),
            "numel": lambda: _numel(impl, rank)}[habit]
    outcome = _attempt(work)
    torch.save(outcome, os.path.join(result_dir, f"{rank}.pt"))
    os._exit(0)        # a rank left in a failed collective would hold the launch


def _launch(impl: str, habit: str, out_dir: str, port: int, timeout_s: float = 300) -> list[dict[str, Any]]:
    with tempfile.TemporaryDirectory() as result_dir:
        context = mp.start_processes(_rank, args=(port, impl, habit, out_dir, result_dir), nprocs=2, join=False,
                                     start_method="spawn")
        deadline = time.monotonic() + timeout_s
        while not context.join(timeout=1):
            if time.monotonic() > deadline:
                for process in context.processes:
                    process.kill()
                return [{"ok": False, "error": f"hung: no result within {timeout_s:.0f} s", "seconds": timeout_s}] * 2
        return [torch.load(os.path.join(result_dir, f"{r}.pt"), weights_only=False) if
                os.path.exists(os.path.join(result_dir, f"{r}.pt")) else
                {"ok": False, "error": "the rank died without a result", "seconds": 0.0} for r in range(2)]


def _close(a: Any, b: Any) -> bool:
    try:
        torch.testing.assert_close(torch.as_tensor(a, dtype=torch.float64), torch.as_tensor(b, dtype=torch.float64),
                                   **TOL)
        return True
    except (AssertionError, RuntimeError, ValueError, TypeError):
        return False


def _saved_equal(path: str, reference: str) -> bool:
    ours, theirs = (torch.load(p, weights_only=False) for p in (path, reference))
    plain = _model()
    try:
        plain.load_state_dict(ours["model"])
    except (RuntimeError, KeyError, TypeError):
        return False
    mine = plain.state_dict()
    return all(_close(mine[key], value) for key, value in theirs["model"].items()) and \
        len(ours["optimizer"]["state"]) == len(theirs["optimizer"]["state"]) and \
        all(_close(ours["optimizer"]["state"][i][k], v) for i, state in theirs["optimizer"]["state"].items()
            for k, v in state.items())


def _verdict(habit: str, outcome: list[dict[str, Any]], reference: list[dict[str, Any]]) -> dict[str, Any]:
    if outcome is not reference and not all(r["ok"] for r in reference) and all(o["ok"] for o in outcome):
        return {"verdict": "ran", "error": None, "note": "DDP itself did not run this habit"}
    if not all(o["ok"] for o in outcome):
        failed = next(o for o in outcome if not o["ok"])
        kind = "hangs" if failed["error"].startswith("hung") else "refused"
        return {"verdict": kind, "error": failed["error"], "seconds": round(max(o["seconds"] for o in outcome), 1)}
    if habit == "rank0_save":
        equal = _saved_equal(outcome[0]["value"], reference[0]["value"])
    elif habit == "rank0_eval":
        equal = True
    else:
        equal = all(_close(o["value"], r["value"]) for o, r in zip(outcome, reference))
    return {"verdict": "equal" if equal else "silent",
            "value": [o["value"] for o in outcome] if habit == "numel" else None}


def _run_here(args: argparse.Namespace) -> dict[str, Any]:
    cells: dict[str, dict[str, Any]] = {}
    port = 29810
    with tempfile.TemporaryDirectory() as out_dir:
        outcomes = {}
        for habit in HABITS:
            for impl in args.impls.split(","):
                port += 1
                outcomes[(impl, habit)] = _launch(impl, habit, out_dir, port)
        for (impl, habit), outcome in outcomes.items():
            reference = outcomes[("ddp", habit)]
            cells.setdefault(impl, {})[habit] = _verdict(habit, outcome, reference)
    return cells


def _parse(argv: Sequence[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--impls", default=",".join(IMPLEMENTATIONS), help="ddp first: the reference")
    parser.add_argument("--overlap-commit", help="the commit of the ShardedModule imported, when not this checkout's")
    parser.add_argument("--out", default="bench_out/dropin_habits.json")
    return parser.parse_args(argv)


def main(argv: Optional[Sequence[str]] = None) -> None:
    args = _parse(argv if argv is not None else sys.argv[1:])
    record = RunRecord("dropin_habits.py", argv if argv is not None else sys.argv[1:])
    cells = _run_here(args)
    result = {**record.fields(), "overlap_commit": args.overlap_commit or record.commit, "habits": list(HABITS),
              "cells": cells}
    write_json(args.out, result)
    width = max(len(h) for h in HABITS)
    print(f"{'habit':<{width}}  " + "  ".join(f"{impl:<10}" for impl in cells))
    for habit in HABITS:
        print(f"{habit:<{width}}  " + "  ".join(f"{cells[impl][habit]['verdict']:<10}" for impl in cells))


if __name__ == "__main__":
    main()
