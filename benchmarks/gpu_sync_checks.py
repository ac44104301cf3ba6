"""Host waits and the step record's clock: steady-state steps make no call that syncs the host
with the device (the runtime's deliberate waits counted), and the record's time of the
collectives in flight agrees with CUPTI's. `count_sync_calls` also serves
tests/test_host_syncs.py.
"""
from __future__ import annotations

import contextlib
import json
import os
import sys
import tempfile
import traceback
from collections import Counter
from types import FrameType
from typing import Any, Callable, Iterator, Optional, Sequence

import torch

from common import patched, train_step
from gpu_harness import (ROOT, Checks, all_finite, bf16, collectives_issued_alone, device_for, flush_record, lm_step,
                         one_rank_on, small_gpt, synchronize, token_batches)

SYNC_WARMUP, SYNC_STEPS = 3, 3
# The checks' own frames, passed over when naming where a sync was made.
CHECKS_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "")
# Each blocks the host until the device catches up when its tensor or event is on the device.
SYNC_CALLS: list[tuple[Any, str]] = [
    (torch.Tensor, "tolist"), (torch.Tensor, "item"), (torch.Tensor, "cpu"), (torch.Tensor, "to"),
    (torch.cuda, "synchronize"), (torch.cuda.Event, "synchronize"), (torch.cuda.Event, "elapsed_time"),
    (torch.cuda.Stream, "synchronize"),
]
Where = Callable[[str, tuple, dict, FrameType], Optional[str]]


def _where(exc: BaseException) -> str:
    """Where a flagged sync was made: the innermost frame in this repository's code, and of all."""
    frames = traceback.extract_tb(exc.__traceback__)
    if not frames:
        return "no traceback"
    ours = [f for f in frames if f.filename.startswith(ROOT) and not f.filename.startswith(CHECKS_DIR)]

    def place(frame: traceback.FrameSummary) -> str:
        path = os.path.relpath(frame.filename, ROOT) if frame.filename.startswith(ROOT) else frame.filename
        return f"{path}:{frame.lineno} in {frame.name}"

    inner = place(frames[-1])
    return f"{place(ours[-1])} (innermost: {inner})" if ours else inner


@contextlib.contextmanager
def counted_calls(targets: Sequence[tuple[Any, str, str]], where: Where) -> Iterator[Counter]:
    """Count the calls of each (owner, method, label) of `targets` inside the block, by
    `where(label, args, kwargs, caller's frame)` (None: not counted)."""
    seen: Counter = Counter()

    def counting(label: str, fn: Callable) -> Callable:
        def run(*args: Any, **kwargs: Any) -> Any:
            key = where(label, args, kwargs, sys._getframe(1))
            if key is not None:
                seen[key] += 1
            return fn(*args, **kwargs)
        return run

    with patched(*[(owner, name, counting(label, getattr(owner, name))) for owner, name, label in targets]):
        yield seen


def count_sync_calls() -> contextlib.AbstractContextManager[Counter]:
    """Count, by "owner.method in file:function", the calls of SYNC_CALLS (`Tensor.to` only with a
    device) that overlap's own code makes inside the block (on CPU too: whether each would
    synchronise depends on its tensor being on the device)."""
    import overlap
    import overlap.kernels

    # Where the package's own code lives (overlap.kernels is installed from kernels/).
    package = (os.path.dirname(overlap.__file__) + os.sep, list(overlap.kernels.__path__)[0] + os.sep)

    def in_overlap(label: str, args: tuple, kwargs: dict, caller: FrameType) -> Optional[str]:
        code = caller.f_code
        moves = label != "Tensor.to" or "device" in kwargs or any(isinstance(a, (torch.device, str)) for a in args[1:])
        return f"{label} in {os.path.basename(code.co_filename)}:{code.co_name}" \
            if code.co_filename.startswith(package) and moves else None

    return counted_calls([(owner, name, f"{owner.__name__}.{name}") for owner, name in SYNC_CALLS], in_overlap)


def counted_host_waits() -> contextlib.AbstractContextManager[Counter]:
    """Count, by caller, the host waits `set_sync_debug_mode` does not flag."""
    from overlap.runtime import step_counter, timing

    def at_caller(label: str, args: tuple, kwargs: dict, caller: FrameType) -> str:
        path = caller.f_code.co_filename
        path = os.path.relpath(path, ROOT) if path.startswith(ROOT) else os.path.basename(path)
        return f"{label} at {path}:{caller.f_lineno}"

    # `polling`: the step record's wait for a step not yet complete (overlap/runtime/timing.py).
    return counted_calls([(torch.cuda.Event, "synchronize", "Event.synchronize"),
                          (torch.cuda.Stream, "synchronize", "Stream.synchronize"),
                          (torch.cuda, "synchronize", "torch.cuda.synchronize"),
                          (timing, "polling", "polling wait"), (step_counter, "polling", "polling wait")], at_caller)


@contextlib.contextmanager
def _sync_debug_mode(device: torch.device) -> Iterator[None]:
    """Every synchronizing CUDA call raises (nothing on CPU)."""
    if device.type != "cuda":
        yield
        return
    torch.cuda.set_sync_debug_mode("error")
    try:
        yield
    finally:
        torch.cuda.set_sync_debug_mode("default")


def check_sync_free(checks: Checks, rehearse: bool) -> None:
    """Steady-state steps make no call that synchronizes the host with the device, but the
    runtime's deliberate waits, counted and printed."""
    from overlap import ShardedModule

    device = device_for(rehearse)
    with one_rank_on(device):
        for mode in ("none", "int8-int4"):
            name = f"sync_free[{mode}]"
            try:
                torch.manual_seed(0)
                with collectives_issued_alone():
                    model = ShardedModule(small_gpt(), prefetch_depth=1, mixed_precision=bf16(), compression=mode)
                optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
                batches = token_batches(device, SYNC_WARMUP + SYNC_STEPS)
                step = lm_step(model, optimizer, batches, contextlib.nullcontext)
                for i in range(SYNC_WARMUP):
                    step(i)
                synchronize(device)
                with counted_host_waits() as waits, _sync_debug_mode(device):
                    losses = [step(SYNC_WARMUP + i) for i in range(SYNC_STEPS)]
                finite = all_finite([float(loss) for loss in losses])
            except Exception as exc:  # noqa: BLE001 - a check that raises is a failed check
                if isinstance(exc, RuntimeError) and "synchronizing" in str(exc):
                    checks.report("FAIL", name, f"a host sync in a steady-state step: {exc}; made at {_where(exc)}")
                else:
                    checks.error(name, exc)
                continue
            kernels = type(model.collectives.kernels).__name__
            unflagged = ", ".join(f"{n / SYNC_STEPS:.1f}/step {where}" for where, n in waits.most_common()) or "none"
            detail = (f"{SYNC_STEPS} steps after {SYNC_WARMUP}, kernels {kernels}, finite: {finite}; host waits the "
                      f"mode does not flag: {unflagged}")
            if device.type != "cuda":
                checks.report("SKIP" if finite else "FAIL", name,
                              f"torch.cuda.set_sync_debug_mode needs CUDA; the steps ran on CPU: {detail}")
            else:
                checks.verdict(name, finite, f"no synchronizing call under set_sync_debug_mode('error'); {detail}")


def check_report_timing(checks: Checks, rehearse: bool) -> None:
    if rehearse:
        checks.report("SKIP", "report_timing", "CUDA events against CUPTI kernel times: nothing to compare on CPU")
        return
    from torch.profiler import ProfilerActivity, profile

    from overlap import ShardedModule
    from overlap.base.intervals import length, union
    from overlap.observe.report import analyse_step

    device = device_for(False)
    with one_rank_on(device):
        torch.manual_seed(0)
        with collectives_issued_alone():                 # one device: the collectives to time
            model = ShardedModule(small_gpt(layers=6, width=1024), prefetch_depth=1, bucket_mb=1e-3)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
        steps = [train_step(model, optimizer, *batch) for batch in token_batches(device, 5)]
        for step in steps[:4]:
            step()
        torch.cuda.synchronize()
        with tempfile.TemporaryDirectory() as scratch:
            with profile(activities=[ProfilerActivity.CUDA]) as prof:
                steps[4]()
                torch.cuda.synchronize()
            flush_record(model)                                # the record of the profiled step
            path = os.path.join(scratch, "trace.json")
            prof.export_chrome_trace(path)
            with open(path) as f:
                trace = json.load(f)["traceEvents"]
    record = model.scheduler.last_step
    if record.step != 5:
        checks.report("FAIL", "report_timing", f"the last record is step {record.step}'s, the profiled step is 5")
        return
    device_work = [e for e in trace if e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset") and "dur" in e]
    busy: dict[Any, float] = {}
    for e in device_work:
        busy[e["args"].get("stream")] = busy.get(e["args"].get("stream"), 0.0) + e["dur"]
    # The compute stream does the most work; the collectives' work runs on every other one.
    compute_stream = max(busy, key=busy.get)
    side = [(e["ts"] * 1e-6, (e["ts"] + e["dur"]) * 1e-6) for e in device_work
            if e["args"].get("stream") != compute_stream]
    cupti_s = length(union(side))
    recorded_s = length(union(c.in_flight for c in record.collectives))
    stats = analyse_step(record)
    # Each collective's events add a few µs of hand-over between streams that no kernel shows.
    allowance = 0.25 * cupti_s + 30e-6 * len(record.collectives)
    ok = bool(side) and abs(recorded_s - cupti_s) <= allowance
    checks.verdict("report_timing", ok,
                   f"{len(record.collectives)} collectives in flight {recorded_s * 1e3:.3f} ms by the step record's "
                   f"CUDA events vs {cupti_s * 1e3:.3f} ms of device work on the side streams by CUPTI "
                   f"({len(side)} kernels and copies on {len(busy) - 1} streams; pass within "
                   f"{allowance * 1e3:.3f} ms); report: communication {stats.comm_s * 1e3:.3f} ms, "
                   f"{100 * stats.hidden_fraction:.0f}% hidden, compute {stats.compute_s * 1e3:.2f} ms of a "
                   f"{stats.span_s * 1e3:.2f} ms step")
