"""One unit: the parameters that are gathered and freed together (one or more modules)."""
from __future__ import annotations

import enum
from typing import Optional

from torch import nn

from overlap.runtime.collectives import Pending
from overlap.runtime.flat_group import FlatGroup
from overlap.base.profiling import Span, phase


class TrainingState(enum.Enum):
    IDLE = "idle"                      # between steps, or forward not reached yet
    FORWARD = "forward"                # at least one member ran forward this step
    PRE_BACKWARD = "pre_backward"      # backward reached the unit; parameters gathered for it
    POST_BACKWARD = "post_backward"    # gradients complete and reduction issued


class GatherState(enum.Enum):
    FREE = "free"
    GATHERING = "gathering"
    GATHERED = "gathered"


class Unit:
    def __init__(self, name: str, modules: list[nn.Module], groups: list[FlatGroup]) -> None:
        self.name = name
        self.modules = modules                   # the root unit has none: the root hooks drive it
        self.groups = groups
        self.state = TrainingState.IDLE
        self.gather_state = GatherState.FREE
        self._pending: list[Pending] = []
        self.members_run: set[int] = set()       # id() of member modules that ran forward this step
        self.grads_pending = 0                   # trainable groups whose gradient has not arrived yet
        self.input_grads_pending = 0             # forward calls whose input gradients are not complete yet
        self.span: Optional[Span] = None         # the profiler range of the unit's compute

    @property
    def gathered_nbytes(self) -> int:
        return sum(g.gathered_nbytes for g in self.groups)

    @property
    def trainable_groups(self) -> list[FlatGroup]:
        return [g for g in self.groups if g.requires_grad]

    def start_gather(self) -> None:
        """Launch the all-gathers of all groups; returns at once."""
        if self.gather_state is not GatherState.FREE:
            return
        self._pending = [g.start_gather(self.name) for g in self.groups]
        self.gather_state = GatherState.GATHERING

    def finish_gather(self) -> None:
        """Block until the parameters are gathered (the wait is timed in each CommRecord)."""
        if self.gather_state is GatherState.GATHERED:
            return
        if self.gather_state is GatherState.FREE:
            self.start_gather()
        with phase(f"overlap::wait_all_gather::{self.name}"):
            for pending in self._pending:
                pending.wait()
        self._pending = []
        self.gather_state = GatherState.GATHERED

    def open_span(self, phase_name: str) -> None:
        self.close_span()
        self.span = Span(f"overlap::{phase_name}::{self.name}")

    def close_span(self) -> None:
        if self.span is not None:
            self.span.close()
            self.span = None

    def install_views(self) -> None:
        for group in self.groups:
            group.install_views()

    def free(self) -> None:
        """Drop the gathered parameters (waiting first for a gather still writing into them)."""
        if self.gather_state is GatherState.FREE:
            return
        for pending in self._pending:
            pending.wait()
        self._pending = []
        self.close_span()
        for group in self.groups:
            group.free()
        self.gather_state = GatherState.FREE

    def begin_pass(self) -> None:
        """Reset what one forward and its backward track."""
        for group in self.groups:
            if group.node_copy is not None:
                group.node_copy.drop()          # made before the optimizer last wrote the shards
        self.state = TrainingState.IDLE
        self.members_run.clear()
        self.grads_pending = len(self.trainable_groups)
        self.input_grads_pending = 0
