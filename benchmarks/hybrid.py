"""Full, hybrid and hpZ sharding, and the planner's choice among them, against FSDP2 HSDP and DDP
(defaults and tuned, as in compare.py) on the emulated two-node cluster (cluster.py): 2 nodes x 2
gloo ranks, a throttled link between the nodes, at one or more rates. The benchmark GPT,
batch 4x128 per rank, AdamW; implementations alternate within each
round; a step is the slower rank's; paired per-round ratios against the tuned peers.

    python benchmarks/hybrid.py --rate 1gbit,10gbit --rounds 3 --steps 10 --out docs/results/hybrid.json
"""
from __future__ import annotations

import argparse
import os
import sys
import tempfile
from typing import Sequence

import torch

from cluster import run_on_cluster
from common import (RunRecord, add_options, arg_parser, forwarded, markdown_table, median, paired_ratios,
                    parse_with_worker_options, quartiles, read_json, script_main, slowest_of_ranks, start_rank,
                    timed_steps, write_json)
from gpt_options import token_step

IMPLEMENTATIONS = ("overlap-full", "overlap-hybrid", "overlap-hybrid-int8", "overlap-hpz", "overlap-auto",
                   "fsdp2-hsdp", "fsdp2-hsdp-tuned", "ddp", "ddp-tuned", "ddp-fp16")
GRID = ("overlap-full", "overlap-hybrid", "overlap-hpz")     # what sharding="auto" chooses among
# ShardedModule's rows: (sharding, compression).
SHARDED = {"overlap-full": ("full", "none"), "overlap-hybrid": ("hybrid", "none"),
           "overlap-hybrid-int8": ("hybrid", "int8"), "overlap-hpz": ("hpz", "none"), "overlap-auto": ("auto", "none")}
# Paired per-round ratios reported: (row, peer). Compressed rows against the compressed peer too.
PAIRS = (("overlap-hybrid", "fsdp2-hsdp-tuned"), ("overlap-hybrid", "ddp-tuned"), ("overlap-auto", "fsdp2-hsdp-tuned"),
         ("overlap-auto", "ddp-tuned"), ("overlap-hybrid", "overlap-full"), ("overlap-hybrid-int8", "ddp-fp16"),
         ("overlap-hybrid-int8", "fsdp2-hsdp-tuned"), ("overlap-hybrid-int8", "overlap-hybrid"))
BATCH = 4                   # sequences per rank
FSDP2_PREFETCH = 2          # fsdp2-hsdp-tuned's prefetch lists, in blocks
DDP_BUCKET_MB = 10.0        # ddp-tuned's and ddp-fp16's bucket_cap_mb
RUN_TIMEOUT_S = 900.0


def run_worker(args: argparse.Namespace) -> None:
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    from overlap import ShardedModule
    from overlap.models import GPT, GPTConfig
    from overlap.models.gpt import Block

    import peers

    rank, world = start_rank()
    local = int(os.environ["LOCAL_WORLD_SIZE"])
    config = GPTConfig()
    torch.manual_seed(0)
    model = GPT(config)
    decision = None
    if args.worker in SHARDED:
        sharding, compression = SHARDED[args.worker]
        model = ShardedModule(model, unit_types=(Block,), sharding=sharding, compression=compression)
        decision = model.sharding.describe()
        if model.sharding_choice is not None:
            decision = f"{decision} ({model.sharding_choice.describe()})"
    elif args.worker.startswith("fsdp2-hsdp"):
        mesh = init_device_mesh("cpu", (world // local, local), mesh_dim_names=("replicate", "shard"))
        model = peers.fsdp2(model, args.worker == "fsdp2-hsdp-tuned", FSDP2_PREFETCH, mesh=mesh)
    else:
        model = peers.ddp(model, args.worker, DDP_BUCKET_MB)
    optimizer = peers.make_optimizer(model.parameters(), lr=1e-4)
    step = token_step(model, optimizer, config, BATCH, seed=rank, drawn_first=args.warmup + args.steps)
    times = slowest_of_ranks(timed_steps(step, args.warmup + args.steps))[args.warmup:]
    if rank == 0:
        write_json(args.result, dict(impl=args.worker, step_s=times, decision=decision))
    dist.barrier()


def _one_rate(args: argparse.Namespace, rate: str, scratch: str) -> dict:
    script = os.path.abspath(__file__)
    per_round: list[dict[str, list[float]]] = []
    decisions: dict[str, list[str]] = {}
    load_before = os.getloadavg()
    for round_index in range(args.rounds):
        per_round.append({})
        for impl in IMPLEMENTATIONS:
            result = os.path.join(scratch, f"{rate}-{impl}-{round_index}.json")
            command = [script, "--worker", impl, "--result", result, *forwarded(args, ("steps", "warmup"))]
            nodes = run_on_cluster(rate, 2, command, RUN_TIMEOUT_S, env={"OMP_NUM_THREADS": "1"})
            for node, done in enumerate(nodes):
                if done.returncode != 0:
                    raise RuntimeError(f"{impl} at {rate} failed on node {node}:\n{done.stdout[-3000:]}")
            measured = read_json(result)
            per_round[-1][impl] = measured["step_s"]
            if measured.get("decision"):
                decisions.setdefault(impl, []).append(measured["decision"])
            print(f"{rate} round {round_index + 1} {impl}: done", flush=True)
    steps = {impl: [s for r in per_round for s in r[impl]] for impl in IMPLEMENTATIONS}
    result = summarise(args, rate, steps, decisions)
    result.update(per_round_steps_s=per_round, paired=paired_ratios(per_round, PAIRS),
                  load_average=dict(before=load_before, after=os.getloadavg()))
    return result


def summarise(args: argparse.Namespace, rate: str, steps: dict[str, list[float]],
              decisions: dict[str, list[str]]) -> dict:
    full = median(steps["overlap-full"])
    rows, summary = [], {}
    for impl, values in steps.items():
        q1, q3 = quartiles(values)
        summary[impl] = dict(step_ms=median(values) * 1e3, iqr_ms=[q1 * 1e3, q3 * 1e3], steps=len(values))
        rows.append([impl, f"{median(values) * 1e3:.0f}", f"{q1 * 1e3:.0f}–{q3 * 1e3:.0f}", len(values),
                     f"{median(values) / full:.2f}"])
    table = markdown_table(["implementation", "step ms (median)", "IQR ms", "steps", "÷ overlap-full"], rows)
    text = (f"2 nodes × 2 gloo ranks, inter-node link {rate}, batch {BATCH}×128 per rank, "
            f"{args.rounds} alternated rounds of {args.steps} timed steps\n\n{table}")
    grid = {impl: summary[impl]["step_ms"] for impl in GRID}
    best = min(grid, key=grid.get)
    text += (f"\n\noverlap-auto ÷ best of {', '.join(grid)} ({best}): "
             f"{summary['overlap-auto']['step_ms'] / grid[best]:.2f}")
    for impl, lines in decisions.items():
        text += "".join(f"\n{impl} round {k + 1}: {line}" for k, line in enumerate(lines))
    print(text, flush=True)
    return dict(steps_s=steps, summary=summary, decisions=decisions, table=text)


def run_driver(args: argparse.Namespace) -> int:
    record = RunRecord("hybrid.py", args.argv)
    rates: dict[str, dict] = {}
    with tempfile.TemporaryDirectory() as scratch:
        for rate in args.rates:
            rates[rate] = _one_rate(args, rate, scratch)
            for pair, entry in rates[rate]["paired"].items():
                print(f"{rate} {pair}: per round {', '.join(f'{r:.2f}' for r in entry['per_round'])}; "
                      f"median {entry['median']:.2f} [{entry['min']:.2f}-{entry['max']:.2f}]", flush=True)
            if args.out:            # after each rate: a run cut short keeps what it measured
                write_json(args.out, dict(**record.fields(), rates=rates))
    return 0


def parse_args(argv: Sequence[str]) -> argparse.Namespace:
    parser = arg_parser(__doc__)
    parser.add_argument("--rate", default="1gbit", help="inter-node link rates (tc tbf), comma-separated")
    add_options(parser, rounds=2, steps=10, warmup=2, out=None)
    args = parse_with_worker_options(parser, argv, IMPLEMENTATIONS)
    args.rates = [rate.strip() for rate in args.rate.split(",") if rate.strip()]
    return args


if __name__ == "__main__":
    sys.exit(script_main(None, parse_args, run_worker, run_driver))
