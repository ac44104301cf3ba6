"""ZeRO-3 inside pipeline stages on torch's 1F1B schedule at (pp, dp) = (2, 2), 4 gloo ranks:
`ShardedModule(stage, mesh=mesh["dp"])`, `overlap.fully_shard` (and forced to gather again per
microbatch, or to keep only the first 3 of a stage's 5 units across them; each `fully_shard`
setting again with the gathers between passes following the schedule's actions,
`overlap.follow_schedule`), against FSDP2 with `reshard_after_forward` True and False (its
reduce-scatter by all-to-all, as peers.py tunes it). Built in one launch, taking turns over
rounds; per step the bytes each rank gathers and reduces, the peak rise of tensor memory
(tensor_memory.py, apart from the timed steps), and per-round ratios to FSDP2's faster setting.

    python benchmarks/pipeline.py --rounds 3 --steps 2
"""
from __future__ import annotations

import argparse
import sys
from typing import Sequence

from common import (RunRecord, add_options, arg_parser, in_turns, launch_worker, markdown_table, median,
                    parse_with_worker_options, ratio_cell, ratio_fields, script_main, slower_rank, start_rank,
                    timed_steps, to_driver, write_results)
from tensor_memory import peak_tensor_rise_mb

WORLD_SIZE, PP = 4, 2
VARIANTS = ("overlap ShardedModule", "overlap fully_shard", "overlap fully_shard, regather", "FSDP2 reshard",
            "FSDP2 no reshard", "overlap fully_shard, followed", "overlap fully_shard, regather, followed",
            "overlap fully_shard, keep 3", "overlap fully_shard, keep 3, followed")
# Units kept gathered across a step's microbatches where the variant sets it: none ("regather"),
# or the root and the first blocks ("keep 3" of a stage's five units), as a memory budget
# too small for all would.
KEEP = {"regather": 0, "keep 3": 3}


def _stage(index: int, args: argparse.Namespace):
    """Stage `index` of the GPT (the same values on every rank)."""
    import torch
    from torch import nn

    from overlap.models import GPT, GPTConfig

    torch.manual_seed(0)
    gpt = GPT(GPTConfig(vocab_size=8192, block_size=args.seq, n_layer=args.layers, n_head=8, n_embd=args.width))
    half = args.layers // 2

    class First(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.wte, self.wpe, self.blocks = gpt.wte, gpt.wpe, nn.ModuleList(gpt.blocks[:half])

        def forward(self, idx):
            x = self.wte(idx) + self.wpe(torch.arange(idx.shape[1]))
            for block in self.blocks:
                x = block(x)
            return x

    class Last(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.blocks, self.ln_f = nn.ModuleList(gpt.blocks[half:]), gpt.ln_f
            self.head = nn.Linear(args.width, 8192, bias=False)
            self.head.weight = nn.Parameter(gpt.wte.weight.detach().clone())     # untied across stages

        def forward(self, x):
            for block in self.blocks:
                x = block(x)
            return self.head(self.ln_f(x))

    return First() if index == 0 else Last()


def _wrap(variant: str, stage, mesh):
    from torch.distributed.fsdp import fully_shard

    from overlap import ShardedModule
    from overlap import fully_shard as overlap_fully_shard
    from peers import reduce_scatter_by_all_to_all, shard_by_block

    if variant == "overlap ShardedModule":
        return ShardedModule(stage, mesh=mesh)
    if variant.startswith("overlap fully_shard"):
        return shard_by_block(overlap_fully_shard, stage, mesh=mesh)
    root = shard_by_block(fully_shard, stage, mesh=mesh, reshard_after_forward=variant == "FSDP2 reshard")
    reduce_scatter_by_all_to_all(root, *stage.blocks)
    return root


class _Bytes:
    """Bytes this rank all-gathers and reduce-scatters, at overlap's collectives and FSDP2's calls."""

    def __init__(self) -> None:
        import torch.distributed as dist

        from peers import AllToAllReduceScatter

        from overlap.runtime.collectives import Collectives

        self.moved = {"gathered": 0, "reduced": 0}
        # (owner, function, total, the counted tensor's position and name). FSDP2 calls
        # dist.all_gather_single; overlap's gathers bound it at import and are counted at Collectives.
        for owner, name, total, index, keyword in (
                (Collectives, "all_gather", "gathered", 1, "out"), (Collectives, "reduce_scatter", "reduced", 1, "grad_full"),
                (dist, "all_gather_single", "gathered", 0, "output_tensor"),
                (AllToAllReduceScatter, "__call__", "reduced", 2, "input_tensor")):
            setattr(owner, name, self._counted(getattr(owner, name), total, index, keyword))

    def _counted(self, fn, total: str, index: int, keyword: str):
        def run(*args, **kwargs):
            tensor = args[index] if len(args) > index else kwargs[keyword]
            self.moved[total] += tensor.numel() * tensor.element_size()
            return fn(*args, **kwargs)
        return run

    def take(self) -> tuple[int, int]:
        out = (self.moved["gathered"], self.moved["reduced"])
        self.moved = {"gathered": 0, "reduced": 0}
        return out


def run_worker(args: argparse.Namespace) -> None:
    import torch
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import FSDPModule
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B
    from torch.nn import functional as F

    from overlap import follow_schedule

    rank, _ = start_rank()
    counter = _Bytes()
    mesh = init_device_mesh("cpu", (PP, WORLD_SIZE // PP), mesh_dim_names=("pp", "dp"))
    pp_rank, dp_rank = mesh.get_local_rank("pp"), mesh.get_local_rank("dp")

    def loss_fn(logits, target):
        return F.cross_entropy(logits.flatten(0, 1), target.flatten())

    built = {}
    for variant in VARIANTS:
        module = _wrap(variant, _stage(pp_rank, args), mesh["dp"])
        stage = PipelineStage(module, pp_rank, PP, torch.device("cpu"), group=mesh["pp"].get_group())
        built[variant] = (Schedule1F1B(stage, n_microbatches=args.microbatches, loss_fn=loss_fn),
                          torch.optim.AdamW(module.parameters(), lr=1e-4), module)
        if variant.endswith(", followed"):
            follow_schedule(built[variant][0])
    gen = torch.Generator().manual_seed(dp_rank)
    idx = torch.randint(0, 8192, (args.microbatches, args.seq), generator=gen)

    def steps(variant: str, count: int) -> list[float]:
        schedule, optimizer, _ = built[variant]

        def step() -> None:
            schedule.step(*((idx,) if pp_rank == 0 else ()), **({"target": idx} if pp_rank == PP - 1 else {}))
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)

        return timed_steps(step, count)

    def rise_mb(variant: str) -> float:
        """One step's peak tensor memory over what the rank held before it, gathered parameters
        freed first (FSDP2 without resharding keeps its own from one step to the next)."""
        for module in built[variant][2].modules():
            if isinstance(module, FSDPModule):
                module.reshard()
        return peak_tensor_rise_mb(lambda: steps(variant, 1))

    for variant in VARIANTS:
        steps(variant, 1)                                          # warm-up: builds the runtimes
        setting = variant.split(", ")[1] if variant.count(", ") else None
        if setting in KEEP:
            built[variant][2].overlap_runtime.scheduler.keep_units = KEEP[setting]
    decided = built["overlap fully_shard"][2].overlap_report().decisions
    counter.take()

    def measure(variant: str) -> tuple[float, list[float]]:
        """A round's median step, and the bytes gathered and reduced per step."""
        step = median(steps(variant, args.steps))
        return step, [moved / args.steps for moved in counter.take()]

    measured = in_turns(VARIANTS, args.rounds, measure)
    peak = in_turns(VARIANTS, args.rounds, rise_mb)                 # memory apart from the timed steps
    to_driver(args.result, dict(step_s={v: [m[0] for m in ms] for v, ms in measured.items()},
                                moved={v: [m[1] for m in ms] for v, ms in measured.items()}, peak_tensor_rise_mb=peak,
                                pp_rank=pp_rank, decided=decided))


def run_driver(args: argparse.Namespace) -> int:
    record = RunRecord("pipeline.py", args.argv)
    data = launch_worker(__file__, WORLD_SIZE, args, ("rounds", "steps", "width", "layers", "seq", "microbatches"))
    ranks = data["ranks"]
    rounds = {v: slower_rank(r["step_s"][v] for r in ranks) for v in VARIANTS}
    best_fsdp2 = [min(a, b) for a, b in zip(rounds["FSDP2 reshard"], rounds["FSDP2 no reshard"])]
    summary = {}
    for variant in VARIANTS:
        ratios = [mine / best for mine, best in zip(rounds[variant], best_fsdp2)]
        summary[variant] = dict(
            step_ms=round(median(rounds[variant]) * 1e3, 1),
            **ratio_fields(ratios, 3, "ratio_to_best_fsdp2_median"),
            gathered_mb_per_rank=round(max(median([m[0] for m in r["moved"][variant]]) for r in ranks) / 2**20, 1),
            reduced_mb_per_rank=round(max(median([m[1] for m in r["moved"][variant]]) for r in ranks) / 2**20, 1),
            peak_tensor_rise_mb_per_rank=round(max(median(r["peak_tensor_rise_mb"][variant]) for r in ranks), 1))
    table = markdown_table(
        ["variant", "step ms", "÷ FSDP2's faster, per round: median (range)", "gathered MB/rank/step",
         "reduced MB/rank/step", "peak tensor memory rise MB/rank"],
        [[v, s["step_ms"], ratio_cell(s, "ratio_to_best_fsdp2_median"),
          s["gathered_mb_per_rank"], s["reduced_mb_per_rank"], s["peak_tensor_rise_mb_per_rank"]]
         for v, s in summary.items()])
    decided = sorted({d for r in ranks for d in r["decided"]})
    write_results(args.out, "pipeline", dict(**record.fields(), world=WORLD_SIZE, pp=PP, schedule="1F1B",
                                             summary=summary, **data), "\n\n".join([table, "\n".join(decided)]))
    return 0


def parse_args(argv: Sequence[str]) -> argparse.Namespace:
    parser = arg_parser(__doc__)
    parser.add_argument("--steps", type=int, default=2, help="timed steps per round and variant")
    parser.add_argument("--layers", type=int, default=8, help="blocks, half per stage (29M parameters at d=512)")
    parser.add_argument("--microbatches", type=int, default=8, help="microbatches per step (one sequence each)")
    add_options(parser, rounds=3, width=512, seq=128, out="bench_out", timeout=1800.0)
    return parse_with_worker_options(parser, argv)


if __name__ == "__main__":
    sys.exit(script_main(None, parse_args, run_worker, run_driver))
