"""Prefetch across a pipeline schedule's passes, in the order of its actions.

Inside one pass (a microbatch's forward or backward of one stage) the runtime prefetches the
units that pass computes next. Between passes it cannot know what comes: under 1F1B a
stage's forward is followed by another forward in the warm-up and by a backward later; with
several stages per rank, by another stage's pass. The schedule knows: it runs the same list
of actions every step (forward F, backward B, its input and weight halves I and W, per stage
and microbatch). `follow_schedule(schedule)` watches the actions the schedule runs on this
rank's stages and, around each, tells the stage's runtime which pass of it comes next (the
end of the pass then gathers that pass's first units, behind the schedule's send and receive
waits), or asks the next action's stage to gather ahead when it is another stage's (see
[Note: the next pass, told by a pipeline schedule] in overlap/runtime/scheduler.py).

Which action comes next is read from the actions the previous step ran, in order; the first
step reads the schedule's own list (`pipeline_order`), where it has one for this rank. That
list is what the multi-stage schedules run; torch's single-stage 1F1B runs a warm-up one
forward longer than its list says, so its first step guesses partly wrong. A wrong guess costs
a gather made early or too late, never a result. Units kept gathered across microbatches (the
planner's choice where the memory allows) need none of this; it pays for the units gathered
again per microbatch.

[Note: compiled blocks under a split backward]
The zero-bubble and V-shaped schedules take a microbatch's backward in two halves over one
graph: the input half keeps the graph for the weight half, so a compiled block's backward runs
in both. Inductor's backward may reuse the memory of the activations it saved ("donated
buffers"), which is safe only where a graph is freed by its one backward, and AOT autograd
refuses a kept graph's backward once the block's compiled backward donates ("compiled with
non-empty donated buffers"; the GPT's blocks do, a stack of Linears does not). So a followed
schedule that splits backward runs each step with donation off: torch's
`_functorch.config.donated_buffer`, read when a block compiles and again when its backward
runs, patched for the step only; eager code is untouched by it. torchtitan's graph trainer
turns it off for the same schedules.
"""
from __future__ import annotations

import contextlib
from typing import Any, Callable, Optional

import torch
from torch import nn
from torch.distributed.pipelining.schedules import _Action, _ComputationType

from overlap.runtime.scheduler import NEXT_BACKWARD, NEXT_FORWARD, NEXT_OTHER, Scheduler

_PASS_OF = {_ComputationType.FORWARD: NEXT_FORWARD, _ComputationType.FULL_BACKWARD: NEXT_BACKWARD,
            _ComputationType.BACKWARD_INPUT: NEXT_BACKWARD}
_ACTIONS = (*_PASS_OF, _ComputationType.BACKWARD_WEIGHT)
Key = tuple[int, _ComputationType, int]               # (stage index, computation, microbatch)
# On a stage: the follower of the schedule that runs it now, and whether its methods are wrapped.
_FOLLOWER, _WRAPPED = "_overlap_follower", "_overlap_follower_wrapped"


def _flat(actions: list[Optional[_Action]]) -> list[Key]:
    """This rank's compute actions in order, an overlapped pair (DualPipeV's) as its two parts."""
    out: list[Key] = []
    for action in actions:
        if action is None:
            continue
        for part in action.sub_actions or (action,):
            if part.computation_type in _ACTIONS:
                out.append((part.stage_index, part.computation_type, part.microbatch_index))
    return out


def splits_backward(schedule: Any) -> bool:
    """Whether `schedule` runs some microbatch's backward as an input and a weight half (on any rank)."""
    order = getattr(schedule, "pipeline_order", None) or {}
    return any(kind is _ComputationType.BACKWARD_WEIGHT for actions in order.values() for _, kind, _ in _flat(actions))


def _scheduler_of(module: nn.Module, index: int) -> Scheduler:
    runtime = getattr(module, "overlap_runtime", module)         # overlap.fully_shard's, built now
    scheduler = getattr(runtime, "scheduler", None)
    if not isinstance(scheduler, Scheduler):
        raise TypeError(f"follow_schedule: stage {index}'s module is a {type(module).__name__}; expected a "
                        "ShardedModule or a module sharded by overlap.fully_shard")
    return scheduler


class ScheduleFollower:
    """What `follow_schedule` attached to a schedule's stages on this rank: the actions it
    expects (`actions`) and how many of those run came as expected (`in_order`,
    `out_of_order`)."""

    def __init__(self, schedule: Any) -> None:
        stages = list(getattr(schedule, "_stages", None) or [schedule._stage])
        order = getattr(schedule, "pipeline_order", None) or {}
        self.schedule = schedule
        self.actions = _flat(order.get(stages[0].group_rank, []))
        self._schedulers = {stage.stage_index: _scheduler_of(stage.submod, stage.stage_index) for stage in stages}
        self._ran: list[Key] = []              # this step's actions so far
        self.in_order = 0
        self.out_of_order = 0
        description = (f"prefetch between passes follows the order of {type(schedule).__name__}'s actions on "
                       f"pipeline rank {stages[0].group_rank}, learned from the step before (overlap.follow_schedule)")
        for scheduler in self._schedulers.values():
            scheduler.schedule_decision = description
        step = schedule.step
        # See [Note: compiled blocks under a split backward].
        donation = (lambda: torch._functorch.config.patch(donated_buffer=False)) if splits_backward(schedule) \
            else contextlib.nullcontext

        def stepped(*args: Any, **kwargs: Any) -> Any:
            # Several schedules may drive the same stages (one per count of microbatches):
            # they follow the one that runs; an evaluation (no backward) follows none.
            training = getattr(schedule, "_has_backward", True)
            for stage in stages:
                stage.__dict__[_FOLLOWER] = self if training else None
            self._ran = []
            try:
                with donation():
                    return step(*args, **kwargs)
            finally:
                if training and self._ran:
                    self.actions = self._ran

        schedule.step = stepped
        for stage in stages:
            if not stage.__dict__.get(_WRAPPED):
                stage.__dict__[_WRAPPED] = True
                _wrap(stage, "forward_one_chunk", lambda args, kwargs: _ComputationType.FORWARD)
                _wrap(stage, "backward_one_chunk", _backward_kind)
                _wrap(stage, "backward_weight_one_chunk", lambda args, kwargs: _ComputationType.BACKWARD_WEIGHT)

    def around(self, index: int, kind: _ComputationType, microbatch: int, run: Callable[[], Any]) -> Any:
        """Run stage `index`'s action (`kind`, `microbatch`) with what comes after it told."""
        position = len(self._ran)
        action = (index, kind, microbatch)
        self._ran.append(action)
        if position < len(self.actions) and self.actions[position] == action:
            self.in_order += 1
        else:
            self.out_of_order += 1
        following = self.actions[position + 1] if position + 1 < len(self.actions) else None
        own = next((later for later in range(position + 1, len(self.actions)) if self.actions[later][0] == index), None)
        self._schedulers[index].tell_next_pass(NEXT_OTHER if own is None else _PASS_OF.get(self.actions[own][1], NEXT_OTHER),
                                               immediate=own == position + 1)
        result = run()
        if following is not None and following[1] in _PASS_OF and (following[0] != index or kind not in _PASS_OF):
            # Another stage's pass, or this stage's after an action that ran no pass of it.
            self._schedulers[following[0]].prepare_pass(_PASS_OF[following[1]])
        return result


def _wrap(stage: Any, name: str, kind_of: Callable[[tuple, dict], _ComputationType]) -> None:
    original = getattr(stage, name)
    index = stage.stage_index

    def run(microbatch: int, *args: Any, **kwargs: Any) -> Any:
        follower = stage.__dict__.get(_FOLLOWER)
        action = lambda: original(microbatch, *args, **kwargs)       # noqa: E731
        return action() if follower is None else follower.around(index, kind_of(args, kwargs), microbatch, action)

    setattr(stage, name, run)


def _backward_kind(args: tuple, kwargs: dict) -> _ComputationType:
    """`backward_one_chunk(mb, loss, full_backward, last_backward)`: B, or I without the weights."""
    full = kwargs.get("full_backward", args[1] if len(args) > 1 else True)
    return _ComputationType.FULL_BACKWARD if full else _ComputationType.BACKWARD_INPUT


def follow_schedule(schedule: Any) -> ScheduleFollower:
    """Make the gathers between passes of `schedule`'s stages on this rank follow its list of
    actions (see the module note). The stages' modules are `ShardedModule`s or modules sharded
    by `overlap.fully_shard` (whose runtimes are built here: call it on every rank, as the
    schedule is made). The overlap report of each stage says so under its decisions. A schedule
    that splits backward then steps with Inductor's donated buffers off (see [Note: compiled
    blocks under a split backward])."""
    return ScheduleFollower(schedule)
