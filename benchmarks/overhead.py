"""The host cost of a ZeRO-3 runtime itself (issuing collectives, hooks, casts, events,
bookkeeping) on a chain of tiny units (`nn.Linear(8, 8)` each) trained with SGD on a batch of 2:

    host time per unit per step = (median wrapped step - median plain step) / units

the plain model taking turns with the wrapped one in the same launch; a step is the slower
rank's. Rows: ShardedModule in every sharding and compression mode the world size allows
(hybrid and hpZ on two emulated nodes of one rank), fully_shard, FSDP2 default and tuned
(peers.py), DeepSpeed ZeRO-3 where installed, and with --baseline another checkout's rows.
Rows alternate within each round; ratios are per round. Also the overlap report's "runtime"
share of the step, and with --profile a cProfile of the 16-unit, 1-rank ShardedModule row.

    python benchmarks/overhead.py --units 16 --world 1 2 --rounds 3 --baseline ../baseline \
        --out docs/results/overhead_before.json --profile docs/results/overhead_profile_before.txt
"""
from __future__ import annotations

import argparse
import logging
import math
import os
import platform
import resource
import sys
import time
from dataclasses import dataclass, replace
from typing import Any, Callable, Optional, Sequence

import torch

import peers
from common import (REPOSITORY as REPO, RunRecord, add_options, arg_parser, checkout_python, forwarded, git_commit,
                    launch, parse_with_worker_options, print_and_write, require_min, script_main, single_rank_env,
                    start_rank, to_driver, write_text)
from overhead_report import (BASELINE_SUFFIX, DEEPSPEED, FSDP2, FSDP2_TUNED, OVERLAP, OVERLAP_FULLY_SHARD,
                             host_s_per_unit, host_table, share_table, summarize)

log = logging.getLogger("overhead")

WIDTH = 8                       # each unit is one nn.Linear(WIDTH, WIDTH)
PROFILE_UNITS = 16
PROFILE_ENTRIES = 40            # rows of each table in the profile
BATCH, LR, SEED = 2, 1e-3, 0    # SGD on a batch of 2
FSDP2_PREFETCH = 2              # FSDP2_TUNED: blocks in each explicit forward/backward prefetch list
RUN_TIMEOUT_S = 300             # one launch
# overlap.base.choices.SHARDINGS and COMPRESSION_MODES: the driver does not import the package.
SHARDINGS = ("full", "hybrid", "hpz")
COMPRESSIONS = ("none", "int8", "int8-int4")


@dataclass(frozen=True)
class Row:
    """One implementation measured: what the worker builds, and whose interpreter runs it."""

    name: str
    impl: str                           # OVERLAP, FSDP2, FSDP2_TUNED or DEEPSPEED
    sharding: str = "full"
    compression: str = "none"
    baseline: bool = False              # ShardedModule of the --baseline checkout
    order_check: str = "collective"     # OVERLAP_ORDER_CHECK (ranks compare their units per collective or per step)


def overlap_rows(world: int) -> list[Row]:
    """ShardedModule in every sharding and compression mode that differs at `world` ranks."""
    shardings = SHARDINGS if world > 1 else ("full",)
    rows = [Row(f"overlap-{sharding}" + ("" if compression == "none" else f"-{compression}"), OVERLAP,
                sharding, compression) for sharding in shardings for compression in COMPRESSIONS]
    if world > 1:
        # Without the order word before every collective (one host round trip each).
        rows.append(Row("overlap-full-order-step", OVERLAP, order_check="step"))
    return rows


def all_rows(world: int, baseline: bool) -> list[Row]:
    ours = [*overlap_rows(world), Row(OVERLAP_FULLY_SHARD, OVERLAP_FULLY_SHARD)]
    theirs = [replace(row, name=row.name + BASELINE_SUFFIX, baseline=True) for row in ours
              if baseline and row.order_check == "collective"]
    return [*ours, Row(FSDP2, FSDP2), Row(FSDP2_TUNED, FSDP2_TUNED), Row(DEEPSPEED, DEEPSPEED), *theirs]


# The worker is this file's, whichever checkout's interpreter runs it: what is measured is the
# `overlap` package that interpreter imports (the driver checks which one it was).

class Unit(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = torch.nn.Linear(WIDTH, WIDTH)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear(x)


class Chain(torch.nn.Module):
    """`units` tiny units in a row; `blocks` is the name peers.fsdp2 wraps."""

    def __init__(self, units: int) -> None:
        super().__init__()
        self.blocks = torch.nn.ModuleList(Unit() for _ in range(units))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return x


def _sgd_step(model: torch.nn.Module, optimizer: Optional[torch.optim.Optimizer]) -> Callable:
    """One step on a batch; without `optimizer`, `model` is DeepSpeed's engine, which steps its own."""
    def step(batch: torch.Tensor) -> torch.Tensor:
        loss = model(batch).square().mean()
        if optimizer is None:
            model.backward(loss)
            model.step()            # steps the optimizer and clears the gradients
        else:
            loss.backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
        return loss.detach()

    return step


def _wrap(args: argparse.Namespace, model: Chain):
    """(wrapped model, step function) for the row the worker runs."""
    if args.worker == DEEPSPEED:
        import deepspeed

        optimizer = torch.optim.SGD(model.parameters(), lr=LR)
        # Threshold 0: every parameter is partitioned and gathered, as in the other rows
        # (DeepSpeed's default would keep all of these tiny ones whole on every rank).
        config = peers.deepspeed_zero3_config(BATCH, WIDTH * (WIDTH + 1), persistence_threshold=0)
        engine, _, _, _ = deepspeed.initialize(model=model, optimizer=optimizer, config=config)
        return engine, _sgd_step(engine, None)
    if args.worker in (FSDP2, FSDP2_TUNED):
        wrapped = peers.fsdp2(model, args.worker == FSDP2_TUNED, FSDP2_PREFETCH)
    elif args.worker == OVERLAP_FULLY_SHARD:
        from overlap import fully_shard

        wrapped = peers.shard_by_block(fully_shard, model)
    else:
        from overlap import ShardedModule

        # `overlap train`'s settings: the planner's prefetch depth and bucket size, fp32.
        wrapped = ShardedModule(model, unit_types=(Unit,), sharding=args.sharding, compression=args.compression)
    return wrapped, _sgd_step(wrapped, torch.optim.SGD(wrapped.parameters(), lr=LR))


def _overlap_facts(model) -> dict[str, Any]:
    """The settings ShardedModule chose, the report's mean step and which checkout ran."""
    import overlap

    mean = model.overlap_report().mean_step()
    codec = model.collectives.codec
    return dict(runtime_units=len(model.scheduler.units), prefetch_depth=model.overlap_config.prefetch_depth,
                bucket_mb=model.overlap_config.bucket_mb, sharding=model.sharding.describe(),
                compression="none" if codec is None else codec.settings.mode,
                report={key: getattr(mean, key) for key in ("span_s", "runtime_s", "compute_s", "gather_wait_s",
                                                            "reduce_wait_s")},
                package_root=os.path.dirname(os.path.dirname(os.path.abspath(overlap.__file__))))


def relative_paths(text: str, package_root: str) -> str:
    """`text` without this machine's directories: the checkout's root dropped, 'site-packages/',
    'stdlib/', and any other absolute path reduced to its file name."""
    import re
    import site
    import sysconfig

    prefixes = [(package_root + os.sep, ""), (REPO + os.sep, "")]
    prefixes += [(path + os.sep, "site-packages/") for path in site.getsitepackages()]
    prefixes += [(sysconfig.get_paths()["stdlib"] + os.sep, "stdlib/")]
    for prefix, replacement in sorted(prefixes, key=lambda p: -len(p[0])):
        text = text.replace(prefix, replacement)
    return re.sub(r"(?<![\w.])/(?:[^/\s:()]+/)+", "", text)


def _profile(step, batch: torch.Tensor, steps: int, package_root: str) -> str:
    """cProfile of `steps` steps, the top entries by own and by cumulative time."""
    import cProfile
    import io
    import pstats

    profiler = cProfile.Profile()
    profiler.enable()
    for _ in range(steps):
        step(batch)
    profiler.disable()
    out = io.StringIO()
    stats = pstats.Stats(profiler, stream=out)
    out.write(f"cProfile of {steps} steady-state steps\n\n== by own (total) time ==\n")
    stats.sort_stats("tottime").print_stats(PROFILE_ENTRIES)
    out.write("\n== by cumulative time ==\n")
    stats.sort_stats("cumulative").print_stats(PROFILE_ENTRIES)
    return relative_paths(out.getvalue(), package_root)


def run_worker(args: argparse.Namespace) -> None:
    if args.ranks_per_node:
        # Two emulated nodes: hybrid and hpZ read the node size from LOCAL_WORLD_SIZE.
        os.environ["LOCAL_WORLD_SIZE"] = str(args.ranks_per_node)
    rank, _ = start_rank()
    (units,) = args.units
    torch.manual_seed(SEED)
    plain = Chain(units)
    torch.manual_seed(SEED)
    model, wrapped_step = _wrap(args, Chain(units))
    plain_step = _sgd_step(plain, torch.optim.SGD(plain.parameters(), lr=LR))
    batch = torch.randn(BATCH, WIDTH, generator=torch.Generator().manual_seed(SEED * 1009 + rank))

    # Plain and wrapped steps take turns, so that load from other programs falls on both alike.
    wrapped_s, plain_s, losses = [], [], []
    for step in range(args.warmup + args.steps):
        if step == args.warmup:
            cpu_start, wall_start = time.process_time(), time.perf_counter()
        start = time.perf_counter()
        plain_step(batch)
        middle = time.perf_counter()
        losses.append(wrapped_step(batch))
        end = time.perf_counter()
        if step >= args.warmup:
            plain_s.append(middle - start)
            wrapped_s.append(end - middle)
    if not all(math.isfinite(float(loss)) for loss in losses):
        raise RuntimeError(f"rank {rank}: {args.worker} has a non-finite loss: {[float(loss) for loss in losses]}")
    mine = dict(wrapped_s=wrapped_s, plain_s=plain_s, loss=[float(loss) for loss in losses],
                cpu_s=time.process_time() - cpu_start, wall_s=time.perf_counter() - wall_start)
    facts = _overlap_facts(model) if args.worker == OVERLAP else \
        _overlap_facts(model._overlap_runtime) if args.worker == OVERLAP_FULLY_SHARD else {}
    if args.profile_out:
        write_text(args.profile_out, _profile(wrapped_step, batch, args.steps, facts["package_root"]))
    to_driver(args.result, mine, **facts)


def _launch(args: argparse.Namespace, row: Row, world: int, units: int, profile_out: Optional[str] = None) -> dict:
    """Run `row` once on `world` ranks (one rank: without torchrun's agent) and read its result."""
    checkout = args.baseline if row.baseline else REPO
    python = checkout_python(checkout) if row.baseline else sys.executable
    worker = ["--worker", row.impl, "--units", str(units), "--sharding", row.sharding, "--compression", row.compression,
              *(["--ranks-per-node", "1"] if row.sharding != "full" and world > 1 else []),
              *(["--profile-out", profile_out] if profile_out else []), *forwarded(args, ("warmup", "steps"))]
    env = {"OVERLAP_ORDER_CHECK": row.order_check, **(single_rank_env() if world == 1 else {})}
    data = launch(os.path.abspath(__file__), None if world == 1 else world, worker, RUN_TIMEOUT_S, python=python,
                  env=env)
    root = data.pop("package_root", None)
    if root is not None and os.path.realpath(root) != os.path.realpath(checkout):
        raise RuntimeError(f"{row.name} ran the package of {root}, not of {checkout}")
    return data


def run_all(args: argparse.Namespace) -> list[dict]:
    """Every (world, units, round, row) launch, rows alternating within a round."""
    runs = []
    for world in args.world:
        rows = [row for row in all_rows(world, bool(args.baseline))
                if row.name in args.rows and row.name not in args.skipped]
        for units in args.units:
            for round_index in range(args.rounds):
                for row in rows:
                    load_before = os.getloadavg()[0]
                    data = _launch(args, row, world, units)
                    runs.append(dict(world=world, units=units, round=round_index, row=row.name,
                                     load_1min=[load_before, os.getloadavg()[0]], **data))
                    log.info("world %d, %d units, round %d, %s: host %.3f ms per unit per step", world, units,
                             round_index + 1, row.name, host_s_per_unit(runs[-1]) * 1e3)
    return runs


def _launched_cpu_s() -> float:
    """CPU seconds the launched processes (and theirs) have used so far."""
    children = resource.getrusage(resource.RUSAGE_CHILDREN)
    return children.ru_utime + children.ru_stime


def write_outputs(args: argparse.Namespace, runs: list[dict], summary: dict, record: RunRecord,
                  cpu_before: float) -> None:
    """The tables printed and, with --out, the run's record, summary and launches as JSON."""
    meta = dict(command=record.command, commit=record.commit,
                baseline_commit=git_commit(args.baseline) if args.baseline else None,
                units=args.units, world=args.world, rounds=args.rounds, warmup=args.warmup, steps=args.steps,
                batch=BATCH, width=WIDTH, optimizer=f"SGD(lr={LR})", skipped=args.skipped,
                torch=record.torch, python=platform.python_version(), cpus=os.cpu_count(), time=record.started,
                host_load=record.host_load(launched_cpu_s=_launched_cpu_s() - cpu_before),
                profile=os.path.relpath(args.profile, REPO) if args.profile else None)
    text = "\n\n".join([
        f"Command: `{meta['command']}`",
        f"{args.rounds} round(s) × {args.steps} timed steps after {args.warmup} warm-up; units of "
        f"nn.Linear({WIDTH}, {WIDTH}), batch {BATCH}, SGD. Host time per unit per step = (median wrapped "
        "step − median plain step in the same launch) ÷ units; ratios are per round, median (range); CPU/wall "
        "well below 1: the launch waited for the cores.",
        *(f"{row}: skipped ({reason})." for row, reason in args.skipped.items()),
        host_table(summary),
        "Runtime share of the step in the overlap report (ShardedModule with `overlap train`'s defaults):",
        share_table(summary)])
    print_and_write(text, args.out, dict(meta=meta, results=summary, runs=runs))


def parse_args(argv: Sequence[str]) -> argparse.Namespace:
    parser = arg_parser(__doc__)
    parser.add_argument("--units", type=int, nargs="+", default=[8, 16, 32, 64], help="units in the model")
    parser.add_argument("--world", type=int, nargs="+", default=[1, 2], choices=(1, 2), help="ranks")
    parser.add_argument("--rows", default=None, help="comma-separated rows to run (default: all)")
    parser.add_argument("--warmup", type=int, default=5, help="untimed steps at the start of each launch")
    parser.add_argument("--steps", type=int, default=30, help="timed steps per launch")
    add_options(parser, rounds=3)
    parser.add_argument("--baseline", help="another checkout with its environment in .venv (`make setup` there): "
                        f"its ShardedModule and fully_shard rows ('<row>{BASELINE_SUFFIX}') run in the same rounds")
    parser.add_argument("--out", default=None, help="result JSON")
    parser.add_argument("--profile", default=None, metavar="TXT",
                        help=f"write a cProfile of the {PROFILE_UNITS}-unit 1-rank ShardedModule row here")
    parser.add_argument("--sharding", default="full", choices=SHARDINGS, help=argparse.SUPPRESS)
    parser.add_argument("--compression", default="none", choices=COMPRESSIONS, help=argparse.SUPPRESS)
    parser.add_argument("--ranks-per-node", type=int, default=None, help=argparse.SUPPRESS)
    parser.add_argument("--profile-out", help=argparse.SUPPRESS)
    args = parse_with_worker_options(parser, argv, (OVERLAP, OVERLAP_FULLY_SHARD, FSDP2, FSDP2_TUNED, DEEPSPEED))
    if args.worker:
        return args
    require_min(parser, args, 1, "rounds", "steps", "warmup")      # the first step learns the order
    if min(args.units) < 1:
        parser.error(f"--units must be >= 1, got {args.units}")
    if args.baseline and not os.path.exists(checkout_python(args.baseline)):
        parser.error(f"--baseline {args.baseline}: no {checkout_python(args.baseline)}; run `make setup` there")
    names = {row.name for world in args.world for row in all_rows(world, bool(args.baseline))}
    args.rows = names if args.rows is None else {name.strip() for name in args.rows.split(",") if name.strip()}
    if not args.rows or args.rows - names:
        parser.error(f"--rows: unknown {sorted(args.rows - names)}; choose from {', '.join(sorted(names))}")
    args.skipped = {row: reason for row, reason in peers.unavailable().items() if row in args.rows}
    return args


def write_profile(args: argparse.Namespace, record: RunRecord) -> None:
    _launch(args, Row("overlap-full", OVERLAP), 1, PROFILE_UNITS, args.profile)
    with open(args.profile) as f:
        profile = f.read()
    header = (f"ShardedModule (full sharding, no compression), {PROFILE_UNITS} units, 1 rank: the {args.steps} "
              f"steps after {args.warmup + args.steps} others; commit {record.commit}\n{record.command}\n\n")
    write_text(args.profile, header + profile)
    log.info("profile written to %s", args.profile)


def run_driver(args: argparse.Namespace) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    record = RunRecord("overhead.py", args.argv, hidden={args.baseline: "<baseline>"})
    cpu_before = _launched_cpu_s()
    runs = run_all(args)
    if args.profile:
        write_profile(args, record)
    summary = summarize(runs, bool(args.baseline))
    write_outputs(args, runs, summary, record, cpu_before)
    return 0


if __name__ == "__main__":
    sys.exit(script_main(None, parse_args, run_worker, run_driver))
