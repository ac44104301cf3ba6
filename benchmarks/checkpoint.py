"""Time to save and load a sharded checkpoint of the benchmark GPT and its AdamW state on 2
gloo ranks: synchronous against asynchronous save (with training steps while the files are
written), with checksums against without, and load verified against unverified; each pair
alternated round by round and its cost given as per-round ratios. Also how fast the candidate
checksums hash, and the growth of resident memory during a synchronous save.

    python benchmarks/checkpoint.py --rounds 8 --out docs/results/checkpoint.json
"""
from __future__ import annotations

import argparse
import hashlib
import os
import shutil
import sys
import tempfile
import zlib
from typing import Sequence

import torch

from common import (PeakMemory, RunRecord, add_options, arg_parser, launch_worker, markdown_table, median,
                    parse_with_worker_options, print_and_write, quartiles, require_min, script_main, seconds_of, slowest_of_ranks,
                    start_rank, timed_steps, write_json)
from gpt_options import token_step

WORLD_SIZE = 2
MIB = 2**20
# The candidate checksums, and how much each hashes per measurement.
HASHES = {"crc32": zlib.crc32, "blake2b": lambda data: hashlib.blake2b(data).digest()}
HASHED_BYTES = 64 * MIB


def run_worker(args: argparse.Namespace) -> None:
    import torch.distributed as dist

    from overlap import ShardedModule, checkpoint
    from overlap.models import GPT, GPTConfig

    rank, _ = start_rank()
    torch.manual_seed(0)
    config = GPTConfig()
    model = ShardedModule(GPT(config))
    optimizer = torch.optim.AdamW(model.module.optimizer_groups(model.named_parameters(), 0.1), lr=1e-4)
    step = token_step(model, optimizer, config, args.batch, seed=rank)

    def slowest(value: float) -> float:
        return slowest_of_ranks([value])[0]

    def timed(fn) -> float:
        return slowest(timed_steps(fn, 1)[0])

    data = os.urandom(HASHED_BYTES)
    hash_gib_s = {}
    for name, fn in HASHES.items():
        dist.barrier()
        hash_gib_s[name] = HASHED_BYTES / 2**30 / slowest(min(seconds_of(lambda: fn(data)) for _ in range(3)))
    del data
    step()
    held = sum(p.numel() * p.element_size() for p in model.parameters())
    held += sum(t.numel() * t.element_size() for s in optimizer.state.values() for t in s.values()
                if isinstance(t, torch.Tensor))
    rounds = []
    for index in range(args.rounds):
        path = os.path.join(args.dir, f"round{index}")
        checked_first = [True, False] if index % 2 == 0 else [False, True]
        save_s: dict[bool, float] = {}
        for checksums in checked_first:
            with PeakMemory(["VmRSS"], interval_s=0.001) as rss:
                save_s[checksums] = timed(lambda: checkpoint.save(path + ("-sync" if checksums else "-plain"), model,
                                                                  optimizer, checksums=checksums))
            if checksums:
                sync_rss_growth = rss.growth("VmRSS")
        pending: list = []
        async_s = timed(lambda: pending.append(checkpoint.async_save(path + "-async", model, optimizer)))
        steps_during = timed(lambda: [step() for _ in range(args.steps)])
        wait_s = timed(pending[0].wait)
        steps_alone = timed(lambda: [step() for _ in range(args.steps)])
        load_s = {verify: timed(lambda: checkpoint.load(path + "-sync", model, optimizer, verify=verify))
                  for verify in checked_first}
        bytes_on_disk = sum(os.path.getsize(os.path.join(path + "-sync", f)) for f in os.listdir(path + "-sync"))
        rounds.append(dict(sync_s=save_s[True], plain_sync_s=save_s[False], async_blocking_s=async_s,
                           async_wait_after_steps_s=wait_s, steps_during_write_s=steps_during,
                           steps_alone_s=steps_alone, load_s=load_s[True], unverified_load_s=load_s[False],
                           checked_first=checked_first[0], sync_rss_growth=slowest(sync_rss_growth),
                           bytes_on_disk=bytes_on_disk))
        dist.barrier()
        if rank == 0:
            for suffix in ("-sync", "-plain", "-async"):
                shutil.rmtree(path + suffix)
    if rank == 0:
        write_json(args.result, dict(params=config.num_params, held_bytes_per_rank=held, steps=args.steps,
                                     batch=args.batch, hash_gib_s=hash_gib_s, rounds=rounds))
    dist.barrier()


ROWS = [("synchronous save: blocking", "sync_s"), ("synchronous save without checksums", "plain_sync_s"),
        ("async save: blocking (staging)", "async_blocking_s"),
        ("async save: still writing after the steps", "async_wait_after_steps_s"),
        ("steps with an async save writing", "steps_during_write_s"), ("the same steps alone", "steps_alone_s"),
        ("load (same world size), verified", "load_s"), ("load without verification", "unverified_load_s")]
# (label, with checksums, without): each round's ratio of the pair
RATIOS = [("save with checksums / without", "sync_s", "plain_sync_s"),
          ("load verified / unverified", "load_s", "unverified_load_s")]


def summarize(result: dict) -> dict:
    rounds = result["rounds"]
    stats = {}
    for _, key in ROWS:
        values = [r[key] * 1e3 for r in rounds]
        stats[key] = dict(median_ms=median(values), iqr_ms=list(quartiles(values)))
    for _, checked, plain in RATIOS:
        ratios = [r[checked] / r[plain] for r in rounds]
        stats[f"{checked}_over_{plain}"] = dict(median=median(ratios), range=[min(ratios), max(ratios)])
    stats["sync_rss_growth_mib"] = median([r["sync_rss_growth"] for r in rounds]) / MIB
    stats["held_mib_per_rank"] = result["held_bytes_per_rank"] / MIB
    stats["checkpoint_mib"] = median([r["bytes_on_disk"] for r in rounds]) / MIB
    return stats


def report(result: dict, stats: dict) -> str:
    rows = [[label, f"{stats[key]['median_ms']:.0f}", "–".join(f"{v:.0f}" for v in stats[key]["iqr_ms"])]
            for label, key in ROWS]
    table = markdown_table(["ms (slower rank)", "median", "IQR"], rows)
    ratio_rows = [[label, f"{stats[f'{checked}_over_{plain}']['median']:.3f}",
                   "–".join(f"{v:.3f}" for v in stats[f"{checked}_over_{plain}"]["range"])]
                  for label, checked, plain in RATIOS]
    ratios = markdown_table(["per-round ratio", "median", "range"], ratio_rows)
    return (f"{result['params'] / 1e6:.1f}M-parameter GPT + AdamW on {WORLD_SIZE} gloo ranks, "
            f"{len(result['rounds'])} rounds, {result['steps']} steps of batch {result['batch']} around each save\n\n"
            f"{table}\n\n{ratios}\n\nhashing per rank, both ranks at once: "
            + ", ".join(f"{name} {rate:.2f} GiB/s" for name, rate in result["hash_gib_s"].items())
            + f"\n\nper rank: parameters + optimizer state {stats['held_mib_per_rank']:.0f} MiB; "
            f"resident memory grew {stats['sync_rss_growth_mib']:.0f} MiB during a synchronous save; "
            f"checkpoint {stats['checkpoint_mib']:.0f} MiB on disk")


def run_driver(args: argparse.Namespace) -> int:
    record = RunRecord("checkpoint.py", args.argv)
    with tempfile.TemporaryDirectory() as scratch:
        result = launch_worker(__file__, WORLD_SIZE, args, ("rounds", "steps", "batch"), "--dir", args.dir or scratch)
    stats = summarize(result)
    text = report(result, stats)
    print_and_write(text, args.out, dict(**record.fields(), **result, summary=stats, table=text))
    return 0


def parse_args(argv: Sequence[str]) -> argparse.Namespace:
    parser = arg_parser(__doc__)
    add_options(parser, rounds=5, out=None, timeout=900.0)
    parser.add_argument("--steps", type=int, default=3, help="training steps after each async save")
    parser.add_argument("--batch", type=int, default=4, help="sequences per rank per step")
    parser.add_argument("--dir", default=None, help="where checkpoints are written (default: a temporary directory)")
    args = parse_with_worker_options(parser, argv)
    require_min(parser, args, 1, "rounds", "steps", "batch")
    return args


if __name__ == "__main__":
    sys.exit(script_main(None, parse_args, run_worker, run_driver))
