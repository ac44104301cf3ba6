"""Fixed prefetch depths x bucket sizes against the planner's automatic choice, per emulated link
(netns.py): 2 gloo ranks train the default GPT with every configuration built side by side,
taking turns step by step; each configuration's median step and its step-by-step ratio to the
best (an IQR that contains 1: this run cannot tell them apart). The automatic run passes no
depth and no bucket size, as a default run.

    python benchmarks/planner_grid.py --links fast=10gbit slow=2gbit --json planner_grid.json

`--json` keeps the links already in the file that this run does not measure.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from typing import Optional, Sequence

from common import (RunRecord, arg_parser, on_link, quartiles, read_json, run_with_deadline, single_thread_env,
                    start_rank, torchrun, train_step, write_json)

DEPTHS = (0, 1, 2, 3)
BUCKETS = (None, 25.0, 50.0)        # None: no merging
WARMUP, STEPS, BATCH = 2, 20, 4     # untimed steps (at least until the planner decides), timed steps, batch
LINK_TIMEOUT_S = 1200.0
# A bucket smaller than any unit merges nothing: how "no merging" is asked of ShardedModule.
NO_MERGE_MB = 1e-3


def _label(bucket: Optional[float]) -> str:
    return "none" if bucket is None else f"{bucket:g}"


def _worker(out: str) -> None:
    import logging

    import torch
    import torch.distributed as dist

    from overlap import ShardedModule
    from overlap.models.gpt import GPT, Block, GPTConfig
    from overlap.control.replanner import FIRST_DECISION_STEP

    rank, _ = start_rank()
    if rank == 0:
        logging.basicConfig(level=logging.INFO, format="%(message)s")
    config = GPTConfig()
    generator = torch.Generator().manual_seed(0)
    idx = torch.randint(0, config.vocab_size, (BATCH, config.block_size), generator=generator)
    targets = torch.randint(0, config.vocab_size, (BATCH, config.block_size), generator=generator)

    runs = [(d, b) for d in DEPTHS for b in BUCKETS] + [("auto", "auto")]
    models = {}
    for depth, bucket in runs:
        torch.manual_seed(0)
        auto = depth == "auto"
        model = ShardedModule(GPT(config), unit_types=(Block,),
                              prefetch_depth=None if auto else depth,
                              bucket_mb=None if auto else (NO_MERGE_MB if bucket is None else bucket))
        key = "auto" if auto else f"{depth}/{_label(bucket)}"
        train = train_step(model, torch.optim.AdamW(model.parameters(), lr=1e-4), idx, targets)
        models[key] = (model, train, depth, bucket)

    # Warm-up lasts until the planner's first decision.
    warmup = max(WARMUP, FIRST_DECISION_STEP)
    times: dict[str, list[float]] = {key: [] for key in models}
    for step in range(warmup + STEPS):
        order = list(models) if step % 2 == 0 else list(models)[::-1]
        for key in order:
            dist.barrier()
            start = time.perf_counter()
            models[key][1]()
            dist.barrier()
            if step >= warmup:
                times[key].append(time.perf_counter() - start)
    if rank == 0:
        results = {}
        for key, (model, _, depth, bucket) in models.items():
            results[key] = {"depth": depth, "bucket_mb": bucket, "steps_s": times[key],
                            "step_s": statistics.median(times[key]), "step_iqr_s": quartiles(times[key])}
            if key == "auto":
                results[key].update(chosen_depth=model.scheduler.prefetch_depth,
                                    chosen_bucket_mb=model.overlap_config.bucket_mb, units=len(model.scheduler.units))
        write_json(out, results)
    dist.destroy_process_group()


def _run_link(rate: str) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "grid.json")
        worker = ["--worker", "--out", out]
        started = time.perf_counter()
        with on_link(rate) as prefix:
            output = run_with_deadline([*prefix, *torchrun(os.path.abspath(__file__), 2, worker)], LINK_TIMEOUT_S,
                                       env={**single_thread_env(), "OVERLAP_LOG": "INFO"})
        results = read_json(out)
    plans = [line for line in output.splitlines() if "plan at step" in line]
    return {"rate": rate, "results": results, "plan_log": plans, "wall_s": time.perf_counter() - started}


def _ratio_summary(a: dict, b: dict) -> dict:
    """a's step time over b's, step by step of the interleaved loop: median, IQR, tied with 1."""
    ratios = [x / y for x, y in zip(a["steps_s"], b["steps_s"])]
    low, high = quartiles(ratios)
    return {"median": statistics.median(ratios), "iqr": [low, high], "tied": low <= 1.0 <= high}


def _report(name: str, link: dict) -> dict:
    results = link["results"]
    grid = {k: v for k, v in results.items() if k != "auto"}
    best_key = min(grid, key=lambda k: grid[k]["step_s"])
    best = grid[best_key]
    auto = results["auto"]
    to_best = {k: _ratio_summary(v, best) for k, v in grid.items()}
    auto_to_best = _ratio_summary(auto, best)
    print(f"\n{name} link ({link['rate']}): median step seconds, then the median [interquartile range] of "
          "its step-by-step ratio to the best cell; rows: depth, columns: bucket MB")
    print("depth " + "".join(f"{_label(b):>28}" for b in BUCKETS))
    for depth in DEPTHS:
        cells = []
        for bucket in BUCKETS:
            key = f"{depth}/{_label(bucket)}"
            ratio = to_best[key]
            mark = "*" if key == best_key else ("=" if ratio["tied"] else " ")
            cells.append(f"{grid[key]['step_s']:.3f} {ratio['median']:.3f} [{ratio['iqr'][0]:.3f}-{ratio['iqr'][1]:.3f}]{mark}")
        print(f"{depth:>5} " + "".join(f"{c:>28}" for c in cells))
    print("  *: best median step; =: the ratio's interquartile range contains 1 (not told apart from the best)")
    print(f"auto: depth {auto['chosen_depth']}, bucket {auto['chosen_bucket_mb']:.2f} MB ({auto['units']} units) -> "
          f"{auto['step_s']:.3f} s [{auto['step_iqr_s'][0]:.3f}-{auto['step_iqr_s'][1]:.3f}]; best fixed {best_key} "
          f"{best['step_s']:.3f} s; step-by-step ratio {auto_to_best['median']:.3f} "
          f"[{auto_to_best['iqr'][0]:.3f}-{auto_to_best['iqr'][1]:.3f}]")
    for line in link["plan_log"][-2:]:
        print(f"  {line.strip()}")
    return {"best": best_key, "ratio": auto["step_s"] / best["step_s"], "auto_to_best": auto_to_best,
            "cells_to_best": to_best}


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = arg_parser(__doc__)
    parser.add_argument("--links", nargs="+", default=["fast=10gbit", "slow=2gbit"], help="name=rate pairs")
    parser.add_argument("--json", default=None, help="write all results here (links already in the file and not "
                        "measured by this run are kept)")
    parser.add_argument("--report", action="store_true", help="print the tables of the links in --json; run nothing")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--out", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        _worker(args.out)
        return 0
    print(f"planner grid: default GPT, 2 gloo ranks, OMP_NUM_THREADS=1, {WARMUP} warm-up + "
          f"{STEPS} timed steps, configurations interleaved step by step; the machine's cores may be shared")
    summary = {}
    if args.json and os.path.exists(args.json):
        summary = read_json(args.json)
    if args.report:
        for name, link in summary.items():
            _report(name, link)
        return 0
    record = RunRecord("planner_grid.py", sys.argv[1:] if argv is None else argv)
    for spec in args.links:
        name, _, rate = spec.partition("=")
        if not rate:
            parser.error(f"--links entry {spec!r} is invalid; expected name=rate, e.g. slow=2gbit")
        link = _run_link(rate)
        # Links kept from an earlier run keep that run's record.
        summary[name] = {**link, **_report(name, link), "meta": record.fields()}
    if args.json:
        write_json(args.json, summary)
    return 0


if __name__ == "__main__":
    sys.exit(main())
