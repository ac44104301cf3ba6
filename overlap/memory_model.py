"""Per-rank memory of data-parallel training: the estimate from formulas, and the same
categories measured on a live `ShardedModule` run.

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
already being gathered, so (prefetch_depth + 1) × the largest unit in the gather dtype are
alive, plus the root unit (parameters outside every unit, gathered for the whole step).
Without resharding after forward every unit stays gathered until its backward.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable, Optional

import torch
from torch.utils._python_dispatch import TorchDispatchMode

if TYPE_CHECKING:
    from torch.distributed._tools.mem_tracker import MemTracker

    from overlap.sharded_module import ShardedModule

logger = logging.getLogger("overlap")

STAGES = ("dp", "zero1", "zero2", "zero3")
PRECISIONS = ("bf16", "fp16", "fp32")
OPTIMIZERS = ("adamw", "sgd-momentum", "sgd")
MODEL_STATE_CATEGORIES = ("weights", "gradients", "optimizer_state")

# Model-state categories each stage divides by the world size.
SHARDED_BY_STAGE: dict[str, frozenset[str]] = {
    "dp": frozenset(),
    "zero1": frozenset({"optimizer_state"}),
    "zero2": frozenset({"gradients", "optimizer_state"}),
    "zero3": frozenset(MODEL_STATE_CATEGORIES),
}
_ELEMENT_BYTES = {"bf16": 2, "fp16": 2, "fp32": 4}
_STATES_PER_PARAM = {"adamw": 2, "sgd-momentum": 1, "sgd": 0}
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
    if optimizer not in _STATES_PER_PARAM:
        raise ValueError(f"optimizer={optimizer!r} is invalid; expected one of {', '.join(OPTIMIZERS)}")
    element = _ELEMENT_BYTES[precision]
    moments = _STATES_PER_PARAM[optimizer] * 4  # optimizer moments are fp32 in both regimes
    master = MASTER_BYTES if element < MASTER_BYTES else 0
    return StateBytes(element, element, master + moments)


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


def gathered_buffer_bytes(largest_unit_bytes: float, prefetch_depth: int, num_units: int,
                          root_bytes: float = 0.0) -> float:
    """Gathered full parameters alive at once under ZeRO-3 with resharding after forward."""
    if prefetch_depth < 0:
        raise ValueError(f"prefetch_depth={prefetch_depth!r} is invalid; expected an integer >= 0")
    return min(prefetch_depth + 1, num_units) * largest_unit_bytes + root_bytes


def wrap_peak_bytes(params: float, world: int, largest_unit_params: float, on_meta: bool,
                    element: float = MASTER_BYTES) -> float:
    """Peak bytes per rank while `ShardedModule` wraps a model built in `element`-byte
    parameters. Eager: the whole model on every rank, plus its shard and one unit's flat
    buffer for the broadcast of rank 0's values. On meta (overlap.materialize): the shard
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
        gathered = None if largest is None else gathered_buffer_bytes(
            largest * element, prefetch_depth, layers or prefetch_depth + 1, root_params * element)
    act = None if activations is None else activation_bytes(activations, element, checkpointing)
    return MemoryEstimate(**states, activations=act, gathered_buffers=gathered)


# ---- the live run -------------------------------------------------------------------------

def optimizer_states_per_param(optimizer: torch.optim.Optimizer, group: dict) -> int:
    """Tensors of the parameter's size that `optimizer` keeps for a parameter of `group`."""
    kind = type(optimizer).__name__
    if kind in ("Adam", "AdamW"):
        return 3 if group.get("amsgrad") else 2
    if kind in ("Adamax", "NAdam", "RAdam", "Adadelta"):
        return 2
    if kind == "SGD":
        return 1 if group.get("momentum", 0) else 0
    if kind == "Adagrad":
        return 1
    if kind == "RMSprop":
        return 1 + bool(group.get("momentum", 0)) + bool(group.get("centered"))
    raise ValueError(f"memory model: no state count for optimizer {kind}; known: Adam, AdamW, Adamax, NAdam, "
                     "RAdam, Adadelta, SGD, Adagrad, RMSprop")


def estimate_sharded(model: "ShardedModule", optimizer: Optional[torch.optim.Optimizer] = None,
                     activations: Optional[ActivationShape] = None,
                     checkpointing: bool = False) -> MemoryEstimate:
    """The estimate for a live `ShardedModule`: parameter counts, dtypes, world size, units and
    prefetch depth read from it, optimizer state counts from `optimizer`'s type and settings.
    See [Note: how overlap's own layout maps onto these categories]."""
    scheduler = model.scheduler
    world = model.collectives.world_size
    states_of: dict[int, int] = {}
    if optimizer is not None:
        for param_group in optimizer.param_groups:
            count = optimizer_states_per_param(optimizer, param_group)
            states_of.update({id(p): count for p in param_group["params"]})
    totals = dict.fromkeys(MODEL_STATE_CATEGORIES, 0.0)
    for unit in scheduler.all_units:
        for group in unit.groups:
            element = group.master_dtype.itemsize
            # States per element, averaged over the group's parameters (their optimizer
            # groups may differ, e.g. SGD with momentum on some only).
            states = sum(states_of.get(id(param), 0) * slot.numel for param, slot in zip(group.params, group.slots))
            per_param = StateBytes(element, element, states / max(group.numel, 1) * element)
            trainable = group.numel if group.requires_grad else 0
            for category, value in model_state_bytes(group.numel, world, "zero3", per_param, trainable).items():
                totals[category] += value
    root_bytes = scheduler.root.gathered_nbytes if scheduler.root is not None else 0
    unit_bytes = [unit.gathered_nbytes for unit in scheduler.units]
    if not unit_bytes:
        gathered = float(root_bytes)
    elif scheduler.reshard_after_forward:
        gathered = gathered_buffer_bytes(max(unit_bytes), scheduler.prefetch_depth, len(unit_bytes), root_bytes)
    else:
        gathered = float(sum(unit_bytes) + root_bytes)
    act = None
    if activations is not None:
        compute_dtype = next((g.gather_dtype for u in scheduler.all_units for g in u.groups
                              if g.gather_dtype.is_floating_point), torch.float32)
        act = activation_bytes(activations, compute_dtype.itemsize, checkpointing)
    return MemoryEstimate(**totals, activations=act, gathered_buffers=gathered)


@dataclass(frozen=True)
class MeasuredMemory:
    """Bytes on this rank. Model states are their held sizes (gradients at the end of
    backward, the rest at the end of the step); activations, gathered buffers and
    temporaries are each one's own maximum during the step; `peak` is the largest total.
    Everything but the model states is None when no step was run."""

    weights: float
    gradients: float
    optimizer_state: float
    activations: Optional[float] = None
    gathered_buffers: Optional[float] = None
    temporaries: Optional[float] = None
    peak: Optional[float] = None
    allocator_peak: Optional[float] = None   # torch.cuda.max_memory_allocated during the step


class _CategoryPeaks(TorchDispatchMode):
    """Reads the tracker's running totals after every operator and keeps each category's
    maximum (the tracker itself only keeps the breakdown at the moment of the total peak)."""

    def __init__(self, tracker: "MemTracker") -> None:
        super().__init__()
        self.tracker = tracker
        self.peaks: dict[str, int] = {}

    def sample(self) -> None:
        for snapshot in self.tracker.get_tracker_snapshot("current").values():
            for category, nbytes in snapshot.items():
                self.peaks[category] = max(self.peaks.get(category, 0), nbytes)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        self.sample()
        return out


def _category_bytes(tracker: "MemTracker", category: str) -> int:
    return sum(snapshot.get(category, 0) for snapshot in tracker.get_tracker_snapshot("current").values())


def measure(model: "ShardedModule", optimizer: Optional[torch.optim.Optimizer] = None,
            step_fn: Optional[Callable[[], object]] = None) -> MeasuredMemory:
    """Measure this rank's memory with torch's MemTracker while `step_fn` runs one training
    step (one forward, backward and optimizer step); without `step_fn`, only the model states
    held now. On CUDA the allocator's own peak for the step is recorded as well."""
    # Imported here: the tracker loads Triton (~145 MB resident), which the formulas above
    # (and `overlap simulate`, `overlap estimate`) do not need.
    from torch.distributed._tools.mem_tracker import MemTracker

    tracker = MemTracker()
    # Gathered buffers are registered up front so the tracker files them under "Other"
    # whatever operator writes into them; their storage resizes are followed from there.
    gathered = [group.full for unit in model.scheduler.all_units for group in unit.groups]
    tracker.track_external(model, *([optimizer] if optimizer is not None else []), *gathered)
    held_grads: list[int] = []

    def after_backward(_scheduler: object) -> None:
        # The parameters' `.grad` views are made by the runtime rather than by autograd, so the
        # tracker first files their buffer as a temporary; re-registering the module files it
        # as a gradient.
        tracker.track_external(model)
        held_grads.append(_category_bytes(tracker, "Gradient"))

    if step_fn is None:
        return MeasuredMemory(*(_category_bytes(tracker, c) for c in ("Parameter", "Gradient", "Optstate")))
    on_cuda = model.collectives.device.type == "cuda"
    model.scheduler.step_end_callbacks.append(after_backward)
    peaks = _CategoryPeaks(tracker)
    allocated_before = 0
    if on_cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        allocated_before = torch.cuda.memory_allocated()
    try:
        with tracker, peaks:
            step_fn()
            if optimizer is not None:
                tracker.track_external(optimizer)
    finally:
        model.scheduler.step_end_callbacks.remove(after_backward)
    allocator_peak = None
    if on_cuda:
        torch.cuda.synchronize()
        allocator_peak = float(torch.cuda.max_memory_allocated() - allocated_before)
    peak = max(sum(s.get("Total", 0) for s in tracker.get_tracker_snapshot("peak").values()),
               peaks.peaks.get("Total", 0))
    return MeasuredMemory(
        weights=_category_bytes(tracker, "Parameter"),
        gradients=max(held_grads, default=_category_bytes(tracker, "Gradient")),
        optimizer_state=_category_bytes(tracker, "Optstate"),
        activations=peaks.peaks.get("Activation", 0),
        gathered_buffers=peaks.peaks.get("Other", 0),
        temporaries=peaks.peaks.get("Temp", 0),
        peak=peak,
        allocator_peak=allocator_peak,
    )


def format_amount(nbytes: Optional[float], divisor: float) -> str:
    """`nbytes` in units of `divisor` bytes with two decimals; '-' when not known."""
    return "-" if nbytes is None else f"{nbytes / divisor:,.2f}"


@dataclass(frozen=True)
class MemoryReport:
    """Measured memory of one rank next to the estimate for the same model."""

    estimate: MemoryEstimate
    measured: MeasuredMemory
    device: str

    def ratio(self, category: str) -> Optional[float]:
        """measured / estimated for one category (None if either side is missing or zero)."""
        estimated, measured = getattr(self.estimate, category), getattr(self.measured, category)
        return None if not estimated or measured is None else measured / estimated

    def table(self) -> str:
        largest = max(self.estimate.total, self.measured.peak or 0.0, self.measured.weights)
        unit, divisor = next((u, d) for u, d in (("GB", 1e9), ("MB", 1e6), ("KB", 1e3), ("B", 1))
                             if largest >= d or d == 1)

        def row(label: str, estimated: Optional[float], measured: Optional[float]) -> tuple[str, ...]:
            ratio = None if not estimated or measured is None else measured / estimated
            return (label, format_amount(estimated, divisor), format_amount(measured, divisor),
                    "-" if ratio is None else f"{ratio:.3f}")

        rows = [("category", f"estimate {unit}", f"measured {unit}", "measured/est")]
        for category in (*MODEL_STATE_CATEGORIES, "activations", "gathered_buffers"):
            rows.append(row(category.replace("_", " "), getattr(self.estimate, category),
                            getattr(self.measured, category)))
        rows.append(row("temporaries", None, self.measured.temporaries))
        rows.append(row("total / peak", self.estimate.total, self.measured.peak))
        if self.measured.allocator_peak is not None:
            rows.append(row("allocator peak", None, self.measured.allocator_peak))
        return f"memory per rank on {self.device}\n" + format_table(rows)


def format_table(rows: list[tuple[str, ...]]) -> str:
    """Left-aligned first column, right-aligned others, a rule under the header row."""
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    lines = ["  ".join(cell.ljust(w) if i == 0 else cell.rjust(w) for i, (cell, w) in enumerate(zip(row, widths)))
             for row in rows]
    lines.insert(1, "-" * len(lines[0]))
    return "\n".join(lines)


def memory_report(model: "ShardedModule", optimizer: Optional[torch.optim.Optimizer] = None,
                  step_fn: Optional[Callable[[], object]] = None, *,
                  activations: Optional[ActivationShape] = None, checkpointing: bool = False) -> MemoryReport:
    """Measure one training step of `model` (see `measure`) and put it next to
    `estimate_sharded` for the same model; `report.table()` formats both."""
    measured = measure(model, optimizer, step_fn)
    logger.debug("measured memory: %s", measured)
    return MemoryReport(estimate_sharded(model, optimizer, activations, checkpointing), measured,
                        str(model.collectives.device))
