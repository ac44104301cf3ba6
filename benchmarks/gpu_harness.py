"""What the checks of gpu_checks.py stand on: verdicts, a one-rank process group, deterministic
kernels, timed steps (CUDA events read once after the last: a sync per step would hide any the
code under test makes), delays, counts and poison injected into the collectives, and the runs."""
from __future__ import annotations

import contextlib
import copy
import math
import os
import sys
import threading
import time
import traceback
from collections import Counter
from typing import TYPE_CHECKING, Any, Callable, Iterator, Optional, Sequence, TypeVar

import torch
import torch.distributed as dist

from common import PROCESS_GROUP_TIMEOUT, REPOSITORY as ROOT, patched, single_rank_env

if TYPE_CHECKING:
    from overlap import MixedPrecision


T = TypeVar("T")


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
    def guarded(self, name: str) -> Iterator[None]:
        """A check that raises inside the block is a failed check, reported, not an abort."""
        try:
            yield
        except Exception as exc:  # noqa: BLE001 - a check that raises is a failed check
            self.error(name, exc)

    def attempt(self, name: str, run: Callable[[], T]) -> Optional[T]:
        """`run()`; None after a FAIL of `name` if it raises."""
        with self.guarded(name):
            return run()
        return None


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
    """`warmup` steps, `at_window()`, `steps` timed steps: their seconds and every step's loss."""
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


# ---- Delays, counts and poison injected into the collectives ShardedModule and FSDP2 issue on
# one device: a missing wait between streams, or a buffer freed while a stream still reads it,
# then shows as a different or non-finite result.

# torch.cuda._sleep cycles injected around each side-stream collective: ~0.5 ms at ~2 GHz.
SLEEP_CYCLES = 1_000_000


def _collective_functions() -> list[tuple[Any, str, str]]:
    """(owner, attribute, kind) of every function through which ShardedModule and FSDP2 issue one."""
    from overlap.runtime import collectives
    from overlap.runtime.collectives import Collectives

    found = [(collectives, "all_gather_flat", "all_gather"), (collectives, "reduce_scatter_flat", "reduce_scatter"),
             # gloo's reduction, and the codec's compressed one on every backend.
             (Collectives, "_all_to_all", "all_to_all")]
    # FSDP2 calls `dist.<name>` at each collective; which name depends on the torch release.
    for name, kind in (("all_gather_into_tensor", "all_gather"), ("all_gather_single", "all_gather"),
                       ("reduce_scatter_tensor", "reduce_scatter"), ("reduce_scatter_single", "reduce_scatter")):
        if hasattr(dist, name):
            found.append((dist, name, kind))
    return found


class Injection:
    """While `active()`: every collective is counted by kind with its largest buffer's bytes; on
    CUDA `cycles(kind, nbytes)` of `torch.cuda._sleep` run on its stream before it (and with
    `after`, after it); with `poison` every freed gathered buffer is NaN-filled first."""

    def __init__(self, cycles: Optional[Callable[[str, int], int]] = None, after: bool = False,
                 poison: bool = False, all_reduce: bool = False) -> None:
        self.cycles = cycles
        self.after = after
        self.poison = poison
        # `dist.all_reduce` too (hybrid's across replicas; the step's norm and flags ones as well).
        self.all_reduce = all_reduce
        self.calls: Counter = Counter()
        self.nbytes: Counter = Counter()
        self.slept: Counter = Counter()       # sleep cycles injected, by kind
        self._inside = threading.local()      # one collective reached through another counts once

    def reset(self) -> None:
        for counter in (self.calls, self.nbytes, self.slept):
            counter.clear()

    def _wrap(self, kind: str, fn: Callable) -> Callable:
        def run(*args: Any, **kwargs: Any) -> Any:
            if getattr(self._inside, "active", False):
                return fn(*args, **kwargs)
            tensors = [a for a in (*args, *kwargs.values()) if isinstance(a, torch.Tensor)]
            nbytes = max((t.numel() * t.element_size() for t in tensors), default=0)
            on_cuda = any(t.is_cuda for t in tensors)
            cycles = self.cycles(kind, nbytes) if self.cycles is not None and on_cuda else 0
            self.calls[kind] += 1
            self.nbytes[kind] += nbytes
            self.slept[kind] += cycles * (2 if self.after else 1)
            if cycles:
                torch.cuda._sleep(cycles)
            self._inside.active = True
            try:
                out = fn(*args, **kwargs)
            finally:
                self._inside.active = False
            if cycles and self.after:
                torch.cuda._sleep(cycles)
            return out
        return run

    def _delayed_copies(self, on: Callable) -> Callable:
        """`HostTier.on` with the delay queued first on the copy's stream (downloads, uploads)."""
        def delayed(tier: Any, stream: Optional[torch.cuda.Stream]) -> Any:
            context = on(tier, stream)
            if stream is None or self.cycles is None:
                return context
            cycles = self.cycles("offload_copy", 0)

            @contextlib.contextmanager
            def on_the_stream() -> Iterator[None]:
                with context:
                    self.calls["offload_copy"] += 1
                    self.slept["offload_copy"] += cycles
                    torch.cuda._sleep(cycles)
                    yield
            return on_the_stream()
        return delayed

    @contextlib.contextmanager
    def active(self) -> Iterator["Injection"]:
        from overlap.runtime.flat_group import FlatGroup
        from overlap.runtime.host_tier import HostTier

        targets = _collective_functions() + ([(dist, "all_reduce", "all_reduce")] if self.all_reduce else [])
        free = FlatGroup.free

        def poisoned_free(group: FlatGroup) -> None:
            if group.is_allocated:
                with torch.no_grad(), torch.autograd._unsafe_preserve_version_counter(group.full):
                    group.full.detach().fill_(float("nan"))
            free(group)

        with patched(*[(owner, name, self._wrap(kind, getattr(owner, name))) for owner, name, kind in targets],
                     (HostTier, "on", self._delayed_copies(HostTier.on)),
                     (FlatGroup, "free", poisoned_free if self.poison else free)):
            yield self


def race_injection(rehearse: bool) -> Injection:
    """Delays around every collective and before every offload copy (none on CPU), poisoned frees."""
    return Injection(cycles=None if rehearse else (lambda kind, nbytes: SLEEP_CYCLES), after=True, poison=True,
                     all_reduce=True)


# ---- The models the checks train, and the runs step by step.

sys.path.insert(0, os.path.join(ROOT, "tests"))        # tests/models.py: the awkward model

PARITY_STEPS = 5
REHEARSAL_STEPS = 3           # of the parity and compressed runs, on CPU


def small_gpt(layers: int = 4, width: int = 128) -> torch.nn.Module:
    from overlap.models import GPT, GPTConfig

    return GPT(GPTConfig(vocab_size=512, block_size=64, n_layer=layers, n_head=4, n_embd=width))


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
    from models import FeatureNet

    return {
        "gpt_fp32_depth2": dict(build=small_gpt, wrap=dict(prefetch_depth=2)),
        "no_sync": dict(build=small_gpt, wrap=dict(prefetch_depth=1), micro_batches=2),
        "tied_frozen_twice_checkpointed": dict(build=lambda: FeatureNet(vocab=512, d=64, hidden=96),
                                               wrap=dict(prefetch_depth=1)),
        "bf16_gather_fp32_reduce": dict(build=small_gpt, wrap=dict(prefetch_depth=1, mixed_precision=bf16()),
                                        param_dtype=torch.bfloat16),
        "no_reshard_after_forward": dict(build=small_gpt, wrap=dict(prefetch_depth=1, reshard_after_forward=False)),
        "odd_shapes_bf16": dict(build=OddNet, wrap=dict(prefetch_depth=1, mixed_precision=bf16()),
                                param_dtype=torch.bfloat16),
        "compiled": dict(build=lambda: small_gpt(layers=2), wrap=dict(prefetch_depth=1, compile=True)),
    }


def token_batches(device: torch.device, steps: int, vocab: int = 512, shape: tuple[int, int] = (8, 64)
                  ) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """`steps` (inputs, targets) pairs of random tokens, the same on every run."""
    gen = torch.Generator().manual_seed(1)
    return [(torch.randint(0, vocab, shape, generator=gen).to(device),
             torch.randint(0, vocab, shape, generator=gen).to(device)) for _ in range(steps)]


def parity_steps(device: torch.device) -> int:
    return PARITY_STEPS if device.type == "cuda" else REHEARSAL_STEPS


def train_sharded(config: dict, device: torch.device, injection: Optional[Injection],
                  steps: Optional[int] = None) -> dict:
    """`steps` (default `parity_steps`) steps of ShardedModule under `injection`: losses,
    allocated bytes per step, final state, and the collectives its step records hold. With
    config["optimizer"] (parameters -> optimizer; SGD without) the optimizer is linked, as a job
    links its own; config["after_backward"](model) runs before each optimizer step."""
    from overlap import ShardedModule

    torch.manual_seed(0)
    with collectives_issued_alone():
        model = ShardedModule(config["build"](), **config["wrap"])
    if "optimizer" in config:
        optimizer = config["optimizer"](model.parameters())
        model.optimizer_link.link(optimizer)
    else:
        optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    micro = config.get("micro_batches", 1)
    losses, allocated = [], []
    records: list = []            # the step records `model` delivers from now on
    model.scheduler.step_end_callbacks.append(lambda scheduler: records.append(scheduler.last_step))
    with injection.active() if injection is not None else contextlib.nullcontext():
        for idx, targets in token_batches(device, steps or parity_steps(device)):
            total = _backward_in_parts(model, idx, targets, micro, model.no_sync)
            config.get("after_backward", lambda model: None)(model)
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
