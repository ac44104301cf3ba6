"""The memory categories of `overlap.plan.memory` measured on a live `ShardedModule` run, and the
report that sets them beside the estimate.
"""
from __future__ import annotations

import contextlib
import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable, Iterator, Optional, Protocol

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from overlap.plan.memory import (MODEL_STATE_CATEGORIES, ActivationShape, MemoryEstimate, StateBytes, activation_bytes, gathered_in_flight, model_state_bytes)

from overlap.runtime.collectives import Collectives
from overlap.runtime.scheduler import Scheduler

if TYPE_CHECKING:
    from torch.distributed._tools.mem_tracker import MemTracker


class ShardedModel(Protocol):
    """What the measurement reads of a `ShardedModule`: its units and where they run."""

    scheduler: Scheduler
    collectives: Collectives

logger = logging.getLogger("overlap")


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


def estimate_sharded(model: ShardedModel, optimizer: Optional[torch.optim.Optimizer] = None,
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
    if scheduler.reshard_after_forward:
        gathered = float(gathered_in_flight(unit_bytes, scheduler.prefetch_depth, root_bytes))
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


@contextlib.contextmanager
def gathered_buffers_as_other(tracker: "MemTracker", model: ShardedModel) -> Iterator[None]:
    """Within an entered `tracker`: file `model`'s gathered buffers under "Other", whatever
    operator writes into them (their storage resizes are followed from there), and keep them
    there. Within a unit's forward its parameters point at its gathered buffer too (see [Note:
    the parameters hold the gathered values during forward] in overlap/runtime/flat_group.py),
    and the tracker files a storage under what last referred to it, so each module's forward
    files them back (a hook registered after the tracker's runs after it). A resident group's
    buffer is its shard (one rank: [Note: one rank computing in the master dtype]): weights,
    left to the tracker."""
    gathered = [group.full for unit in model.scheduler.all_units for group in unit.groups if not group.resident]
    tracker.track_external(*gathered)
    refiling = torch.nn.modules.module.register_module_forward_pre_hook(lambda *_: tracker.track_external(*gathered))
    try:
        yield
    finally:
        refiling.remove()


def measure(model: ShardedModel, optimizer: Optional[torch.optim.Optimizer] = None,
            step_fn: Optional[Callable[[], object]] = None) -> MeasuredMemory:
    """Measure this rank's memory with torch's MemTracker while `step_fn` runs one training
    step (one forward, backward and optimizer step); without `step_fn`, only the model states
    held now. On CUDA the allocator's own peak for the step is recorded as well."""
    # Imported here: the tracker loads Triton (~145 MB resident), which the formulas above
    # (and `overlap simulate`, `overlap estimate`) do not need.
    from torch.distributed._tools.mem_tracker import MemTracker

    tracker = MemTracker()
    tracker.track_external(model, *([optimizer] if optimizer is not None else []))
    held_grads: list[int] = []

    def after_backward(_scheduler: object) -> None:
        # The parameters' `.grad` views are made by the runtime rather than by autograd, so the
        # tracker first files their buffer as a temporary; re-registering the module files it
        # as a gradient.
        tracker.track_external(model)
        held_grads.append(_category_bytes(tracker, "Gradient"))

    if step_fn is None:
        with gathered_buffers_as_other(tracker, model):
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
        with tracker, peaks, gathered_buffers_as_other(tracker, model):
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


def memory_report(model: ShardedModel, optimizer: Optional[torch.optim.Optimizer] = None,
                  step_fn: Optional[Callable[[], object]] = None, *,
                  activations: Optional[ActivationShape] = None, checkpointing: bool = False) -> MemoryReport:
    """Measure one training step of `model` (see `measure`) and put it next to
    `estimate_sharded` for the same model; `report.table()` formats both."""
    measured = measure(model, optimizer, step_fn)
    logger.debug("measured memory: %s", measured)
    return MemoryReport(estimate_sharded(model, optimizer, activations, checkpointing), measured,
                        str(model.collectives.device))
