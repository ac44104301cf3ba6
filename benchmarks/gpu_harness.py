"""What the checks of gpu_checks.py stand on: verdicts, a process group of one rank,
deterministic kernels, devices, dtypes and timed steps (by CUDA events read once after the
timed steps: a sync per step would hide any sync the code under test makes)."""
from __future__ import annotations

import contextlib
import math
import os
import time
import traceback
from typing import TYPE_CHECKING, Any, Callable, Iterator, Optional, Sequence

import torch
import torch.distributed as dist

from common import PROCESS_GROUP_TIMEOUT, patched, single_rank_env

if TYPE_CHECKING:
    from overlap import MixedPrecision


ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


class Checks:
    def __init__(self) -> None:
        self.failed = False

    def report(self, status: str, name: str, detail: str) -> None:
        self.failed |= status == "FAIL"
        print(f"{status} {name}: {detail}", flush=True)

    def verdict(self, name: str, ok: bool, detail: str) -> None:
        self.report("PASS" if ok else "FAIL", name, detail)

    def error(self, name: str, exc: BaseException) -> None:
        self.report("FAIL", name, f"{type(exc).__name__}: {exc}\n{traceback.format_exc()}")


@contextlib.contextmanager
def one_rank_group(backend: Optional[str]) -> Iterator[None]:
    """A process group of this process alone; `backend=None`: none named."""
    os.environ.update(single_rank_env())
    kwargs = {} if backend is None else {"backend": backend}
    dist.init_process_group(timeout=PROCESS_GROUP_TIMEOUT, **kwargs)
    try:
        yield
    finally:
        dist.destroy_process_group()


@contextlib.contextmanager
def one_rank_on(device: torch.device) -> Iterator[None]:
    """`one_rank_group` with nccl (gloo in a rehearsal), the device made current."""
    with one_rank_group("nccl" if device.type == "cuda" else "gloo"):
        if device.type == "cuda":
            torch.cuda.set_device(device)
        yield


@contextlib.contextmanager
def deterministic() -> Iterator[None]:
    """Kernels that give the same bits on every run, so that "plain == injected" tests the
    streams, not the kernels (`main` sets CUBLAS_WORKSPACE_CONFIG before cuBLAS's handle is
    made). warn_only: an op with no deterministic kernel warns, naming itself."""
    saved = torch.are_deterministic_algorithms_enabled(), torch.is_deterministic_algorithms_warn_only_enabled()
    torch.use_deterministic_algorithms(True, warn_only=True)
    try:
        yield
    finally:
        torch.use_deterministic_algorithms(saved[0], warn_only=saved[1])


def device_for(rehearse: bool) -> torch.device:
    return torch.device("cpu") if rehearse else torch.device("cuda", 0)


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def empty_cache(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.empty_cache()


def all_finite(values: Sequence[float]) -> bool:
    return all(math.isfinite(v) for v in values)


def bf16() -> "MixedPrecision":
    from overlap import MixedPrecision

    return MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)


def lm_step(model: torch.nn.Module, optimizer: torch.optim.Optimizer, data: Sequence[tuple[torch.Tensor, ...]],
            context: Callable[[], Any]) -> Callable[[int], torch.Tensor]:
    """Step i: `model(*data[i])` (a loss) under `context()`, its backward and `optimizer`'s step."""

    def step(i: int) -> torch.Tensor:
        with context():
            loss = model(*data[i])
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return loss.detach()

    return step


def timed_steps(step: Callable[[int], torch.Tensor], device: torch.device, warmup: int, steps: int,
                at_window: Optional[Callable[[], None]] = None) -> tuple[list[float], list[float]]:
    """`warmup` steps, `at_window()`, `steps` timed steps; their seconds (CUDA events, read
    after the last one) and every step's loss."""
    losses = [step(i) for i in range(warmup)]
    if at_window is not None:
        at_window()
    if device.type == "cuda":
        marks = [torch.cuda.Event(enable_timing=True) for _ in range(steps + 1)]
        marks[0].record()
        for i in range(steps):
            losses.append(step(warmup + i))
            marks[i + 1].record()
        marks[-1].synchronize()
        seconds = [a.elapsed_time(b) / 1e3 for a, b in zip(marks, marks[1:])]
    else:
        stamps = [time.perf_counter()]
        for i in range(steps):
            losses.append(step(warmup + i))
            stamps.append(time.perf_counter())
        seconds = [b - a for a, b in zip(stamps, stamps[1:])]
    return seconds, [float(loss) for loss in losses]


def collectives_issued_alone() -> contextlib.AbstractContextManager[None]:
    """ShardedModules built inside issue their collectives at world size 1 as with more ranks
    (by default one rank copies in place), for the checks to delay, time and poison."""
    from overlap.runtime.collectives import Collectives

    return patched((Collectives, "local_when_alone", False))
