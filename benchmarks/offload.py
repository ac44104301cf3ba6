"""Step time with offload="cpu" against no offload, on `overlap train`'s default model (2 gloo
ranks on CPU).

On a machine without a GPU host and device memory are one memory: the offloaded run still
keeps separate host shards and device buffers and copies between them (synchronous copies
here), so the difference measures the runtime's own overhead of offloading (the copies, the
staging buffers, the bookkeeping), not a PCIe link.

Each round runs `overlap train --steps N` once per mode, the order alternating from round to
round, and reads the overlap report it prints at the end (the mean of its steady steps:
forward+backward span, compute, runtime, waits); the whole run's wall time is kept too (it
includes start-up and the optimizer steps). Ratios are taken per round, offload over none.

    python benchmarks/offload.py --rounds 4 --steps 60 --out docs/results/offload_cpu.json
"""
from __future__ import annotations

import argparse
import logging
import os
import sys
import time
from typing import Optional, Sequence

from common import git_commit, markdown_table, median, run_with_deadline, single_thread_env, write_json
from runtime_share import parse_report

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
logger = logging.getLogger("offload")
MODES = ("none", "cpu")


def run_once(offload: str, steps: int, precision: str, timeout_s: float) -> dict[str, float]:
    """One `overlap train` run: the report's mean step, in seconds per part, and the wall time."""
    command = [sys.executable, "-P", "-m", "overlap", "train", "--steps", str(steps), "--eval-every", str(steps),
               "--sample", "0", "--offload", offload, "--mixed-precision", precision]
    started = time.perf_counter()
    output = run_with_deadline(command, timeout_s, env=single_thread_env())
    report = parse_report(output)
    report["wall_s"] = time.perf_counter() - started
    return report


def _spread(values: list[float]) -> dict:
    return dict(per_round=values, median=median(values), min=min(values), max=max(values))


def run(args: argparse.Namespace) -> dict:
    started, load_before = time.time(), os.getloadavg()
    rounds = []
    for index in range(args.rounds):
        order = MODES if index % 2 == 0 else MODES[::-1]
        runs = {}
        for mode in order:
            runs[mode] = run_once(mode, args.steps, args.precision, args.run_timeout)
            logger.info("round %d, offload=%s: step %.1f ms, runtime %.1f ms, run %.1f s", index + 1, mode,
                        runs[mode]["span"] * 1e3, runs[mode]["runtime"] * 1e3, runs[mode]["wall_s"])
        rounds.append(dict(order=list(order), runs=runs))
    summary = {
        "step_cpu_over_none": _spread([r["runs"]["cpu"]["span"] / r["runs"]["none"]["span"] for r in rounds]),
        "runtime_cpu_over_none": _spread([r["runs"]["cpu"]["runtime"] / r["runs"]["none"]["runtime"]
                                          for r in rounds]),
        "wall_cpu_over_none": _spread([r["runs"]["cpu"]["wall_s"] / r["runs"]["none"]["wall_s"] for r in rounds]),
        **{f"step_ms_{mode}": _spread([r["runs"][mode]["span"] * 1e3 for r in rounds]) for mode in MODES},
    }
    meta = dict(command="python benchmarks/offload.py " + " ".join(args.argv), commit=git_commit(REPO),
                steps=args.steps, rounds=args.rounds, precision=args.precision,
                time=time.strftime("%Y-%m-%d %H:%M:%S"),
                host_load=dict(load_1_5_15min_before=list(load_before), load_1_5_15min_after=list(os.getloadavg()),
                               wall_s=time.time() - started))
    return dict(meta=meta, summary=summary, rounds=rounds)


def parse_args(argv: Sequence[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--steps", type=int, default=60, help="steps of each `overlap train` run")
    parser.add_argument("--precision", choices=("fp32", "bf16"), default="fp32",
                        help="`overlap train --mixed-precision` (bf16: the persistent bf16 copy on the device)")
    parser.add_argument("--out", help="result JSON")
    parser.add_argument("--run-timeout", type=float, default=600)
    args = parser.parse_args(argv)
    if args.rounds < 1 or args.steps < 2:
        parser.error("--rounds must be >= 1 and --steps >= 2")
    args.argv = list(argv)
    return args


def main(argv: Optional[Sequence[str]] = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    args = parse_args(sys.argv[1:] if argv is None else argv)
    result = run(args)
    if args.out:
        write_json(args.out, result)
    rows = [[name, f"{s['median']:.3f}", f"{s['min']:.3f}–{s['max']:.3f}"]
            for name, s in result["summary"].items()]
    print(markdown_table(["figure", "median", "range"], rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
