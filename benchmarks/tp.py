"""ZeRO-3 over dp of a tensor-parallel GPT against FSDP2 + TP with the same plan, at (dp, tp) =
(2, 2) on 4 gloo ranks: ShardedModule over mesh["dp"] after `parallelize_module(model,
mesh["tp"], gpt_tp_plan())`, FSDP2 with its defaults and tuned (`peers.fsdp2`). Implementations
alternate within each round; paired per-round ratios; peak memory (MemTracker and RSS).

    python benchmarks/tp.py --rounds 3 --steps 4 --out docs/results/tp.json
"""
from __future__ import annotations

import argparse
import sys
from typing import Sequence

import torch

import peers
from common import (RunRecord, add_options, arg_parser, launch_worker, markdown_table, median, paired_ratios,
                    parse_with_worker_options, peak_rss, script_main, slowest_of_ranks, start_rank, timed_steps,
                    to_driver, write_json)
from gpt_options import token_step

IMPLEMENTATIONS = ("overlap-tp", "fsdp2-tp", "fsdp2-tp-tuned")
PEERS = ("fsdp2-tp", "fsdp2-tp-tuned")
DP, TP = 2, 2
BATCH = 4                   # sequences per dp rank
FSDP2_PREFETCH = 1          # tuned FSDP2's explicit prefetch depth


def _build(args: argparse.Namespace):
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import parallelize_module

    from overlap import ShardedModule
    from overlap.models import GPT, GPTConfig
    from overlap.models.gpt import Block
    from overlap.models.tensor_parallel_plan import gpt_tp_plan

    mesh = init_device_mesh("cpu", (DP, dist.get_world_size() // DP), mesh_dim_names=("dp", "tp"))
    config = GPTConfig()
    torch.manual_seed(0)
    model = GPT(config)
    parallelize_module(model, mesh["tp"], gpt_tp_plan())
    if args.worker == "overlap-tp":
        model = ShardedModule(model, unit_types=(Block,), mesh=mesh["dp"])
    else:
        model = peers.fsdp2(model, args.worker == "fsdp2-tp-tuned", FSDP2_PREFETCH, mesh=mesh["dp"])
    return model, mesh, config


def run_worker(args: argparse.Namespace) -> None:
    start_rank()
    model, mesh, config = _build(args)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, foreach=True)
    train = token_step(model, optimizer, config, BATCH, seed=mesh.get_local_rank("dp"))  # the same on tp ranks
    losses: list[float] = []

    def step() -> None:
        losses.append(float(train()))

    times = slowest_of_ranks(timed_steps(step, args.warmup + args.steps))[args.warmup:]
    # The gathered flat buffers of ShardedModule are registered with MemTracker, as in compare.py.
    tracked = peers.tracked_memory(model, optimizer, step, flat_buffers=hasattr(model, "scheduler"))
    to_driver(args.result, (tracked["peak"].get("Total", 0), peak_rss()), impl=args.worker, step_s=times, losses=losses)


def run_driver(args: argparse.Namespace) -> int:
    record = RunRecord("tp.py", args.argv)
    per_round: list[dict[str, list[float]]] = []
    memory: dict[str, dict] = {}
    for round_index in range(args.rounds):
        per_round.append({})
        for impl in IMPLEMENTATIONS:
            measured = launch_worker(__file__, DP * TP, args, ("steps", "warmup"), impl)
            per_round[-1][impl] = measured["step_s"]
            tracked, rss = zip(*measured["ranks"])
            memory[impl] = dict(peak_tracked=list(tracked), peak_rss=list(rss), losses=measured["losses"])
            print(f"round {round_index + 1} {impl}: median {median(measured['step_s']):.3f} s", flush=True)
    rows = [(impl, f"{median([s for r in per_round for s in r[impl]]):.3f}",
             f"{max(memory[impl]['peak_tracked']) / 2**20:.1f}", f"{max(memory[impl]['peak_rss']) / 2**20:.0f}")
            for impl in IMPLEMENTATIONS]
    paired = paired_ratios(per_round, [("overlap-tp", peer) for peer in PEERS], "{row}/{peer}")
    print(markdown_table(["implementation", "median step (s)", "peak tracked MiB (max rank)", "peak RSS MiB (max rank)"],
                         rows))
    for name, ratio in paired.items():
        print(f"{name}: paired per-round step ratio median {ratio['median']:.3f} "
              f"(range {ratio['min']:.3f}-{ratio['max']:.3f}, {len(ratio['per_round'])} rounds)")
    if args.out:
        write_json(args.out, dict(record.fields(), dp=DP, tp=TP, batch=BATCH,
                                  per_round_steps_s=per_round, memory=memory, paired=paired))
    return 0


def parse_args(argv: Sequence[str]) -> argparse.Namespace:
    parser = arg_parser(__doc__)
    add_options(parser, rounds=3, steps=4, warmup=2, timeout=900.0, out=None)
    return parse_with_worker_options(parser, argv, IMPLEMENTATIONS)


if __name__ == "__main__":
    sys.exit(script_main(None, parse_args, run_worker, run_driver))
