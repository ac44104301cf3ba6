"""What every check of gpu_checks.py stands on: the verdicts, a process group of one rank,
deterministic kernels, and the few helpers for devices, dtypes and timed steps.

Step times come from CUDA events read once after the timed steps, never from a sync per step:
a loop that syncs every step lets the host never run ahead, which hides any sync the code
under test makes itself.
"""
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
    """Collects the verdicts; `failed` says whether any check failed."""

    def __init__(self) -> None:
        self.failed = False

    def report(self, status: str, name: str, detail: str) -> None:
        self.failed |= status == "FAIL"
        print(f"{status} {name}: {detail}", flush=True)

    def verdict(self, name: str, ok: bool, detail: str) -> None:
        self.report("PASS" if ok else "FAIL", name, detail)

    def error(self, name: str, exc: BaseException) -> None:
        """A check that raised is a failed check."""
        self.report("FAIL", name, f"{type(exc).__name__}: {exc}\n{traceback.format_exc()}")


@contextlib.contextmanager
def one_rank_group(backend: Optional[str]) -> Iterator[None]:
    """A process group of this process alone, as torchrun would set it up; `backend=None` is
    `init_process_group()` with no backend named."""
    os.environ.update(single_rank_env())
    kwargs = {} if backend is None else {"backend": backend}
    dist.init_process_group(timeout=PROCESS_GROUP_TIMEOUT, **kwargs)
    try:
        yield
    finally:
        dist.destroy_process_group()


@contextlib.contextmanager
def one_rank_on(device: torch.device) -> Iterator[None]:
    """`one_rank_group` with the backend for `device` (nccl, or gloo for a rehearsal), the
    device made current."""
    with one_rank_group("nccl" if device.type == "cuda" else "gloo"):
        if device.type == "cuda":
            torch.cuda.set_device(device)
        yield


@contextlib.contextmanager
def deterministic() -> Iterator[None]:
    """Kernels that give the same bits on every run (SDPA's backward, cuBLAS's split-K
    reductions otherwise may not), so that "plain == injected" tests the streams, not the
    kernels. cuBLAS reads CUBLAS_WORKSPACE_CONFIG when its handle is made: `main` sets it
    before any CUDA work. warn_only: an op with no deterministic kernel warns, naming itself."""
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


def all_finite(values: Sequence[float]) -> bool:
    return all(math.isfinite(v) for v in values)


def bf16() -> "MixedPrecision":
    from overlap import MixedPrecision

    return MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)


def lm_step(model: torch.nn.Module, optimizer: torch.optim.Optimizer, data: list[torch.Tensor],
            context: Callable[[], Any]) -> Callable[[int], torch.Tensor]:
    """One training step of a language model on batch `i` of `data` (inputs are the targets)."""

    def step(i: int) -> torch.Tensor:
        with context():
            loss = model(data[i], data[i])
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return loss.detach()

    return step


def timed_steps(step: Callable[[int], torch.Tensor], device: torch.device, warmup: int, steps: int,
                at_window: Optional[Callable[[], None]] = None) -> tuple[list[float], list[float]]:
    """Run `step(i)` `warmup` times, call `at_window()`, then `steps` more times; the seconds
    of each of the last `steps`, and every step's returned (detached) loss. On CUDA each
    step's end is an event on the compute stream and nothing waits until the last one (see
    the module's note); each loss is read after the window."""
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
    """ShardedModules built inside run their gathers and reductions as collectives (on their
    streams, into buffers they free) at world size 1 too, as with more ranks, for the checks
    to delay, time and poison; by default one rank copies in place or gathers nothing."""
    from overlap.runtime.collectives import Collectives

    return patched((Collectives, "local_when_alone", False))
