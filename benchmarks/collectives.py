"""Gloo's ways to reduce-scatter a gradient, and its all-gather, timed on 2 ranks (docs/benchmarks.md).

A size S is the full fp32 tensor. Ways, each ending with the result in its own buffer:
`reduce_scatter_tensor`; `all_to_all_single` then a local sum of the chunks (ShardedModule on
gloo); `all_reduce` then a copy of this rank's chunk; and `all_gather_into_tensor`. Each timing
starts after a barrier; a repetition is the slower rank's; the median is reported.

    python benchmarks/collectives.py --sizes-mb 1,8,32 --links loopback,2gbit
"""
from __future__ import annotations

import argparse
import os
import sys
from typing import Callable, Sequence

import torch

from common import (RunRecord, arg_parser, forwarded, launch, markdown_table, median, on_link, parse_links, parse_sizes,
                    parse_with_worker_options, script_main, slower_rank, start_rank, timed_steps, to_driver, write_results)

WORLD_SIZE = 2
REDUCE_SCATTER_WAYS = ("reduce_scatter", "all_to_all+sum", "all_reduce+slice")
OPS = (*REDUCE_SCATTER_WAYS, "all_gather")
MIB = 2**20
LINK_TIMEOUT_S = 600.0      # one link's launch


def _rank_input(numel: int, rank: int) -> torch.Tensor:
    """Rank `rank`'s full tensor (seeded: every rank can compute every rank's)."""
    return torch.randn(numel, generator=torch.Generator().manual_seed(rank))


def _op(name: str, full: torch.Tensor, rank: int, world: int) -> tuple[Callable[[], None], torch.Tensor]:
    """One repetition of `name` as a closure, and the tensor its result lands in."""
    import torch.distributed as dist

    chunk = torch.empty(full.numel() // world)
    if name == "reduce_scatter":
        return lambda: dist.reduce_scatter_tensor(chunk, full), chunk
    if name == "all_to_all+sum":
        received = torch.empty_like(full)

        def all_to_all_sum() -> None:
            dist.all_to_all_single(received, full)
            torch.sum(received.view(world, -1), dim=0, out=chunk)

        return all_to_all_sum, chunk
    if name == "all_reduce+slice":
        reduced = full.clone()  # reduced in place, as the runtime may do with its own gradient buffer

        def all_reduce_slice() -> None:
            dist.all_reduce(reduced)
            chunk.copy_(reduced.view(world, -1)[rank])

        return all_reduce_slice, chunk
    shard = full.view(world, -1)[rank].clone()
    gathered = torch.empty_like(full)
    return lambda: dist.all_gather_into_tensor(gathered, shard), gathered


def _expected(name: str, numel: int, rank: int, world: int) -> torch.Tensor:
    inputs = [_rank_input(numel, r).view(world, -1) for r in range(world)]
    if name == "all_gather":
        return torch.cat([inputs[r][r] for r in range(world)])
    return sum(inputs)[rank]


def run_worker(args: argparse.Namespace) -> None:
    rank, world = start_rank()
    times: dict[str, dict[str, list[float]]] = {}
    for size_mb in args.sizes_mb:
        numel = max(world, int(size_mb * MIB / 4) // world * world)
        for name in OPS:
            run, output = _op(name, _rank_input(numel, rank), rank, world)
            # The first call, untimed, is checked against the sum computed locally.
            run()
            if not torch.allclose(output, _expected(name, numel, rank, world), rtol=1e-5, atol=1e-5):
                raise RuntimeError(f"{name} at {size_mb:g} MB gave a wrong result on rank {rank}")
            times.setdefault(f"{size_mb:g}", {})[name] = timed_steps(run, args.warmup + args.iters)[args.warmup:]
    to_driver(args.result, times, world_size=world)

def measure(args: argparse.Namespace) -> dict[str, dict[str, dict[str, dict]]]:
    """link -> size (MB) -> op -> {ms, gbps}: median over repetitions of the slower rank."""
    from tqdm import tqdm

    results: dict[str, dict] = {}
    for link in tqdm(args.links, unit="link"):
        sizes = ",".join(f"{s:g}" for s in args.sizes_mb)
        worker = ["--worker", "--sizes-mb", sizes, *forwarded(args, ("iters", "warmup"))]
        with on_link(link) as prefix:
            ranks = launch(os.path.abspath(__file__), WORLD_SIZE, worker, LINK_TIMEOUT_S, prefix)["ranks"]
        for size, by_op in ranks[0].items():
            for name in by_op:
                slowest = slower_rank(r[size][name] for r in ranks)
                seconds = median(slowest)
                results.setdefault(link, {}).setdefault(size, {})[name] = dict(
                    ms=seconds * 1e3, gbps=float(size) * MIB / seconds / 1e9, samples_s=slowest)
    return results


def table(results: dict) -> str:
    links = list(results)
    sizes = list(next(iter(results.values())))
    rows = []
    for size in sizes:
        for name in OPS:
            cells = []
            for link in links:
                entry = results[link][size][name]
                best = min(REDUCE_SCATTER_WAYS, key=lambda way: results[link][size][way]["ms"]) == name
                cells.append(f"{entry['ms']:.1f}{' *' if best else ''}")
                cells.append(f"{entry['gbps']:.2f}")
            rows.append([size, name, *cells])
    headers = ["size MB", "op"] + [h for link in links for h in (f"{link} ms", f"{link} GB/s")]
    note = "* fastest way to reduce-scatter at that size and link; GB/s = size / time."
    return markdown_table(headers, rows) + "\n\n" + note


def parse_args(argv: Sequence[str]) -> argparse.Namespace:
    parser = arg_parser(__doc__)
    parser.add_argument("--sizes-mb", default="1,8,32", help="full tensor sizes in MiB, comma-separated")
    parser.add_argument("--links", default="loopback,2gbit", help="loopback and/or tc rates, e.g. loopback,2gbit")
    parser.add_argument("--iters", type=int, default=7, help="timed repetitions per op and size")
    parser.add_argument("--warmup", type=int, default=1, help="untimed repetitions after the checked first call")
    parser.add_argument("--out", default="bench_out", help="directory for collectives.json/.md")
    args = parse_with_worker_options(parser, argv)
    try:
        args.sizes_mb = parse_sizes(args.sizes_mb, "--sizes-mb")
        if not args.worker:
            args.links = parse_links(args.links)
    except ValueError as exc:
        parser.error(str(exc))
    if args.iters < 1 or args.warmup < 0:
        parser.error(f"--iters must be >= 1 and --warmup >= 0, got {args.iters} and {args.warmup}")
    return args


def run_driver(args: argparse.Namespace) -> int:
    record = RunRecord("collectives.py", args.argv)
    results = measure(args)
    markdown = f"Command: `{record.command}` (gloo, {WORLD_SIZE} ranks, fp32)\n\n{table(results)}"
    write_results(args.out, "collectives", dict(**record.fields(), world_size=WORLD_SIZE, results=results), markdown)
    return 0


if __name__ == "__main__":
    sys.exit(script_main(None, parse_args, run_worker, run_driver))
