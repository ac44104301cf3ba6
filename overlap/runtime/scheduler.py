"""When each unit is gathered, freed and reduced: the hooks, the learned execution orders,
prefetch, the end-of-backward flush, and the step count.

Prefetch follows the order units actually ran in the previous step (forward order in
forward; in backward the order backward reached them, which before the first backward is
the reverse of forward). When the order changes, the unit that runs is gathered on demand,
prefetch continues from its position in the known order, and the new order replaces the
old one at the end of the step: prefetch is never switched off.

Steps are counted here and only here (see [Note: what a step is] in overlap/step_record.py);
each ends with a `StepRecord` in `last_step` and a call of every `step_end_callbacks` entry.

[Note: when a unit is freed in backward]
A unit's gathered parameters are read by the backward nodes of its forward: frozen ones
too, to compute the gradient of the unit's input. The gradient hook of its trainable groups
says when their gradients are complete, but not when the last node reading a frozen weight
has run: autograd may run those after it (another device's queue, a reentrant backward).
So each forward call passes the unit's inputs that require a gradient through an identity
function whose backward runs once their gradients are complete, i.e. after every node of
the unit that leads to them (FSDP2 does the same). A unit is freed in backward once both its
trainable gradients and its input gradients are complete; a unit that never gets both is
freed when the backward pass ends.
"""
from __future__ import annotations

from functools import partial
from typing import Any, Callable, Iterable, Optional

import torch
from torch.autograd import Variable
from torch.utils._pytree import tree_flatten, tree_unflatten

from overlap.runtime.collectives import Collectives, Pending
from overlap.base.rules import MAX_REDUCES_IN_FLIGHT
from overlap.runtime.flat_group import FlatGroup
from overlap.runtime.order_check import END_BACKWARD, END_FORWARD, OrderCheck
from overlap.base.profiling import phase
from overlap.base.step_record import Mark, StepKind, StepRecord
from overlap.runtime.timing import polling
from overlap.runtime.unit import GatherState, TrainingState, Unit


def _distinct_after(order: list[Unit], index: int, skip: Unit, count: int) -> list[Unit]:
    found: list[Unit] = []
    for unit in order[index + 1:]:
        if len(found) == count:
            break
        if unit is not skip and unit not in found:
            found.append(unit)
    return found


def _dedupe(units: Iterable[Unit]) -> list[Unit]:
    seen: list[Unit] = []
    for unit in units:
        if unit not in seen:
            seen.append(unit)
    return seen


class _AfterInputGrads(torch.autograd.Function):
    """Identity on a unit's inputs; its backward calls `callback` once their gradients are
    complete. See [Note: when a unit is freed in backward]."""

    @staticmethod
    def forward(ctx, callback: Callable[[], None], *inputs: torch.Tensor) -> tuple[torch.Tensor, ...]:
        ctx.callback = callback
        return inputs

    @staticmethod
    def backward(ctx, *grads: torch.Tensor) -> tuple[Optional[torch.Tensor], ...]:
        ctx.callback()
        return (None, *grads)


class Scheduler:
    def __init__(self, root: Optional[Unit], units: list[Unit], collectives: Collectives, prefetch_depth: int,
                 memory_budget_bytes: Optional[int], reshard_after_forward: bool) -> None:
        self.root = root
        self.units = units
        self.collectives = collectives
        self.prefetch_depth = prefetch_depth
        # Backward may prefetch deeper or shallower than forward (the planner's choice);
        # None follows `prefetch_depth`.
        self.backward_prefetch_depth: Optional[int] = None
        self.memory_budget_bytes = memory_budget_bytes
        self.reshard_after_forward = reshard_after_forward
        self.sync_grads = True
        self.in_backward = False
        self.forward_order: list[Unit] = []
        self.backward_order: list[Unit] = []
        self._this_forward: list[Unit] = []
        self._this_backward: list[Unit] = []
        self._pending_reduces: list[Pending] = []
        self._pending_all_reduces: list[Pending] = []
        # The step in progress is written here (marks and collectives); `last_step` is the
        # record of the last step that ended.
        self.log = collectives.log
        self.last_step: Optional[StepRecord] = None
        self.step = 0                      # steps begun; see [Note: what a step is]
        self._step_open = False
        self._forwards = 0
        self._backwards = 0
        self.max_gathered_units = 0
        # Called with the scheduler after every step (re-planner, overlap report).
        self.step_end_callbacks: list[Callable[["Scheduler"], None]] = []
        self._index = {id(unit): i for i, unit in enumerate(self.all_units)}
        # Ranks that run different units get an error (see overlap.runtime.order_check).
        self.order: Optional[OrderCheck] = None
        if collectives.world_size > 1:
            self.order = OrderCheck(collectives.group, [unit.name for unit in self.all_units])
            collectives.watch = self.order

        for unit in units:
            for module in unit.modules:
                module.register_forward_pre_hook(partial(self._pre_forward, unit), with_kwargs=True)
                module.register_forward_hook(partial(self._post_forward, unit))
        for unit in self.all_units:
            for group in unit.trainable_groups:
                group.register_grad_hook(partial(self._on_grad, unit))

    @property
    def all_units(self) -> list[Unit]:
        return ([self.root] if self.root is not None else []) + self.units

    def _log(self, mark: Mark, unit: Unit) -> None:
        self.log.mark(mark, unit.name)

    # ---- prefetch -------------------------------------------------------------------------

    def _gathered_units(self) -> list[Unit]:
        return [u for u in self.units if u.gather_state is not GatherState.FREE]

    def _start_gather(self, unit: Unit, mark: Mark) -> None:
        self._log(mark, unit)
        unit.start_gather()
        self.max_gathered_units = max(self.max_gathered_units, len(self._gathered_units()))

    @property
    def backward_depth(self) -> int:
        return self.prefetch_depth if self.backward_prefetch_depth is None else self.backward_prefetch_depth

    def _prefetch_after(self, order: list[Unit], position: int, current: Optional[Unit], depth: int) -> None:
        """Start the gathers of the `depth` units that follow `current` in `order`."""
        if depth == 0 or not order:
            return
        if current is None:
            index = -1
        elif position < len(order) and order[position] is current:
            index = position
        elif current in order[position:]:
            index = position + order[position:].index(current)
        elif current in order:
            index = order.index(current)
        else:
            return
        for unit in _distinct_after(order, index, current, depth):
            if unit.gather_state is not GatherState.FREE:
                continue
            if self.memory_budget_bytes is not None:
                in_flight = sum(u.gathered_nbytes for u in self._gathered_units())
                if in_flight + unit.gathered_nbytes > self.memory_budget_bytes:
                    break
            self._start_gather(unit, Mark.PREFETCH)

    def _gather_for_compute(self, unit: Unit, order: list[Unit], position: int, depth: int) -> None:
        """Make `unit` ready to compute, prefetching what follows it before blocking on it."""
        if unit.gather_state is GatherState.FREE:
            self._log(Mark.MISS, unit)
            self._start_gather(unit, Mark.GATHER)
        elif unit.gather_state is GatherState.GATHERING:
            self._log(Mark.HIT, unit)
        self._prefetch_after(order, position, unit, depth)
        unit.finish_gather()

    # ---- forward --------------------------------------------------------------------------

    def begin_forward(self) -> None:
        """Called before the wrapped module's forward: recover, gather the root, prefetch."""
        self._recover()
        if not self._step_open:
            self._step_open = True
            self.step += 1
            self._forwards = self._backwards = 0
            self.max_gathered_units = 0
            if self.order is not None:
                self.order.begin_step(self.step)
        self._forwards += 1
        self._this_forward = []
        for unit in self.all_units:
            unit.begin_pass()
        if self.root is not None:
            self._start_gather(self.root, Mark.GATHER)
        self._prefetch_after(self.forward_order, -1, None, self.prefetch_depth)
        if self.root is not None:
            self.root.finish_gather()
            self._log(Mark.PRE_FORWARD, self.root)
            self.root.install_views()
            self.root.state = TrainingState.FORWARD

    def _recover(self) -> None:
        """Bring every unit back to free after a forward or backward that did not finish (an
        exception in forward, or a forward with no backward)."""
        self._wait_reduces()
        self._free_all()
        for unit in self.all_units:
            for group in unit.trainable_groups:
                group.reduced = False        # an unfinished backward's reductions are not published
        self.in_backward = False

    def _pre_forward(self, unit: Unit, module: torch.nn.Module, args: tuple, kwargs: dict
                     ) -> Optional[tuple[tuple, dict]]:
        if self.in_backward:
            # Activation checkpointing re-runs forward inside backward: the unit is already
            # gathered for its backward; only the views need to be (re)made.
            unit.finish_gather()
            unit.install_views()
            return None
        with phase(f"overlap::pre_forward::{unit.name}"):
            position = len(self._this_forward)
            self._this_forward.append(unit)
            if self.order is not None:
                self.order.ran(self._index[id(unit)], backward=False)
            self._gather_for_compute(unit, self.forward_order, position, self.prefetch_depth)
            unit.install_views()
            unit.state = TrainingState.FORWARD
            unit.members_run.add(id(module))
            self._log(Mark.PRE_FORWARD, unit)
            unit.open_span("forward")
            return self._after_input_grads(unit, args, kwargs)

    def _after_input_grads(self, unit: Unit, args: tuple, kwargs: dict) -> Optional[tuple[tuple, dict]]:
        """The call's arguments with those that require a gradient passed through
        `_AfterInputGrads`. See [Note: when a unit is freed in backward]."""
        if not torch.is_grad_enabled():
            return None
        leaves, spec = tree_flatten((args, kwargs))
        wanted = [i for i, leaf in enumerate(leaves) if isinstance(leaf, torch.Tensor) and leaf.requires_grad]
        if not wanted:
            return None
        unit.input_grads_pending += 1
        outputs = _AfterInputGrads.apply(partial(self._on_input_grads, unit), *(leaves[i] for i in wanted))
        for i, tensor in zip(wanted, outputs):
            leaves[i] = tensor
        return tree_unflatten(leaves, spec)

    def _post_forward(self, unit: Unit, module: torch.nn.Module, args: Any, output: Any) -> None:
        if self.in_backward:
            return
        unit.close_span()
        with phase(f"overlap::post_forward::{unit.name}"):
            self._log(Mark.POST_FORWARD, unit)
            backward_follows = torch.is_grad_enabled() and self._hook_outputs(
                output, partial(self._pre_backward, unit))
            if (self.reshard_after_forward and len(unit.members_run) == len(unit.modules)
                    and not (backward_follows and self._ends_forward(unit))):
                self._free(unit)

    def _ends_forward(self, unit: Unit) -> bool:
        """Whether `unit` ran last in the previous forward and again at the same position:
        backward needs it first, so it stays gathered instead of being freed and gathered
        again at once."""
        position = len(self._this_forward) - 1
        return bool(self.forward_order) and position == len(self.forward_order) - 1 \
            and self.forward_order[position] is unit

    def end_forward(self, output: Any) -> None:
        """Called with the wrapped module's output."""
        self.forward_order = list(self._this_forward)
        if not self.backward_order or set(self.backward_order) != set(self.forward_order):
            self.backward_order = _dedupe(reversed(self.forward_order))
        if self.root is not None:
            self._log(Mark.POST_FORWARD, self.root)
        if self.order is not None:
            self.order.ended(END_FORWARD)
        if torch.is_grad_enabled() and self._hook_outputs(output, self._root_pre_backward):
            # Backward starts with the root's own layers (head, loss): gather the first units
            # of backward under them.
            self._prefetch_after(self.backward_order, -1, None, self.backward_depth)
        else:
            # No backward can follow: the step ends here (evaluation, generation).
            self._free_all()
            self._end_step(StepKind.FORWARD)

    def _free(self, unit: Unit) -> None:
        unit.free()
        self._log(Mark.FREE, unit)

    def _free_all(self) -> None:
        for unit in self.all_units:
            if unit.gather_state is not GatherState.FREE:
                self._free(unit)

    @staticmethod
    def _hook_outputs(output: Any, hook) -> bool:
        leaves, _ = tree_flatten(output)
        hooked = False
        for leaf in leaves:
            if isinstance(leaf, torch.Tensor) and leaf.requires_grad:
                leaf.register_hook(hook)
                hooked = True
        return hooked

    # ---- backward -------------------------------------------------------------------------

    def _begin_backward(self) -> None:
        if self.in_backward:
            return
        self.in_backward = True
        self._backwards += 1
        self._this_backward = []
        Variable._execution_engine.queue_callback(self._end_backward)

    def _root_pre_backward(self, grad: torch.Tensor) -> None:
        self._begin_backward()
        if self.root is not None and self.root.state is not TrainingState.PRE_BACKWARD:
            self.root.state = TrainingState.PRE_BACKWARD
            self._log(Mark.PRE_BACKWARD, self.root)

    def _pre_backward(self, unit: Unit, grad: torch.Tensor) -> None:
        self._begin_backward()
        if unit.state is TrainingState.PRE_BACKWARD:
            return
        with phase(f"overlap::pre_backward::{unit.name}"):
            position = len(self._this_backward)
            self._this_backward.append(unit)
            if self.order is not None:
                self.order.ran(self._index[id(unit)], backward=True)
            self._gather_for_compute(unit, self.backward_order, position, self.backward_depth)
            unit.state = TrainingState.PRE_BACKWARD
            self._log(Mark.PRE_BACKWARD, unit)
            unit.open_span("backward")

    def _on_grad(self, unit: Unit, group: FlatGroup, grad: torch.Tensor) -> None:
        unit.close_span()
        with phase(f"overlap::post_backward::{unit.name}"):
            unit.grads_pending -= 1
            if unit.grads_pending == 0:
                unit.state = TrainingState.POST_BACKWARD
                self._log(Mark.POST_BACKWARD, unit)
            if self.sync_grads:
                self._reduce(unit, group, group.take_grad_for_reduce(grad))
            else:
                group.hold_unsynced(grad)
            self._free_after_backward(unit)

    def _on_input_grads(self, unit: Unit) -> None:
        unit.input_grads_pending -= 1
        self._free_after_backward(unit)

    def _free_after_backward(self, unit: Unit) -> None:
        """See [Note: when a unit is freed in backward]."""
        if unit.grads_pending == 0 and unit.input_grads_pending == 0 \
                and unit.gather_state is not GatherState.FREE:
            self._free(unit)

    def _reduce(self, unit: Unit, group: FlatGroup, grad: torch.Tensor) -> None:
        shard_grad = group.grad_for_reduce()
        self._log(Mark.REDUCE, unit)
        self._pending_reduces.append(
            self.collectives.reduce_scatter(grad, shard_grad, group.reduce_dtype, unit.name))
        self._bound_in_flight(self._pending_reduces, "wait_reduce_scatter")
        # Hybrid sharding: each completed reduce-scatter left an all-reduce across replicas
        # in flight, as many again, waited one unit's backward later.
        self._bound_in_flight(self._pending_all_reduces, "wait_all_reduce")

    def _bound_in_flight(self, queue: list[Pending], label: str) -> None:
        while len(queue) > MAX_REDUCES_IN_FLIGHT:
            pending = queue.pop(0)
            with phase(f"overlap::{label}::{pending.record.unit}"):
                pending.wait()
            if pending.follow_up is not None:
                self._pending_all_reduces.append(pending.follow_up)

    def _wait_reduces(self) -> None:
        with phase("overlap::wait_reduce_scatter::all"):
            while self._pending_reduces or self._pending_all_reduces:
                pending = (self._pending_reduces or self._pending_all_reduces).pop(0)
                pending.wait()
                if pending.follow_up is not None:
                    self._pending_all_reduces.append(pending.follow_up)

    def _publish_grads(self) -> None:
        """Wait for every reduction, then give `.grad` to the parameters that got a gradient
        on any rank. Which ones did is a small all-reduce of flags, issued before the wait so
        that it queues behind the reductions instead of adding its latency to theirs; it
        also carries the check that every rank ran the same units (overlap.runtime.order_check)."""
        groups = [group for unit in self.all_units for group in unit.trainable_groups]
        flags = [used for group in groups for used in group.got_grad]
        pending = self.collectives.any_rank(flags, self.order.words() if self.order is not None else [])
        self._wait_reduces()
        flags, maxima, minima = pending()
        if self.order is not None:
            self.order.verify(maxima, minima)
        start = 0
        for group in groups:
            group.publish_grads(flags[start:start + len(group.slots)])
            start += len(group.slots)

    def _end_backward(self) -> None:
        """Runs once when the backward pass finishes: every gradient is reduced and every
        gathered buffer freed before `backward()` returns."""
        with phase("overlap::end_backward"):
            if self.order is not None:
                self.order.ended(END_BACKWARD)
            if self.sync_grads:
                # Gradients held back by no_sync for units that got none this time.
                for unit in self.all_units:
                    for group in unit.trainable_groups:
                        if group.unsynced_grad is not None:
                            self._reduce(unit, group, group.take_grad_for_reduce(None))
                self._publish_grads()
            else:
                self._wait_reduces()
            self._free_all()
            if self._this_backward:
                self.backward_order = _dedupe(self._this_backward)
            self.in_backward = False
            self.log.mark(Mark.END_BACKWARD, "")
            if self.sync_grads:
                self._end_step(StepKind.TRAIN)

    # ---- steps ----------------------------------------------------------------------------

    def _end_step(self, kind: StepKind) -> None:
        """Close the step: its record into `last_step`, then the callbacks."""
        self._step_open = False
        if self.order is not None:
            self.order.end_step()

        def wait(done: Callable[[], bool]) -> None:
            if self.order is not None:
                self.order.block(done, polling(done))

        self.last_step = self.log.close(
            self.step, kind, self.root.name if self.root is not None else None,
            {unit.name: unit.gathered_nbytes for unit in self.all_units}, self._forwards, self._backwards, wait)
        for callback in self.step_end_callbacks:
            callback(self)
