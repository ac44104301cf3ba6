"""The learning-rate schedule of `overlap train`: a function of the step alone, so a resumed
run follows the same one."""
from __future__ import annotations

import argparse
import math


def schedule_steps(args: argparse.Namespace) -> int:
    return args.schedule_steps if args.schedule_steps is not None else args.steps


def learning_rate(step: int, args: argparse.Namespace) -> float:
    """Linear warm-up over the first 10% of the schedule, then cosine decay to a tenth of the
    peak, which it keeps past the schedule's end."""
    steps = schedule_steps(args)
    warmup = max(1, steps // 10)
    if step < warmup:
        return args.lr * (step + 1) / warmup
    progress = min(1.0, (step - warmup) / max(1, steps - warmup))
    return args.lr * (0.1 + 0.45 * (1 + math.cos(math.pi * progress)))
