"""Step time with offload="cpu" against no offload, on `overlap train`'s default model (GPT,
4 layers, d=128, 4 heads, seq 64, batch 16 per rank, AdamW as the job builds it), 2 gloo
ranks on CPU.

On a machine without a GPU host and device are one memory: the offloaded run still keeps
separate host shards and device buffers and copies between them (synchronous copies here),
so the difference measures the runtime's own overhead of offloading (the copies, the staging
buffers, the bookkeeping), not a PCIe link.

One launch of 2 ranks builds both models from the same seed and trains them by turns: each
round runs `--steps` steps of one, then of the other, the order alternating from round to
round; a step is forward, backward, `optimizer.step()` and `zero_grad()`, its time the slower
rank's. Per round, the ratio of the two modes' median step times; the summary gives the
median and range of those paired ratios. The first round is a warm-up and is not counted.

    python benchmarks/offload.py --rounds 9 --steps 20 --out docs/results/offload_cpu.json
"""
from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import tempfile
import time
from typing import Optional, Sequence

from common import (git_commit, markdown_table, median, run_with_deadline, script_main, single_thread_env,
                    torchrun, write_json)

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
logger = logging.getLogger("offload")
MODES = ("none", "cpu")


# ---- worker: one launch of 2 ranks ---------------------------------------------------------------

def run_worker(args: argparse.Namespace) -> None:
    import torch
    import torch.distributed as dist

    from overlap import MixedPrecision, ShardedModule
    from overlap.models import GPT, Block, GPTConfig
    from overlap.train.job import VOCAB_SIZE, build_parser

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))      # as `overlap train` does
    job = build_parser().parse_args([])                                 # the job's defaults
    config = GPTConfig(vocab_size=VOCAB_SIZE, block_size=job.seq, n_layer=job.layers, n_head=job.heads,
                       n_embd=job.hidden)
    precision = MixedPrecision(param_dtype=torch.bfloat16) if args.precision == "bf16" else None
    models, optimizers = {}, {}
    for mode in MODES:
        torch.manual_seed(job.seed)
        model = ShardedModule(GPT(config), unit_types=(Block,), mixed_precision=precision, offload=mode)
        models[mode] = model
        optimizers[mode] = torch.optim.AdamW(model.module.optimizer_groups(model.named_parameters(),
                                                                           job.weight_decay),
                                             lr=job.lr, betas=(0.9, 0.95))
    gen = torch.Generator().manual_seed(rank)
    batches = [torch.randint(0, VOCAB_SIZE, (job.batch, job.seq + 1), generator=gen) for _ in range(args.steps)]

    def steps(mode: str) -> list[float]:
        model, optimizer = models[mode], optimizers[mode]
        seconds = []
        for batch in batches:
            start = time.perf_counter()
            loss = model(batch[:, :-1], batch[:, 1:])
            loss.backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            seconds.append(time.perf_counter() - start)
            if not torch.isfinite(loss):
                raise RuntimeError(f"offload={mode}: non-finite loss {float(loss)}")
        # A step takes the slower rank's time.
        times = torch.tensor(seconds, dtype=torch.float64)
        dist.all_reduce(times, op=dist.ReduceOp.MAX)
        return times.tolist()

    rounds = []
    for index in range(args.rounds):
        order = MODES if index % 2 == 0 else MODES[::-1]
        rounds.append(dict(order=list(order), step_s={mode: steps(mode) for mode in order}))
    if rank == 0:
        with open(args.result, "w") as f:
            json.dump(dict(rounds=rounds, model=dict(layers=job.layers, hidden=job.hidden, heads=job.heads,
                                                     seq=job.seq, batch=job.batch, params=config.num_params)), f)


# ---- driver ---------------------------------------------------------------------------------------

def _spread(values: list[float]) -> dict:
    return dict(per_round=values, median=median(values), min=min(values), max=max(values))


def run_driver_result(args: argparse.Namespace) -> dict:
    started, load_before = time.time(), os.getloadavg()
    with tempfile.TemporaryDirectory() as tmp:
        result_path = os.path.join(tmp, "result.json")
        command = torchrun(os.path.abspath(__file__), 2, ["--worker", "--result", result_path,
                                                          "--rounds", str(args.rounds), "--steps", str(args.steps),
                                                          "--precision", args.precision])
        run_with_deadline(command, args.timeout, env=single_thread_env())
        with open(result_path) as f:
            measured = json.load(f)
    counted = measured["rounds"][1:]                  # the first round warms both models up
    ratios = [median(r["step_s"]["cpu"]) / median(r["step_s"]["none"]) for r in counted]
    summary = dict(step_cpu_over_none=_spread(ratios),
                   **{f"median_step_ms_{mode}": _spread([1e3 * median(r["step_s"][mode]) for r in counted])
                      for mode in MODES})
    meta = dict(command="python benchmarks/offload.py " + " ".join(args.argv), commit=git_commit(REPO),
                world=2, backend="gloo", rounds=args.rounds, rounds_counted=len(counted), steps=args.steps,
                precision=args.precision, model=measured["model"], time=time.strftime("%Y-%m-%d %H:%M:%S"),
                host_load=dict(load_1_5_15min_before=list(load_before), load_1_5_15min_after=list(os.getloadavg()),
                               wall_s=time.time() - started))
    return dict(meta=meta, summary=summary, rounds=measured["rounds"])


def run_driver(args: argparse.Namespace) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    result = run_driver_result(args)
    if args.out:
        write_json(args.out, result)
    rows = [[name, f"{s['median']:.3f}", f"{s['min']:.3f}–{s['max']:.3f}"] for name, s in result["summary"].items()]
    print(markdown_table(["figure", "median", "range"], rows))
    return 0


def parse_args(argv: Sequence[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=9, help="rounds, the first one a warm-up (default 9)")
    parser.add_argument("--steps", type=int, default=20, help="steps of each mode per round (default 20)")
    parser.add_argument("--precision", choices=("fp32", "bf16"), default="fp32",
                        help="bf16: gathers in bf16, the persistent bf16 copy on the device")
    parser.add_argument("--out", help="result JSON")
    parser.add_argument("--timeout", type=float, default=600, help="seconds the launch may take")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--result", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.rounds < 2 or args.steps < 1:
        parser.error("--rounds must be >= 2 (the first is a warm-up) and --steps >= 1")
    args.argv = [a for a in argv]
    return args


def main(argv: Optional[Sequence[str]] = None) -> int:
    return script_main(argv, parse_args, run_worker, run_driver)


if __name__ == "__main__":
    sys.exit(main())
