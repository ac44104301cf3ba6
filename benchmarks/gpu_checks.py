"""The checks of benchmarks/gpu_check.sh that run Python, on one CUDA device, each printing
`PASS`, `FAIL` or `SKIP` with its name and figures:

  device        `init_process_group()`, "cpu:gloo,cuda:nccl" and "nccl" each put the shards on
                the GPU, and a step runs there
  parity        five configurations, each trained plainly and with delays injected on the side
                streams (`torch.cuda._sleep` before and after every collective) and every freed
                gathered buffer NaN-filled before its storage is released: bit-identical runs,
                finite, equal to the unsharded model, allocated memory flat from step 2 on
  large_index   every kernel backend on tensors past 2**31 elements against torch
  report_timing the step record's time of the collectives in flight against the side-stream
                kernels CUPTI saw (torch.profiler)
  overhead      step time and peak memory of ShardedModule, FSDP2 and the plain model at world
                size 1 on a ~1B-parameter GPT in bf16

Without a GPU every check says SKIP and why. `--rehearse` runs the same code on the CPU with
gloo and small sizes (no delays, no timing check): a test of this script, not of the GPU
paths.

    python benchmarks/gpu_checks.py [--only device,parity] [--rehearse]
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
import sys
import tempfile
import time
import traceback
from typing import Any, Callable, Iterator, Optional, Sequence

import torch
import torch.distributed as dist

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "tests"))        # tests/models.py: the awkward model

CHECKS = ("device", "parity", "large_index", "report_timing", "overhead")
# torch.cuda._sleep cycles injected around each side-stream collective: ~0.5 ms at ~2 GHz.
SLEEP_CYCLES = 1_000_000
PARITY_STEPS = 5
OVERHEAD_STEPS, OVERHEAD_WARMUP = 8, 3


class Checks:
    """Collects the verdicts; `failed` says whether any check failed."""

    def __init__(self) -> None:
        self.failed = False

    def report(self, status: str, name: str, detail: str) -> None:
        self.failed |= status == "FAIL"
        print(f"{status} {name}: {detail}", flush=True)

    def verdict(self, name: str, ok: bool, detail: str) -> None:
        self.report("PASS" if ok else "FAIL", name, detail)


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


def _device(rehearse: bool) -> torch.device:
    return torch.device("cpu") if rehearse else torch.device("cuda", 0)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


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

def _gpt(layers: int = 4, width: int = 128):
    from overlap.models import GPT, GPTConfig

    return GPT(GPTConfig(vocab_size=512, block_size=64, n_layer=layers, n_head=4, n_embd=width))


def _feature_net():
    from models import FeatureNet

    return FeatureNet(vocab=512, d=64, hidden=96)


def _parity_configs() -> dict[str, dict]:
    from overlap import MixedPrecision

    bf16 = MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    return {
        "gpt_fp32_depth2": dict(build=_gpt, wrap=dict(prefetch_depth=2)),
        "no_sync": dict(build=_gpt, wrap=dict(prefetch_depth=1), micro_batches=2),
        "tied_frozen_twice_checkpointed": dict(build=_feature_net, wrap=dict(prefetch_depth=1)),
        "bf16_gather_fp32_reduce": dict(build=_gpt, wrap=dict(prefetch_depth=1, mixed_precision=bf16),
                                        param_dtype=torch.bfloat16),
        "no_reshard_after_forward": dict(build=_gpt, wrap=dict(prefetch_depth=1, reshard_after_forward=False)),
    }


def _batches(device: torch.device, steps: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    gen = torch.Generator().manual_seed(1)
    return [(torch.randint(0, 512, (8, 64), generator=gen).to(device),
             torch.randint(0, 512, (8, 64), generator=gen).to(device)) for _ in range(steps)]


@contextlib.contextmanager
def injected(delays: bool) -> Iterator[None]:
    """Delays on the side streams around every collective, and every freed gathered buffer
    filled with NaN before its storage goes back to the allocator: a consumer that does not
    wait for a collective, or a buffer freed while a stream still reads it, shows as a
    different or non-finite result."""
    from overlap.runtime import collectives
    from overlap.runtime.flat_group import FlatGroup

    originals = (collectives.all_gather_flat, collectives.reduce_scatter_flat, FlatGroup.free)

    def delayed(fn: Callable) -> Callable:
        def run(*args: Any, **kwargs: Any) -> Any:
            if delays:
                torch.cuda._sleep(SLEEP_CYCLES)      # on the side stream: the caller is inside its context
            out = fn(*args, **kwargs)
            if delays:
                torch.cuda._sleep(SLEEP_CYCLES)
            return out
        return run

    def poisoned_free(group: FlatGroup) -> None:
        if group.is_allocated:
            with torch.no_grad(), torch.autograd._unsafe_preserve_version_counter(group.full):
                group.full.detach().fill_(float("nan"))
        originals[2](group)

    collectives.all_gather_flat = delayed(originals[0])
    collectives.reduce_scatter_flat = delayed(originals[1])
    FlatGroup.free = poisoned_free
    try:
        yield
    finally:
        collectives.all_gather_flat, collectives.reduce_scatter_flat, FlatGroup.free = originals


def _train_sharded(config: dict, device: torch.device, inject: bool, delays: bool) -> dict:
    from overlap import ShardedModule

    torch.manual_seed(0)
    model = ShardedModule(config["build"](), **config["wrap"])
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    micro = config.get("micro_batches", 1)
    losses, allocated = [], []
    with injected(delays) if inject else contextlib.nullcontext():
        for idx, targets in _batches(device, PARITY_STEPS):
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
    return dict(losses=losses, allocated=allocated, state=model.full_state_dict())


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
    for idx, targets in _batches(device, PARITY_STEPS):
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


def check_parity(checks: Checks, rehearse: bool) -> None:
    device = _device(rehearse)
    backend = "gloo" if rehearse else "nccl"
    with one_rank_group(backend):
        if device.type == "cuda":
            torch.cuda.set_device(device)
        for name, config in _parity_configs().items():
            try:
                plain = _train_sharded(config, device, inject=False, delays=False)
                poked = _train_sharded(config, device, inject=True, delays=not rehearse)
                reference = _train_plain(config, device)
            except Exception as exc:  # noqa: BLE001 - a check that raises is a failed check
                checks.report("FAIL", f"parity[{name}]", f"{type(exc).__name__}: {exc}\n{traceback.format_exc()}")
                continue
            identical = plain["losses"] == poked["losses"] and all(
                torch.equal(plain["state"][k], poked["state"][k]) for k in plain["state"])
            finite = all(math.isfinite(v) for v in poked["losses"]) and all(
                bool(t.isfinite().all()) for t in poked["state"].values() if t.is_floating_point())
            tol = dict(rtol=2e-2, atol=2e-3) if config.get("param_dtype") is not None else dict(rtol=1e-4, atol=1e-5)
            worst = max(float(((plain["state"][k].double() - v.double()).abs()
                               / (tol["atol"] + tol["rtol"] * v.double().abs())).max())
                        for k, v in reference["state"].items() if v.is_floating_point() and v.numel())
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


# ---- kernels past 2**31 elements ---------------------------------------------------------------

def check_large_index(checks: Checks, rehearse: bool) -> None:
    from overlap.kernels import available_backends, get_backend
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
    with one_rank_group("nccl"):
        torch.cuda.set_device(device)
        torch.manual_seed(0)
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
            path = os.path.join(scratch, "trace.json")
            prof.export_chrome_trace(path)
            with open(path) as f:
                trace = json.load(f)["traceEvents"]
    record = model.scheduler.last_step
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


# ---- the runtime's overhead at world size 1 -------------------------------------------------------

def check_overhead(checks: Checks, rehearse: bool) -> None:
    from overlap import MixedPrecision, ShardedModule
    from overlap.models import GPT, Block, GPTConfig

    device = _device(rehearse)
    config = (GPTConfig(vocab_size=512, block_size=64, n_layer=2, n_head=4, n_embd=64) if rehearse else
              GPTConfig(vocab_size=32768, block_size=1024, n_layer=18, n_head=16, n_embd=2048))
    batch = 2 if rehearse else 8
    gen = torch.Generator().manual_seed(0)
    data = [torch.randint(0, config.vocab_size, (batch, config.block_size), generator=gen).to(device)
            for _ in range(OVERHEAD_STEPS + OVERHEAD_WARMUP)]

    def wrap(kind: str) -> tuple[torch.nn.Module, contextlib.AbstractContextManager]:
        torch.manual_seed(0)
        with torch.device(device):                     # built in place: seconds, not a minute on the host
            model = GPT(config)
        if kind == "overlap":
            mp = MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
            return ShardedModule(model, unit_types=(Block,), mixed_precision=mp), contextlib.nullcontext()
        if kind == "fsdp2":
            from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

            policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
            for block in model.blocks:
                fully_shard(block, mp_policy=policy)
            return fully_shard(model, mp_policy=policy), contextlib.nullcontext()
        return model, torch.autocast(device.type, dtype=torch.bfloat16)

    results = {}
    with one_rank_group("gloo" if rehearse else "nccl"):
        if device.type == "cuda":
            torch.cuda.set_device(device)
        for kind in ("plain", "fsdp2", "overlap"):
            try:
                model, context = wrap(kind)
                optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
                if device.type == "cuda":
                    torch.cuda.synchronize(device)
                    torch.cuda.reset_peak_memory_stats(device)
                times, losses = [], []
                for i, idx in enumerate(data):
                    _sync(device)
                    start = time.perf_counter()
                    with context:
                        loss = model(idx, idx)
                    loss.backward()
                    optimizer.step()
                    optimizer.zero_grad(set_to_none=True)
                    _sync(device)
                    if i >= OVERHEAD_WARMUP:
                        times.append(time.perf_counter() - start)
                    losses.append(loss.item())
                peak = torch.cuda.max_memory_allocated(device) if device.type == "cuda" else 0
                results[kind] = dict(step_ms=1e3 * sorted(times)[len(times) // 2], peak_gib=peak / 2**30,
                                     finite=all(math.isfinite(v) for v in losses), last_loss=losses[-1])
                del model, optimizer, loss
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
    ok = all(r["finite"] for r in results.values()) and ratio <= 1.15
    checks.verdict("overhead", ok, f"ShardedModule / FSDP2 step time {ratio:.3f} (pass at <= 1.15), / plain "
                                   f"{results['overlap']['step_ms'] / results['plain']['step_ms']:.3f}; peak memory "
                                   f"/ FSDP2 {memory:.3f}")


RUNNERS: dict[str, Callable[[Checks, bool], None]] = {
    "device": check_device, "parity": check_parity, "large_index": check_large_index,
    "report_timing": check_report_timing, "overhead": check_overhead,
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
    if not args.rehearse and not torch.cuda.is_available():
        for name in names:
            checks.report("SKIP", name, "no CUDA device (torch.cuda.is_available() is False)")
        return 0
    for name in names:
        start = time.perf_counter()
        RUNNERS[name](checks, args.rehearse)
        print(f"      ({name}: {time.perf_counter() - start:.1f} s)", flush=True)
    return 1 if checks.failed else 0


if __name__ == "__main__":
    sys.exit(main())
