"""What the check that every rank runs the same units costs per step (overlap/runtime/order_check.py).

Two gloo ranks train a 6-block GPT with ShardedModule; rounds with the check and without it
alternate, and the per-round ratios of median steps are summarised. Also timed alone: one
order word exchange, one step's bookkeeping and the end-of-backward all-reduce with and
without the check's words.

    python benchmarks/order_check.py --rounds 5 --steps 10
"""
from __future__ import annotations

import argparse
import sys
import time
from typing import Sequence

from common import (RunRecord, add_options, arg_parser, in_turns, launch_worker, markdown_table, median,
                    parse_with_worker_options, patched, ratio_cell, ratio_fields, script_main, seconds_of, slower_rank,
                    start_rank, to_driver, train_step, write_results)

WORLD_SIZE = 2


def _train_steps(model, optimizer, batch, steps: int) -> float:
    """Median seconds of `steps` training steps."""
    step = train_step(model, optimizer, *batch)
    return median([seconds_of(step) for _ in range(steps)])


def run_worker(args: argparse.Namespace) -> None:
    import torch
    import torch.distributed as dist

    from overlap import ShardedModule
    from overlap.models import GPT, Block, GPTConfig

    rank, _ = start_rank()
    torch.manual_seed(0)
    config = GPTConfig(n_layer=6, n_embd=args.width, n_head=8, vocab_size=8192, block_size=128)
    model = ShardedModule(GPT(config), unit_types=(Block,), prefetch_depth=1, bucket_mb=1e-3)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    gen = torch.Generator().manual_seed(rank)
    idx = torch.randint(0, config.vocab_size, (4, 128), generator=gen)
    batch = (idx, idx)
    scheduler, collectives = model.scheduler, model.collectives
    check = scheduler.order
    _train_steps(model, optimizer, batch, 2)                       # warm-up

    def steps_with(name: str) -> float:
        scheduler.order = collectives.watch = check if name == "with check" else None
        dist.barrier()
        return _train_steps(model, optimizer, batch, args.steps)

    # Which setting goes first alternates, so drift in the machine's load splits evenly.
    step_s = in_turns(("with check", "without"), args.rounds, steps_with)
    scheduler.order = collectives.watch = check

    # The order words of one step: one before each collective of the shard group.
    issued: list[tuple[str, str, int]] = []
    original = check.before_issue

    def counted(kind: str, unit: str, nbytes: int) -> None:
        issued.append((kind, unit, nbytes))
        original(kind, unit, nbytes)

    with patched((check, "before_issue", counted)):
        _train_steps(model, optimizer, batch, 1)
    # One order word exchange alone, as `before_issue` makes it.
    word_times = [seconds_of(lambda: check.before_issue("all_gather", "bench", 0)) for _ in range(300)]

    # The bookkeeping alone: one step's notes, words and reset, as the scheduler makes them.
    units = len(scheduler.all_units)
    repetitions = 2000
    start = time.perf_counter()
    for _ in range(repetitions):
        for i in range(units):
            check.ran(i, backward=False)
        check.boundary(-1)
        for i in reversed(range(units)):
            check.ran(i, backward=True)
        check.boundary(-2)
        words = check.words()
        check.verify(words, words)
    bookkeeping_s = (time.perf_counter() - start) / repetitions

    # The end-of-backward all-reduce, with and without the check's words, taking turns.
    flags = [True] * sum(len(g.slots) for u in scheduler.all_units for g in u.trainable_groups)
    variants = {"flags only": [], "flags + check": check.words()}
    times: dict[str, list[float]] = {name: [] for name in variants}
    for _ in range(300):
        for name, words in variants.items():
            times[name].append(seconds_of(lambda: collectives.any_rank(flags, words)()))
    all_reduce_s = {name: median(samples) for name, samples in times.items()}
    to_driver(args.result, dict(step_s=step_s, bookkeeping_s=bookkeeping_s, all_reduce_s=all_reduce_s, units=units,
                                flags=len(flags), words_per_step=len(issued), word_s=median(word_times)),
              width=args.width, rounds=args.rounds, steps=args.steps)


def run_driver(args: argparse.Namespace) -> int:
    record = RunRecord("order_check.py", args.argv)
    data = launch_worker(__file__, WORLD_SIZE, args, ("rounds", "steps", "width"))
    ranks = data["ranks"]
    rounds = {name: slower_rank(r["step_s"][name] for r in ranks) for name in ranks[0]["step_s"]}
    with_check, without = median(rounds["with check"]), median(rounds["without"])
    ratios = [w / o for w, o in zip(rounds["with check"], rounds["without"])]
    summary = dict(
        step_ms_with_check=round(with_check * 1e3, 2), step_ms_without=round(without * 1e3, 2),
        difference_ms=round((with_check - without) * 1e3, 2),
        **ratio_fields(ratios, 4),
        words_per_step=ranks[0]["words_per_step"],
        word_us=round(max(r["word_s"] for r in ranks) * 1e6, 1),
        bookkeeping_us=round(max(r["bookkeeping_s"] for r in ranks) * 1e6, 1),
        all_reduce_us={name: round(max(r["all_reduce_s"][name] for r in ranks) * 1e6, 1)
                       for name in ranks[0]["all_reduce_s"]},
        units=ranks[0]["units"], flags=ranks[0]["flags"])
    summary["words_ms_per_step"] = round(summary["words_per_step"] * summary["word_us"] / 1e3, 2)
    table = markdown_table(
        ["", "µs or ms"],
        [["step, with the check (median of rounds)", f"{summary['step_ms_with_check']} ms"],
         ["step, without it", f"{summary['step_ms_without']} ms"],
         [f"with / without, per round: median (range of {args.rounds})", ratio_cell(summary)],
         [f"one order word exchange ({summary['words_per_step']} per step)", f"{summary['word_us']} µs"],
         [f"bookkeeping of one step ({summary['units']} units)", f"{summary['bookkeeping_us']} µs"],
         *[[f"end-of-backward all-reduce, {name} ({summary['flags']} flags)", f"{value} µs"]
           for name, value in summary["all_reduce_us"].items()]])
    write_results(args.out, "order_check", dict(**record.fields(), summary=summary, **data), table)
    return 0


def parse_args(argv: Sequence[str]) -> argparse.Namespace:
    parser = arg_parser(__doc__)
    parser.add_argument("--steps", type=int, default=10, help="timed steps per round and setting")
    add_options(parser, rounds=5, width=512, out="bench_out", timeout=900.0)
    return parse_with_worker_options(parser, argv)


if __name__ == "__main__":
    sys.exit(script_main(None, parse_args, run_worker, run_driver))
