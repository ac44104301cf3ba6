"""The training loop of `overlap train`: one optimizer step over this rank's batch shards,
the lines it prints, and the saves it makes."""
from __future__ import annotations

import argparse
import contextlib
import time
from typing import Optional, Protocol

import torch
import torch.distributed as dist

from overlap import ShardedModule
from overlap.base.profiling import phase
from overlap.observe.report import OverlapMonitor, format_seconds
from overlap.train.batches import ByteBatches
from overlap.train.checkpoints import Progress, Saver
from overlap.train.memory import peak_memory_bytes
from overlap.train.schedule import learning_rate

VAL_BATCHES = 4           # the same validation batches at every evaluation
HIDDEN_EVERY = 10         # steps between readings of the hidden share the progress bar shows
CLIP_NORM = 1.0


def mean_over_ranks(values: list[Optional[float]], device: torch.device) -> list[float]:
    """Each value's mean over the ranks that have it (a pipeline's losses are on its last
    stage's ranks only)."""
    tensor = torch.tensor([[0.0 if v is None else v, v is not None] for v in values], dtype=torch.float64,
                          device=device)
    dist.all_reduce(tensor)
    return (tensor[:, 0] / tensor[:, 1]).tolist()


class Steps(Protocol):
    """What the loop runs each step: a ShardedModule over all ranks (DataParallelSteps) or a
    pipeline stage (overlap.train.pipeline.PipelineSteps)."""

    monitor: OverlapMonitor

    def train(self, optimizer: torch.optim.Optimizer, step: int, clip_norm: float) -> Optional[float]: ...

    def val_loss(self, draws: int) -> Optional[float]: ...


class DataParallelSteps:
    """The steps of a ShardedModule that holds the whole model on every rank."""

    def __init__(self, model: ShardedModule, batches: ByteBatches, shards: range, args: argparse.Namespace) -> None:
        self.model, self.batches, self.shards, self.args = model, batches, shards, args
        self.monitor = model.overlap_monitor

    def train(self, optimizer: torch.optim.Optimizer, step: int, clip_norm: float) -> float:
        """One optimizer step on this rank's shards of the global batch: their gradients are
        accumulated locally and reduced with the last one's backward; returns this rank's mean
        loss over its shards."""
        model, shards, args = self.model, self.shards, self.args
        for group in optimizer.param_groups:
            group["lr"] = learning_rate(step, args)
        total = 0.0
        for index, shard in enumerate(shards):
            inputs, targets = self.batches.get("train", args.batch, step, shard)
            reduce = index == len(shards) - 1
            with contextlib.nullcontext() if reduce else model.no_sync():
                with phase("overlap::forward"):
                    loss = model(inputs, targets)
                with phase("overlap::backward"):
                    # Each rank's gradient is the mean over its shards; the reduction averages over ranks.
                    (loss / len(shards)).backward()
            total += loss.item()
        with phase("overlap::optimizer_step"):
            model.clip_grad_norm_(clip_norm)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
        return total / len(shards)

    @torch.no_grad()
    def val_loss(self, draws: int) -> float:
        self.model.eval()
        losses = [self.model(*self.batches.get("val", self.args.batch, draw, shard)).item()
                  for shard in self.shards for draw in range(draws)]
        self.model.train()
        return sum(losses) / len(losses)


class Losses:
    """The last step's loss (mean over ranks) and the last validation loss, for the final line."""

    def __init__(self) -> None:
        self.train: Optional[float] = None
        self.val: Optional[float] = None


def train_loop(steps: Steps, optimizer: torch.optim.Optimizer, progress: Progress, args: argparse.Namespace,
               device: torch.device, saver: Optional[Saver], tracer, on_first_step) -> Losses:
    """Steps from `progress.step` to --steps, with the progress bar, the `step N:` lines and the
    saves; `on_first_step()` runs once after the first step."""
    from tqdm import tqdm

    rank = dist.get_rank()
    bar = tqdm(range(progress.step, args.steps), initial=progress.step, total=args.steps, disable=rank != 0,
               dynamic_ncols=True, desc="train")
    losses = Losses()
    hidden = 0.0
    first = progress.step
    for step in bar:
        started = time.perf_counter()
        loss = steps.train(optimizer, step, CLIP_NORM)
        if tracer is not None:
            tracer.step()
        losses.train, peak_memory = mean_over_ranks([loss, peak_memory_bytes(device)], device)
        if step == first:
            on_first_step(bar)
        progress.window.append(losses.train)
        elapsed = time.perf_counter() - started
        if step % HIDDEN_EVERY == 1:       # the analysis behind it costs host time: not every step
            last = steps.monitor.last
            hidden = 100 * last.hidden_fraction if last is not None else 0.0
        bar.set_postfix_str(f"loss {losses.train:.3f}, step {format_seconds(elapsed)}, {hidden:.0f}% comm hidden, "
                            f"mem {peak_memory / 2**20:.0f} MB/rank", refresh=False)
        progress.step = done = step + 1
        if done % args.eval_every == 0 or done == args.steps:
            losses.val = mean_over_ranks([steps.val_loss(VAL_BATCHES)], device)[0]
            if rank == 0:   # tqdm.write prints even where the bar is disabled
                bar.write(f"step {done}: train loss {sum(progress.window) / len(progress.window):.3f}, "
                          f"val loss {losses.val:.3f}")
            if done % args.eval_every == 0:     # a last step between multiples keeps its window
                progress.window = []
        if saver is not None and saver.due(done):
            saver.save(progress)
    bar.close()
    if saver is not None:
        saver.wait()
    return losses
