"""`overlap train --checkpoint-dir`: resuming from the newest complete checkpoint and saving
in the background, with what a resume must agree on."""
from __future__ import annotations

import argparse
import os
import statistics
import time
from dataclasses import dataclass, field
from typing import Callable, Optional

import torch
import torch.distributed as dist

from overlap import checkpoint
from overlap.checkpoint import CheckpointMismatch
from overlap.observe.report import format_seconds
from overlap.train.options import JobError
from overlap.train.schedule import schedule_steps


def run_settings(args: argparse.Namespace, text_name: str) -> dict:
    """The options that shape the run beyond the model's size (load checks that), saved with
    each checkpoint so that a resume with other values is pointed out."""
    return {"--seed": args.seed, "--batch": args.batch, "--lr": args.lr, "--weight-decay": args.weight_decay,
            "--schedule-steps (default: --steps)": schedule_steps(args), "--mixed-precision": args.mixed_precision,
            "--data": text_name}


@dataclass
class Progress:
    """Where training stands: completed steps, the batch shards of the global batch (see
    [Note: batch shards]) and the train-loss window of the next `step N:` line (the steps
    since the last multiple of --eval-every), which travels with the checkpoint so that a
    resumed run prints the same lines as an uninterrupted one."""
    step: int
    shards: int
    window: list[float] = field(default_factory=list)
    resumed_from: Optional[str] = None


# Loads the checkpoint at a path into the job's state and returns the extra values saved with
# it; writes the job's state to a path with extra values, returning once they are staged.
Load = Callable[[str], dict]
Write = Callable[[str, dict], checkpoint.PendingSave]


def model_checkpoints(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> tuple[Load, Write]:
    """How a ShardedModule and its optimizer are loaded and saved (overlap.checkpoint)."""
    return (lambda path: checkpoint.load(path, model, optimizer),
            lambda path, extra: checkpoint.async_save(path, model, optimizer, extra=extra))


def resume(args: argparse.Namespace, load: Load, text_name: str, shards: int) -> Progress:
    """Load the newest complete checkpoint in --checkpoint-dir (rank 0 chooses, every rank
    loads the same one); `shards`: a fresh run's batch shards. Raises JobError on every rank
    for a checkpoint that does not fit."""
    fresh = Progress(step=0, shards=shards)
    if args.checkpoint_dir is None:
        return fresh
    choice = [checkpoint.latest_checkpoint(args.checkpoint_dir) if dist.get_rank() == 0 else None]
    dist.broadcast_object_list(choice, src=0)
    path = choice[0]
    if path is None:
        return fresh
    try:
        extra = load(path)
    except CheckpointMismatch as exc:
        raise JobError(f"--checkpoint-dir {args.checkpoint_dir}: {exc}") from None
    if "step" not in extra or "window" not in extra:
        raise JobError(f"--checkpoint-dir {args.checkpoint_dir}: checkpoint {path} holds no step count: it was not "
                       "saved by overlap train")
    progress = Progress(step=int(extra["step"]), shards=int(extra.get("shards", shards)),
                        window=[float(x) for x in extra["window"]], resumed_from=path)
    if progress.step > args.steps:
        raise JobError(f"the newest checkpoint in --checkpoint-dir {args.checkpoint_dir} is at step "
                       f"{progress.step}, past --steps {args.steps}")
    if dist.get_rank() == 0:
        saved = extra.get("settings", {})
        for option, value in run_settings(args, text_name).items():
            if option in saved and saved[option] != value:
                print(f"overlap train: note: {option} is {value}, it was {saved[option]} when {path} was saved")
    return progress


class Saver:
    """Asynchronous saves into --checkpoint-dir, and how long each held training up."""

    def __init__(self, args: argparse.Namespace, write: Write, text_name: str) -> None:
        self.directory = args.checkpoint_dir
        self.every = args.checkpoint_every or args.steps
        self.last_step = args.steps
        self.write = write
        self.settings = run_settings(args, text_name)
        self.pending: Optional[checkpoint.PendingSave] = None
        self.blocking: list[float] = []
        self.last_wait = 0.0

    def due(self, done: int) -> bool:
        return done == self.last_step or done % self.every == 0

    def save(self, progress: Progress) -> None:
        started = time.perf_counter()
        # Returns once the state is staged in host memory (after the previous save finished).
        self.pending = self.write(os.path.join(self.directory, f"step-{progress.step:08d}"),
                                  {"step": progress.step, "shards": progress.shards, "window": list(progress.window),
                                   "settings": self.settings})
        self.blocking.append(time.perf_counter() - started)

    def wait(self) -> None:
        if self.pending is not None:
            started = time.perf_counter()
            self.pending.wait()
            self.last_wait = time.perf_counter() - started

    def summary(self) -> str:
        saves = f"{len(self.blocking)} save{'s' if len(self.blocking) > 1 else ''}"
        return (f"checkpoints: {saves}, {format_seconds(statistics.median(self.blocking))} blocking each "
                f"(median; longest {format_seconds(max(self.blocking))}), {format_seconds(self.last_wait)} "
                f"waiting for the last one at the end; newest {self.pending.path}")
