"""Step time with offload="cpu" against no offload on `overlap train`'s default model, 2 gloo ranks.

Without a GPU host and device are one memory: the difference is the runtime's own cost of
offloading (copies, staging buffers, bookkeeping), not a PCIe link. One launch builds both
models and trains them by turns, the order alternating per round (the first round a warm-up);
per round the ratio of median steps, and each step split into forward + backward and the
optimizer step with how busy the rank's threads were (see [Note: what overlapping the update
could hide]).

    python benchmarks/offload.py --rounds 9 --steps 20 --out docs/results/offload_cpu.json
    python benchmarks/offload.py --modes cpu,disk --precision bf16 --optimizer overlap \
        --model-params 300M --model-layers 12 --rounds 4 --steps 3 --out docs/results/offload_disk_vs_cpu.json
"""
from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from typing import Sequence

from common import (RunRecord, add_options, arg_parser, launch_worker, median, parse_with_worker_options, require_min,
                    print_and_write, script_main, slowest_of_ranks, spread, spread_table, write_json)

MODES = ("none", "cpu")
# [Note: what overlapping the update could hide]
# Stepping a host shard while backward goes on (as offload="disk" does) can hide at most the
# update's time, and only in cycles backward leaves idle: per mode and round, the medians of
# forward + backward, of the optimizer step, and of the share of its threads' time the process
# was on a CPU in forward and backward (1.0: no idle cycle for an update to use).
PHASE_FIGURES = (("median_compute_ms", "compute", 1e3), ("median_update_ms", "update", 1e3),
                 ("busy_in_compute", "busy_in_compute", 1.0))


def run_worker(args: argparse.Namespace) -> None:
    import torch
    import torch.distributed as dist

    from overlap import MixedPrecision, ShardedModule
    from overlap.models import GPT, Block, GPTConfig
    from overlap.optim import AdamW
    from overlap.train.options import build_parser
    from overlap.train.rank import VOCAB_SIZE

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))      # as `overlap train` does
    job = build_parser().parse_args([])                                 # the job's defaults
    if args.model_params is None:
        config = GPTConfig(vocab_size=VOCAB_SIZE, block_size=job.seq, n_layer=job.layers, n_head=job.heads,
                           n_embd=job.hidden)
        batch = job.batch
    else:
        from gpt_options import gpt_config
        from overlap.cli.estimate import parameter_count

        config, batch = gpt_config(parameter_count(args.model_params), args.model_layers), 2
    precision = (MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) if args.precision == "bf16"
                 else None)
    optimizer_class = AdamW if args.optimizer == "overlap" else torch.optim.AdamW
    models, optimizers = {}, {}
    for mode in args.modes:
        torch.manual_seed(job.seed)
        with torch.device("meta" if args.model_params is not None else "cpu"):
            inner = GPT(config)
        model = ShardedModule(inner, unit_types=(Block,), mixed_precision=precision, offload=mode)
        models[mode] = model
        optimizers[mode] = optimizer_class(model.module.optimizer_groups(model.named_parameters(), job.weight_decay),
                                           lr=job.lr, betas=(0.9, 0.95))
        model.optimizer_link.link(optimizers[mode])        # as the job does
    gen = torch.Generator().manual_seed(rank)
    batches = [torch.randint(0, config.vocab_size, (batch, config.block_size + 1), generator=gen)
               for _ in range(args.steps)]

    threads = torch.get_num_threads()

    def steps(mode: str) -> dict[str, list[float]]:
        model, optimizer = models[mode], optimizers[mode]
        seconds, compute, compute_cpu, update, clipped = [], [], [], [], []
        for batch in batches:
            start, cpu_start = time.perf_counter(), time.process_time()
            loss = model(batch[:, :-1], batch[:, 1:])
            loss.backward()
            computed, cpu_computed = time.perf_counter(), time.process_time()
            if args.clip is not None:
                clipped.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), args.clip)) > args.clip)
            optimizer.step()
            stepped = time.perf_counter()
            optimizer.zero_grad(set_to_none=True)
            seconds.append(time.perf_counter() - start)
            compute.append(computed - start)
            compute_cpu.append(cpu_computed - cpu_start)
            update.append(stepped - computed)
            if not torch.isfinite(loss):
                raise RuntimeError(f"offload={mode}: non-finite loss {float(loss)}")
        # A step takes the slower rank's time; the phases are this rank's (rank 0's).
        busy = [cpu / (wall * threads) for cpu, wall in zip(compute_cpu, compute)]
        return dict(step=slowest_of_ranks(seconds), compute=compute, update=update, busy_in_compute=busy,
                    clip_bound=clipped)

    rounds = []
    for index in range(args.rounds):
        order = args.modes if index % 2 == 0 else args.modes[::-1]
        measured = {mode: steps(mode) for mode in order}
        rounds.append(dict(order=list(order), step_s={mode: m["step"] for mode, m in measured.items()},
                           phases={mode: {k: v for k, v in m.items() if k != "step"} for mode, m in measured.items()}))
    if rank == 0:
        write_json(args.result, dict(rounds=rounds, model=dict(layers=config.n_layer, hidden=config.n_embd,
                                                               heads=config.n_head, seq=config.block_size, batch=batch,
                                                               params=config.num_params)))


def run_driver(args: argparse.Namespace) -> int:
    record = RunRecord("offload.py", args.argv)
    options = ("rounds", "steps", "precision", "optimizer", "model_layers", "model_params", "clip")
    with tempfile.TemporaryDirectory(prefix="offload-", dir=".") as state_dir:
        measured = launch_worker(__file__, 2, args, options, "--modes", ",".join(args.modes),
                                 env={"OVERLAP_OFFLOAD_DIR": state_dir})
    counted = measured["rounds"][1:]                  # the first round warms both models up
    first, second = args.modes
    summary = {f"step_{second}_over_{first}": spread([median(r["step_s"][second]) / median(r["step_s"][first])
                                                       for r in counted]),
               **{f"median_step_ms_{mode}": spread([1e3 * median(r["step_s"][mode]) for r in counted])
                  for mode in args.modes},
               **{f"{figure}_{mode}": spread([median(r["phases"][mode][key]) * scale for r in counted])
                  for mode in args.modes for figure, key, scale in PHASE_FIGURES},
               **({f"clip_binding_share_{mode}": spread([sum(r["phases"][mode]["clip_bound"]) /
                                                         len(r["phases"][mode]["clip_bound"]) for r in counted])
                   for mode in args.modes} if args.clip is not None else {})}
    meta = dict(command=record.command, commit=record.commit,
                world=2, backend="gloo", rounds=args.rounds, rounds_counted=len(counted), steps=args.steps,
                precision=args.precision, modes=list(args.modes), optimizer=args.optimizer, clip=args.clip,
                model=measured["model"], time=record.started, host_load=record.host_load())
    print_and_write(spread_table(summary), args.out, dict(meta=meta, summary=summary, rounds=measured["rounds"]))
    return 0


def parse_args(argv: Sequence[str]) -> argparse.Namespace:
    parser = arg_parser(__doc__)
    parser.add_argument("--rounds", type=int, default=9, help="rounds, the first one a warm-up (default 9)")
    parser.add_argument("--steps", type=int, default=20, help="steps of each mode per round (default 20)")
    parser.add_argument("--precision", choices=("fp32", "bf16"), default="fp32",
                        help="bf16: gathers in bf16, the persistent bf16 copy on the device")
    parser.add_argument("--modes", default=",".join(MODES), help="the two offload tiers compared (default none,cpu)")
    parser.add_argument("--optimizer", choices=("torch", "overlap"), default="torch",
                        help="torch.optim.AdamW (default) or overlap.optim.AdamW for both")
    parser.add_argument("--model-params", default=None, help="a GPT of about this many parameters, e.g. 300M "
                        "(default: overlap train's default model)")
    parser.add_argument("--model-layers", type=int, default=12, help="its blocks (with --model-params)")
    parser.add_argument("--clip", type=float, default=None, metavar="MAX",
                        help="clip the gradients' norm to MAX before each optimizer step (torch's clip_grad_norm_); "
                             "the share of steps where it bound is recorded")
    add_options(parser, out=None, timeout=600.0)
    args = parse_with_worker_options(parser, argv)
    require_min(parser, args, 2, "rounds")          # the first is a warm-up
    require_min(parser, args, 1, "steps")
    args.modes = tuple(args.modes.split(","))
    if len(args.modes) != 2 or len(set(args.modes)) != 2 or not set(args.modes) <= {"none", "cpu", "disk"}:
        parser.error(f"--modes {','.join(args.modes)}: expected two different tiers of none, cpu, disk")
    if "disk" in args.modes and (args.optimizer != "overlap" or args.precision != "bf16"):
        parser.error("offload disk steps with overlap.optim.AdamW and keeps bf16 gathers: add --optimizer overlap "
                     "--precision bf16")
    return args


if __name__ == "__main__":
    sys.exit(script_main(None, parse_args, run_worker, run_driver))
