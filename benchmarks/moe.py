"""Expert parallelism's step against ZeRO-3 without it and against FSDP2, on a GPT-MoE (8 experts,
top-2) on 4 gloo ranks: `ShardedModule(model)`, `expert_parallel=2` and `=4`, and FSDP2, built
in one launch and taking turns over rounds; per-round ratios to `ShardedModule(model)`, and
from the overlap report the bytes gathered, reduced and sent by all-to-all, and the time
blocked on and hidden of the all-to-alls.

    python benchmarks/moe.py --rounds 5 --steps 3 --link loopback      # or --link 2gbit
    python benchmarks/moe.py --variants "no EP,EP 2/1,EP 2,EP 2/4"    # EP 2 with 1, 2 (default) and 4 chunks
    python benchmarks/moe.py --variants "no EP,EP 2,fully_shard EP 2"  # the same through overlap.fully_shard
    python benchmarks/moe.py --variants "no EP,EP 4,EP 4 unsplit"      # expert backward not split in two
"""
from __future__ import annotations

import argparse
import os
import sys
import re
from typing import Optional, Sequence

from common import (RunRecord, add_options, arg_parser, in_turns, launch_worker, markdown_table, median, on_link,
                    parse_with_worker_options, ratio_cell, ratio_fields, script_main, slower_rank, spread, start_rank,
                    timed_steps, to_driver, train_step, write_results)
from tensor_memory import peak_tensor_rise_mb

WORLD_SIZE = 4
VARIANTS = ("no EP", "EP 2", "EP 4", "FSDP2")
# "EP <E>/<C>": each MoE layer's tokens in C chunks (OVERLAP_EXPERT_CHUNKS); "fully_shard EP <E>":
# overlap.fully_shard with OverlapPolicy(expert_parallel=E); "EP <E> unsplit": the forward under
# pass-through saved-tensor hooks, under which expert calls keep their backward in one piece
# ([Note: expert weight gradients after the send] in overlap/runtime/expert_backward.py).
VARIANT_FORM = re.compile(r"(no EP|FSDP2|(fully_shard )?EP [124](/[1-9])?( unsplit)?)$")


class _Unsplit:
    """`model` called under pass-through saved-tensor hooks."""

    def __init__(self, model) -> None:
        self.model = model

    def __call__(self, *args):
        import torch
        with torch.autograd.graph.saved_tensors_hooks(lambda t: t, lambda t: t):
            return self.model(*args)

    def overlap_report(self):
        return self.model.overlap_report()


def _config(args: argparse.Namespace):
    from overlap.models.moe import MoEConfig
    return MoEConfig(vocab_size=8192, block_size=args.seq, n_layer=args.layers, n_head=8, n_embd=args.width,
                     n_expert=8, top_k=2, expert_hidden=args.expert_hidden)


def _build(variant: str, args: argparse.Namespace):
    import torch
    from torch.distributed.fsdp import fully_shard

    from overlap import ShardedModule
    from overlap.models.moe import GPTMoE, MoEBlock
    from peers import shard_by_block

    torch.manual_seed(0)
    model = GPTMoE(_config(args))
    os.environ.pop("OVERLAP_EXPERT_CHUNKS", None)          # set below for "EP <E>/<chunks>" only
    if variant == "FSDP2":
        shard_by_block(fully_shard, model)
    elif variant.startswith("fully_shard "):
        from overlap import OverlapPolicy
        from overlap import fully_shard as overlap_fully_shard

        for block in model.blocks:
            overlap_fully_shard(block)
        overlap_fully_shard(model, overlap_policy=OverlapPolicy(expert_parallel=int(variant.split()[-1])))
    else:
        ep, _, chunks = variant.split()[1].partition("/") if variant != "no EP" else (None, "", "")
        if chunks:
            os.environ["OVERLAP_EXPERT_CHUNKS"] = chunks
        model = ShardedModule(model, unit_types=(MoEBlock,), expert_parallel=None if ep is None else int(ep))
        if variant.endswith(" unsplit"):
            return _Unsplit(model), torch.optim.AdamW(model.parameters(), lr=1e-4)
    return model, torch.optim.AdamW(model.parameters(), lr=1e-4)


def _all_to_all(model, count: int) -> tuple[float, float, float]:
    """Per step of the report's last `count` steps: all-to-all bytes sent, seconds in flight,
    seconds waited on (zeros for FSDP2, which has no report)."""
    if not hasattr(model, "overlap_report"):
        return 0.0, 0.0, 0.0
    steps = model.overlap_report().steps[-count:]
    return tuple(sum(getattr(s, name) for s in steps) / len(steps)
                 for name in ("all_to_all_bytes", "all_to_all_s", "all_to_all_exposed_s"))


def run_worker(args: argparse.Namespace) -> None:
    import torch

    rank, _ = start_rank()
    variants = args.variants.split(",")
    built = {variant: _build(variant, args) for variant in variants}
    gen = torch.Generator().manual_seed(rank)
    idx = torch.randint(0, 8192, (args.batch, args.seq), generator=gen)

    def steps(variant: str, count: int) -> list[float]:
        return timed_steps(train_step(*built[variant], idx, idx), count)

    for variant in variants:
        steps(variant, 2)                                          # warm-up: the runtime learns its order
    # Per round: the median step and the all-to-all figures of those steps.
    measured = in_turns(variants, args.rounds, lambda v: (median(steps(v, args.steps)),
                                                          _all_to_all(built[v][0], args.steps)))
    peak = {v: [peak_tensor_rise_mb(lambda: steps(v, 1)) for _ in range(args.rounds)] for v in variants}
    reports = {}
    for variant, (model, _) in built.items():
        if variant != "FSDP2":
            mean = model.overlap_report().mean_step()
            reports[variant] = dict(gathered_bytes=mean.gathered_bytes, reduced_bytes=mean.reduced_bytes,
                                    comm_ms=mean.comm_s * 1e3, hidden_fraction=mean.hidden_fraction)
    to_driver(args.result, dict(step_s={v: [m[0] for m in ms] for v, ms in measured.items()},
                                all_to_all={v: [m[1] for m in ms] for v, ms in measured.items()}, reports=reports,
                                peak_tensor_rise_mb=peak))


def _twin(variant: str) -> str:
    """The same expert parallelism under ShardedModule, split: what a variant is compared with."""
    return variant.removeprefix("fully_shard ").removesuffix(" unsplit")


def _hidden_share(per_round: list[list[list[float]]]) -> Optional[float]:
    """The median over rounds of the share of all-to-all time not waited on; None without any."""
    shares = [1 - sum(rank[2] for rank in round_) / total for round_ in per_round
              if (total := sum(rank[1] for rank in round_)) > 0]
    return round(median(shares), 3) if shares else None


def run_driver(args: argparse.Namespace) -> int:
    record = RunRecord("moe.py", args.argv)
    options = ("rounds", "steps", "width", "layers", "seq", "batch", "expert_hidden", "variants")
    with on_link(args.link) as prefix:
        data = launch_worker(__file__, WORLD_SIZE, args, options, prefix=prefix)
    ranks = data["ranks"]
    variants = args.variants.split(",")
    rounds = {v: slower_rank(r["step_s"][v] for r in ranks) for v in variants}
    summary = {}
    for variant in variants:
        ratios = [mine / base for mine, base in zip(rounds[variant], rounds["no EP"])]
        per_round = [[r["all_to_all"][variant][i] for r in ranks] for i in range(args.rounds)]
        sent = median([sum(rank[0] for rank in round_) for round_ in per_round])
        blocked = median([max(rank[2] for rank in round_) for round_ in per_round])
        report = ranks[0]["reports"].get(variant)
        summary[variant] = dict(
            step_ms=round(median(rounds[variant]) * 1e3, 1),
            **ratio_fields(ratios, 3),
            all_to_all_mb_per_step=round(sent / 2**20, 2), all_to_all_blocked_ms=round(blocked * 1e3, 1),
            all_to_all_hidden_share=_hidden_share(per_round),
            gathered_mb_per_rank=None if report is None else round(report["gathered_bytes"] / 2**20, 2),
            reduced_mb_per_rank=None if report is None else round(report["reduced_bytes"] / 2**20, 2),
            peak_tensor_rise_mb_per_rank=round(max(median(r["peak_tensor_rise_mb"][variant]) for r in ranks), 1))
        twin = _twin(variant)
        if twin != variant and twin in rounds:
            summary[variant]["ratio_to_" + twin.replace(" ", "_")] = spread(
                [round(mine / theirs, 3) for mine, theirs in zip(rounds[variant], rounds[twin])])
    table = markdown_table(
        ["variant", "step ms", "÷ no EP, per round: median (range)", "gathered MB/rank", "reduced MB/rank",
         "all-to-all MB (all ranks)", "blocked in all-to-all ms", "all-to-all hidden",
         "peak tensor memory rise MB/rank"],
        [[v, s["step_ms"], ratio_cell(s),
          "–" if s["gathered_mb_per_rank"] is None else s["gathered_mb_per_rank"],
          "–" if s["reduced_mb_per_rank"] is None else s["reduced_mb_per_rank"],
          s["all_to_all_mb_per_step"], s["all_to_all_blocked_ms"],
          "–" if s["all_to_all_hidden_share"] is None else f"{100 * s['all_to_all_hidden_share']:.0f}%",
          s["peak_tensor_rise_mb_per_rank"]]
         for v, s in summary.items()])
    twins = [f"{v} ÷ {_twin(v)}, per round: {s[key]['median']} ({s[key]['min']}–{s[key]['max']})"
             for v, s in summary.items() for key in s if key.startswith("ratio_to_")]
    table += "".join(f"\n{line}" for line in twins)
    write_results(args.out, f"moe_{args.link}", dict(**record.fields(), link=args.link, world=WORLD_SIZE,
                                                     params=_config(args).num_params, summary=summary, **data), table)
    return 0


def parse_args(argv: Sequence[str]) -> argparse.Namespace:
    parser = arg_parser(__doc__)
    parser.add_argument("--steps", type=int, default=3, help="timed steps per round and variant")
    parser.add_argument("--expert-hidden", type=int, default=1152, help="31.5M parameters at the defaults")
    parser.add_argument("--batch", type=int, default=2, help="sequences per rank")
    parser.add_argument("--link", default="loopback", help="loopback, or a rate such as 2gbit")
    add_options(parser, rounds=5, width=256, layers=4, seq=128, out="bench_out", timeout=1800.0)
    parser.add_argument("--variants", default=",".join(VARIANTS),
                        help="comma-separated, 'no EP' among them: no EP, EP 2, EP 4, FSDP2, EP <E>/<chunks>, "
                             "EP <E> unsplit")
    args = parse_with_worker_options(parser, argv)
    variants = args.variants.split(",")
    if "no EP" not in variants or len(set(variants)) != len(variants) or not all(
            VARIANT_FORM.match(v) for v in variants):
        parser.error(f"--variants {args.variants!r}: expected distinct variants among {', '.join(VARIANTS)} "
                     "or 'EP <E>/<chunks>' or 'fully_shard EP <E>', 'no EP' among them")
    return args


if __name__ == "__main__":
    sys.exit(script_main(None, parse_args, run_worker, run_driver))
