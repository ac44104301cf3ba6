"""A step of one flat shard taken during backward, before `optimizer.step()` is called, and
the rule that decides at the step whether it stands.

[Note: the speculative step]
Under offload="disk" a step reads and writes every bucket's fp32 master and moments, so for a
large model `optimizer.step()` costs about as much as forward and backward. Its inputs are
ready earlier: a flat group's gradient is final once its reduction (and hybrid sharding's
all-reduce after it) reached the host gradient shard, and the hyperparameters are those of the
`overlap.optim.AdamW` holding the parameters, at the state's step + 1. So the disk tier
starts that group's step then (overlap.runtime.disk_tier), on the engine's one worker
thread, while backward goes on. It writes the new master and moments into each bucket's
spare slot (the current one stays as it was: [Note: two slots per bucket] in state_file),
and the new 16-bit values into the resident shard, whose buckets are copied to the device as
a step's are.

The strategy is speculate, validate, recompute. `optimizer.step()` uses a speculation (flips
its buckets' slots, no IO) only where nothing it read has changed: the shard's segments and
their hyperparameters (lr, betas, eps, weight decay, step count, maximize) equal this step's,
and the gradient shard is the same tensor at the same `_version`. Every in-place change of a
gradient after backward bumps that version: a user's scaling, GradScaler's unscale, a
`.grad` assigned and copied into the shard, a clip that binds. A clip that does not bind
multiplies by exactly 1, which `ShardGrad` skips ([Note: multiplying a gradient by one] in
overlap.runtime.shard_grad), so the common case keeps its speculation. A speculation that
fails the check is recomputed from the current slot, exactly as a step without speculation.
One that no step follows (the next forward gathers the group first, a checkpoint or state
dict is loaded) or that a step does not step at all is dropped and the resident shard
restored from the current masters: nothing trains on a value that was not committed.

Ordering, per bucket:
- its speculative update may overlap the backward of earlier units and the other groups'
  reductions and speculations (they queue on the one worker);
- the next gather of its group waits for the worker and then for the commit or the restore
  (`DiskShard.gather_source`);
- a checkpoint save or load, a state dict read or load, and every other call of the engine
  wait for the worker first (`PagedAdamW.wait_speculation`);
- `optimizer.step()` returns only once every bucket is committed or recomputed, so code that
  reads the parameters after it sees the updated values.

When to speculate is the disk tier's choice: in a backward that reduced gradients (a no_sync
micro-batch reduces nothing), and only when the previous step followed exactly one such
backward, so a loop that accumulates without no_sync stops speculating instead of paying a
restore per micro-batch.
"""
from __future__ import annotations

from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Optional, Sequence

import torch

# A `Segment` of overlap.optim.paged (which imports this module): anything with `shard`,
# `start` and `stop` that compares by value.
Segment = Any


def shard_segments(segments: Iterable[Segment], shard: int) -> tuple[Segment, ...]:
    """The non-empty segments of `shard`, in order: what a speculation is compared on."""
    return tuple(sorted((s for s in segments if s.shard == shard and s.start < s.stop),
                        key=lambda s: (s.start, s.stop)))


@dataclass
class Speculation:
    """One shard's speculative step: what it read (segments, the gradient and its version),
    the buckets it wrote into their spare slots, the resident shard it wrote and the disk
    tier's callbacks; `future` while it runs on the worker, `failed` if it raised. With
    `ahead`, nothing was computed: the buckets were read ahead into the engine's window, and
    the step computes them ([Note: choosing between them] in paged.py)."""

    shard: int
    segments: tuple[Segment, ...]
    grad: torch.Tensor
    grad_version: int
    buckets: Sequence[int]
    resident: Optional[torch.Tensor]
    before_write: Callable[[], None]
    restored: Callable[[], None]
    future: Optional[Future] = None
    failed: Optional[BaseException] = None
    seconds: float = field(default=0.0)
    ahead: bool = False

    def holds_for(self, grad: Optional[torch.Tensor], segments: tuple[Segment, ...]) -> bool:
        """Whether this step would compute what the speculation computed."""
        return (self.failed is None and grad is self.grad and grad._version == self.grad_version
                and segments == self.segments)
