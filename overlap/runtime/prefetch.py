"""What is gathered when: the execution orders learned from the previous step, the gathers
started ahead of the unit that computes (prefetch, within the memory budget), and the gather
on demand of a unit that was not prefetched.

Prefetch follows the order units actually ran in the previous step (forward order in
forward; in backward the order backward reached them, which before the first backward is
the reverse of forward). When the order changes, the unit that runs is gathered on demand,
prefetch continues from its position in the known order, and the new order replaces the
old one at the end of the pass: prefetch is never switched off.
"""
from __future__ import annotations

from typing import Iterable, Optional

from overlap.base.step_record import Mark
from overlap.runtime.timing import StepLog
from overlap.runtime.unit import GatherState, GatheredTally, Unit


def _distinct_after(order: list[Unit], index: int, skip: Unit, count: int) -> list[Unit]:
    found: list[Unit] = []
    for position in range(index + 1, len(order)):
        if len(found) == count:
            break
        unit = order[position]
        if unit is not skip and unit not in found:
            found.append(unit)
    return found


def _dedupe(units: Iterable[Unit]) -> list[Unit]:
    seen: list[Unit] = []
    for unit in units:
        if unit not in seen:
            seen.append(unit)
    return seen


class Prefetcher:
    def __init__(self, units: list[Unit], log: StepLog, prefetch_depth: int,
                 memory_budget_bytes: Optional[int]) -> None:
        self.units = units                 # the non-root units: those the budget counts
        self.log = log
        self.prefetch_depth = prefetch_depth
        # Backward may prefetch deeper or shallower than forward (the planner's choice);
        # None follows `prefetch_depth`.
        self.backward_prefetch_depth: Optional[int] = None
        self.memory_budget_bytes = memory_budget_bytes
        self.gathered = GatheredTally()    # of the units the budget counts
        for unit in units:
            # A unit never freed holds no gathered memory of its own.
            unit.tally = None if unit.never_freed else self.gathered
        self.forward_order: list[Unit] = []
        self.backward_order: list[Unit] = []
        self._this_forward: list[Unit] = []
        self._this_backward: list[Unit] = []

    @property
    def backward_depth(self) -> int:
        return self.prefetch_depth if self.backward_prefetch_depth is None else self.backward_prefetch_depth

    @property
    def max_gathered_units(self) -> int:
        """The most units gathered at once in this step."""
        return self.gathered.most_units

    def start_gather(self, unit: Unit, mark: Mark) -> None:
        self.log.mark(mark, unit.name)
        unit.start_gather()

    def _prefetch_after(self, order: list[Unit], position: int, current: Optional[Unit], depth: int,
                        backward: bool = False) -> None:
        """Start the gathers of the `depth` units that follow `current` in `order` (in
        `backward`, of those that backward needs gathered)."""
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
            if unit.gather_state is not GatherState.SHARDED or (backward and not unit.gather_in_backward):
                continue
            if self.memory_budget_bytes is not None:
                if self.gathered.nbytes + unit.gathered_nbytes > self.memory_budget_bytes:
                    break
            self.start_gather(unit, Mark.PREFETCH)

    def _gather_for_compute(self, unit: Unit, order: list[Unit], position: int, depth: int,
                            backward: bool = False) -> None:
        """Make `unit` ready to compute, prefetching what follows it before blocking on it."""
        if backward and not unit.gather_in_backward and unit.gather_state is GatherState.SHARDED:
            self._prefetch_after(order, position, unit, depth, backward)
            return
        if unit.gather_state is GatherState.SHARDED:
            self.log.mark(Mark.MISS, unit.name)
            self.start_gather(unit, Mark.GATHER)
        elif unit.gather_state is GatherState.GATHERING:
            self.log.mark(Mark.HIT, unit.name)
        self._prefetch_after(order, position, unit, depth, backward)
        unit.finish_gather()

    # ---- forward --------------------------------------------------------------------------

    def begin_forward(self, root: Optional[Unit]) -> None:
        """Start the root's gather, then prefetch the first units of forward under it."""
        self._this_forward = []
        if root is not None and root.gather_state is GatherState.SHARDED:   # else kept from the last pass
            self.start_gather(root, Mark.GATHER)
        self.prefetch_forward_start()

    def prefetch_forward_start(self, minimum: int = 0) -> None:
        """Gather the first units of forward ahead of it (the root is the caller's)."""
        self._prefetch_after(self.forward_order, -1, None, max(self.prefetch_depth, minimum))

    def gather_for_forward(self, unit: Unit) -> None:
        position = len(self._this_forward)
        self._this_forward.append(unit)
        self._gather_for_compute(unit, self.forward_order, position, self.prefetch_depth)

    def ends_forward(self, unit: Unit) -> bool:
        """Whether `unit`, which just ran, ran last in the previous forward and at the same
        position: backward needs it first, so it stays gathered instead of being freed and
        gathered again at once."""
        position = len(self._this_forward) - 1
        return bool(self.forward_order) and position == len(self.forward_order) - 1 \
            and self.forward_order[position] is unit

    def end_forward(self) -> None:
        """Learn this forward's order (and from it the backward order, if the units differ)."""
        self.forward_order = list(self._this_forward)
        if not self.backward_order or set(self.backward_order) != set(self.forward_order):
            self.backward_order = _dedupe(reversed(self.forward_order))

    # ---- backward -------------------------------------------------------------------------

    def prefetch_backward_start(self, minimum: int = 0) -> None:
        """Backward starts with the root's own layers (head, loss): gather the first units of
        backward under them."""
        self._prefetch_after(self.backward_order, -1, None, max(self.backward_depth, minimum), backward=True)

    def begin_backward(self) -> None:
        self._this_backward = []

    def gather_for_backward(self, unit: Unit) -> None:
        position = len(self._this_backward)
        self._this_backward.append(unit)
        self._gather_for_compute(unit, self.backward_order, position, self.backward_depth, backward=True)

    def end_backward(self) -> None:
        """Learn the order backward reached the units in."""
        if self._this_backward:
            self.backward_order = _dedupe(self._this_backward)
