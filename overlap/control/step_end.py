"""The step-end protocol: when the scheduler closes a step, its record is analysed once and the
`ClosedStep` is handed to each controller (depth re-planner, automatic compression) and
observer (overlap report, trace timeline) in turn. None of them holds the scheduler: a
controller that changes the prefetch depths is given `PrefetchDepths`, nothing more.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Protocol

from overlap.observe.report import ClosedStep

if TYPE_CHECKING:
    from overlap.runtime.scheduler import Scheduler


class StepEndController(Protocol):
    def on_step_end(self, step: ClosedStep) -> None:
        """Called on every rank after every step, training or evaluation (see [Note: what a
        step is]); a controller that communicates does so at the same steps on every rank."""


class PrefetchDepths:
    """The forward and backward prefetch depths a scheduler runs with, read and set."""

    def __init__(self, scheduler: "Scheduler") -> None:
        self._scheduler = scheduler

    @property
    def current(self) -> tuple[int, int]:
        return self._scheduler.prefetch_depth, self._scheduler.backward_depth

    def set(self, forward: int, backward: int) -> None:
        self._scheduler.prefetch_depth = forward
        self._scheduler.backward_prefetch_depth = backward


class StepEndControllers:
    """The scheduler's step-end callback: analyses the step just closed once, then hands it to
    each of `controllers` in order (the re-planner sets the depths before the compression
    chooser reads them; the report comes last)."""

    def __init__(self, controllers: list[StepEndController]) -> None:
        self.controllers = controllers

    def __call__(self, scheduler: "Scheduler") -> None:
        step = ClosedStep.of(scheduler.last_step)
        for controller in self.controllers:
            controller.on_step_end(step)
