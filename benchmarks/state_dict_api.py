"""What torch's state-dict API costs over overlap's state dicts, against FSDP2 over its own.

Two gloo ranks build the benchmark GPT as `ShardedModule(model)`, with `overlap.fully_shard` and
with FSDP2, each after one AdamW step; the variants take turns over rounds timing each call of
CALLS (the slower rank's). Per call: the median over rounds and the per-round ratios to FSDP2's.

    python benchmarks/state_dict_api.py --rounds 5
"""
from __future__ import annotations

import argparse
import os
import sys
import shutil
import tempfile
from typing import Callable, Sequence

from common import (RunRecord, add_options, arg_parser, from_every_rank, in_turns, launch_worker, markdown_table,
                    median, parse_with_worker_options, script_main, slower_rank, spread, spread_cell, start_rank,
                    timed_steps, to_driver, train_step, write_results)

WORLD_SIZE = 2
VARIANTS = ("overlap ShardedModule", "overlap fully_shard", "FSDP2")
CALLS = ("model.state_dict()", "get_model_state_dict (full, cpu_offload)",
         "get_optimizer_state_dict (full, cpu_offload)", "set_model_state_dict (full, broadcast_from_rank0)",
         "dcp.save(model.state_dict())", "dcp.load + load_state_dict")


def _built(variant: str, args: argparse.Namespace):
    import torch
    from torch.distributed.fsdp import fully_shard

    from overlap import ShardedModule
    from overlap import fully_shard as overlap_fully_shard
    from overlap.models import GPT, GPTConfig
    from peers import shard_by_block

    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=8192, block_size=args.seq, n_layer=args.layers, n_head=8, n_embd=args.width))
    if variant == "overlap ShardedModule":
        model = ShardedModule(model)
    else:
        shard_by_block(fully_shard if variant == "FSDP2" else overlap_fully_shard, model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    idx = torch.randint(0, 8192, (2, args.seq), generator=torch.Generator().manual_seed(1))
    train_step(model, optimizer, idx, idx)()
    return model, optimizer


def _calls(model, optimizer, scratch: str) -> dict[str, Callable[[], object]]:
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_model_state_dict,
                                                         get_optimizer_state_dict, set_model_state_dict)

    full = StateDictOptions(full_state_dict=True, cpu_offload=True)
    held: dict[str, object] = {}
    directory = os.path.join(scratch, "checkpoint")

    def save() -> None:
        if dist.get_rank() == 0 and os.path.exists(directory):
            shutil.rmtree(directory)
        dist.barrier()
        dcp.save(model.state_dict(), checkpoint_id=directory)

    def load() -> None:
        state = model.state_dict()
        dcp.load(state, checkpoint_id=directory)
        model.load_state_dict(state)

    def get_full() -> None:
        held["full"] = get_model_state_dict(model, options=full)

    return {
        CALLS[0]: model.state_dict,
        CALLS[1]: get_full,
        CALLS[2]: lambda: get_optimizer_state_dict(model, optimizer, options=full),
        CALLS[3]: lambda: set_model_state_dict(model, held["full"], options=StateDictOptions(
            full_state_dict=True, broadcast_from_rank0=True)),
        CALLS[4]: save,
        CALLS[5]: load,
    }


def run_worker(args: argparse.Namespace) -> None:
    import torch.distributed as dist

    rank, _ = start_rank()
    scratch = tempfile.mkdtemp(prefix="state_dict_api_") if rank == 0 else None
    scratch = from_every_rank(scratch)[0]         # one shared directory (the ranks share a host)
    calls = {}
    for variant in VARIANTS:
        model, optimizer = _built(variant, args)
        calls[variant] = _calls(model, optimizer, os.path.join(scratch, variant.replace(" ", "_")))
        for call in calls[variant].values():      # warm-up: the first call of each builds what it caches
            timed_steps(call, 1)
    measured = in_turns(VARIANTS, args.rounds, lambda v: {call: timed_steps(calls[v][call], 1)[0] for call in CALLS})
    to_driver(args.result, {v: {call: [r[call] for r in rounds] for call in CALLS} for v, rounds in measured.items()})
    dist.barrier()
    if rank == 0:
        shutil.rmtree(scratch, ignore_errors=True)


def run_driver(args: argparse.Namespace) -> int:
    record = RunRecord("state_dict_api.py", args.argv)
    data = launch_worker(__file__, WORLD_SIZE, args, ("rounds", "width", "layers", "seq"))
    per_round = {variant: {call: slower_rank(rank[variant][call] for rank in data["ranks"]) for call in CALLS}
                 for variant in VARIANTS}
    summary = {variant: {call: dict(ms=round(1e3 * median(per_round[variant][call]), 2),
                                    over_fsdp2=spread([ours / theirs for ours, theirs in
                                                       zip(per_round[variant][call], per_round["FSDP2"][call])]))
                         for call in CALLS} for variant in VARIANTS}
    rows = []
    for call in CALLS:
        cells = [call, summary["FSDP2"][call]["ms"]]
        for variant in VARIANTS[:2]:
            cells += [summary[variant][call]["ms"], spread_cell(summary[variant][call]["over_fsdp2"])]
        rows.append(cells)
    table = markdown_table(["call", "FSDP2 ms", "ShardedModule ms", "÷ FSDP2", "fully_shard ms", "÷ FSDP2"], rows)
    write_results(args.out, "state_dict_api", dict(**record.fields(), world=WORLD_SIZE, summary=summary, **data), table)
    return 0


def parse_args(argv: Sequence[str]) -> argparse.Namespace:
    parser = arg_parser(__doc__)
    parser.add_argument("--layers", type=int, default=6, help="blocks (23.2M parameters at d=512)")
    add_options(parser, rounds=5, width=512, seq=128, out="bench_out", timeout=1200.0)
    return parse_with_worker_options(parser, argv)


if __name__ == "__main__":
    sys.exit(script_main(None, parse_args, run_worker, run_driver))
