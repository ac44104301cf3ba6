"""The overlap report's "runtime" share of the step under `overlap train`'s defaults (2 gloo ranks):
each round runs it once per checkout (this one, this one with OVERLAP_ORDER_CHECK=step, and
--baseline another one), and reads the report's mean steady step; ratios are per round.

    python benchmarks/runtime_share.py --rounds 2 --steps 100 --baseline ../baseline \
        --out docs/results/runtime_share.json
"""
from __future__ import annotations

import argparse
import logging
import re
import sys
from typing import Optional, Sequence

from common import (REPOSITORY, RunRecord, arg_parser, checkout_python, git_commit, markdown_table, parse_recorded,
                    run_with_deadline, single_thread_env, spread, spread_cell, write_json)

logger = logging.getLogger("runtime_share")

# "step 112.3 ms (forward+backward): compute 80.1 ms, runtime 12.8 ms, gather wait 3.1 ms, reduce wait 2.0 ms"
_TIME = r"([0-9.]+) (ms|s)"
STEP_LINE = re.compile(rf"step {_TIME} \(forward\+backward\): compute {_TIME}, runtime {_TIME}, "
                       rf"gather wait {_TIME}, reduce wait {_TIME}")
PARTS = ("span", "compute", "runtime", "gather_wait", "reduce_wait")


def parse_report(output: str) -> dict[str, float]:
    """The mean step of the report in `output`, in seconds per part."""
    found = STEP_LINE.search(output)
    if found is None:
        raise ValueError(f"no report step line in the output; its tail:\n{output[-2000:]}")
    values = found.groups()
    return {part: float(values[2 * i]) * (1e-3 if values[2 * i + 1] == "ms" else 1.0)
            for i, part in enumerate(PARTS)}


def run_once(checkout: str, steps: int, timeout_s: float, env: Optional[dict] = None) -> dict[str, float]:
    # -P: this checkout does not go on the path ahead of the interpreter's own package.
    command = [checkout_python(checkout) if checkout != REPOSITORY else sys.executable, "-P", "-m", "overlap", "train",
               "--steps", str(steps), "--eval-every", str(steps), "--sample", "0"]
    output = run_with_deadline(command, timeout_s, env={**single_thread_env(), **(env or {})})
    report = parse_report(output)
    report["runtime_share"] = report["runtime"] / report["span"]
    return report


def run(args: argparse.Namespace) -> dict:
    # "this, order step": without the order word before every collective (counted as runtime).
    checkouts = {"this": (REPOSITORY, {}), "this, order step": (REPOSITORY, {"OVERLAP_ORDER_CHECK": "step"}),
                 **({"baseline": (args.baseline, {})} if args.baseline else {})}
    record = RunRecord("runtime_share.py", args.argv, hidden={args.baseline: "<baseline>"})
    rounds = []
    for index in range(args.rounds):
        runs = {}
        for name, (checkout, env) in checkouts.items():
            runs[name] = run_once(checkout, args.steps, args.run_timeout, env)
            logger.info("round %d, %s: step %.1f ms, runtime %.1f ms (%.1f%%)", index + 1, name,
                        runs[name]["span"] * 1e3, runs[name]["runtime"] * 1e3, 100 * runs[name]["runtime_share"])
        rounds.append(runs)
    summary = {name: dict(runtime_share=spread([r[name]["runtime_share"] for r in rounds])) for name in checkouts}
    if args.baseline:
        summary["step_this_over_baseline"] = spread([r["this"]["span"] / r["baseline"]["span"] for r in rounds])
    meta = dict(command=record.command, commit=record.commit,
                baseline_commit=git_commit(args.baseline) if args.baseline else None,
                steps=args.steps, rounds=args.rounds, time=record.started, host_load=record.host_load())
    return dict(meta=meta, summary=summary, rounds=rounds)


def parse_args(argv: Sequence[str]) -> argparse.Namespace:
    parser = arg_parser(__doc__)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--steps", type=int, default=100, help="steps of each `overlap train` run")
    parser.add_argument("--baseline", help="another checkout of the project, with its own .venv")
    parser.add_argument("--out", help="result JSON")
    parser.add_argument("--run-timeout", type=float, default=900)
    return parse_recorded(parser, argv)


def main(argv: Optional[Sequence[str]] = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    args = parse_args(sys.argv[1:] if argv is None else argv)
    result = run(args)
    if args.out:
        write_json(args.out, result)
    print(markdown_table(["checkout", "runtime share % (range)"], [[name, spread_cell(s["runtime_share"], 1, 100)]
                                                                   for name, s in result["summary"].items()
                                                                   if "runtime_share" in s]))
    if "step_this_over_baseline" in result["summary"]:
        ratio = result["summary"]["step_this_over_baseline"]
        print(f"step this / baseline: median {ratio['median']:.3f} [{ratio['min']:.3f}–{ratio['max']:.3f}]")
    return 0


if __name__ == "__main__":
    sys.exit(main())
