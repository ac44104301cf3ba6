"""Peak memory and time of wrapping a large GPT with ShardedModule, built eagerly (rank 0's values
broadcast) against on the meta device (each rank materialises only its parts); optionally one
AdamW step after. Each configuration is one launch of 2 gloo ranks, alternated round by round.

    python benchmarks/wrap_memory.py --layers 20 --hidden 2048 --rounds 2 --train-step \
        --out docs/results/wrap_memory.json
"""
from __future__ import annotations

import argparse
import sys
import time
from typing import Optional, Sequence

import torch

from common import (RunRecord, add_options, arg_parser, launch_worker, markdown_table, median,
                    parse_with_worker_options, peak_rss, print_and_write, script_main, start_rank, to_driver)

WORLD_SIZE = 2
GIB = 2**30
MODES = ("eager", "meta")


def run_worker(args: argparse.Namespace) -> None:
    import torch.distributed as dist

    from overlap import ShardedModule
    from overlap.models import GPT, GPTConfig
    from overlap.models.gpt import Block

    start_rank()
    config = GPTConfig(n_layer=args.layers, n_embd=args.hidden, n_head=args.heads, vocab_size=args.vocab,
                       block_size=args.seq)
    before = peak_rss()
    dist.barrier()
    start = time.perf_counter()
    torch.manual_seed(0)
    if args.mode == "meta":
        with torch.device("meta"):
            model = GPT(config)
    else:
        model = GPT(config)
    sharded = ShardedModule(model, unit_types=(Block,), prefetch_depth=1, bucket_mb=1.0)
    dist.barrier()
    wrap_s = time.perf_counter() - start
    after_wrap = peak_rss()
    shard_bytes = sum(p.numel() * p.element_size() for p in sharded.parameters())
    largest_unit = max(sum(g.padded_numel * g.master_dtype.itemsize for g in unit.groups)
                       for unit in sharded.scheduler.all_units)
    after_step = None
    if args.train_step:
        optimizer = torch.optim.AdamW(sharded.parameters(), lr=1e-4)
        tokens = torch.randint(0, args.vocab, (1, args.seq + 1))
        sharded(tokens[:, :-1], tokens[:, 1:]).backward()
        optimizer.step()
        after_step = peak_rss()
    to_driver(args.result, dict(before=before, after_wrap=after_wrap, after_step=after_step, wrap_s=wrap_s,
                                shard_bytes=shard_bytes, largest_unit_bytes=largest_unit),
              mode=args.mode, params=config.num_params)
    dist.barrier()


def run_driver(args: argparse.Namespace) -> int:
    record = RunRecord("wrap_memory.py", args.argv)
    runs = []
    for round_index in range(args.rounds):
        for mode in MODES:
            options = ("layers", "hidden", "heads", "vocab", "seq", "train_step")
            runs.append(launch_worker(__file__, WORLD_SIZE, args, options, "--mode", mode))
            print(f"round {round_index + 1} {mode}: done", flush=True)
    rows, summary = [], {}
    for mode in MODES:
        mine = [r for r in runs if r["mode"] == mode]

        def worst(key: str) -> Optional[float]:
            values = [max(rank[key] for rank in run["ranks"]) for run in mine if run["ranks"][0][key] is not None]
            return median(values) if values else None

        first = mine[0]["ranks"][0]
        summary[mode] = dict(params=mine[0]["params"], wrap_s=worst("wrap_s"), rss_before=worst("before"),
                             rss_after_wrap=worst("after_wrap"), rss_after_step=worst("after_step"),
                             shard_bytes=first["shard_bytes"], largest_unit_bytes=first["largest_unit_bytes"])
        s = summary[mode]
        bound = s["rss_before"] + s["shard_bytes"] + s["largest_unit_bytes"]
        rows.append([mode, f"{s['params'] / 1e9:.2f}B", f"{s['wrap_s']:.1f}", f"{s['rss_before'] / GIB:.2f}",
                     f"{s['rss_after_wrap'] / GIB:.2f}", f"{bound / GIB:.2f}",
                     "–" if s["rss_after_step"] is None else f"{s['rss_after_step'] / GIB:.2f}"])
    table = markdown_table(["build", "params", "wrap s", "RSS after imports GiB", "peak RSS after wrap GiB",
                            "imports + shard + largest unit GiB", "peak RSS after a step GiB"], rows)
    text = (f"GPT, {args.layers} layers, d={args.hidden}, vocab {args.vocab}, fp32, {WORLD_SIZE} gloo ranks "
            f"(per rank, the larger of the two; median of {args.rounds} rounds)\n\n{table}")
    print_and_write(text, args.out, dict(**record.fields(), runs=runs, summary=summary, table=text))
    return 0


def parse_args(argv: Sequence[str]) -> argparse.Namespace:
    parser = arg_parser(__doc__)
    add_options(parser, layers=20, hidden=2048, heads=16, vocab=8192, seq=128, rounds=2, out=None, timeout=1200.0)
    parser.add_argument("--train-step", action="store_true", help="also one AdamW training step after wrapping")
    parser.add_argument("--mode", choices=MODES, help=argparse.SUPPRESS)
    return parse_with_worker_options(parser, argv)


if __name__ == "__main__":
    sys.exit(script_main(None, parse_args, run_worker, run_driver))
