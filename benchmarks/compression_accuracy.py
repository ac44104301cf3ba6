"""What compressed collectives cost in accuracy: `overlap train` at its defaults once per
compression mode, its losses and the report's bytes per step read back (docs/compression.md).

    python benchmarks/compression_accuracy.py
"""
from __future__ import annotations

import re
import sys
from typing import Optional, Sequence

from common import RunRecord, arg_parser, markdown_table, run_with_deadline, write_json

MODES = ("none", "int8", "int8-int4")
EVAL = re.compile(r"step (\d+): train loss ([0-9.]+), val loss ([0-9.]+)")
FINAL = re.compile(r"final step \d+: loss ([0-9.]+) .*val loss ([0-9.]+)")
MOVED = re.compile(r"moved ([0-9.]+) MB/step(?: \(([0-9.]+) MB before compression\))?")


def run_mode(mode: str, steps: Optional[int], timeout_s: float) -> dict:
    shorter = [] if steps is None else ["--steps", str(steps), "--eval-every", str(max(1, min(50, steps)))]
    command = [sys.executable, "-m", "overlap", "train", "--compress", mode, *shorter]
    output = run_with_deadline(command, timeout_s, env={"OMP_NUM_THREADS": "1"})
    evals = [dict(step=int(s), train_loss=float(t), val_loss=float(v)) for s, t, v in EVAL.findall(output)]
    final, moved = FINAL.search(output), MOVED.search(output)
    if final is None or moved is None or not evals:
        raise RuntimeError(f"overlap train --compress {mode}: no final losses or bytes in its output:\n{output[-3000:]}")
    wire = float(moved.group(1))
    return dict(command=" ".join(["python", *command[1:]]), final_train_loss=float(final.group(1)),
                final_val_loss=float(final.group(2)), evals=evals, wire_mb_per_step=wire,
                uncompressed_mb_per_step=float(moved.group(2)) if moved.group(2) else wire)


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = arg_parser(__doc__)
    parser.add_argument("--out", default="bench_out/compression_accuracy.json")
    parser.add_argument("--steps", type=int, default=None, help="steps per run (default: the job's 300)")
    parser.add_argument("--timeout", type=float, default=900, help="seconds one run may take")
    args = parser.parse_args(argv)
    record = RunRecord("compression_accuracy.py", list(argv if argv is not None else sys.argv[1:]))
    runs = {mode: run_mode(mode, args.steps, args.timeout) for mode in MODES}
    for run in runs.values():
        run["val_loss_vs_none"] = run["final_val_loss"] / runs["none"]["final_val_loss"] - 1
    write_json(args.out, dict(**record.fields(), target="final val loss within 1% (int8) and 2% (int8-int4) of "
                                                        "uncompressed", runs=runs))
    print(markdown_table(["mode", "final val loss", "vs none", "final train loss", "MB on the wire per step"],
                         [[mode, f"{r['final_val_loss']:.4f}", f"{100 * r['val_loss_vs_none']:+.2f} %",
                           f"{r['final_train_loss']:.4f}", f"{r['wire_mb_per_step']:.2f}"] for mode, r in runs.items()]))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
