"""Can the gathers and reductions go inside the compiled graph? Two ways tried against
per-unit compile (`ShardedModule(compile=True)`, collectives in eager hooks), 2 gloo ranks on
CPU, one small GPT (docs/compile.md, "Capturing the collectives"):

- `compiled-autograd`: the same ShardedModule, its backward run under compiled autograd
  (`torch._dynamo.compiled_autograd`), which traces the autograd graph, hooks included, into
  one compiled backward.
- `traced`: SimpleFSDP's form, written here in a few lines: every parameter is a dim-0 shard,
  and a parametrization gathers it with the traceable functional collective
  (`all_gather_tensor_autograd`, whose backward is a reduce-scatter), inside a selective
  activation checkpoint that recomputes the gather in backward instead of saving the gathered
  parameter (the reshard); the whole model is one `torch.compile` region.

For each: does it run, its losses and final parameters against one eager process on the
global batch (fp32 tolerance), Dynamo's graph breaks and graphs made in warm-up and after it
(recompiles), and step time paired against per-unit compile round by round (the variants
alternate within each round, in the same two processes).

    python benchmarks/compile_capture.py --rounds 5 --steps 5 --out docs/results/compile_capture.json
    python benchmarks/compile_capture.py --link 2gbit ...      # an emulated link (root; netns.py)

The GPT's head is untied from its embedding in every variant and in the reference (a tied
parameter would need one gather shared by two modules; untying keeps the traced form short).
"""
from __future__ import annotations

import argparse
import os
import re
import sys
import time
import traceback
from typing import Any, Callable, Optional, Sequence

import torch
from torch import nn

from common import (LOOPBACK, RunRecord, forwarded, launch, median, on_link, parse_choices, parse_links,
                    parse_with_worker_options, script_main, start_rank, write_json)
from gpt_options import MODEL_FIELDS, SMALL_MODEL, add_model_options, model_config, token_batch

WORLD_SIZE = 2
# per-unit: ShardedModule(compile=True). compiled-autograd*: the same (or eager units, or no
# prefetch) with backward under compiled autograd. traced: SimpleFSDP's form, one gather and
# one reduce-scatter per parameter; traced-bucketed: the same with Inductor's FX passes that
# merge the gathers and the reduce-scatters into buckets (Inductor's default cap, 2000 MB: the
# whole model here) and reorder them for overlap; traced-block-buckets: buckets capped at one
# block's bytes, ZeRO-3's granularity.
VARIANTS = ("per-unit", "compiled-autograd", "compiled-autograd-eager-units", "compiled-autograd-no-prefetch",
            "traced", "traced-bucketed", "traced-block-buckets")
BUCKETED = dict(bucket_all_gathers_fx="all", bucket_reduce_scatters_fx="all", reorder_for_compute_comm_overlap=True)
MIB = 2**20


def _inductor_options(name: str, block_mb: float) -> Optional[dict]:
    if name == "traced-bucketed":
        return BUCKETED
    if name == "traced-block-buckets":
        return {**BUCKETED, "bucket_all_gathers_fx_bucket_size_determinator": lambda bucket: block_mb,
                "bucket_reduce_scatters_fx_bucket_size_determinator": lambda bucket: block_mb}
    return None
BASELINE = "per-unit"
PARITY_STEPS = 4            # steps compared with the reference, from the same initial values
LOSS_RTOL = 1e-4            # fp32: sharded and one-process sums differ only in order
PARAM_RTOL, PARAM_ATOL = 1e-4, 1e-5     # the tests' fp32 tolerance (torch.allclose's form)


def _gpt(args: argparse.Namespace) -> nn.Module:
    from overlap.models import GPT

    torch.manual_seed(args.seed)
    model = GPT(model_config(args))
    model.lm_head.weight = nn.Parameter(model.wte.weight.detach().clone())      # untied (see the docstring)
    return model


def _optimizer(params) -> torch.optim.Optimizer:
    """The tests' tight check: SGD with momentum (AdamW's normalisation would magnify fp32
    rounding in near-zero gradients into differences of the order of its step)."""
    return torch.optim.SGD(params, lr=0.05, momentum=0.9, foreach=True)


# ---- the traced form ---------------------------------------------------------------------

class GatherShard(nn.Module):
    """Parametrization: a dim-0 shard in, the whole parameter out, gathered by a traceable
    functional collective (its autograd backward reduce-scatters the gradient)."""

    def __init__(self, group) -> None:
        super().__init__()
        self.group = group

    def forward(self, shard: torch.Tensor) -> torch.Tensor:
        from torch.distributed._functional_collectives import all_gather_tensor_autograd
        from torch.utils.checkpoint import checkpoint

        # Reshard: the gathered parameter is not saved for backward but gathered again there.
        return checkpoint(all_gather_tensor_autograd, shard, 0, self.group, use_reentrant=False,
                          context_fn=_recompute_gathers)


def _recompute_gathers():
    from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

    gathers = {torch.ops._c10d_functional.all_gather_into_tensor.default, torch.ops._c10d_functional.wait_tensor.default}

    def policy(ctx, op, *args, **kwargs):
        return CheckpointPolicy.MUST_RECOMPUTE if op in gathers else CheckpointPolicy.PREFER_SAVE

    return create_selective_checkpoint_contexts(policy)


def traced(model: nn.Module, rank: int, world: int, options: Optional[dict] = None) -> nn.Module:
    """`model` with each parameter replaced by this rank's dim-0 shard behind GatherShard,
    compiled whole (Inductor `options`, if given)."""
    import torch.distributed as dist
    from torch.nn.utils import parametrize

    group = dist.group.WORLD
    for module in list(model.modules()):
        for name, param in list(module.named_parameters(recurse=False)):
            if param.shape[0] % world:
                raise ValueError(f"{name}: dim 0 ({param.shape[0]}) is not divisible by {world} ranks")
            module._parameters[name] = nn.Parameter(param.detach().chunk(world)[rank].clone())
            parametrize.register_parametrization(module, name, GatherShard(group), unsafe=True)
    return torch.compile(model, options=options)


def _traced_full_params(model: nn.Module) -> dict[str, torch.Tensor]:
    import torch.distributed as dist

    full = {}
    for name, shard in model.named_parameters():
        parts = [torch.empty_like(shard) for _ in range(dist.get_world_size())]
        dist.all_gather(parts, shard.detach().contiguous())
        full[name.replace(".parametrizations.", ".").replace(".original", "")] = torch.cat(parts)
    return full


# ---- the worker --------------------------------------------------------------------------

def _counts() -> dict[str, int]:
    from torch._dynamo.utils import counters

    return dict(graph_breaks=sum(counters["graph_break"].values()), graphs=counters["stats"]["unique_graphs"],
                frames=counters["frames"]["ok"], autograd_captures=counters["compiled_autograd"]["captures"],
                autograd_compiles=counters["compiled_autograd"]["compiles"])


def _delta(after: dict[str, int], before: dict[str, int]) -> dict[str, int]:
    return {key: after[key] - before[key] for key in after}


def _break_reasons() -> list[str]:
    from torch._dynamo.utils import counters

    return sorted(counters["graph_break"])[:20]


class Variant:
    """One way of training the model, its step function and what it measured."""

    def __init__(self, name: str, args: argparse.Namespace, rank: int, world: int) -> None:
        from overlap import ShardedModule
        from overlap.models import Block

        self.name, self.rank, self.world = name, rank, world
        model = _gpt(args)
        if name.startswith("traced"):
            block_mb = sum(p.numel() * p.element_size() for p in model.blocks[0].parameters()) / MIB
            self.model = traced(model, rank, world, _inductor_options(name, block_mb))
        else:
            self.model = ShardedModule(model, unit_types=(Block,), compile=name != "compiled-autograd-eager-units",
                                       **(dict(prefetch_depth=0) if name == "compiled-autograd-no-prefetch" else {}))
        self.optimizer = _optimizer(self.model.parameters())
        self.losses: list[float] = []
        self.step_s: list[list[float]] = []     # per round
        self.counts: dict[str, dict[str, int]] = {}
        self.error: Optional[str] = None

    def _backward_context(self):
        import contextlib

        if not self.name.startswith("compiled-autograd"):
            return contextlib.nullcontext()
        from torch._dynamo import compiled_autograd

        return compiled_autograd._enable(torch.compile)

    def step(self, batch: tuple[torch.Tensor, torch.Tensor]) -> float:
        import torch.distributed as dist

        idx, targets = batch
        loss = self.model(idx, targets)
        # The runtime averages gradients over ranks; the traced reduce-scatter sums them.
        with self._backward_context():
            (loss / self.world if self.name.startswith("traced") else loss).backward()
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        global_loss = loss.detach().clone()
        dist.all_reduce(global_loss)
        return global_loss.item() / self.world

    def full_params(self) -> dict[str, torch.Tensor]:
        if self.name.startswith("traced"):
            return _traced_full_params(self.model._orig_mod)
        return self.model.full_state_dict()


def _reference(args: argparse.Namespace, world: int) -> tuple[list[float], dict[str, torch.Tensor]]:
    """One eager process on the global batch (every rank's batch, concatenated)."""
    model = _gpt(args)
    optimizer = _optimizer(model.parameters())
    losses = []
    for step in range(PARITY_STEPS):
        batches = [token_batch(args, rank, step) for rank in range(world)]
        loss = model(torch.cat([b[0] for b in batches]), torch.cat([b[1] for b in batches]))
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(loss.item())
    return losses, {name: p.detach().clone() for name, p in model.named_parameters()}


COLLECTIVE_WORDS = ("all_gather", "allgather", "reduce_scatter", "reducescatter", "all_reduce", "allreduce",
                    "alltoall", "all_to_all")


def _collectives_in_one_step(variant: Variant, batch) -> dict[str, int]:
    """Profiler events of one step whose names say they are collectives, counted by name."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        variant.step(batch)
    counts: dict[str, int] = {}
    for event in prof.events():
        if any(word in event.name.lower() for word in COLLECTIVE_WORDS):
            counts[event.name] = counts.get(event.name, 0) + 1
    return counts


def _relative_paths(text: str) -> str:
    """A traceback with this checkout's and the installed packages' paths relative."""
    checkout = os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep
    return re.sub(r'"[^"]*site-packages/', '"site-packages/', text.replace(checkout, ""))


def _guarded(variant: Variant, work: Callable[[], Any]) -> Any:
    """Run `work`; a failure is recorded as the variant's result (and the variant dropped)."""
    try:
        return work()
    except Exception:                                      # the experiment's finding, not a crash
        variant.error = _relative_paths(traceback.format_exc(limit=4)[-2500:])
        return None


def run_worker(args: argparse.Namespace) -> None:
    import torch.distributed as dist
    import torch._dynamo

    rank, world = start_rank()
    torch._dynamo.config.cache_size_limit = 64
    ref_losses, ref_params = _reference(args, world)

    variants = [Variant(name, args, rank, world) for name in args.variants]
    step = 0
    for variant in variants:                              # parity steps; compiles in the first
        torch._dynamo.utils.counters.clear()
        start = time.perf_counter()

        def parity(v: Variant = variant) -> None:
            for s in range(PARITY_STEPS):
                v.losses.append(v.step(token_batch(args, rank, s)))

        _guarded(variant, parity)
        variant.first_steps_s = time.perf_counter() - start
        variant.counts["warmup"] = _counts()
        variant.reasons = _break_reasons()
        if variant.error is None:
            full = variant.full_params()
            # How far the worst element is outside allclose's bound (<= 0: within it), and its difference.
            variant.param_excess = max(((full[n] - p).abs() - PARAM_ATOL - PARAM_RTOL * p.abs()).max().item()
                                       for n, p in ref_params.items())
            variant.max_param_diff = max((full[n] - p).abs().max().item() for n, p in ref_params.items())
            variant.max_loss_rdiff = max(abs(a - b) / abs(b) for a, b in zip(variant.losses, ref_losses))
    step = PARITY_STEPS
    live = [v for v in variants if v.error is None]
    for v in live:
        v.before_rounds = _counts()
    for round_index in range(args.rounds):
        order = live if round_index % 2 == 0 else live[::-1]   # alternate which goes first
        for variant in order:
            before = _counts()
            times = []
            for _ in range(args.steps):
                batch = token_batch(args, rank, step)
                step += 1
                start = time.perf_counter()
                variant.step(batch)
                times.append(time.perf_counter() - start)
            times_t = torch.tensor(times)
            dist.all_reduce(times_t, op=dist.ReduceOp.MAX)     # a step's time is the slower rank's
            variant.step_s.append(times_t.tolist())
            delta = _delta(_counts(), before)
            variant.counts["rounds"] = {k: variant.counts.get("rounds", {}).get(k, 0) + d for k, d in delta.items()}
    for variant in live:
        variant.collectives = _collectives_in_one_step(variant, token_batch(args, rank, step))
        step += 1
    if rank == 0:
        write_json(args.result, dict(reference_losses=ref_losses, variants=[dict(
            name=v.name, error=v.error, losses=v.losses, first_steps_s=v.first_steps_s,
            max_loss_rdiff=getattr(v, "max_loss_rdiff", None), max_param_diff=getattr(v, "max_param_diff", None),
            param_excess=getattr(v, "param_excess", None),
            counts=v.counts, break_reasons=v.reasons, step_s=v.step_s, collectives=getattr(v, "collectives", None))
            for v in variants]))


# ---- the driver --------------------------------------------------------------------------

def _exception_line(error: Optional[str]) -> Optional[str]:
    """The last 'SomeError: message' line of a traceback (Dynamo appends advice after it)."""
    if error is None:
        return None
    lines = [line for line in error.splitlines() if re.match(r"^[\w.]+(Error|Exception|StopIteration)\b", line)]
    return lines[-1] if lines else error.strip().splitlines()[-1]


def summarize(result: dict) -> dict:
    by_name = {v["name"]: v for v in result["variants"]}
    base = by_name.get(BASELINE)
    summary = {}
    for name, v in by_name.items():
        entry = dict(runs=v["error"] is None, error=_exception_line(v["error"]),
                     max_loss_rdiff=v["max_loss_rdiff"], max_param_diff=v["max_param_diff"],
                     parity=None if v["error"] else (v["max_loss_rdiff"] <= LOSS_RTOL and v["param_excess"] <= 0),
                     nan=any(x != x for x in v["losses"]), warmup_counts=v["counts"].get("warmup"),
                     round_counts=v["counts"].get("rounds"), break_reasons=v["break_reasons"],
                     first_steps_s=v["first_steps_s"], collectives_per_step=v["collectives"])
        if v["step_s"]:
            entry["round_step_ms"] = [median(r) * 1e3 for r in v["step_s"]]
            entry["step_ms"] = median([t for r in v["step_s"] for t in r]) * 1e3
        if base and v["step_s"] and base["step_s"] and name != BASELINE:
            ratios = [median(a) / median(b) for a, b in zip(v["step_s"], base["step_s"])]
            entry["over_per_unit_rounds"] = ratios
            entry["over_per_unit"] = median(ratios)
        summary[name] = entry
    return summary


def run_driver(args: argparse.Namespace) -> int:
    record = RunRecord("compile_capture.py", args.argv)
    worker = ["--worker", "--variants", ",".join(args.variants),
              *forwarded(args, ("rounds", "steps", *MODEL_FIELDS, "batch", "seed"))]
    with on_link(args.link) as prefix:
        result = launch(os.path.abspath(__file__), WORLD_SIZE, worker, args.run_timeout, prefix)
    summary = summarize(result)
    out = dict(meta=dict(**record.fields(), world_size=WORLD_SIZE, link=args.link,
                         model=dict(n_layer=args.n_layer, n_embd=args.n_embd, n_head=args.n_head,
                                    vocab_size=args.vocab_size, block_size=args.block_size, batch=args.batch),
                         rounds=args.rounds, steps=args.steps, loss_rtol=LOSS_RTOL, param_rtol=PARAM_RTOL,
                         param_atol=PARAM_ATOL, bucketed_options=BUCKETED),
               summary=summary, raw=result)
    write_json(args.out, out)
    for name, entry in summary.items():
        print(name, {k: entry.get(k) for k in ("runs", "error", "parity", "max_loss_rdiff", "max_param_diff",
                                                 "warmup_counts", "round_counts", "step_ms", "over_per_unit",
                                                 "over_per_unit_rounds", "first_steps_s", "collectives_per_step")})
    return 0


def parse_args(argv: Sequence[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--variants", default=",".join(VARIANTS))
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--steps", type=int, default=5, help="timed steps per variant per round")
    add_model_options(parser, SMALL_MODEL)
    parser.add_argument("--batch", type=int, default=2, help="sequences per rank per step")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--link", default=LOOPBACK, help="loopback, or a tc rate such as 2gbit (needs root: netns.py)")
    parser.add_argument("--out", default="bench_out/compile_capture.json")
    parser.add_argument("--run-timeout", type=float, default=900)
    args = parse_with_worker_options(parser, argv)
    try:
        args.link = parse_links(args.link)[0]
        args.variants = parse_choices(args.variants, VARIANTS, "--variants")
    except ValueError as exc:
        parser.error(str(exc))
    if BASELINE not in args.variants:
        parser.error(f"--variants must include {BASELINE!r}, the baseline of the paired ratios")
    return args


def main(argv: Optional[Sequence[str]] = None) -> int:
    return script_main(argv, parse_args, run_worker, run_driver)


if __name__ == "__main__":
    sys.exit(main())
