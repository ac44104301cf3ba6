"""Step accounting: the step count, opening a step at its first forward and closing it
with its `StepRecord`, then the step-end callbacks.

Steps are counted here and only here (see [Note: what a step is] in
overlap/base/step_record.py).
"""
from __future__ import annotations

from typing import Callable, Generic, Optional, TypeVar

from overlap.base.step_record import StepKind, StepRecord
from overlap.runtime.order_check import OrderCheck
from overlap.runtime.timing import StepLog, polling
from overlap.runtime.unit import Unit

Owner = TypeVar("Owner")


class StepCounter(Generic[Owner]):
    def __init__(self, log: StepLog, owner: Owner, root: Optional[Unit], units: list[Unit]) -> None:
        # The step in progress is written to `log` (marks and collectives); `last_step` is
        # the record of the last step that ended (on CUDA, of the one before it: see [Note:
        # reading CUDA times one step late] in overlap/runtime/timing.py).
        self.log = log
        self.last_step: Optional[StepRecord] = None
        self.step = 0                      # steps begun
        # Called with `owner` (the scheduler) after every step (re-planner, overlap report).
        self.callbacks: list[Callable[[Owner], None]] = []
        self._owner = owner
        self._root = root
        self._unit_bytes = {unit.name: unit.gathered_nbytes for unit in units}   # every unit, the root included
        self._open = False
        self._forwards = 0
        self._backwards = 0

    def forward_begins(self, order: Optional[OrderCheck]) -> bool:
        """Count a forward, first opening a step if none is open; True if one was opened."""
        opened = not self._open
        if opened:
            self._open = True
            self.step += 1
            self._forwards = self._backwards = 0
            if order is not None:
                order.begin_step(self.step)
        self._forwards += 1
        return opened

    def backward_begins(self) -> None:
        self._backwards += 1

    def close(self, kind: StepKind, order: Optional[OrderCheck]) -> None:
        """Close the step: the log's record into `last_step`, then the callbacks (none when the
        log gives no record yet)."""
        self._open = False
        if order is not None:
            order.end_step()
        self._deliver(self.log.close(
            self.step, kind, self._root.name if self._root is not None else None,
            self._unit_bytes, self._forwards, self._backwards, self._waiting(order)))

    def flush(self, order: Optional[OrderCheck] = None) -> Optional[StepRecord]:
        """Deliver the record of the last closed step if the log still holds it (CUDA), as
        `close` would have: into `last_step`, then the callbacks; returns it (None when every
        closed step was delivered). Collective like `close`: a callback may decide with the
        other ranks at this step, so every rank flushes at the same point."""
        record = self.log.flush(self._waiting(order))
        self._deliver(record)
        return record

    @staticmethod
    def _waiting(order: Optional[OrderCheck]) -> Callable[[Callable[[], bool]], None]:
        def wait(done: Callable[[], bool]) -> None:
            if order is not None:
                order.block(done, polling(done))

        return wait

    def _deliver(self, record: Optional[StepRecord]) -> None:
        if record is None:
            return                         # CUDA: this step's record comes when the next one closes
        self.last_step = record
        for callback in self.callbacks:
            callback(self._owner)
