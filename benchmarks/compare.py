"""ShardedModule against FSDP2 and DDP (defaults and tuned), DeepSpeed ZeRO-3 and a single process
without communication (docs/benchmarks.md).

Every implementation (peers.py) trains the same GPT from the same seed on the same batches with
the same AdamW, one launch each (2 gloo ranks; `local` runs rank 0's batches alone), alternating
over rounds. Per (link, implementation): the median step (the slower rank's), peak memory per
rank by category (MemTracker, one extra step) and peak RSS, bytes sent per rank per step.
Compiled rows (docs/compile.md) are paired with their eager twins round by round. `--merge`
summarises earlier runs of the same settings as one run, and runs nothing.

    python benchmarks/compare.py --links loopback,10gbit,2gbit --rounds 3 --steps 20
    python benchmarks/compare.py --quick            # tiny model, one round: a smoke run
    python benchmarks/compare.py --merge a/compare.json b/compare.json --out merged

Writes <out>/compare.json, <out>/compare.md and <out>/compare.png. Emulated links need root.
"""
from __future__ import annotations

import argparse
import os
import sys
from typing import Optional, Sequence

import peers
from common import (LOOPBACK, RunRecord, add_options, arg_parser, checkout_python, forwarded, launch, on_link,
                    parse_choices, parse_links, parse_with_worker_options, read_json, require_min, script_main)
from compare_report import write_outputs
from compare_summary import BASELINE, WORLD_SIZE, summarize
from compare_targets import check_targets
from compare_worker import run_worker
from gpt_options import BENCHMARK_MODEL, MODEL_FIELDS, SMALL_MODEL, add_model_options

WORKER_OPTIONS = ("model", "seed", "lr", "batch", "warmup", "steps", *MODEL_FIELDS, "prefetch_depth", "bucket_mb",
                  "ddp_bucket_mb", "fsdp2_prefetch")


def _launch(args: argparse.Namespace, impl: str, prefix: list[str], memory: bool) -> dict:
    # The baseline runs its own checkout's worker: its package's modules may have other names.
    script = os.path.join(args.baseline, "benchmarks", "compare.py") if impl == BASELINE else os.path.abspath(__file__)
    python = checkout_python(args.baseline) if impl == BASELINE else sys.executable
    worker = ["--worker", peers.OVERLAP if impl == BASELINE else impl, *forwarded(args, WORKER_OPTIONS),
              *(["--memory"] if memory else [])]
    nproc = None if impl in peers.SINGLE_PROCESS else WORLD_SIZE
    return {**launch(script, nproc, worker, args.run_timeout, prefix, python), "impl": impl}


def run_all(args: argparse.Namespace) -> list[dict]:
    """Every (link, round, implementation) launch, implementations alternating within a round."""
    from tqdm import tqdm

    runs = []
    progress = tqdm(total=len(args.links) * args.rounds * len(args.impls), unit="run")
    for link in args.links:
        with on_link(link) as prefix:
            for round_index in range(args.rounds):
                for impl in args.impls:
                    progress.set_description(f"{link} round {round_index + 1} {impl}")
                    # Memory does not depend on the link: measured once, in the first round of the first link.
                    memory = round_index == 0 and link == args.links[0]
                    runs.append({**_launch(args, impl, prefix, memory), "link": link, "round": round_index})
                    progress.update()
    progress.close()
    return runs


def parse_args(argv: Sequence[str]) -> argparse.Namespace:
    parser = arg_parser(__doc__)
    parser.add_argument("--impls", default=None, help="comma-separated, alternated in this order "
                        f"(default: {','.join(peers.IMPLEMENTATIONS)}, less those not installed)")
    parser.add_argument("--links", default=LOOPBACK, help="loopback and/or tc rates, e.g. loopback,10gbit,2gbit")
    parser.add_argument("--warmup", type=int, default=2, help="untimed steps at the start of each run")
    parser.add_argument("--steps", type=int, default=20, help="timed steps per run")
    parser.add_argument("--batch", type=int, default=4, help="sequences per rank per step")
    parser.add_argument("--model", choices=("gpt", "mlp"), default="gpt",
                        help="gpt: overlap.models.GPT; mlp: narrow_mlp.NarrowMLP (blocks of narrow "
                        "LayerNorm/GELU layers, where compiling helps on CPU; --n-head unused)")
    add_model_options(parser, BENCHMARK_MODEL)
    add_options(parser, rounds=3, lr=1e-3, seed=0)
    parser.add_argument("--prefetch-depth", type=int, default=None, help="ShardedModule's (default: its planner)")
    parser.add_argument("--bucket-mb", type=float, default=None, help="ShardedModule's (default: its planner)")
    parser.add_argument("--ddp-bucket-mb", type=float, default=10.0, help=f"{peers.DDP_TUNED}'s bucket_cap_mb")
    parser.add_argument("--fsdp2-prefetch", type=int, default=2,
                        help=f"{peers.FSDP2_TUNED}: blocks in each explicit forward/backward prefetch list")
    parser.add_argument("--baseline", help=f"another checkout with its environment in .venv (`make setup` there): "
                        f"adds {BASELINE!r}, that checkout's ShardedModule run by its own worker, to the "
                        "implementations")
    parser.add_argument("--out", default="bench_out", help="directory for compare.json/.md/.png")
    parser.add_argument("--run-timeout", type=float, default=600, help="seconds one launch may take")
    parser.add_argument("--quick", action="store_true", help="tiny model, one round, two timed steps")
    parser.add_argument("--merge", nargs="+", metavar="JSON", help="compare.json files of earlier runs to summarise "
                        "together (same model and settings); runs nothing")
    parser.add_argument("--memory", action="store_true", help=argparse.SUPPRESS)
    args = parse_with_worker_options(parser, argv, peers.ALL)
    args.sources = None
    if args.worker:
        return args
    if args.quick:
        for key, value in SMALL_MODEL.items():
            setattr(args, key, value)
        args.batch, args.rounds, args.warmup, args.steps = 2, 1, 1, 2
    try:
        args.links = parse_links(args.links)
        args.skipped = {} if args.impls else peers.unavailable()
        args.impls = parse_choices(args.impls or ",".join(i for i in peers.IMPLEMENTATIONS if i not in args.skipped),
                                   (*peers.ALL, BASELINE), "--impls")
        if args.baseline and BASELINE not in args.impls:
            args.impls.append(BASELINE)
        if BASELINE in args.impls and not args.baseline:
            raise ValueError(f"--impls {BASELINE} needs --baseline")
    except ValueError as exc:
        parser.error(str(exc))
    require_min(parser, args, 1, "rounds", "steps", "batch", *MODEL_FIELDS)
    require_min(parser, args, 0, "warmup")
    if args.n_embd % args.n_head:
        parser.error(f"--n-embd {args.n_embd} is not divisible by --n-head {args.n_head}")
    return args


def merged_runs(args: argparse.Namespace) -> list[dict]:
    """The launches recorded in args.merge, rounds renumbered; args takes the first file's settings."""
    runs, settings, args.sources = [], None, []
    for path in args.merge:
        data = read_json(path)
        recorded = parse_args(data["meta"]["argv"])
        these = {key: getattr(recorded, key) for key in ("model", "batch", "steps", "warmup", "seed", "lr", *MODEL_FIELDS)}
        if settings is None:
            settings = these
            args.skipped = data["meta"].get("skipped", {})
        elif these != settings:
            raise ValueError(f"--merge: {path} was run with {these}, the first file with {settings}")
        for run in data["runs"]:
            offset = 1 + max((r["round"] for r in runs if r["link"] == run["link"] and r["source"] < len(args.sources)),
                             default=-1)
            runs.append({**run, "round": run["round"] + offset, "source": len(args.sources)})
        args.sources.append(data["meta"])
    for key, value in settings.items():
        setattr(args, key, value)
    rounds = {link: len({r["round"] for r in runs if r["link"] == link}) for link in dict.fromkeys(r["link"] for r in runs)}
    args.rounds = next(iter(rounds.values())) if len(set(rounds.values())) == 1 else \
        ", ".join(f"{link} {count}" for link, count in rounds.items())
    return runs


def run_driver(args: argparse.Namespace) -> int:
    args.record = RunRecord("compare.py", args.argv)        # what runs is the code at the start
    runs = merged_runs(args) if args.merge else run_all(args)
    summary = summarize(runs)
    targets = check_targets(summary)
    print(write_outputs(args, runs, summary, targets))
    return 0


def main(argv: Optional[Sequence[str]] = None) -> int:
    return script_main(argv, parse_args, run_worker, run_driver)


if __name__ == "__main__":
    sys.exit(main())
