"""`async_save` under offload="disk": its masters and moments streamed from the state file against
staged in host memory first (as every other tier's), alternated round by round in one process
(docs/offload_disk.md): the seconds it blocked, until complete, of the steps taken meanwhile,
and the peak of anonymous resident memory above its level before the save.

    python benchmarks/disk_async_save.py --model-params 200M --rounds 4 --out docs/results/disk_async_save.json
"""
from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from typing import Optional, Sequence

import torch

from common import (PeakMemory, RunRecord, add_options, arg_parser, median, parse_recorded, print_and_write,
                    single_rank_env, spread, spread_table)
from gpt_options import gpt_config, token_step

MODES = ("staged", "streamed")
MODEL_LAYERS = 8                    # the GPT's blocks


def run(args: argparse.Namespace, directory: str) -> dict:
    import torch.distributed as dist

    import overlap.checkpoint as checkpoint
    from overlap import MixedPrecision, ShardedModule
    from overlap.cli.estimate import parameter_count
    from overlap.models import GPT
    from overlap.optim import AdamW

    streamed_keys = checkpoint.streamed_keys
    os.environ.update(single_rank_env())
    dist.init_process_group("gloo", rank=0, world_size=1)
    try:
        config = gpt_config(parameter_count(args.model_params), MODEL_LAYERS)
        with torch.device("meta"):
            inner = GPT(config)
        model = ShardedModule(inner, offload="disk",
                              mixed_precision=MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=torch.float32))
        optimizer = AdamW(model.parameters(), lr=1e-4)
        model.optimizer_link.link(optimizer)
        train = token_step(model, optimizer, config, batch=2, seed=0)

        def step() -> float:
            start = time.perf_counter()
            loss = train()
            if not torch.isfinite(loss):
                raise RuntimeError(f"the loss is {float(loss)}")
            return time.perf_counter() - start

        step()
        rounds = []
        for index in range(args.rounds):
            order = MODES if index % 2 == 0 else MODES[::-1]
            measured = {}
            for mode in order:
                checkpoint.streamed_keys = streamed_keys if mode == "streamed" else (lambda *_: frozenset())
                path = os.path.join(directory, f"round{index}-{mode}")
                with PeakMemory(["RssAnon", "RssFile"], interval_s=0.01) as peak:
                    start = time.perf_counter()
                    pending = checkpoint.async_save(path, model, optimizer)
                    blocked = time.perf_counter() - start
                    steps = [step() for _ in range(args.steps)]
                    pending.wait()
                    total = time.perf_counter() - start
                measured[mode] = dict(blocked_s=blocked, total_s=total, steps_s=steps,
                                      anon_growth_bytes=peak.growth("RssAnon"),
                                      file_growth_bytes=peak.growth("RssFile"))
                print(f"round {index} {mode}: async_save blocked {blocked:.2f} s, complete after {total:.2f} s, "
                      f"steps {[round(s, 2) for s in steps]} s, RssAnon +{measured[mode]['anon_growth_bytes'] / 2**30:.2f} "
                      f"GiB, RssFile +{measured[mode]['file_growth_bytes'] / 2**30:.2f} GiB", flush=True)
            rounds.append(dict(order=list(order), **measured))
        checkpoint.streamed_keys = streamed_keys
        return dict(params=config.num_params, config=vars(config), rounds=rounds,
                    state_bytes=12 * sum(p.numel() for p in model.parameters()))
    finally:
        dist.destroy_process_group()


def parse_args(argv: Sequence[str]) -> argparse.Namespace:
    parser = arg_parser(__doc__)
    parser.add_argument("--model-params", default="200M", help="GPT parameters, e.g. 200M (default)")
    add_options(parser, rounds=4, out=None)
    parser.add_argument("--steps", type=int, default=2, help="training steps while each save is written")
    return parse_recorded(parser, argv)


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    record = RunRecord("disk_async_save.py", args.argv)
    # The state file and the checkpoints go to a temporary directory under the current one.
    with tempfile.TemporaryDirectory(prefix="disk-async-save-", dir=".") as directory:
        os.environ["OVERLAP_OFFLOAD_DIR"] = directory
        measured = run(args, directory)
    counted = measured["rounds"]
    summary = {f"{figure}_{mode}": spread([scale * r[mode][key] for r in counted]) for mode in MODES
               for figure, key, scale in (("blocked_s", "blocked_s", 1.0), ("complete_s", "total_s", 1.0),
                                          ("anon_growth_gib", "anon_growth_bytes", 2**-30))}
    summary["step_during_save_s_streamed_over_staged"] = spread(
        [median(r["streamed"]["steps_s"]) / median(r["staged"]["steps_s"]) for r in counted])
    meta = dict(command=record.command, commit=record.commit, time=record.started, host_load=record.host_load(),
                params=measured["params"], state_gib=measured["state_bytes"] / 2**30)
    print_and_write(spread_table(summary), args.out, dict(meta=meta, summary=summary, rounds=counted))
    return 0


if __name__ == "__main__":
    sys.exit(main())
