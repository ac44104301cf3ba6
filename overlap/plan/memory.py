"""Per-rank memory of data-parallel training, estimated from formulas (the same categories are
measured on a live run by `overlap.observe.memory`).

Model states (ZeRO paper, arXiv 1910.02054). Mixed-precision training with Adam holds, per
parameter, 2 bytes of 16-bit weights, 2 bytes of 16-bit gradients and 12 bytes of optimizer
state (fp32 master weights, momentum, variance): 16 bytes. Training in fp32 holds 4 bytes of
weights, 4 of gradients and 4 per optimizer state tensor (Adam 2, SGD with momentum 1, plain
SGD 0). Over N ranks each ZeRO stage shards one more category:

    stage   sharded                                  mixed-precision Adam, per rank
    dp      nothing                                  16Ψ
    zero1   optimizer state                          4Ψ + 12Ψ/N
    zero2   + gradients                              2Ψ + 14Ψ/N
    zero3   + weights                                16Ψ/N

[Note: how overlap's own layout maps onto these categories]
`ShardedModule` keeps each rank's shard in the parameters' own dtype (fp32 as a rule): the
shard *is* the master copy (the parameters are views of it), the gradients are fp32, and the
optimizer holds only its moments.
Mixed-precision Adam therefore splits as 4Ψ/N weights + 4Ψ/N gradients + 8Ψ/N optimizer
state: the same 16Ψ/N as ZeRO-3, with the master weights counted as weights. The 16-bit
weights exist only in the gathered buffers (`FlatGroup.full`) of the units in flight.

Activations per transformer layer (self-attention + 4h MLP, pre-norm, no dropout), for a
micro-batch of b sequences of s tokens, hidden size h, a heads, e bytes per activation
element; the tensors autograd keeps for backward, counted in units of s·b·h:
    layer-norm inputs 2, QKV input 1, Q and K 2, V 1, output-projection input 1, MLP input 1,
    GELU input 4, second MLP matmul input 4  ->  16·e·s·b·h
    attention: fused kernels keep a fp32 log-sum-exp, 4·a·s·b; an eager softmax keeps its
    output, e·a·s²·b.
(With dropout the masks and dropped copies bring this to the 34·s·b·h + 5·a·s²·b bytes of
Korthikanti et al., arXiv 2205.05198, for e = 2.) With activation checkpointing of every layer
only each layer's input is kept (e·s·b·h per layer) and one layer is recomputed at a time
during backward, so one layer's full activations come on top. With a vocabulary V, the head
adds the final layer norm's input and output (2·e·s·b·h) and the fp32 log-probabilities the
loss keeps (4·s·b·V).

Gathered buffers (ZeRO-3 only): while a unit computes, the next `prefetch_depth` units are
already being gathered, so the largest run of prefetch_depth + 1 consecutive units in the
gather dtype is alive (at most (prefetch_depth + 1) × the largest unit), plus the root unit
(parameters outside every unit, gathered for the whole step). Without resharding after
forward every unit stays gathered until its backward.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence

STAGES = ("dp", "zero1", "zero2", "zero3")
PRECISIONS = ("bf16", "fp16", "fp32")
# Tensors of a parameter's size each optimizer keeps: Adam's two moments, SGD's momentum.
OPTIMIZER_MOMENTS = {"adamw": 2, "sgd-momentum": 1, "sgd": 0}
OPTIMIZERS = tuple(OPTIMIZER_MOMENTS)
MODEL_STATE_CATEGORIES = ("weights", "gradients", "optimizer_state")

# Model-state categories each stage divides by the world size.
SHARDED_BY_STAGE: dict[str, frozenset[str]] = {
    "dp": frozenset(),
    "zero1": frozenset({"optimizer_state"}),
    "zero2": frozenset({"gradients", "optimizer_state"}),
    "zero3": frozenset(MODEL_STATE_CATEGORIES),
}
_ELEMENT_BYTES = {"bf16": 2, "fp16": 2, "fp32": 4}
MASTER_BYTES = 4  # fp32 master weights of mixed-precision training
_LSE_BYTES = 4     # fp32 log-sum-exp a fused attention kernel keeps per head and token
_LOSS_BYTES = 4    # fp32 log-probabilities the cross-entropy loss keeps


@dataclass(frozen=True)
class StateBytes:
    """Bytes each parameter costs in each model-state category, before sharding."""

    weights: float
    gradients: float
    optimizer_state: float


def state_bytes(precision: str, optimizer: str) -> StateBytes:
    """Per-parameter bytes as the ZeRO paper counts them (16-bit copies + fp32 master in the
    optimizer state under mixed precision; one fp32 copy of everything under fp32)."""
    if precision not in _ELEMENT_BYTES:
        raise ValueError(f"precision={precision!r} is invalid; expected one of {', '.join(PRECISIONS)}")
    if optimizer not in OPTIMIZER_MOMENTS:
        raise ValueError(f"optimizer={optimizer!r} is invalid; expected one of {', '.join(OPTIMIZERS)}")
    element = _ELEMENT_BYTES[precision]
    moments = OPTIMIZER_MOMENTS[optimizer] * 4  # optimizer moments are fp32 in both regimes
    master = MASTER_BYTES if element < MASTER_BYTES else 0
    return StateBytes(element, element, master + moments)


def state_copies(optimizer: str) -> int:
    """Model-state bytes per byte of master parameters in overlap's own layout: the shard, its
    gradient and the optimizer's moments, all in the master dtype (see [Note: how overlap's
    own layout maps onto these categories]); 4 with Adam, the 16Ψ/N of fp32 ZeRO-3."""
    return 2 + OPTIMIZER_MOMENTS[optimizer]


@dataclass(frozen=True)
class ActivationShape:
    """What the activation formula needs; `batch` is the micro-batch of one rank."""

    batch: int
    seq: int
    hidden: int
    layers: int
    heads: int
    vocab: int = 0                  # 0: leave the head and loss out
    fused_attention: bool = True    # False: the softmax output (s² per head) is kept

    def __post_init__(self) -> None:
        for name in ("batch", "seq", "hidden", "layers", "heads"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"ActivationShape.{name}={value!r} is invalid; expected an integer >= 1")
        if self.hidden % self.heads:
            raise ValueError(f"ActivationShape: hidden={self.hidden} is not divisible by heads={self.heads}")
        if not isinstance(self.vocab, int) or self.vocab < 0:
            raise ValueError(f"ActivationShape.vocab={self.vocab!r} is invalid; expected an integer >= 0")


def layer_activation_bytes(shape: ActivationShape, element_bytes: int) -> float:
    """Bytes one transformer layer keeps for backward (see the module docstring)."""
    sbh = shape.seq * shape.batch * shape.hidden
    if shape.fused_attention:
        attention = _LSE_BYTES * shape.heads * shape.seq * shape.batch
    else:
        attention = element_bytes * shape.heads * shape.seq ** 2 * shape.batch
    return 16 * element_bytes * sbh + attention


def activation_bytes(shape: ActivationShape, element_bytes: int, checkpointing: bool) -> float:
    """Activations of the whole model at the end of forward (with checkpointing: the peak of
    backward, when one layer has been recomputed)."""
    sbh = shape.seq * shape.batch * shape.hidden
    per_layer = layer_activation_bytes(shape, element_bytes)
    layers = shape.layers * element_bytes * sbh + per_layer if checkpointing else shape.layers * per_layer
    head = 2 * element_bytes * sbh + _LOSS_BYTES * shape.seq * shape.batch * shape.vocab if shape.vocab else 0
    return layers + head


def gathered_in_flight(unit_bytes: Sequence[float], prefetch_depth: int, root_bytes: float = 0.0) -> float:
    """Gathered full parameters alive at once under ZeRO-3 with resharding after forward: the
    root unit, gathered for the whole step, and the largest sum of `prefetch_depth + 1`
    consecutive units (the one computing and those prefetched), units given in order."""
    if prefetch_depth < 0:
        raise ValueError(f"prefetch_depth={prefetch_depth!r} is invalid; expected an integer >= 0")
    window = min(prefetch_depth + 1, len(unit_bytes))
    return root_bytes + max((sum(unit_bytes[i:i + window]) for i in range(len(unit_bytes) - window + 1)),
                            default=0)


def wrap_peak_bytes(params: float, world: int, largest_unit_params: float, on_meta: bool,
                    element: float = MASTER_BYTES) -> float:
    """Peak bytes per rank while `ShardedModule` wraps a model built in `element`-byte
    parameters. Eager: the whole model on every rank, plus its shard and one unit's flat
    buffer for the broadcast of rank 0's values. On meta (overlap.runtime.materialize): the shard
    plus at most one unit in full (one module at a time, in fact)."""
    shard = element * params / world
    unit = element * largest_unit_params
    return shard + unit if on_meta else element * params + shard + unit


@dataclass(frozen=True)
class MemoryEstimate:
    """Bytes per rank by category; None where the inputs did not allow an estimate."""

    weights: float
    gradients: float
    optimizer_state: float
    activations: Optional[float]
    gathered_buffers: Optional[float]

    @property
    def model_states(self) -> float:
        return self.weights + self.gradients + self.optimizer_state

    @property
    def total(self) -> float:
        return self.model_states + (self.activations or 0.0) + (self.gathered_buffers or 0.0)


def model_state_bytes(params: float, world: int, stage: str, per_param: StateBytes,
                      trainable_params: Optional[float] = None) -> dict[str, float]:
    """Weights, gradients and optimizer state per rank; frozen parameters have only weights."""
    if stage not in SHARDED_BY_STAGE:
        raise ValueError(f"stage={stage!r} is invalid; expected one of {', '.join(STAGES)}")
    if world < 1:
        raise ValueError(f"world={world!r} is invalid; expected an integer >= 1")
    trainable = params if trainable_params is None else trainable_params
    counts = {"weights": params, "gradients": trainable, "optimizer_state": trainable}
    sharded = SHARDED_BY_STAGE[stage]
    return {category: counts[category] * getattr(per_param, category) / (world if category in sharded else 1)
            for category in MODEL_STATE_CATEGORIES}


def formula(stage: str, per_param: StateBytes, category: str) -> str:
    """The category's per-rank formula in the paper's notation, e.g. '12Ψ/N'."""
    coefficient = getattr(per_param, category)
    if coefficient == 0:
        return "0"
    return f"{coefficient:g}Ψ" + ("/N" if category in SHARDED_BY_STAGE[stage] else "")


def estimate(params: float, world: int, *, stage: str = "zero3", precision: str = "bf16",
             optimizer: str = "adamw", activations: Optional[ActivationShape] = None,
             checkpointing: bool = False, prefetch_depth: int = 1,
             largest_unit_params: Optional[float] = None, root_params: float = 0.0) -> MemoryEstimate:
    """Per-rank memory of training a `params`-parameter model on `world` ranks.

    The largest unit defaults to params / layers (one transformer block per unit) when the
    activation shape gives the layer count; with neither, ZeRO-3's gathered buffers are not
    estimated (None).
    """
    if not params > 0:
        raise ValueError(f"params={params!r} is invalid; expected a number > 0")
    per_param = state_bytes(precision, optimizer)
    states = model_state_bytes(params, world, stage, per_param)
    element = _ELEMENT_BYTES[precision]
    gathered: Optional[float] = 0.0
    if stage == "zero3":
        layers = activations.layers if activations is not None else None
        largest = largest_unit_params if largest_unit_params is not None else (params / layers if layers else None)
        gathered = None if largest is None else gathered_in_flight(
            [largest * element] * (layers or prefetch_depth + 1), prefetch_depth, root_params * element)
    act = None if activations is None else activation_bytes(activations, element, checkpointing)
    return MemoryEstimate(**states, activations=act, gathered_buffers=gathered)
