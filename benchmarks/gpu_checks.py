"""The checks of benchmarks/gpu_check.sh that run Python, on one CUDA device, each printing
`PASS`, `FAIL` or `SKIP` with its name and figures, newest code first:

  offload       offload="cpu" against "none" on a small GPT, fp32 and bf16 gathers (equal
                losses, parameters and gradients pinned on the host); the offload copies'
                bandwidth (host->device as a gather's source, device->host as a reduced
                gradient going home) against a plain pinned copy of the same 256 MiB; and the
                share of each copy hidden when it runs beside matmuls on the compute stream;
                offload="disk" against "none" with bf16 gathers and overlap.optim.AdamW
                (losses and fp32 masters close, parameters and gradients pinned on the host,
                the gathered 16-bit shards on the GPU), and the bandwidth of the 16-bit
                shard's refresh, bucket by bucket, against one plain pinned copy
  compressed    ShardedModule with NCCL at world size 1 uncompressed, int8 and int8-int4:
                finite, losses close to uncompressed, bit-identical with delays injected on
                the side streams, every collective seen by the injection (the compressed
                gathers too), gathers compressed on the wire
  report_timing the step record's time of the collectives in flight (CUDA clock) against the
                side-stream kernels CUPTI saw (torch.profiler)
  sync_free     a few steady-state steps under `torch.cuda.set_sync_debug_mode("error")`,
                uncompressed and int8-int4, and the host waits that mode does not flag
  hybrid, hpz   hybrid sharding with a replicate group of one rank, and hpZ with a node group
                of one, collectives issued as with more ranks: the replicas' all-reduce on its
                own stream behind each reduce-scatter, and backward's re-gather from the node
                copy, under delays on every collective's stream and poisoned frees: identical
                to the plain run, equal to the unsharded model
  slow_link     a slow link emulated on one GPU: a sleep kernel sized to bytes / bandwidth
                on the stream of each collective, for ShardedModule and FSDP2; the share of
                the injected time that the step time exposes, against the overlap report
  device        `init_process_group()`, "cpu:gloo,cuda:nccl" and "nccl" each put the shards on
                the GPU, and a step runs there
  parity        seven configurations (among them odd parameter sizes and compile=True), each trained plainly and with delays injected on the side
                streams (`torch.cuda._sleep` before and after every collective) and every freed
                gathered buffer NaN-filled before its storage is released: bit-identical runs,
                finite, equal to the unsharded model, allocated memory flat from step 2 on
  sanitized     two steps of one parity configuration under TORCH_CUDA_SANITIZER=1
  large_index   every kernel backend on tensors past 2**31 elements against torch
  overhead      step time and peak memory of ShardedModule, FSDP2 and the plain model at world
                size 1 on a ~1B-parameter GPT in bf16

Step times come from CUDA events read once after the timed steps, never from a sync per step:
a loop that syncs every step lets the host never run ahead, which hides any sync the code
under test makes itself.

Without a GPU every check says SKIP and why. `--rehearse` runs the same code on the CPU with
gloo and small sizes (no delays, no timing verdicts): a test of this script, not of the GPU
paths.

    python benchmarks/gpu_checks.py [--only compressed,sync_free] [--rehearse]
"""
from __future__ import annotations

import argparse
import contextlib
import copy
import datetime
import json
import math
import os
import socket
import statistics
import sys
import tempfile
import threading
import time
import traceback
from collections import Counter
from typing import Any, Callable, Iterator, Optional, Sequence

import torch
import torch.distributed as dist

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "tests"))        # tests/models.py: the awkward model

CHECKS = ("offload", "compressed", "report_timing", "sync_free", "hybrid", "hpz", "slow_link", "device", "parity",
          "sanitized", "large_index", "overhead")
# torch.cuda._sleep cycles injected around each side-stream collective: ~0.5 ms at ~2 GHz.
SLEEP_CYCLES = 1_000_000
PARITY_STEPS = 5
REHEARSAL_STEPS = 3           # of the parity and compressed runs, on CPU
OVERHEAD_STEPS, OVERHEAD_WARMUP = 8, 3
# Losses of compressed training against uncompressed, per step: the CPU suite measures within
# 0.55% (tests/test_compression.py); this checks the GPU path, not the codec's accuracy.
COMPRESSED_LOSS_RTOL = 0.02
SYNC_WARMUP, SYNC_STEPS = 3, 3
# The emulated link moves ShardedModule's bytes of a step in this share of its uninjected step.
LINK_LOAD = 0.5
SLOW_WARMUP, SLOW_STEPS = 4, 10
# The report's added exposed time must match the step time's within this share of the
# injected time (plus EXPOSED_SLACK_S): the report brackets waits with events on the compute
# stream, so a few µs per wait of hand-over between streams show on one side only.
EXPOSED_TOLERANCE, EXPOSED_SLACK_S = 0.25, 0.5e-3


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


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def one_rank_group(backend: Optional[str]) -> Iterator[None]:
    """A process group of this process alone, as torchrun would set it up; `backend=None` is
    `init_process_group()` with no backend named."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(_free_port()), RANK="0", WORLD_SIZE="1",
                      LOCAL_RANK="0", LOCAL_WORLD_SIZE="1")
    kwargs = {} if backend is None else {"backend": backend}
    dist.init_process_group(timeout=datetime.timedelta(seconds=120), **kwargs)
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


def _device(rehearse: bool) -> torch.device:
    return torch.device("cpu") if rehearse else torch.device("cuda", 0)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _finite(values: Sequence[float]) -> bool:
    return all(math.isfinite(v) for v in values)


def _bf16():
    from overlap import MixedPrecision

    return MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)


def _lm_step(model: torch.nn.Module, optimizer: torch.optim.Optimizer, data: list[torch.Tensor],
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


# ---- injection into the collectives ------------------------------------------------------------

def _collective_functions() -> list[tuple[Any, str, str]]:
    """(owner, attribute, kind) of every function through which ShardedModule and FSDP2 issue
    a collective, looked up on its owner at each call."""
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


@contextlib.contextmanager
def collectives_issued_alone() -> Iterator[None]:
    """ShardedModules built inside run their gathers and reductions as collectives (on their
    streams, into buffers they free) at world size 1 too, as with more ranks, for the checks
    to delay, time and poison; by default one rank copies in place or gathers nothing."""
    from overlap.runtime.collectives import Collectives

    saved = Collectives.local_when_alone
    Collectives.local_when_alone = False
    try:
        yield
    finally:
        Collectives.local_when_alone = saved


class Injection:
    """While `active()`: every collective ShardedModule or FSDP2 issues is counted by kind with
    its largest buffer's bytes; on CUDA `cycles(kind, nbytes)` of `torch.cuda._sleep` run on
    the current stream (the collective's own side stream) before it, and with `after` once
    more after it (delaying the completion work queued behind it); with `poison` every freed
    gathered buffer is NaN-filled before its storage goes back to the allocator. A consumer
    that does not wait for a collective, or a buffer freed while a stream still reads it,
    then shows as a different or non-finite result."""

    def __init__(self, cycles: Optional[Callable[[str, int], int]] = None, after: bool = False,
                 poison: bool = False, all_reduce: bool = False) -> None:
        self.cycles = cycles
        self.after = after
        self.poison = poison
        # `dist.all_reduce` too: hybrid sharding's all-reduce across replicas, on a stream of
        # its own (the step's norm and flags all-reduces are counted too, and delayed where
        # their tensors are on the GPU).
        self.all_reduce = all_reduce
        self.calls: Counter = Counter()
        self.nbytes: Counter = Counter()
        self.slept: Counter = Counter()       # sleep cycles injected, by kind
        self._inside = threading.local()      # one collective reached through another counts once

    def reset(self) -> None:
        self.calls.clear()
        self.nbytes.clear()
        self.slept.clear()

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
        """`HostTier.on`, with the injected delay queued first on the copy's stream (the
        download stream of reduced gradients, the all-gather stream of uploads): a copy whose
        consumer does not wait for its event then reads or frees too early."""
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
        saved = [(owner, name, getattr(owner, name)) for owner, name, _ in targets]
        saved.append((HostTier, "on", HostTier.on))
        free = FlatGroup.free

        def poisoned_free(group: FlatGroup) -> None:
            if group.is_allocated:
                with torch.no_grad(), torch.autograd._unsafe_preserve_version_counter(group.full):
                    group.full.detach().fill_(float("nan"))
            free(group)

        for owner, name, kind in targets:
            setattr(owner, name, self._wrap(kind, getattr(owner, name)))
        HostTier.on = self._delayed_copies(HostTier.on)
        if self.poison:
            FlatGroup.free = poisoned_free
        try:
            yield self
        finally:
            for owner, name, fn in saved:
                setattr(owner, name, fn)
            FlatGroup.free = free


def _race_injection(rehearse: bool) -> Injection:
    """Delays before and after every collective, all-reduces included, and before every
    offload copy on its stream (none on CPU), and poisoned frees."""
    return Injection(cycles=None if rehearse else (lambda kind, nbytes: SLEEP_CYCLES), after=True, poison=True,
                     all_reduce=True)


# ---- models and training -------------------------------------------------------------------------

def _gpt(layers: int = 4, width: int = 128):
    from overlap.models import GPT, GPTConfig

    return GPT(GPTConfig(vocab_size=512, block_size=64, n_layer=layers, n_head=4, n_embd=width))


def _feature_net():
    from models import FeatureNet

    return FeatureNet(vocab=512, d=64, hidden=96)


class OddNet(torch.nn.Module):
    """A language model whose parameters have odd sizes (37, 29, 7 wide; 1-D pieces before
    matrices): flat offsets and shard boundaries that fall off 16-byte alignment unless the
    layout rounds them."""

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


def _parity_configs() -> dict[str, dict]:
    return {
        "gpt_fp32_depth2": dict(build=_gpt, wrap=dict(prefetch_depth=2)),
        "no_sync": dict(build=_gpt, wrap=dict(prefetch_depth=1), micro_batches=2),
        "tied_frozen_twice_checkpointed": dict(build=_feature_net, wrap=dict(prefetch_depth=1)),
        "bf16_gather_fp32_reduce": dict(build=_gpt, wrap=dict(prefetch_depth=1, mixed_precision=_bf16()),
                                        param_dtype=torch.bfloat16),
        "no_reshard_after_forward": dict(build=_gpt, wrap=dict(prefetch_depth=1, reshard_after_forward=False)),
        "odd_shapes_bf16": dict(build=OddNet, wrap=dict(prefetch_depth=1, mixed_precision=_bf16()),
                                param_dtype=torch.bfloat16),
        "compiled": dict(build=lambda: _gpt(layers=2), wrap=dict(prefetch_depth=1, compile=True)),
    }


def _batches(device: torch.device, steps: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    gen = torch.Generator().manual_seed(1)
    return [(torch.randint(0, 512, (8, 64), generator=gen).to(device),
             torch.randint(0, 512, (8, 64), generator=gen).to(device)) for _ in range(steps)]


def _parity_steps(device: torch.device) -> int:
    return PARITY_STEPS if device.type == "cuda" else REHEARSAL_STEPS


def _train_sharded(config: dict, device: torch.device, injection: Optional[Injection],
                   steps: Optional[int] = None) -> dict:
    """`steps` (default `_parity_steps`) steps of ShardedModule under `injection`; its losses, allocated bytes after
    each step, final state, and the collectives its step records hold (by kind, and the
    gathers sent compressed)."""
    from overlap import ShardedModule

    torch.manual_seed(0)
    with collectives_issued_alone():
        model = ShardedModule(config["build"](), **config["wrap"])
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    micro = config.get("micro_batches", 1)
    losses, allocated = [], []
    records = _delivered_records(model)
    with injection.active() if injection is not None else contextlib.nullcontext():
        for idx, targets in _batches(device, steps or _parity_steps(device)):
            total = torch.zeros((), device=device)
            for k in range(micro):
                part = slice(k * idx.shape[0] // micro, (k + 1) * idx.shape[0] // micro)
                with model.no_sync() if k < micro - 1 else contextlib.nullcontext():
                    loss = model(idx[part], targets[part]) / micro
                    loss.backward()
                total += loss.detach().float()
            optimizer.step()
            optimizer.zero_grad()
            _sync(device)
            losses.append(total.item())
            allocated.append(torch.cuda.memory_allocated(device) if device.type == "cuda" else 0)
        _flush(model)
    recorded: Counter = Counter()
    for c in (c for record in records for c in record.collectives):
        recorded[c.kind] += 1
        recorded[f"{c.kind} compressed"] += c.uncompressed_nbytes is not None
    if [r.step for r in records] != list(range(1, len(losses) + 1)):
        raise AssertionError(f"step records of steps {[r.step for r in records]} after {len(losses)} steps")
    return dict(losses=losses, allocated=allocated, state=model.full_state_dict(), recorded=recorded)


def _delivered_records(model) -> list:
    """The step records `model` delivers from now on, in order (see `_flush`)."""
    records: list = []
    model.scheduler.step_end_callbacks.append(lambda scheduler: records.append(scheduler.last_step))
    return records


def _flush(model) -> None:
    """Deliver the last step's record: on CUDA (and in a rehearsal, see [Note: the late host
    clock] in overlap/runtime/timing.py) each record comes when the next step closes."""
    model.scheduler.steps.flush(model.scheduler.order)


def _train_plain(config: dict, device: torch.device) -> dict:
    """The unsharded model: fp32 master weights; with a 16-bit `param_dtype` each step
    computes with a copy in that dtype and steps the master with its gradients in fp32, as
    ShardedModule's mixed precision does."""
    torch.manual_seed(0)
    master = config["build"]().to(device)
    optimizer = torch.optim.SGD(master.parameters(), lr=0.05, momentum=0.9)
    dtype = config.get("param_dtype")
    micro = config.get("micro_batches", 1)
    losses = []
    for idx, targets in _batches(device, _parity_steps(device)):
        model = master if dtype is None else copy.deepcopy(master).to(dtype)
        total = torch.zeros((), device=device)
        for k in range(micro):
            part = slice(k * idx.shape[0] // micro, (k + 1) * idx.shape[0] // micro)
            loss = model(idx[part], targets[part]) / micro
            loss.backward()
            total += loss.detach().float()
        if dtype is not None:
            for ours, theirs in zip(master.parameters(), model.parameters()):
                ours.grad = None if theirs.grad is None else theirs.grad.float()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(total.item())
    return dict(losses=losses, state={k: v.detach().cpu() for k, v in master.state_dict().items()})


def _identical(a: dict, b: dict) -> bool:
    return a["losses"] == b["losses"] and all(torch.equal(a["state"][k], b["state"][k]) for k in a["state"])


def _worst_parameter(run: dict, reference: dict, rtol: float, atol: float) -> float:
    """The largest |run - reference| of any parameter element, in units of atol + rtol * |reference|
    (at most 1.0: every element within the tolerance)."""
    return max(float(((run["state"][k].double() - v.double()).abs() / (atol + rtol * v.double().abs())).max())
               for k, v in reference["state"].items() if v.is_floating_point() and v.numel())


def _finite_run(run: dict) -> bool:
    return _finite(run["losses"]) and all(bool(t.isfinite().all()) for t in run["state"].values()
                                          if t.is_floating_point())


# ---- compressed collectives at world size 1 ---------------------------------------------------------

def check_compressed(checks: Checks, rehearse: bool) -> None:
    from overlap.base.choices import COMPRESSION_MODES

    device = _device(rehearse)
    uncompressed: Optional[dict] = None        # losses and gathered bytes of mode "none"
    with one_rank_on(device), deterministic():
        for mode in COMPRESSION_MODES:
            name = f"compressed[{mode}]"
            config = dict(build=_gpt, wrap=dict(prefetch_depth=1, compression=mode))
            try:
                plain = _train_sharded(config, device, None)
                injection = _race_injection(rehearse)
                poked = _train_sharded(config, device, injection)
            except Exception as exc:  # noqa: BLE001 - a check that raises is a failed check
                checks.error(name, exc)
                continue
            if mode == "none":
                uncompressed = dict(losses=plain["losses"], gather_bytes=injection.nbytes["all_gather"])
            recorded, seen = poked["recorded"], injection.calls
            gathers, reductions = recorded["all_gather"], recorded["reduce_scatter"]
            reductions_seen = seen["reduce_scatter"] + seen["all_to_all"]
            every_one_seen = seen["all_gather"] == gathers > 0 and reductions_seen == reductions
            coded = recorded["all_gather compressed"]
            coded_ok = coded == (0 if mode == "none" else gathers)
            if uncompressed is None:
                worst, bytes_share = math.inf, math.nan
            else:
                worst = max(abs(a - b) / abs(b) for a, b in zip(plain["losses"], uncompressed["losses"]))
                bytes_share = injection.nbytes["all_gather"] / max(uncompressed["gather_bytes"], 1)
            identical, finite = _identical(plain, poked), _finite_run(poked) and _finite_run(plain)
            ok = identical and finite and every_one_seen and coded_ok and worst <= COMPRESSED_LOSS_RTOL
            checks.verdict(name, ok,
                           f"plain == injected: {identical}; finite: {finite}; the injection saw {seen['all_gather']}"
                           f"/{gathers} gathers and {reductions_seen}/{reductions} reductions of the step records; "
                           f"{coded}/{gathers} gathers compressed on the wire, gathered bytes {bytes_share:.3f} of "
                           f"uncompressed; losses vs uncompressed within {worst:.3%} (pass at <= "
                           f"{COMPRESSED_LOSS_RTOL:.0%}): {['%.5f' % v for v in plain['losses']]}")


# ---- report timing against CUPTI ----------------------------------------------------------------

def check_report_timing(checks: Checks, rehearse: bool) -> None:
    if rehearse:
        checks.report("SKIP", "report_timing", "CUDA events against CUPTI kernel times: nothing to compare on CPU")
        return
    from torch.profiler import ProfilerActivity, profile

    from overlap import ShardedModule
    from overlap.base.intervals import length, union
    from overlap.observe.report import analyse_step

    device = _device(False)
    with one_rank_on(device):
        torch.manual_seed(0)
        with collectives_issued_alone():                 # one device: the collectives to time
            model = ShardedModule(_gpt(layers=6, width=1024), prefetch_depth=1, bucket_mb=1e-3)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
        batches = _batches(device, 5)

        def step(batch) -> None:
            model(*batch).backward()
            optimizer.step()
            optimizer.zero_grad()

        for batch in batches[:4]:
            step(batch)
        torch.cuda.synchronize()
        with tempfile.TemporaryDirectory() as scratch:
            with profile(activities=[ProfilerActivity.CUDA]) as prof:
                step(batches[4])
                torch.cuda.synchronize()
            _flush(model)                                # the record of the profiled step
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
    # The compute stream does the most work; the collectives' work runs on every other one:
    # the all-gather and reduce-scatter streams (casts, accumulation) and NCCL's own.
    compute_stream = max(busy, key=busy.get)
    side = [(e["ts"] * 1e-6, (e["ts"] + e["dur"]) * 1e-6) for e in device_work
            if e["args"].get("stream") != compute_stream]
    cupti_s = length(union(side))
    recorded_s = length(union(c.in_flight for c in record.collectives))
    stats = analyse_step(record)
    # Events bracket each collective on its stream, so each adds a few µs of hand-over
    # between streams that no kernel shows; at world size 1 NCCL's work is a local copy.
    allowance = 0.25 * cupti_s + 30e-6 * len(record.collectives)
    ok = bool(side) and abs(recorded_s - cupti_s) <= allowance
    checks.verdict("report_timing", ok,
                   f"{len(record.collectives)} collectives in flight {recorded_s * 1e3:.3f} ms by the step record's "
                   f"CUDA events vs {cupti_s * 1e3:.3f} ms of device work on the side streams by CUPTI "
                   f"({len(side)} kernels and copies on {len(busy) - 1} streams; pass within "
                   f"{allowance * 1e3:.3f} ms); report: communication {stats.comm_s * 1e3:.3f} ms, "
                   f"{100 * stats.hidden_fraction:.0f}% hidden, compute {stats.compute_s * 1e3:.2f} ms of a "
                   f"{stats.span_s * 1e3:.2f} ms step")


# ---- no host syncs in steady state ----------------------------------------------------------------

def _where(exc: BaseException) -> str:
    """Where a flagged sync was made: the innermost frame in this repository's library code
    (runtime, kernels, model) and the innermost frame of all."""
    frames = traceback.extract_tb(exc.__traceback__)
    if not frames:
        return "no traceback"
    ours = [f for f in frames if f.filename.startswith(ROOT) and os.path.basename(f.filename) != "gpu_checks.py"]

    def place(frame: traceback.FrameSummary) -> str:
        path = os.path.relpath(frame.filename, ROOT) if frame.filename.startswith(ROOT) else frame.filename
        return f"{path}:{frame.lineno} in {frame.name}"

    inner = place(frames[-1])
    return f"{place(ours[-1])} (innermost: {inner})" if ours else inner


@contextlib.contextmanager
def counted_host_waits() -> Iterator[Counter]:
    """Count, by caller, the host waits `set_sync_debug_mode` does not flag: an event's or a
    stream's `synchronize()`, `torch.cuda.synchronize()` and the runtime's polling waits."""
    seen: Counter = Counter()

    def counting(label: str, fn: Callable) -> Callable:
        def run(*args: Any, **kwargs: Any) -> Any:
            caller = sys._getframe(1)
            path = caller.f_code.co_filename
            path = os.path.relpath(path, ROOT) if path.startswith(ROOT) else os.path.basename(path)
            seen[f"{label} at {path}:{caller.f_lineno}"] += 1
            return fn(*args, **kwargs)
        return run

    from overlap.runtime import step_counter, timing

    # `polling` makes the host wait for a CUDA event by querying it: the step record's read
    # of a step not yet complete (overlap/runtime/timing.py).
    targets = [(torch.cuda.Event, "synchronize", "Event.synchronize"),
               (torch.cuda.Stream, "synchronize", "Stream.synchronize"),
               (torch.cuda, "synchronize", "torch.cuda.synchronize"),
               (timing, "polling", "polling wait"), (step_counter, "polling", "polling wait")]
    saved = [(owner, name, getattr(owner, name)) for owner, name, _ in targets]
    for owner, name, label in targets:
        setattr(owner, name, counting(label, getattr(owner, name)))
    try:
        yield seen
    finally:
        for owner, name, fn in saved:
            setattr(owner, name, fn)


@contextlib.contextmanager
def _sync_debug(device: torch.device) -> Iterator[None]:
    """Every synchronizing CUDA call raises (nothing on CPU, which has no such mode)."""
    if device.type != "cuda":
        yield
        return
    torch.cuda.set_sync_debug_mode("error")
    try:
        yield
    finally:
        torch.cuda.set_sync_debug_mode("default")


def check_sync_free(checks: Checks, rehearse: bool) -> None:
    """Steady-state training steps (inputs already on the device, losses kept on it) make no
    call that synchronizes the host with the device, except the waits the runtime makes on
    purpose, which are counted and printed."""
    from overlap import ShardedModule

    device = _device(rehearse)
    with one_rank_on(device):
        for mode in ("none", "int8-int4"):
            name = f"sync_free[{mode}]"
            try:
                torch.manual_seed(0)
                # The side streams' gathers and reductions, as with more ranks: their waits are
                # what this counts.
                with collectives_issued_alone():
                    model = ShardedModule(_gpt(), prefetch_depth=1, mixed_precision=_bf16(), compression=mode)
                optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
                batches = _batches(device, SYNC_WARMUP + SYNC_STEPS)

                def step(batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
                    loss = model(*batch)
                    loss.backward()
                    optimizer.step()
                    optimizer.zero_grad()
                    return loss.detach()

                for batch in batches[:SYNC_WARMUP]:
                    step(batch)
                _sync(device)
                with counted_host_waits() as waits, _sync_debug(device):
                    losses = [step(batch) for batch in batches[SYNC_WARMUP:]]
                finite = _finite([float(loss) for loss in losses])
            except RuntimeError as exc:
                if "synchronizing" not in str(exc):
                    checks.error(name, exc)
                    continue
                checks.report("FAIL", name, f"a host sync in a steady-state step: {exc}; made at {_where(exc)}")
                continue
            except Exception as exc:  # noqa: BLE001 - a check that raises is a failed check
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


# ---- sharding over two levels ----------------------------------------------------------------------

@contextlib.contextmanager
def second_level_of_one(kind: str, device: torch.device) -> Iterator[None]:
    """ShardedModules built inside shard over every rank with a second group of this one rank:
    hybrid sharding's replicate group (`kind="hybrid"`: each reduced gradient shard is
    all-reduced across the replicas on a stream of its own, chained behind its reduce-scatter)
    or hpZ's node group (`kind="hpz"`: forward keeps a node copy, backward re-gathers from it
    over the node). With one rank `resolve_sharding` builds neither (nothing to replicate, the
    node is every rank); with collectives issued as if not alone, the group of one runs their
    streams, events and buffers as several nodes would."""
    from overlap.control import startup
    from overlap.runtime.mesh import ShardingGroups, connect

    second = dist.new_group([0])
    connect(second, device.type)
    resolve = startup.resolve_sharding

    def with_second_level(*args: Any, **kwargs: Any) -> ShardingGroups:
        groups = resolve(*args, **kwargs)
        if kind == "hybrid":
            return ShardingGroups(groups.shard, second)
        return ShardingGroups(groups.shard, None, second)

    startup.resolve_sharding = with_second_level
    try:
        yield
    finally:
        startup.resolve_sharding = resolve


def _second_level_parity(checks: Checks, rehearse: bool, kind: str) -> None:
    """Parity of a GPT sharded as `kind` over one rank and a group of one (see
    `second_level_of_one`), trained plainly and under the race injection (delays on every
    collective's stream, the all-reduce's included; poisoned frees): bit-identical, finite,
    equal to the unsharded model, and the second level's collectives issued every step."""
    from overlap.runtime.node_copy import NodeCopy

    device = _device(rehearse)
    config = _parity_configs()["gpt_fp32_depth2"]
    # What only the second level issues: the all-reduce across replicas, or backward's
    # gathers from the node copy (in place of gathers over every rank), counted here.
    from_copies = Counter()
    gather = NodeCopy.gather

    def counted_gather(copy: NodeCopy, *args: Any, **kwargs: Any) -> Any:
        from_copies["gathers"] += 1
        from_copies["from the node copy"] += copy.secondary is not None
        return gather(copy, *args, **kwargs)

    NodeCopy.gather = counted_gather
    try:
        with one_rank_on(device), deterministic(), second_level_of_one(kind, device):
            plain = _train_sharded(config, device, None)
            injection = _race_injection(rehearse)
            from_copies.clear()
            poked = _train_sharded(config, device, injection)
        reference = _train_plain(config, device)
    except Exception as exc:  # noqa: BLE001 - a check that raises is a failed check
        checks.error(kind, exc)
        return
    finally:
        NodeCopy.gather = gather
    identical, finite = _identical(plain, poked), _finite_run(poked)
    worst = _worst_parameter(plain, reference, rtol=1e-4, atol=1e-5)
    steps = len(plain["losses"])
    if kind == "hybrid":
        extra = poked["recorded"]["all_reduce"]
        issued = extra >= steps and injection.calls["all_reduce"] >= extra
        what = f"{extra} all-reduces across replicas in {steps} steps ({injection.calls['all_reduce']} seen by the " \
               f"injection)"
    else:
        extra = from_copies["from the node copy"]
        issued = extra >= steps
        what = f"{extra} of {from_copies['gathers']} gathers from the node copy in {steps} steps"
    ok = identical and finite and worst <= 1.0 and issued
    checks.verdict(kind, ok, f"{what}; plain == injected: {identical}; finite: {finite}; worst parameter against "
                             f"the unsharded model at {worst:.2f} of rtol 1e-4 + atol 1e-5; "
                             f"losses {['%.5f' % v for v in plain['losses']]}")


def check_hybrid(checks: Checks, rehearse: bool) -> None:
    _second_level_parity(checks, rehearse, "hybrid")


def check_hpz(checks: Checks, rehearse: bool) -> None:
    _second_level_parity(checks, rehearse, "hpz")


# ---- a slow link emulated on one GPU -----------------------------------------------------------------

def sleep_rate(device: torch.device) -> float:
    """`torch.cuda._sleep` cycles per second, measured: it counts SM clock cycles, and the
    clock boosts."""
    cycles = 20_000_000
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda._sleep(cycles // 10)
    start.record()
    torch.cuda._sleep(cycles)
    end.record()
    end.synchronize()
    return cycles / (start.elapsed_time(end) / 1e3)


def _gpt_config(rehearse: bool, large: bool):
    from overlap.models import GPTConfig

    if rehearse:
        return GPTConfig(vocab_size=512, block_size=64, n_layer=2, n_head=4, n_embd=64)
    if large:
        return GPTConfig(vocab_size=32768, block_size=1024, n_layer=18, n_head=16, n_embd=2048)
    return GPTConfig(vocab_size=8192, block_size=512, n_layer=8, n_head=8, n_embd=1024)


def _wrapped(kind: str, config, device: torch.device, prefetch_depth: Optional[int] = None
             ) -> tuple[torch.nn.Module, Callable[[], contextlib.AbstractContextManager]]:
    """The GPT of `config` built in place on `device` (seconds, not a minute on the host),
    wrapped as `kind` ("overlap", "fsdp2" or "plain"), all computing in bf16 with fp32
    master weights; and the context each forward runs in."""
    from overlap import ShardedModule
    from overlap.models import GPT, Block

    torch.manual_seed(0)
    with torch.device(device):
        model = GPT(config)
    if kind == "overlap":
        wrapped = ShardedModule(model, unit_types=(Block,), mixed_precision=_bf16(), prefetch_depth=prefetch_depth)
        return wrapped, contextlib.nullcontext
    if kind == "fsdp2":
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

        policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        for block in model.blocks:
            fully_shard(block, mp_policy=policy)
        return fully_shard(model, mp_policy=policy), contextlib.nullcontext
    return model, lambda: torch.autocast(device.type, dtype=torch.bfloat16)


def _emulated_run(kind: str, config, device: torch.device, injection: Injection, warmup: int, steps: int) -> dict:
    """`warmup` + `steps` SGD steps of `kind` under `injection`, counted from the window on."""
    with collectives_issued_alone():                     # one device: the collectives to delay
        model, context = _wrapped(kind, config, device, prefetch_depth=1 if kind == "overlap" else None)
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-3, momentum=0.9)
    gen = torch.Generator().manual_seed(0)
    data = [torch.randint(0, config.vocab_size, (8, config.block_size), generator=gen).to(device)
            for _ in range(warmup + steps)]

    step = _lm_step(model, optimizer, data, context)

    with injection.active():
        seconds, losses = timed_steps(step, device, warmup, steps, at_window=injection.reset)
    result = dict(step_s=statistics.median(seconds), finite=_finite(losses), calls=Counter(injection.calls),
                  bytes_per_step=sum(injection.nbytes.values()) / steps,
                  slept_per_step={k: v / steps for k, v in injection.slept.items()})
    if kind == "overlap":
        _flush(model)                                    # the window's last step
        window = model.overlap_report().steps[-steps:]
        result["window"] = [s.step for s in window]
        result["hidden"] = sum(s.hidden_s for s in window) / max(sum(s.comm_s for s in window), 1e-12)
        result["exposed_s"] = statistics.mean(s.exposed_s for s in window)
    del model, optimizer
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return result


def check_slow_link(checks: Checks, rehearse: bool) -> None:
    """Each collective's bytes over an emulated link of one bandwidth, as a sleep on its stream
    before it: the share of the injected time that shows in the step time, for ShardedModule
    (against what its overlap report says was exposed) and for FSDP2 where it communicates."""
    device = _device(rehearse)
    config = _gpt_config(rehearse, large=False)
    warmup, steps = (2, 3) if rehearse else (SLOW_WARMUP, SLOW_STEPS)
    try:
        with one_rank_on(device):
            rate = sleep_rate(device) if device.type == "cuda" else 0.0
            runs = {("overlap", "plain"): _emulated_run("overlap", config, device, Injection(), warmup, steps)}
            base = runs[("overlap", "plain")]
            bandwidth = base["bytes_per_step"] / (LINK_LOAD * base["step_s"])    # bytes per second

            def cycles(kind: str, nbytes: int) -> int:
                return round(nbytes / bandwidth * rate)

            runs[("overlap", "slow")] = _emulated_run("overlap", config, device, Injection(cycles), warmup, steps)
            runs[("fsdp2", "plain")] = _emulated_run("fsdp2", config, device, Injection(), warmup, steps)
            # Recent torch gives FSDP2 a path for one rank that copies its shard in place and
            # calls no collective: then there is nothing to delay.
            if sum(runs[("fsdp2", "plain")]["calls"].values()):
                runs[("fsdp2", "slow")] = _emulated_run("fsdp2", config, device, Injection(cycles), warmup, steps)
    except Exception as exc:  # noqa: BLE001 - a check that raises is a failed check
        checks.error("slow_link", exc)
        return
    print(f"      GPT {config.num_params / 1e6:.1f}M parameters, batch 8 x {config.block_size}, bf16; emulated link "
          f"{bandwidth / 1e9:.3f} GB/s (ShardedModule's {base['bytes_per_step'] / 2**20:.1f} MB/step in "
          f"{LINK_LOAD:.0%} of its {base['step_s'] * 1e3:.1f} ms step)"
          + (f", sleep kernel at {rate / 1e9:.2f} GHz" if rate else ", no sleep kernel on CPU"))
    exposed = {}
    for kind, label in (("overlap", "ShardedModule"), ("fsdp2", "FSDP2")):
        plain, slow = runs[(kind, "plain")], runs.get((kind, "slow"))
        if slow is None:
            print(f"      {label:<14} step {plain['step_s'] * 1e3:7.1f} ms; no collective at world size 1 "
                  "(it copies its shard in place): nothing to delay")
            continue
        injected_s = sum(slow["slept_per_step"].values()) / rate if rate else 0.0
        exposed[kind] = (slow["step_s"] - plain["step_s"]) / injected_s if injected_s else math.nan
        parts = ", ".join(f"{k} {v / rate * 1e3:.2f}" for k, v in slow["slept_per_step"].items() if v) if rate else ""
        print(f"      {label:<14} step {plain['step_s'] * 1e3:7.1f} -> {slow['step_s'] * 1e3:7.1f} ms; injected "
              f"{injected_s * 1e3:.2f} ms/step ({parts or 'nothing'}); collectives per window {dict(slow['calls'])}; "
              f"exposed {exposed[kind]:.0%} of the injected time")
    fsdp = (f"FSDP2 exposed {exposed['fsdp2']:.0%}" if "fsdp2" in exposed else
            "FSDP2 calls no collective at world size 1, so no figure for it")
    finite = all(run["finite"] for run in runs.values())
    ours_plain, ours_slow = runs[("overlap", "plain")], runs[("overlap", "slow")]
    expected = list(range(warmup + 1, warmup + steps + 1))
    if ours_plain["window"] != expected or ours_slow["window"] != expected:
        checks.report("FAIL", "slow_link", f"the report's window covers steps {ours_slow['window']}, the timed "
                                           f"steps are {expected}")
        return
    if not finite or not ours_slow["calls"]["all_gather"]:
        checks.report("FAIL", "slow_link", f"finite: {finite}; the injection saw {dict(ours_slow['calls'])} of "
                                           "ShardedModule's collectives")
        return
    if not rate:
        checks.report("SKIP", "slow_link", f"no sleep kernel on CPU, so nothing was injected; the injection saw "
                                           f"ShardedModule's {dict(ours_slow['calls'])} per window; {fsdp}")
        return
    injected_s = sum(ours_slow["slept_per_step"].values()) / rate
    added_s = ours_slow["step_s"] - ours_plain["step_s"]
    report_added_s = ours_slow["exposed_s"] - ours_plain["exposed_s"]
    ok = abs(added_s - report_added_s) <= EXPOSED_TOLERANCE * injected_s + EXPOSED_SLACK_S
    checks.verdict("slow_link", ok,
                   f"ShardedModule exposed {exposed['overlap']:.0%} of the injected communication by step time "
                   f"(+{added_s * 1e3:.2f} ms); its report: {ours_slow['hidden']:.0%} hidden, exposed time "
                   f"+{report_added_s * 1e3:.2f} ms (pass within {EXPOSED_TOLERANCE:.0%} of the injected "
                   f"{injected_s * 1e3:.2f} ms + {EXPOSED_SLACK_S * 1e3:.1f} ms); {fsdp}")


# ---- device selection -------------------------------------------------------------------------

def check_device(checks: Checks, rehearse: bool) -> None:
    from overlap import ShardedModule

    forms = {"init_process_group()": None, "cpu:gloo,cuda:nccl": "cpu:gloo,cuda:nccl", "nccl": "nccl"}
    if rehearse:
        forms = {"init_process_group()": None, "gloo": "gloo"}
    expected = _device(rehearse)
    for label, backend in forms.items():
        try:
            with one_rank_group(backend):
                if expected.type == "cuda":
                    torch.cuda.set_device(expected)
                model = ShardedModule(torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.Linear(64, 8)))
                out = model(torch.randn(4, 64, device=expected))
                out.sum().backward()
                _sync(expected)
                got = model.collectives.device
                grads_on = {p.grad.device for p in model.parameters() if p.grad is not None}
            checks.verdict(f"device[{label}]", got == expected and grads_on == {expected},
                           f"shards on {got}, gradients on {sorted(map(str, grads_on))}, expected {expected}")
        except Exception as exc:  # noqa: BLE001 - a check that raises is a failed check
            checks.report("FAIL", f"device[{label}]", f"{type(exc).__name__}: {exc}")


# ---- stream-race parity ----------------------------------------------------------------------

def check_parity(checks: Checks, rehearse: bool) -> None:
    device = _device(rehearse)
    with one_rank_on(device), deterministic():
        for name, config in _parity_configs().items():
            try:
                plain = _train_sharded(config, device, None)
                poked = _train_sharded(config, device, _race_injection(rehearse))
                reference = _train_plain(config, device)
            except Exception as exc:  # noqa: BLE001 - a check that raises is a failed check
                checks.error(f"parity[{name}]", exc)
                continue
            identical, finite = _identical(plain, poked), _finite_run(poked)
            tol = dict(rtol=2e-2, atol=2e-3) if config.get("param_dtype") is not None else dict(rtol=1e-4, atol=1e-5)
            worst = _worst_parameter(plain, reference, **tol)
            losses_close = all(math.isclose(a, b, rel_tol=tol["rtol"], abs_tol=tol["atol"])
                               for a, b in zip(plain["losses"], reference["losses"]))
            flat = {run: max(r["allocated"][1:]) - min(r["allocated"][1:]) for run, r in
                    (("plain", plain), ("injected", poked))}
            ok = identical and finite and worst <= 1.0 and losses_close and not any(flat.values())
            checks.verdict(f"parity[{name}]", ok,
                           f"plain == injected: {identical}; finite: {finite}; vs unsharded: losses "
                           f"{'close' if losses_close else 'DIFFER'}, worst parameter at {worst:.2f} of the "
                           f"tolerance; allocated bytes moved from step 2 on by {flat['plain']} (plain) / "
                           f"{flat['injected']} (injected); losses {['%.5f' % v for v in plain['losses']]}")


# ---- the same parity under torch's CUDA sanitizer --------------------------------------------------

SANITIZED_STEPS = 2


def check_sanitized(checks: Checks, rehearse: bool) -> None:
    """Two steps of one parity configuration, plain and injected, with TORCH_CUDA_SANITIZER=1
    set before torch was imported (gpu_check.sh does): torch's sanitizer raises on a kernel that
    uses a tensor another stream writes without an event between them, or memory freed while a
    stream still reads it: the direct test of "buffers held until the consumer waited"."""
    from torch.cuda._sanitizer import cuda_sanitizer

    device = _device(rehearse)
    config = _parity_configs()["gpt_fp32_depth2"]
    active = device.type == "cuda" and cuda_sanitizer is not None and cuda_sanitizer.enabled
    try:
        with one_rank_on(device), deterministic():
            plain = _train_sharded(config, device, None, SANITIZED_STEPS)
            poked = _train_sharded(config, device, _race_injection(rehearse), SANITIZED_STEPS)
    except Exception as exc:  # noqa: BLE001 - a sanitizer's report is an exception: a failed check
        checks.error("sanitized", exc)
        return
    identical, finite = _identical(plain, poked), _finite_run(poked)
    detail = (f"{SANITIZED_STEPS} steps plain and injected: no unsynchronised cross-stream use reported; "
              f"plain == injected: {identical}; finite: {finite}")
    if not active:
        checks.report("SKIP" if identical and finite else "FAIL", "sanitized",
                      f"the sanitizer tracks CUDA streams and TORCH_CUDA_SANITIZER=1 was "
                      f"{'set' if os.environ.get('TORCH_CUDA_SANITIZER') else 'not set'}; the steps ran: {detail}")
        return
    checks.verdict("sanitized", identical and finite, detail)


# ---- kernels past 2**31 elements ---------------------------------------------------------------

def check_large_index(checks: Checks, rehearse: bool) -> None:
    from overlap.kernels.backends import available_backends, get_backend
    from overlap.kernels.reference import TorchKernels

    device = _device(rehearse)
    big = (1 << 20) if rehearse else (1 << 31)
    half = big // 2
    reference = TorchKernels()
    gen = torch.Generator(device=device).manual_seed(0)

    def randn(n: int, dtype: torch.dtype) -> torch.Tensor:
        return torch.randn(n, generator=gen, device=device, dtype=torch.float32).to(dtype)

    def nan(n: int, dtype: torch.dtype) -> torch.Tensor:
        return torch.full((n,), float("nan"), device=device, dtype=dtype)

    # (label, run(backend) -> outputs): each past `big` elements in its offsets or its reads.
    def pack_one(backend):
        src = randn(big + 4099, torch.float32)
        dst = nan(big + 4200, torch.bfloat16)
        backend.pack([src], dst, [37], 0.5)
        return [dst]

    def pack_many(backend):
        srcs = [randn(half + 5, torch.float32), randn(half + 1031, torch.float32)]
        dst = nan(big + 2048, torch.bfloat16)
        backend.pack(srcs, dst, [11, half + 100], 1.0)
        return [dst]

    def accumulate(backend):
        dst = randn(half + 3, torch.float32)
        src = randn(2 * (half + 3), torch.bfloat16)
        backend.accumulate(dst, src, 0.5, 2)
        return [dst]

    ops = {"pack_one": pack_one, "pack_many": pack_many, "accumulate": accumulate}
    names = [n for n in available_backends(device) if n != "torch" and not (rehearse and n == "triton")]
    for name in names:
        backend = get_backend(name, device)
        for label, run in ops.items():
            try:
                gen.manual_seed(0)
                expected = run(reference)
                gen.manual_seed(0)
                got = run(backend)
                _sync(device)
                same = all(torch.equal(a.isnan(), b.isnan()) and torch.equal(a.nan_to_num(), b.nan_to_num())
                           for a, b in zip(got, expected))
                checks.verdict(f"large_index[{name}.{label}]", same,
                               f"{sum(t.numel() for t in got):,} output elements {'equal' if same else 'DIFFER'} "
                               "to torch's")
                del expected, got
                if device.type == "cuda":
                    torch.cuda.empty_cache()
            except Exception as exc:  # noqa: BLE001 - a check that raises is a failed check
                checks.report("FAIL", f"large_index[{name}.{label}]", f"{type(exc).__name__}: {exc}")


# ---- offload="cpu": parity, copy bandwidth, copies under compute -----------------------------------

# Bytes each copy of the bandwidth and overlap checks moves: 256 MiB, long enough (several ms
# on PCIe) that a launch's few µs do not count.
OFFLOAD_COPY_NUMEL = 64 * 2**20
# offload="cpu" against "none": losses and parameters within this relative tolerance.
OFFLOAD_RTOL = 1e-3
# The offload copies must reach this share of a plain pinned copy's bandwidth, and hide this
# share of their time under compute when they run beside it.
OFFLOAD_BANDWIDTH_SHARE, OFFLOAD_HIDDEN_SHARE = 0.8, 0.5


def _offload_runs(device: torch.device, wrap: dict) -> dict:
    """`_parity_steps` steps of a GPT with offload "none" and "cpu", collectives issued as with
    more ranks and "cpu" under the race injection (delays on the collectives' streams and
    before each upload and download on its stream);
    losses, states and where the offloaded parameters and gradients lived."""
    from overlap import ShardedModule

    out = {}
    batches = _batches(device, _parity_steps(device))
    for offload in ("none", "cpu"):
        torch.manual_seed(0)
        with collectives_issued_alone():
            model = ShardedModule(_gpt(), offload=offload, **wrap)
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
        losses = []
        with _race_injection(device.type != "cuda").active() if offload == "cpu" else contextlib.nullcontext():
            for inputs, targets in batches:
                loss = model(inputs, targets)
                loss.backward()
                places = {(p.device.type, p.is_pinned(), p.grad.device.type) for p in model.parameters()
                          if p.grad is not None}
                optimizer.step()
                optimizer.zero_grad()
                losses.append(float(loss.detach()))
        out[offload] = dict(losses=losses, state=model.full_state_dict(), places=places)
    return out


def _offload_parity(checks: Checks, device: torch.device) -> None:
    for name, wrap in (("fp32", {}), ("bf16", dict(mixed_precision=_bf16()))):
        try:
            runs = _offload_runs(device, wrap)
        except Exception as exc:  # noqa: BLE001 - a check that raises is a failed check
            checks.error(f"offload[parity_{name}]", exc)
            continue
        ref, got = runs["none"], runs["cpu"]
        identical = ref["losses"] == got["losses"] and all(torch.equal(got["state"][k], v)
                                                            for k, v in ref["state"].items())
        # On CUDA "none" steps AdamW on the device and "cpu" on the host: the same arithmetic in
        # another order (fused kernels, another sqrt), so close as the disk check's, not equal.
        close = all(math.isclose(a, b, rel_tol=OFFLOAD_RTOL) for a, b in zip(ref["losses"], got["losses"]))
        states = all(torch.allclose(got["state"][k].float(), v.float(), rtol=OFFLOAD_RTOL, atol=1e-5)
                     for k, v in ref["state"].items())
        pinned = torch.cuda.is_available()
        on_host = got["places"] == {("cpu", pinned, "cpu")}
        checks.verdict(f"offload[parity_{name}]", close and states and on_host and _finite(got["losses"]),
                       f"offload=cpu (delays injected on the collectives' and the copies' streams) against none: "
                       f"identical {identical}, losses and parameters within {OFFLOAD_RTOL:g}: {close}, {states}; "
                       f"parameters and gradients (device, pinned, grad device): {sorted(got['places'])}; "
                       f"losses {['%.5f' % v for v in got['losses']]}")


def _elapsed_ms(run: Callable[[], None], device: torch.device, repeats: int = 3) -> float:
    """The fastest of `repeats` runs of `run`, timed by events on the compute stream (`run`
    makes the compute stream wait for whatever it queued elsewhere)."""
    best = math.inf
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        run()
        end.record()
        end.synchronize()
        best = min(best, start.elapsed_time(end))
    return best


def _offload_copies(checks: Checks, device: torch.device) -> None:
    """The offload copies' bandwidth against a plain pinned copy, and how much of them runs
    hidden under compute on the compute stream."""
    from overlap.kernels.backends import get_backend
    from overlap.runtime.host_tier import HostTier
    from overlap.runtime.pending import COMPLETED

    n = OFFLOAD_COPY_NUMEL
    nbytes = 4 * n
    gather_stream = torch.cuda.Stream(device=device, priority=-1)
    tier = HostTier(device, get_backend("auto", device), gather_stream)
    place = tier.place()
    master = place.place_master(torch.randn(n))
    grad_shard = place.zeros_like(master)
    device_buffer = torch.empty(n, device=device)
    compute = torch.cuda.current_stream(device)

    def upload() -> None:                      # what a gather sends, as the runtime queues it
        place.gather_source(master, torch.float32, encoded=False, local=False)
        compute.wait_stream(gather_stream)

    def download() -> None:                    # a reduced gradient going home
        place.reduce_target(grad_shard, zeros=True)
        place.reduction_issued(COMPLETED)
        compute.wait_stream(tier.download_stream)
        place.grads_ready()

    plain_h2d = _elapsed_ms(lambda: device_buffer.copy_(master, non_blocking=True), device)
    plain_d2h = _elapsed_ms(lambda: grad_shard.copy_(device_buffer, non_blocking=True), device)
    ours_h2d, ours_d2h = _elapsed_ms(upload, device), _elapsed_ms(download, device)
    gbps = {name: nbytes / (ms * 1e-3) / 1e9 for name, ms in
            (("plain_h2d", plain_h2d), ("plain_d2h", plain_d2h), ("h2d", ours_h2d), ("d2h", ours_d2h))}
    shares = {"h2d": gbps["h2d"] / gbps["plain_h2d"], "d2h": gbps["d2h"] / gbps["plain_d2h"]}
    checks.verdict("offload[bandwidth]", min(shares.values()) >= OFFLOAD_BANDWIDTH_SHARE,
                   f"{nbytes / 2**20:.0f} MiB: host->device {gbps['h2d']:.1f} GB/s ({shares['h2d']:.2f} of a plain "
                   f"pinned copy's {gbps['plain_h2d']:.1f}), device->host {gbps['d2h']:.1f} GB/s ({shares['d2h']:.2f} of "
                   f"{gbps['plain_d2h']:.1f}); pass at >= {OFFLOAD_BANDWIDTH_SHARE} each")

    # Compute about three copies long: square bf16 matmuls on the compute stream.
    a = torch.randn(4096, 4096, device=device, dtype=torch.bfloat16)
    one_ms = _elapsed_ms(lambda: a @ a, device)
    reps = max(1, int(3 * max(ours_h2d, ours_d2h) / max(one_ms, 1e-3)))

    def matmuls() -> None:
        for _ in range(reps):
            a @ a

    compute_ms = _elapsed_ms(matmuls, device)
    for name, copy_ms in (("h2d", ours_h2d), ("d2h", ours_d2h)):
        # The copy is queued first (its stream waits only for what the compute stream queued
        # before it), the matmuls after it on the compute stream; the end waits for both.
        def both() -> None:
            if name == "h2d":
                place.gather_source(master, torch.float32, encoded=False, local=False)
                matmuls()
                compute.wait_stream(gather_stream)
            else:
                place.reduce_target(grad_shard, zeros=True)
                place.reduction_issued(COMPLETED)
                matmuls()
                compute.wait_stream(tier.download_stream)

        together_ms = _elapsed_ms(both, device)
        place.grads_ready()
        hidden = (compute_ms + copy_ms - together_ms) / copy_ms
        checks.verdict(f"offload[overlap_{name}]", hidden >= OFFLOAD_HIDDEN_SHARE,
                       f"copy {copy_ms:.2f} ms, compute {compute_ms:.2f} ms, both {together_ms:.2f} ms: "
                       f"{100 * hidden:.0f}% of the copy hidden (pass at >= {100 * OFFLOAD_HIDDEN_SHARE:.0f}%)")


# ---- offload="disk": parity, the 16-bit shard's refresh -------------------------------------------

# The refresh must reach this share of a plain pinned copy's bandwidth over the same bytes: it
# is one copy per bucket, each a few MB, so launches cost a little more than in one big copy.
DISK_REFRESH_SHARE = 0.7


def _disk_runs(device: torch.device) -> dict:
    """`_parity_steps` steps of a bf16 GPT with offload "none" and "disk", both stepped by
    overlap.optim.AdamW; losses, fp32 masters and where parameters, gradients and the
    gathered 16-bit shards lived."""
    from overlap import ShardedModule
    from overlap.optim import AdamW

    out = {}
    batches = _batches(device, _parity_steps(device))
    for offload in ("none", "disk"):             # "disk": a state file in a fresh temporary directory
        torch.manual_seed(0)
        with collectives_issued_alone():
            model = ShardedModule(_gpt(), offload=offload, mixed_precision=_bf16())
        optimizer = AdamW(model.parameters(), lr=1e-3)
        losses = []
        with _race_injection(device.type != "cuda").active() if offload == "disk" else contextlib.nullcontext():
            for inputs, targets in batches:
                loss = model(inputs, targets)
                loss.backward()
                places = {(p.device.type, p.is_pinned(), str(p.dtype), p.grad.device.type, str(p.grad.dtype))
                          for p in model.parameters() if p.grad is not None}
                optimizer.step()
                optimizer.zero_grad()
                losses.append(float(loss.detach()))
        groups = [g for unit in model.scheduler.all_units for g in unit.groups if g.place.offloaded]
        sent = {g.place.sent.device.type for g in groups}
        out[offload] = dict(losses=losses, state=model.full_state_dict(), places=places, sent=sent)
    return out


def _disk_parity(checks: Checks, device: torch.device) -> None:
    try:
        runs = _disk_runs(device)
    except Exception as exc:  # noqa: BLE001 - a check that raises is a failed check
        checks.error("offload[disk_parity_bf16]", exc)
        return
    ref, got = runs["none"], runs["disk"]
    # The disk tier steps the masters with the CPU kernel, "none" on the device: the same
    # arithmetic, not the same order of operations, so close rather than identical.
    identical = ref["losses"] == got["losses"]
    close = all(math.isclose(a, b, rel_tol=1e-3) for a, b in zip(ref["losses"], got["losses"]))
    masters = all(torch.allclose(got["state"][k].float(), v.float(), rtol=1e-3, atol=1e-5)
                  for k, v in ref["state"].items())
    pinned = torch.cuda.is_available()
    places_ok = got["places"] == {("cpu", pinned, "torch.bfloat16", "cpu", "torch.float32")}
    sent_ok = bool(got["sent"]) and got["sent"] == {device.type}
    checks.verdict("offload[disk_parity_bf16]",
                   close and masters and places_ok and sent_ok and _finite(got["losses"]),
                   f"offload=disk against none: identical losses {identical}, within 1e-3: {close}, fp32 masters "
                   f"within 1e-3: {masters}; parameters and gradients (device, pinned, dtype, grad device, grad "
                   f"dtype): {sorted(got['places'])}; gathered shards on {sorted(got['sent'])}; "
                   f"losses {['%.5f' % v for v in got['losses']]} (none: {['%.5f' % v for v in ref['losses']]})")


def _disk_refresh(checks: Checks, device: torch.device) -> None:
    """The bandwidth of the 16-bit shard's refresh (host -> device, one copy per bucket, as a
    step queues it) against one plain pinned copy of the same bytes."""
    from overlap import ShardedModule
    from overlap.optim.paged import paged_of

    torch.manual_seed(0)
    model = ShardedModule(_gpt(layers=4, width=512), offload="disk", mixed_precision=_bf16())
    groups = [g for unit in model.scheduler.all_units for g in unit.groups if g.place.offloaded]
    engine = paged_of(next(model.parameters())).engine
    buckets = [(g.place, b) for g in groups for b in engine.buckets if b.shard == g.place.index]
    nbytes = sum(g.shard.nbytes for g in groups)
    compute = torch.cuda.current_stream(device)
    host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    target = torch.empty(nbytes, dtype=torch.uint8, device=device)

    def refresh() -> None:                 # every bucket, as a step queues them
        for place, bucket in buckets:
            place.bucket_written(bucket)
        for g in groups:
            if g.place.refreshed is not None:
                compute.wait_event(g.place.refreshed)

    plain_ms = _elapsed_ms(lambda: target.copy_(host, non_blocking=True), device)
    ours_ms = _elapsed_ms(refresh, device)
    equal = all(torch.equal(g.place.sent.cpu(), g.shard) for g in groups)
    plain, ours = nbytes / (plain_ms * 1e-3) / 1e9, nbytes / (ours_ms * 1e-3) / 1e9
    checks.verdict("offload[disk_refresh]", equal and ours / plain >= DISK_REFRESH_SHARE,
                   f"{nbytes / 2**20:.1f} MiB in {len(buckets)} bucket copies: host->device {ours:.1f} GB/s "
                   f"({ours / plain:.2f} of one plain pinned copy's {plain:.1f}); device shards equal the host's: "
                   f"{equal}; pass at >= {DISK_REFRESH_SHARE}")


def check_offload(checks: Checks, rehearse: bool) -> None:
    device = _device(rehearse)
    with one_rank_on(device):
        _offload_parity(checks, device)
        _disk_parity(checks, device)
    if rehearse:
        for name in ("bandwidth", "overlap", "disk_refresh"):
            checks.report("SKIP", f"offload[{name}]", "CPU rehearsal: host and device are one memory, there is no "
                                                      "copy engine to measure or overlap")
        return
    try:
        _offload_copies(checks, device)
    except Exception as exc:  # noqa: BLE001 - a check that raises is a failed check
        checks.error("offload[copies]", exc)
    try:
        with one_rank_on(device):
            _disk_refresh(checks, device)
    except Exception as exc:  # noqa: BLE001 - a check that raises is a failed check
        checks.error("offload[disk_refresh]", exc)


# ---- the runtime's overhead at world size 1 -------------------------------------------------------

def check_overhead(checks: Checks, rehearse: bool) -> None:
    device = _device(rehearse)
    config = _gpt_config(rehearse, large=True)
    batch = 2 if rehearse else 8
    gen = torch.Generator().manual_seed(0)
    data = [torch.randint(0, config.vocab_size, (batch, config.block_size), generator=gen).to(device)
            for _ in range(OVERHEAD_STEPS + OVERHEAD_WARMUP)]
    results = {}
    with one_rank_on(device):
        for kind in ("plain", "fsdp2", "overlap"):
            try:
                model, context = _wrapped(kind, config, device)
                optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
                if device.type == "cuda":
                    torch.cuda.synchronize(device)
                    torch.cuda.reset_peak_memory_stats(device)

                step = _lm_step(model, optimizer, data, context)
                seconds, losses = timed_steps(step, device, OVERHEAD_WARMUP, OVERHEAD_STEPS)
                peak = torch.cuda.max_memory_allocated(device) if device.type == "cuda" else 0
                results[kind] = dict(step_ms=1e3 * statistics.median(seconds), peak_gib=peak / 2**30,
                                     finite=_finite(losses), last_loss=losses[-1])
                del model, optimizer
                if device.type == "cuda":
                    torch.cuda.empty_cache()
            except Exception as exc:  # noqa: BLE001 - a check that raises is a failed check
                checks.report("FAIL", f"overhead[{kind}]", f"{type(exc).__name__}: {exc}")
    if len(results) < 3:
        return
    print(f"      GPT {config.num_params / 1e9:.2f}B parameters, batch {batch} x {config.block_size}, bf16 compute, "
          f"fp32 master weights and AdamW")
    for kind, r in results.items():
        print(f"      {kind:<8} step {r['step_ms']:8.1f} ms   peak {r['peak_gib']:6.2f} GiB   last loss "
              f"{r['last_loss']:.4f}")
    ratio = results["overlap"]["step_ms"] / results["fsdp2"]["step_ms"]
    memory = results["overlap"]["peak_gib"] / max(results["fsdp2"]["peak_gib"], 1e-9)
    finite = all(r["finite"] for r in results.values())
    detail = (f"ShardedModule / FSDP2 step time {ratio:.3f} (pass at <= 1.15), / plain "
              f"{results['overlap']['step_ms'] / results['plain']['step_ms']:.3f}; peak memory / FSDP2 {memory:.3f}; "
              f"finite: {finite}")
    if rehearse:
        checks.report("SKIP" if finite else "FAIL", "overhead", f"CPU times in a rehearsal say nothing of the GPU's: "
                                                                f"{detail}")
        return
    checks.verdict("overhead", finite and ratio <= 1.15, detail)


RUNNERS: dict[str, Callable[[Checks, bool], None]] = {
    "offload": check_offload, "compressed": check_compressed, "report_timing": check_report_timing,
    "sync_free": check_sync_free,
    "hybrid": check_hybrid, "hpz": check_hpz, "slow_link": check_slow_link, "device": check_device,
    "parity": check_parity, "sanitized": check_sanitized, "large_index": check_large_index, "overhead": check_overhead,
}


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--only", default=",".join(CHECKS), help="comma-separated checks to run")
    parser.add_argument("--rehearse", action="store_true", help="run on the CPU with gloo and small sizes")
    args = parser.parse_args(argv)
    names = [n.strip() for n in args.only.split(",") if n.strip()]
    unknown = [n for n in names if n not in RUNNERS]
    if unknown:
        parser.error(f"--only: unknown checks {unknown}; choose from {', '.join(CHECKS)}")
    checks = Checks()
    # See `deterministic`: before cuBLAS makes its handle.
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    if not args.rehearse and not torch.cuda.is_available():
        for name in names:
            checks.report("SKIP", name, "no CUDA device (torch.cuda.is_available() is False)")
        return 0
    from overlap.runtime.timing import records_one_step_late

    # A rehearsal takes its step records one step late, as the CUDA clock delivers them, so
    # that the checks read records the way they will on the GPU.
    with records_one_step_late() if args.rehearse else contextlib.nullcontext():
        for name in names:
            start = time.perf_counter()
            RUNNERS[name](checks, args.rehearse)
            print(f"      ({name}: {time.perf_counter() - start:.1f} s)", flush=True)
    return 1 if checks.failed else 0


if __name__ == "__main__":
    sys.exit(main())
