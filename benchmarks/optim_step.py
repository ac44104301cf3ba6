"""CPU optimizer step throughput: overlap.optim.AdamW against torch.optim.AdamW (foreach and
fused) and DeepSpeedCPUAdam, in parameters updated per second (docs/optim.md).

    python benchmarks/optim_step.py [--full] [--sizes 10M,50M] [--threads 1,2] [--rounds 5]
                                    [--out docs/results/optim_step.json]

Sizes that do not fit the memory available (16 bytes a parameter) are skipped and listed.
Implementations take turns within every round, each with a fresh optimizer (its first step
untimed); per round each one's time over overlap's. The bound: a 512 MB copy's bandwidth (read
+ write, best round) over the 28 bytes an fp32 AdamW update reads and writes (an update can
exceed it: a copy is not credited for its write-allocate reads).
"""
from __future__ import annotations

import gc
import logging
import statistics
import sys
from typing import Callable, Optional

import torch

from common import RunRecord, add_options, arg_parser, markdown_table, seconds_of, write_json

from overlap.cli.estimate import parameter_count
from overlap.optim import AdamW, extension_available

QUICK_SIZES = "10M,50M"
FULL_SIZES = "50M,100M,250M,500M"
TENSOR_ELEMENTS = 16 * 2**20     # the largest parameter tensor
BYTES_PER_UPDATE = 7 * 4         # read p, g, m, v; write p, m, v (fp32)
RESIDENT_BYTES = 16              # p, g and one optimizer's m, v per parameter
COPY_BYTES = 512 * 2**20         # the tensor the copy bandwidth is measured on
LOG = logging.getLogger("optim_step")


def deepspeed_adam() -> tuple[Optional[Callable], str]:
    """DeepSpeedCPUAdam's constructor in AdamW mode, or None and why not (its op builds on first use)."""
    try:
        from deepspeed.ops.adam import DeepSpeedCPUAdam
        probe = [torch.zeros(8, requires_grad=True)]
        DeepSpeedCPUAdam(probe, adamw_mode=True)
    except Exception as exc:  # noqa: BLE001 - any failure to import or build means "skipped"
        return None, f"{type(exc).__name__}: {exc}".splitlines()[0][:300]
    return (lambda params: DeepSpeedCPUAdam(params, lr=1e-3, weight_decay=1e-2, adamw_mode=True)), "available"


def implementations() -> tuple[dict[str, Callable], dict[str, str]]:
    impls: dict[str, Callable] = {
        "overlap": lambda params: AdamW(params, lr=1e-3, weight_decay=1e-2, backend="ext"),
        "torch-foreach": lambda params: torch.optim.AdamW(params, lr=1e-3, weight_decay=1e-2, foreach=True),
        "torch-fused": lambda params: torch.optim.AdamW(params, lr=1e-3, weight_decay=1e-2, fused=True),
    }
    make_ds, status = deepspeed_adam()
    if make_ds is not None:
        impls["deepspeed-cpu-adam"] = make_ds
    return impls, {} if make_ds is not None else {"deepspeed-cpu-adam": status}


def copy_bandwidth(repeats: int = 5) -> float:
    src = torch.rand(COPY_BYTES // 4)
    dst = torch.empty_like(src)
    dst.copy_(src)
    best = min(seconds_of(lambda: dst.copy_(src)) for _ in range(repeats))
    return 2 * COPY_BYTES / best


def make_params(count: int) -> list[torch.Tensor]:
    sizes = [TENSOR_ELEMENTS] * (count // TENSOR_ELEMENTS) + ([count % TENSOR_ELEMENTS] if count % TENSOR_ELEMENTS else [])
    params = [torch.randn(n).requires_grad_() for n in sizes]
    for p in params:
        p.grad = torch.randn_like(p) * 1e-2
    return params


def measure_size(count: int, threads: int, impls: dict[str, Callable], rounds: int, steps: int) -> dict:
    torch.set_num_threads(threads)
    params = make_params(count)
    times: dict[str, list[float]] = {name: [] for name in impls}
    copies: list[float] = []
    for _ in range(rounds):
        for name, make in impls.items():
            optimizer = make(params)
            optimizer.step()   # creates the state, untimed
            times[name].append(min(seconds_of(optimizer.step) for _ in range(steps)))
            del optimizer
            gc.collect()
        copies.append(copy_bandwidth(repeats=3))
    bandwidth = max(copies)                # what memory allows when the host lets it
    bound = bandwidth / BYTES_PER_UPDATE
    entry: dict = {"params": count, "threads": threads, "copy_GBps": bandwidth / 1e9,
                   "bound_params_per_s": bound, "implementations": {}}
    for name, seconds in times.items():
        ratios = [theirs / ours for theirs, ours in zip(seconds, times["overlap"])]
        per_s = count / statistics.median(seconds)
        entry["implementations"][name] = {
            "seconds_per_round": seconds,
            "params_per_s": per_s,
            "fraction_of_bound": per_s / bound,
            "time_over_overlap_median": statistics.median(ratios),
            "time_over_overlap_range": [min(ratios), max(ratios)],
        }
    return entry


def fits(count: int) -> bool:
    """Whether the size's resident bytes fit in the memory available now, with 2 GB spare."""
    try:
        with open("/proc/meminfo") as f:
            available = next(int(line.split()[1]) * 1024 for line in f if line.startswith("MemAvailable"))
    except (OSError, StopIteration):
        return True
    return count * RESIDENT_BYTES + 2e9 < available


def print_table(entries: list[dict]) -> None:
    names = list(entries[0]["implementations"]) if entries else []
    print(markdown_table(["params", "threads", *names, "bound M/s"], [
        [f"{e['params'] / 1e6:.0f}M", e["threads"], *(f"{r['params_per_s'] / 1e6:.0f}M/s ({r['time_over_overlap_median']:.2f}x)"
                                                      for r in e["implementations"].values()),
         f"{e['bound_params_per_s'] / 1e6:.0f}"] for e in entries]))
    print("(x: an implementation's step time over overlap's, median of paired rounds)")


def main(argv: Optional[list[str]] = None) -> None:
    parser = arg_parser(__doc__)
    parser.add_argument("--full", action="store_true", help=f"sizes {FULL_SIZES}")
    parser.add_argument("--sizes", default=None, help=f"comma-separated parameter counts (default {QUICK_SIZES})")
    add_options(parser, threads="1,2", rounds=5, out="docs/results/optim_step.json")
    parser.add_argument("--steps", type=int, default=2, help="timed steps per round (the fastest counts)")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    if not extension_available():
        parser.error("overlap._C was not built: overlap.optim.AdamW has no kernel to measure")
    sizes = [int(parameter_count(s)) for s in (args.sizes or (FULL_SIZES if args.full else QUICK_SIZES)).split(",")]
    threads = [int(t) for t in args.threads.split(",")]
    impls, skipped = implementations()
    record = RunRecord("optim_step.py", sys.argv[1:] if argv is None else argv)
    entries, too_big = [], []
    for count in sizes:
        if not fits(count):
            too_big.append(count)
            LOG.info("%dM parameters: skipped, %.1f GB do not fit the memory available now", count / 1e6,
                     count * RESIDENT_BYTES / 1e9)
            continue
        for t in threads:
            LOG.info("%dM parameters, %d thread(s)...", count / 1e6, t)
            entries.append(measure_size(count, t, impls, args.rounds, args.steps))
    result = {
        "commit": record.commit, "command": record.command,
        "host": record.host(cpu_capability=torch.backends.cpu.get_cpu_capability()),
        "bytes_per_update": BYTES_PER_UPDATE, "skipped_implementations": skipped,
        "skipped_sizes_for_memory": too_big, "results": entries,
    }
    print_table(entries)
    for name, why in skipped.items():
        print(f"{name}: skipped ({why})")
    write_json(args.out, result)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
