"""One unit: the parameters that are gathered and freed together (one or more modules), and
the two states it moves through, each transition checked.

[Note: the states of a unit]
A unit has two orthogonal states, as FSDP2's `ShardedState` and `TrainingState`: where its
parameters are (`GatherState`) and how far the pass has got with it (`TrainingState`).
Every change goes through `Unit._move`, which names the states it may start from and raises
`UnitStateError` (naming the unit and both states) from any other.

    gather state    entered by                       from
    GATHERING       start_gather                     SHARDED
    GATHERED        finish_gather                    GATHERING (from SHARDED it starts the gather)
    SHARDED         reshard: after it computed       GATHERED
    SHARDED         discard: at the end of a pass    GATHERING, GATHERED (an unused prefetch)

    training state  entered by                       from
    IDLE            begin_pass, end_pass             any: a pass may stop anywhere (an exception
                                                     in forward, a forward with no backward)
    FORWARD         a member's forward starts        IDLE; FORWARD (a member called again, or
                                                     another member of the unit)
    PRE_BACKWARD    backward reaches an output       FORWARD; POST_BACKWARD (an output whose
                                                     backward adds nothing to the trainable
                                                     gradients, reached after they completed);
                                                     IDLE (a backward through the graph of an
                                                     earlier forward of the step than the last,
                                                     which this unit did not run)
    POST_BACKWARD   its trainable gradients complete PRE_BACKWARD; FORWARD (it ran under
                                                     reentrant checkpointing, whose forward
                                                     leaves its outputs without a hook)

Activation checkpointing re-runs a unit's forward inside backward: that moves neither state
(the parameters are gathered on demand, see `finish_gather`).
"""
from __future__ import annotations

import enum
from typing import Optional, Union

from torch import nn

from overlap.runtime.collectives import Pending
from overlap.runtime.flat_group import FlatGroup
from overlap.base.profiling import Span, labelling, phase


class GatherState(enum.Enum):
    SHARDED = "sharded"                # only this rank's shards exist
    GATHERING = "gathering"            # all-gathers issued, not waited for
    GATHERED = "gathered"              # the full parameters are ready to compute with


class TrainingState(enum.Enum):
    IDLE = "idle"                      # between passes, or this pass has not reached the unit
    FORWARD = "forward"                # at least one member ran forward in this pass
    PRE_BACKWARD = "pre_backward"      # backward reached the unit; parameters gathered for it
    POST_BACKWARD = "post_backward"    # trainable gradients complete and their reduction issued


class UnitStateError(RuntimeError):
    """A transition the unit's state does not allow (see [Note: the states of a unit])."""


State = Union[GatherState, TrainingState]
ANY_TRAINING_STATE = tuple(TrainingState)


class GatheredTally:
    """How many units of a set are gathered (or gathering) now, and their gathered bytes: kept
    by the units as their gather state changes, so that prefetch reads it without scanning
    every unit at every gather."""

    def __init__(self) -> None:
        self.units = 0
        self.nbytes = 0
        self.most_units = 0                      # the most units gathered at once since reset

    def reset_most(self) -> None:
        self.most_units = self.units


def backward_reads_weights(modules: list[nn.Module]) -> bool:
    """Whether backward through `modules` may read their weights. An `nn.Embedding`'s does not:
    its weight's gradient is the output's gradient added up by index (unless forward
    renormalises rows, `max_norm`); any other module is taken to, as is an embedding whose
    class has a forward of its own."""
    return not modules or any(not isinstance(module, nn.Embedding) or type(module).forward is not nn.Embedding.forward
                              or module.max_norm is not None for module in modules)


class Unit:
    def __init__(self, name: str, modules: list[nn.Module], groups: list[FlatGroup]) -> None:
        self.name = name
        self.modules = modules                   # the root unit has none: the root hooks drive it
        self.groups = groups
        # Fixed once the groups are built; read at every gather and step.
        self.gathered_nbytes = sum(g.gathered_nbytes for g in groups)
        self.trainable_groups = [g for g in groups if g.requires_grad]
        # The end of a forward or a free can take the views off the modules (the parameters
        # stand in; see FlatGroup.leave_forward and FlatGroup.free): only such units ask their
        # groups at each backward.
        self.drops_views = any(g.dtensor_params or g.params_between_forwards for g in groups)
        # The groups whose parameters stand in for the views between forwards, and those of them
        # that show the gathered values during forward (one rank's need not: they are whole).
        self._between_forwards = [g for g in groups if g.params_between_forwards]
        self._showing = [g for g in self._between_forwards if not g.resident]
        # Nothing of the unit is ever freed (one rank, see [Note: one rank computing in the
        # master dtype] in flat_group.py): no need to learn when its input gradients are complete.
        self.never_freed = all(g.resident for g in groups)
        self.tally: Optional[GatheredTally] = None   # set by the prefetcher for the units it counts
        self.gather_state = GatherState.SHARDED
        self.training_state = TrainingState.IDLE
        self._gathers: list[Pending] = []        # the all-gathers in flight while GATHERING
        # What this pass has seen of the unit; see [Note: when a unit is freed in backward]
        # in overlap/runtime/scheduler.py for the two counts.
        self._members_run: set[int] = set()      # id() of member modules that ran forward
        self._grads_pending = 0                  # trainable groups whose gradient has not arrived
        self._input_grads_pending = 0            # forward calls whose input gradients are not complete
        self._forwards_running = 0               # member forwards begun and not ended (nested calls)
        self.span: Optional[Span] = None         # the profiler range of the unit's compute
        # Whether to free the unit after its forward; None follows the scheduler's setting
        # (`fully_shard`'s reshard_after_forward is per unit).
        self.reshard_after_forward: Optional[bool] = None
        # False: backward computes without the unit's weights, so a unit freed after forward
        # is not gathered again for it; its gradient flows all the same. So for units of
        # embeddings alone (see `backward_reads_weights`), or asked (`fully_shard`'s
        # `set_unshard_in_backward`). A pipeline stage's weight step reads its gathered leaves.
        self.gather_in_backward = backward_reads_weights(modules) or any(g.stage_leaves for g in groups)
        # Kept gathered from one pass to the next within a step of several microbatches, and
        # the versions of its shards it was gathered from (see [Note: gathers kept across
        # microbatches] in overlap/runtime/scheduler.py).
        self.kept = False
        self._gathered_from: tuple[int, ...] = ()

    def _require(self, sources: tuple[State, ...], action: str) -> None:
        """Raise unless the unit is in one of `sources` (all of one kind)."""
        current = self.gather_state if isinstance(sources[0], GatherState) else self.training_state
        if current not in sources:
            self._refuse(current, sources, action)

    def _refuse(self, current: State, sources: tuple[State, ...], action: str) -> None:
        allowed = " or ".join(s.value for s in sources)
        raise UnitStateError(
            f"unit {self.name!r}: cannot {action} while {current.value} (only while {allowed}); "
            f"its states: gather {self.gather_state.value}, training {self.training_state.value}")

    def _move(self, to: State, sources: tuple[State, ...], action: str) -> None:
        """The one place a state changes: from one of `sources` to `to`, else an error."""
        if to.__class__ is TrainingState:
            if self.training_state not in sources:
                self._refuse(self.training_state, sources, action)
            self.training_state = to
        else:
            if self.gather_state not in sources:
                self._refuse(self.gather_state, sources, action)
            tally = self.tally
            if tally is not None and (to is GatherState.SHARDED) != (self.gather_state is GatherState.SHARDED):
                step = -1 if to is GatherState.SHARDED else 1
                tally.units += step
                tally.nbytes += step * self.gathered_nbytes
                tally.most_units = max(tally.most_units, tally.units)
            self.gather_state = to

    # ---- gather state ---------------------------------------------------------------------

    def start_gather(self) -> None:
        """Launch the all-gathers of all groups; returns at once."""
        self._move(GatherState.GATHERING, (GatherState.SHARDED,), "start a gather")
        self._gathers = [g.start_gather(self.name) for g in self.groups]

    def finish_gather(self) -> None:
        """Block until the parameters are gathered (the wait is timed in each CommRecord),
        starting the gather first if none is in flight; nothing to do if gathered."""
        if self.gather_state is GatherState.GATHERED:
            return
        if self.gather_state is GatherState.SHARDED:
            self.start_gather()
        with phase(f"overlap::wait_all_gather::{self.name}"):
            for pending in self._gathers:
                pending.wait()
        self._gathers = []
        self._move(GatherState.GATHERED, (GatherState.GATHERING,), "finish a gather")
        if self.kept:
            self._gathered_from = self._shard_versions()

    def _shard_versions(self) -> tuple[int, ...]:
        return tuple(group.shard._version for group in self.groups)

    @property
    def gathered_is_stale(self) -> bool:
        """Whether a shard was written (an optimizer step) since this kept unit was gathered."""
        return self._shard_versions() != self._gathered_from

    def install_views(self) -> None:
        self._require((GatherState.GATHERED,), "install parameter views")
        for group in self.groups:
            group.install_views()

    def show_gathered(self) -> None:
        """Its parameters hold the gathered values, for hooks of its forward (see FlatGroup)."""
        for group in self._showing:
            group.show_gathered()

    def hide_gathered(self) -> None:
        for group in self._showing:
            group.hide_gathered()

    def leave_forward_views(self) -> None:
        """Its forward ended: the modules hold the registered parameters (see FlatGroup)."""
        for group in self._between_forwards:
            group.leave_forward()

    @property
    def views_installed(self) -> bool:
        return all(group.views_installed for group in self.groups)

    def restore_views(self) -> None:
        """Before the unit's backward: its views on the modules again, where a free took them
        off (units with DTensor parameters, `drops_views`; see FlatGroup.restore_views)."""
        self._require((GatherState.GATHERED,), "restore parameter views")
        for group in self.groups:
            if not group.views_current:
                group.restore_views()

    @property
    def views_current(self) -> bool:
        """Whether every group's modules still hold the views of this pass's forward."""
        return all(group.views_current for group in self.groups)

    def remove_views(self) -> None:
        for group in self.groups:
            group.remove_views()

    def reshard(self) -> None:
        """Drop the gathered parameters once the unit has computed with them."""
        self._move(GatherState.SHARDED, (GatherState.GATHERED,), "reshard")
        self._release()

    def discard(self) -> None:
        """Drop the gathered parameters, or a gather still in flight (waited for first, since
        it writes into them): at the end of a pass, for units prefetched and never used."""
        self._move(GatherState.SHARDED, (GatherState.GATHERING, GatherState.GATHERED), "discard")
        for pending in self._gathers:
            pending.wait()
        self._gathers = []
        self._release()

    def _release(self) -> None:
        self.close_span()
        for group in self.groups:
            group.free()
            if not self.gather_in_backward and group.node_copy is not None:
                group.node_copy.drop()          # hpZ's copy is for backward's gather, which this unit skips

    # ---- training state -------------------------------------------------------------------

    def begin_pass(self) -> None:
        """Reset what one forward and its backward track."""
        for group in self.groups:
            if group.node_copy is not None:
                group.node_copy.drop()          # made before the optimizer last wrote the shards
        self._move(TrainingState.IDLE, ANY_TRAINING_STATE, "begin a pass")
        self._members_run.clear()
        # Which parameters train is read at each pass: `requires_grad_()` after wrapping counts.
        self.trainable_groups = [g for g in self.groups if g.refresh_requires_grad()]
        self._grads_pending = len(self.trainable_groups)
        self._input_grads_pending = 0
        self._forwards_running = 0

    def end_pass(self) -> None:
        """The backward pass ended, or a forward that no backward follows."""
        self._move(TrainingState.IDLE, ANY_TRAINING_STATE, "end a pass")

    def enter_forward(self, module: Optional[nn.Module] = None) -> None:
        """`module`, one of the unit's members (None for the root unit), starts its forward."""
        self._move(TrainingState.FORWARD, (TrainingState.IDLE, TrainingState.FORWARD), "run forward")
        if module is not None:
            self._members_run.add(id(module))
            self._forwards_running += 1

    def leave_forward(self) -> bool:
        """A member's forward ended; True unless it ran inside another member's forward."""
        self._forwards_running = max(self._forwards_running - 1, 0)
        return self._forwards_running == 0

    @property
    def all_members_ran(self) -> bool:
        return len(self._members_run) == len(self.modules)

    def enter_backward(self) -> bool:
        """Backward reached one of the unit's outputs; False if an earlier one already did."""
        if self.training_state is TrainingState.PRE_BACKWARD:
            return False
        self._move(TrainingState.PRE_BACKWARD,
                   (TrainingState.FORWARD, TrainingState.POST_BACKWARD, TrainingState.IDLE), "run backward")
        return True

    def trainable_grad_arrived(self) -> bool:
        """One trainable group's gradient is complete; True once all of them are."""
        self._grads_pending -= 1
        if self._grads_pending != 0:
            return False
        self._move(TrainingState.POST_BACKWARD, (TrainingState.PRE_BACKWARD, TrainingState.FORWARD),
                   "finish backward")
        return True

    def expect_input_grads(self) -> None:
        """A forward call whose inputs require a gradient: wait for them before freeing."""
        self._input_grads_pending += 1

    def input_grads_arrived(self) -> None:
        self._input_grads_pending -= 1

    @property
    def backward_complete(self) -> bool:
        """Trainable gradients and input gradients complete: nothing left in backward reads
        the gathered parameters. See [Note: when a unit is freed in backward]."""
        return self._grads_pending == 0 and self._input_grads_pending == 0

    # ---- profiling ------------------------------------------------------------------------

    def open_span(self, phase_name: str) -> None:
        self.close_span()
        if labelling():
            self.span = Span(f"overlap::{phase_name}::{self.name}")

    def close_span(self) -> None:
        if self.span is not None:
            self.span.close()
            self.span = None
