"""One rank of `overlap train`, as a recipe: process group, model, optimizer, resume, loop,
report. Each step is a function of its own."""
from __future__ import annotations

import argparse
import contextlib
import datetime
import os
import sys
from typing import Optional

import torch
import torch.distributed as dist
from torch import nn

from overlap import MixedPrecision, ShardedModule
from overlap.base.config import local_world_size_from_env
from overlap.models import GPT, Block, GPTConfig
from overlap.models.moe import GPTMoE, MoEBlock, MoEConfig
from overlap.observe.timeline import TraceRecorder
from overlap import optim as overlap_optim
from overlap.train.batches import ByteBatches, shards_of_rank
from overlap.train.checkpoints import Progress, Saver, model_checkpoints, resume
from overlap.train.loop import DataParallelSteps, Losses, train_loop
from overlap.train.options import JobError, check_pipeline, check_world_size, read_text, stages_per_rank
from overlap.train.process_group import init_process_group

VOCAB_SIZE = 256          # byte-level tokens: any text works, nothing to download
PG_TIMEOUT = datetime.timedelta(seconds=120)


def run_rank(args: argparse.Namespace) -> int:
    """One rank of the job (under torchrun or started by the job's own launcher): 0 when
    done, 2 when a setting or checkpoint is refused (every rank prints why)."""
    device = _device()
    init_process_group("nccl" if device.type == "cuda" else "gloo", timeout=PG_TIMEOUT)
    try:
        train(args, device)
        return 0
    except JobError as exc:
        print(f"overlap train: error (rank {dist.get_rank()}): {exc}", file=sys.stderr, flush=True)
        return 2
    finally:
        dist.destroy_process_group()


def train(args: argparse.Namespace, device: torch.device) -> Optional[Losses]:
    """The job on this rank, in an initialised process group; None when every step was
    already done."""
    world = dist.get_world_size()
    check_world_size(args, world)
    check_pipeline(args)
    if device.type == "cpu":
        torch.set_num_threads(_threads_per_rank(world))
    name, text = read_text(args.data)
    batches = ByteBatches(text, args.seq, device, seed=args.seed)
    if args.pp is not None:
        return _train_pipeline(args, device, name, text, batches)
    model, config = build_model(args)
    optimizer = build_optimizer(model, args)
    load, write = model_checkpoints(model, optimizer)
    progress = resume(args, load, name, world)
    shards = shards_of_rank(progress.shards, dist.get_rank(), world)
    if dist.get_rank() == 0:
        print(_header(args, model, config, name, text, device, progress), flush=True)
    if progress.step == args.steps:
        if dist.get_rank() == 0:
            print(f"overlap train: all --steps {args.steps} are done; nothing to train")
        return None
    tracer = _tracer(args, model, progress, device)
    saver = Saver(args, write, name) if args.checkpoint_dir is not None else None

    def on_first_step(bar) -> None:
        if model.overlap_config.compile:
            _print_compile_seconds(bar)

    steps = DataParallelSteps(model, batches, shards, args)
    losses = train_loop(steps, optimizer, progress, args, device, saver, tracer, on_first_step)
    _report(args, model, losses, saver, tracer)
    if args.sample:
        _print_samples(model, args, device)
    return losses


def _train_pipeline(args: argparse.Namespace, device: torch.device, name: str, text: bytes,
                    batches: ByteBatches) -> Optional[Losses]:
    """--pp: this rank's stage (overlap.train.pipeline), the same loop and lines; the report is
    the first stage's (rank 0's)."""
    from overlap.train.pipeline import PipelineSteps
    from overlap.train.pipeline_checkpoints import stage_checkpoints

    data_parallel = dist.get_world_size() // args.pp
    config = model_config(args)
    steps = PipelineSteps(args, config, device, batches)
    runtime = steps.runtime
    optimizer = torch.optim.AdamW(steps.parameter_groups(args.weight_decay), lr=args.lr, betas=(0.9, 0.95))
    load, write = stage_checkpoints(steps.modules, optimizer, steps.group_names)
    progress = resume(args, load, name, data_parallel)
    # The mesh is (pp, dp): rank r is data-parallel rank r % dp of its stage.
    steps.shards = shards_of_rank(progress.shards, dist.get_rank() % data_parallel, data_parallel)
    if dist.get_rank() == 0:
        print(_header(args, runtime, config, name, text, device, progress), flush=True)
    if progress.step == args.steps:
        if dist.get_rank() == 0:
            print(f"overlap train: all --steps {args.steps} are done; nothing to train")
        return None
    saver = Saver(args, write, name) if args.checkpoint_dir is not None else None
    tracer = _tracer(args, runtime, progress, device)       # each rank's first stage

    def on_first_step(bar) -> None:
        if runtime.overlap_config.compile:
            _print_compile_seconds(bar)

    losses = train_loop(steps, optimizer, progress, args, device, saver, tracer, on_first_step)
    _report(args, runtime, losses, saver, tracer)
    if args.sample:
        whole = steps.whole_model(config)
        if whole is not None:           # rank 0 generates alone, from the stages' values
            _print_samples(whole.to(device), args, device)
    return losses


def _threads_per_rank(world: int) -> int:
    """The ranks of one machine share its cores (those this process may run on): more threads
    than cores per rank only adds contention, and waiting threads spin on oversubscribed
    cores. A node's ranks are LOCAL_WORLD_SIZE, not the world size, which also counts the
    other nodes'."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    return max(1, cores // (local_world_size_from_env() or world))


def _device() -> torch.device:
    if torch.cuda.is_available():
        torch.cuda.set_device(dist.get_node_local_rank())
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def model_config(args: argparse.Namespace) -> GPTConfig:
    sizes = dict(vocab_size=VOCAB_SIZE, block_size=args.seq, n_layer=args.layers, n_head=args.heads,
                 n_embd=args.hidden)
    return MoEConfig(**sizes, n_expert=args.experts, top_k=args.top_k, expert_hidden=2 * args.hidden,
                     capacity_factor=args.capacity_factor) if args.moe else GPTConfig(**sizes)


def build_model(args: argparse.Namespace) -> tuple[ShardedModule, GPTConfig]:
    torch.manual_seed(args.seed)
    config = model_config(args)
    precision = MixedPrecision(param_dtype=torch.bfloat16) if args.mixed_precision == "bf16" else None
    # On the meta device no rank ever holds the whole model; the values are the same as an
    # eager build's (the GPT initialises in construction order). Expert parallelism keeps each
    # rank's experts of an eager build: on the meta device every rank would draw the same
    # values for its experts.
    with contextlib.nullcontext() if args.eager_init or args.expert_parallel else torch.device("meta"):
        gpt = GPTMoE(config) if args.moe else GPT(config)
    try:
        model = ShardedModule(gpt, unit_types=(MoEBlock if args.moe else Block,), mixed_precision=precision,
                              prefetch_depth=args.prefetch_depth, bucket_mb=args.bucket_mb,
                              compression=args.compress, compile=args.compile, offload=args.offload,
                              expert_parallel=args.expert_parallel)
    except ValueError as exc:       # settings the runtime refuses together, raised on every rank
        raise JobError(str(exc)) from None
    return model, config


def build_optimizer(model: ShardedModule, args: argparse.Namespace) -> torch.optim.Optimizer:
    """torch.optim.AdamW, except under offload="disk", whose fp32 masters and moments live in
    the state file that only overlap.optim.AdamW steps (same results, same state dict). Linked
    to the model now rather than at its first step, so that the disk tier takes that step
    during backward too."""
    kind = overlap_optim.AdamW if model.overlap_config.offload == "disk" else torch.optim.AdamW
    optimizer = kind(model.module.optimizer_groups(model.named_parameters(), args.weight_decay), lr=args.lr,
                     betas=(0.9, 0.95))
    model.optimizer_link.link(optimizer)
    return optimizer


def _header(args: argparse.Namespace, model: ShardedModule, config: GPTConfig,
            name: str, text: bytes, device: torch.device, progress: Progress) -> str:
    world = dist.get_world_size()
    per_rank = progress.shards // (world // args.pp if args.pp is not None else world)
    moe = f", {args.experts} experts top-{args.top_k}" + \
        (f" split over {args.expert_parallel} ranks" if args.expert_parallel else "") + \
        (f", capacity {args.capacity_factor:g}" if args.capacity_factor else "") if args.moe else ""
    lines = [f"overlap train: GPT{'-MoE' if args.moe else ''} {args.layers} layers, d={args.hidden}, "
             f"{args.heads} heads{moe}, seq {args.seq} "
             f"({config.num_params / 1e6:.2f}M params, {args.mixed_precision}) on {world} "
             f"{'GPUs (nccl)' if device.type == 'cuda' else 'CPU ranks (gloo)'}; {name}, {len(text) / 1e3:.1f} kB; "
             f"batch {args.batch}/rank" + (f" x {per_rank} accumulated" if per_rank > 1 else "") +
             f"; {len(model.scheduler.units)} units, prefetch depth {model.overlap_config.prefetch_depth}, "
             f"bucket {model.overlap_config.bucket_mb:.3g} MB"]
    if args.pp is not None:
        per_rank = stages_per_rank(args.pp_schedule)
        lines.append(f"pipeline: {args.pp * per_rank} stages, {per_rank} per rank, over {args.pp} groups of "
                     f"{world // args.pp} ranks (overlap.fully_shard), {args.pp_schedule} over {args.microbatches} "
                     "microbatches per batch; the units and report above and below are rank 0's first stage's")
    if model.overlap_config.offload == "disk":
        lines.append("optimizer: overlap.optim.AdamW (offload disk: it steps the masters and moments in the state file)")
    if progress.resumed_from is not None:
        lines.append(f"resumed from {progress.resumed_from} at step {progress.step}")
    return "\n".join(lines)


def _tracer(args: argparse.Namespace, model: ShardedModule, progress: Progress,
            device: torch.device) -> Optional[TraceRecorder]:
    if args.trace is None:
        return None
    tracer = TraceRecorder(args.trace, capture_step=min(2, args.steps - progress.step - 1), device=device)
    model.step_end.controllers.append(tracer)
    return tracer


def _print_compile_seconds(bar) -> None:
    """Once, after the first step (which compiles the blocks): each rank's compile time."""
    seconds = torch._dynamo.utils.calculate_time_spent()["total_wall_time"]
    per_rank: list[Optional[float]] = [None] * dist.get_world_size()
    dist.all_gather_object(per_rank, seconds)
    if dist.get_rank() == 0:
        bar.write("compiled the blocks in " + ", ".join(f"{s:.1f}" for s in per_rank) + " s (per rank)")


def _report(args: argparse.Namespace, model: ShardedModule, losses: Losses, saver: Optional[Saver],
            tracer: Optional[TraceRecorder]) -> None:
    trace_png = tracer.finish() if tracer is not None else None
    if dist.get_rank() != 0:
        return
    print(f"final step {args.steps}: loss {losses.train:.8f} (the last step's, mean over ranks), "
          f"val loss {losses.val:.8f}")
    print(model.overlap_report().to_text())
    if saver is not None:
        print(saver.summary())
    if trace_png is not None:
        print(f"trace: {args.trace}/trace_rank<r>.json (one per rank), timeline {trace_png}")


def _print_samples(model: nn.Module, args: argparse.Namespace, device: torch.device) -> None:
    """Generate through `model`: a ShardedModule (every rank takes part in the gathers), or
    under --pp the whole model on rank 0."""
    torch.manual_seed(args.seed)            # the same draws on every rank
    model.eval()
    prompt = torch.full((args.sample, 1), ord("\n"), dtype=torch.long, device=device)
    out = model.generate(prompt, max_new_tokens=args.sample_len)
    if dist.get_rank() == 0:
        for index, row in enumerate(out[:, 1:].tolist()):
            print(f"--- sample {index + 1} ---\n{bytes(row).decode('utf-8', errors='replace')}")
