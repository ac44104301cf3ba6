"""What compressed collectives cost in accuracy: `overlap train` once per compression mode.

Each mode runs the main job at its defaults (byte-level GPT, 4 layers, d=128, 2 gloo ranks,
AdamW, seed 0, 300 steps) one after the other, and the run's printed losses and the overlap
report's bytes are read back: the train and validation loss at every evaluation, the final
ones, and the bytes each rank sent per step, compressed and before compression. The target
is a final validation loss within 1% (int8) and 2% (int8-int4) of the uncompressed run's.

    python benchmarks/compression_accuracy.py
"""
from __future__ import annotations

import argparse
import os
import re
import sys
from typing import Optional, Sequence

from common import RunRecord, markdown_table, run_with_deadline, write_json

REPOSITORY = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MODES = ("none", "int8", "int8-int4")
EVAL = re.compile(r"step (\d+): train loss ([0-9.]+), val loss ([0-9.]+)")
FINAL = re.compile(r"final step \d+: loss ([0-9.]+) .*val loss ([0-9.]+)")
MOVED = re.compile(r"moved ([0-9.]+) MB/step(?: \(([0-9.]+) MB before compression\))?")


def run_mode(mode: str, steps: Optional[int], timeout_s: float) -> dict:
    """One `overlap train --compress MODE` run, its output read back."""
    shorter = [] if steps is None else ["--steps", str(steps), "--eval-every", str(max(1, min(50, steps)))]
    command = [sys.executable, "-m", "overlap", "train", "--compress", mode, *shorter]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    output = run_with_deadline(command, timeout_s, env=env)
    evals = [dict(step=int(s), train_loss=float(t), val_loss=float(v)) for s, t, v in EVAL.findall(output)]
    final, moved = FINAL.search(output), MOVED.search(output)
    if final is None or moved is None or not evals:
        raise RuntimeError(f"overlap train --compress {mode}: no final losses or bytes in its output:\n{output[-3000:]}")
    wire = float(moved.group(1))
    return dict(command=" ".join(["python", *command[1:]]), final_train_loss=float(final.group(1)),
                final_val_loss=float(final.group(2)), evals=evals, wire_mb_per_step=wire,
                uncompressed_mb_per_step=float(moved.group(2)) if moved.group(2) else wire)


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
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
