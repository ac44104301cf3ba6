"""Per-rank memory of training a model with `ShardedModule`, predicted before wrapping.

`memory_model.estimate` works from a parameter count alone; this prediction walks the
unwrapped model instead: the same unit discovery and bucket merge rule the runtime uses
(`overlap.base.units`), each unit's parameters grouped and padded by the runtime's flat
layout (`overlap.base.layout`), and the settings (bucket size, prefetch depth, mixed
precision, optimizer, batch and sequence). Nothing is read from a wrapped module or a process
group, so the prediction can be checked against a measurement of the same run
(tests/test_memory_prediction.py).

Categories, as torch's MemTracker files them on the measured run (rank 0):
- weights: the fp32 master shards (the parameters are views of them).
- gradients: the shard gradients the reduce-scatter adds into, in the master dtype.
- optimizer state: each state tensor is the size of the rank's part of its parameter (the
  shard less the padding), in the master dtype; Adam adds a 4-byte step counter per tensor.
- gathered buffers: the root unit, gathered for the whole step, plus the largest sum of
  `prefetch_depth + 1` consecutive units (the unit computing and those prefetched), in the
  gather dtype.
- activations: `memory_model.activation_bytes` (what each layer keeps for backward) plus what
  the loss holds for a moment at the end of forward (`loss_transient_bytes`).
- temporaries: the larger of two moments of backward. At the loss: the gradient of the
  log-probabilities and of the logits, fp32, b·s·V each. At a unit whose gradient is being
  concatenated into its flat buffer: that unit's per-parameter gradients and the flat copy
  (2 × the unit in the gather dtype), the previous unit's gradient still in flight to the
  reduce-scatter (the unit in the reduce dtype, `MAX_REDUCES_IN_FLIGHT` = 1) with the chunks
  it receives; a bucket of several modules holds one more flat gradient, since each member's
  forward made its own views of the bucket and each view set's backward yields a whole
  bucket-size gradient, summed into the first; the root's gradients made by the head (counted as the whole root), and the
  gradient of the hidden state (b·s·h).
Not predicted: the optimizer step's own temporaries (the single-tensor AdamW the tests use
makes them one parameter at a time), communication scratch inside the backend, allocator
fragmentation; resharding after forward is assumed (the default).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence, Union

import torch
from torch import nn

from overlap.base.layout import FlatLayout, group_by_kind
from overlap.base.mixed_precision import MixedPrecision
from overlap.base.rules import MAX_REDUCES_IN_FLIGHT
from overlap.plan.memory import (OPTIMIZER_MOMENTS, OPTIMIZERS, ActivationShape, activation_bytes,
                                 gathered_in_flight)
from overlap.base.units import UnitSpec, discover_units, merge_into_buckets

_STEP_COUNTER_BYTES = 4   # Adam's per-parameter `step`, a float32 scalar tensor
_FP32 = 4                 # the loss's log-probabilities and their gradients are fp32
MIB = 2**20


@dataclass(frozen=True)
class GroupSizes:
    """One flat group of a unit: its layout and the bytes per element of its master shard,
    its gathered buffer and its reduced gradient."""

    layout: FlatLayout
    master_bytes: int
    gather_bytes: int
    reduce_bytes: int
    requires_grad: bool

    @property
    def shard_numel(self) -> int:
        return self.layout.shard_numel

    @property
    def gathered(self) -> int:
        return self.layout.padded_numel * self.gather_bytes


@dataclass(frozen=True)
class PredictedMemory:
    """Bytes on one rank by category (see the module docstring)."""

    weights: float
    gradients: float
    optimizer_state: float
    gathered_buffers: float
    activations: Optional[float]
    temporaries: Optional[float]

    @property
    def total(self) -> float:
        return sum(getattr(self, c) or 0.0 for c in PREDICTED_CATEGORIES)


PREDICTED_CATEGORIES = ("weights", "gradients", "optimizer_state", "gathered_buffers", "activations", "temporaries")


def _groups(spec: UnitSpec, world: int, mp: MixedPrecision) -> list[GroupSizes]:
    """The flat groups `ShardedModule` builds for one unit."""
    return [GroupSizes(FlatLayout.of([param.shape for _, param, _ in entries], world), dtype.itemsize,
                       mp.gather_dtype(dtype).itemsize, mp.grad_reduce_dtype(dtype).itemsize, requires_grad)
            for (dtype, requires_grad), entries in group_by_kind(spec.params, lambda entry: entry[1]).items()]


def _gathered(groups: Sequence[GroupSizes]) -> int:
    return sum(g.gathered for g in groups)


def loss_transient_bytes(shape: ActivationShape, element_bytes: int) -> float:
    """What a cross-entropy head holds at the end of forward on top of what it keeps: the
    logits in the compute dtype, and their fp32 copy when the compute dtype is narrower."""
    if not shape.vocab:
        return 0.0
    tokens_vocab = shape.seq * shape.batch * shape.vocab
    return tokens_vocab * element_bytes + (tokens_vocab * _FP32 if element_bytes < _FP32 else 0)


def predict_memory(model: nn.Module, world: int, *, unit_types: Union[type, Sequence[type], None] = None,
                   bucket_mb: Optional[float] = None, prefetch_depth: int = 1,
                   param_dtype: Optional[torch.dtype] = None, reduce_dtype: Optional[torch.dtype] = None,
                   optimizer: str = "adamw", activations: Optional[ActivationShape] = None,
                   checkpointing: bool = False) -> PredictedMemory:
    """Rank 0's memory while `ShardedModule(model, unit_types=..., bucket_mb=...,
    prefetch_depth=..., mixed_precision=MixedPrecision(param_dtype, reduce_dtype))` trains
    over `world` gloo ranks (`bucket_mb` None: no merging). Activations and temporaries need
    `activations` (the micro-batch shape of one rank)."""
    if world < 1:
        raise ValueError(f"world={world!r} is invalid; expected an integer >= 1")
    if prefetch_depth < 0:
        raise ValueError(f"prefetch_depth={prefetch_depth!r} is invalid; expected an integer >= 0")
    if optimizer not in OPTIMIZER_MOMENTS:
        raise ValueError(f"optimizer={optimizer!r} is invalid; expected one of {', '.join(OPTIMIZERS)}")
    root, units = discover_units(model, unit_types)
    buckets = merge_into_buckets(units, None if bucket_mb is None else int(bucket_mb * MIB))
    mp = MixedPrecision(param_dtype, reduce_dtype)
    root_groups = _groups(root, world, mp) if root.params else []
    unit_groups = [_groups(b, world, mp) for b in buckets]
    every = root_groups + [g for groups in unit_groups for g in groups]
    trainable = [g for g in every if g.requires_grad]

    weights = sum(g.shard_numel * g.master_bytes for g in every)
    gradients = sum(g.shard_numel * g.master_bytes for g in trainable)
    moments = OPTIMIZER_MOMENTS[optimizer]
    optimizer_state = sum(moments * g.layout.held_numel(0) * g.master_bytes
                          + (_STEP_COUNTER_BYTES * len(g.layout.numels) if optimizer == "adamw" else 0)
                          for g in trainable)
    gathered = gathered_in_flight([_gathered(groups) for groups in unit_groups], prefetch_depth,
                                  _gathered(root_groups))

    act = temporaries = None
    if activations is not None:
        compute = param_dtype.itemsize if param_dtype is not None else max((g.master_bytes for g in every), default=4)
        act = activation_bytes(activations, compute, checkpointing) + loss_transient_bytes(activations, compute)
        temporaries = max(_loss_backward_bytes(activations),
                          _unit_backward_bytes(buckets, unit_groups, root_groups, world, activations, compute))
    return PredictedMemory(weights=weights, gradients=gradients, optimizer_state=optimizer_state,
                           gathered_buffers=gathered, activations=act, temporaries=temporaries)


def _loss_backward_bytes(shape: ActivationShape) -> float:
    """Gradients of the fp32 log-probabilities and of the logits, alive together."""
    return 2 * _FP32 * shape.seq * shape.batch * shape.vocab


def _unit_backward_bytes(buckets: list[UnitSpec], unit_groups: list[list[GroupSizes]],
                         root_groups: list[GroupSizes], world: int, shape: ActivationShape,
                         compute_bytes: int) -> float:
    """Temporaries while the largest unit's gradient is concatenated into its flat buffer."""
    if not unit_groups:
        return 0.0
    index = max(range(len(unit_groups)), key=lambda i: _gathered(unit_groups[i]))
    trainable = [g for g in unit_groups[index] if g.requires_grad]
    # This unit's per-parameter gradients and their flat concatenation, in the gather dtype,
    # and in a bucket of several modules the flat gradient of the members done before.
    copies = 3 if len(buckets[index].modules) > 1 else 2
    this_unit = copies * _gathered(trainable)
    # The previous unit's gradient in flight, in the reduce dtype, with the chunks rank 0
    # receives: gloo's reduction is an all-to-all in which the first rank keeps its own chunk.
    previous = MAX_REDUCES_IN_FLIGHT * sum((2 * world - 1) * g.shard_numel * g.reduce_bytes for g in trainable)
    root = _gathered([g for g in root_groups if g.requires_grad])
    hidden_grad = shape.batch * shape.seq * shape.hidden * compute_bytes
    return this_unit + previous + root + hidden_grad
