"""Optimizers over sharded parameters, whenever and however they were built.

[Note: optimizers built before wrapping]
Parameters keep their identity ([Note: parameters keep their identity]), so an optimizer
built from the module before wrapping steps the shards like one built after. What can still
be wrong is its state: filled before wrapping (a resume that loaded a one-process
`optimizer.state_dict()` and then wrapped), or loaded later from a one-process state dict,
it holds tensors of the whole parameter's shape where the parameter now holds this rank's
rows. A process-wide optimizer step pre-hook (torch.optim's global hook) checks each
optimizer the first time it steps a sharded parameter and again whenever its state dict or
its groups were replaced: state of the whole parameter's shape is resharded to this rank's
rows (the same state one process would have), any other shape is an error naming the
parameter, and a parameter left behind by a refused swap is an error saying what to do. The
check costs one comparison per step otherwise. The same first check makes the optimizer's
`state_dict()` refuse to be pickled where it holds a part (see [Note: a one-rank save of a
sharded state]).
"""
from __future__ import annotations

import itertools
from typing import Any, Optional

import torch
from torch.utils.weak import WeakIdKeyDictionary
from torch.distributed.tensor import DTensor
from torch.optim.optimizer import register_optimizer_step_pre_hook

from overlap.optim.paged import paged_of
from overlap.runtime.param_identity import left_behind
from overlap.runtime.row_dtensors import local_part, local_rows, same_layout
from overlap.runtime.unpicklable_state import FULL_OPTIMIZER, PartialStateError, RankPartStateDict, every_rank_asks

# A flat group (overlap.runtime.flat_group imports this module: no import back). It answers
# `params`, `slots`, `layout`, `collectives`, `global_shape`, `local_of_global`, `dtensor` and `gather_parts`.
FlatGroup = Any

# Each sharded parameter -> its flat group and slot.
_places = WeakIdKeyDictionary()   # by identity: tensors compare element-wise
_hook: Optional[Any] = None
# Attributes set on an optimizer once checked: what its state and groups were then, and
# whether its state_dict() is guarded.
_CHECKED = "_overlap_checked"
_GUARDED = "_overlap_guarded"
# On a guarded optimizer: its number among guarded optimizers and how often its state dict was
# asked for, the key under which every rank's arrival is counted (see unpicklable_state.py).
_ASKED = "_overlap_state_dict_asked"
_guarded_numbers = itertools.count(1)
# Flat groups a backward reached and left without their gradients, with the unit's
# name: see [Note: a backward over inputs only].
_lost_grads = WeakIdKeyDictionary()


def register_group(group: FlatGroup) -> None:
    """Make `group`'s parameters known to every optimizer's check (see the note)."""
    global _hook
    for index, param in enumerate(group.module_params):
        _places[param] = (group, index)
    if _hook is None:
        _hook = register_optimizer_step_pre_hook(_before_step)


# [Note: a backward over inputs only]
# `torch.autograd.grad(outputs, inputs, retain_graph=True)` reaches a unit's outputs and ends
# without its weights' gradients; the unit is freed at the end of that backward, as after any
# other, so a later weight-only step over the kept graph (after the input step of the zero-
# bubble pipeline schedules, ScheduleInterleavedZeroBubble, ScheduleZBVZeroBubble and
# DualPipeV) finds no weights in it, and the gradients of that microbatch are lost whatever
# later microbatches compute. The optimizer's next step over such a unit's parameters is
# refused. The refusal waits for the step: raised inside the schedule, it would leave the
# other stages' ranks waiting on their sends; at the step, every rank has finished its
# schedule. A backward over inputs that keeps no graph (a probe of shapes, as a pipeline
# stage's first step runs) or builds its own (`create_graph=True`, a gradient penalty) is not
# one of these; a kept graph that a full backward of the same forward then uses is refused
# with them, since the two cannot be told apart from inside backward.


def note_lost_grads(group: FlatGroup, unit_name: str) -> None:
    """`group`'s unit ended a backward without `group`'s gradient (see the note)."""
    _lost_grads[group] = unit_name


def _refuse_lost_grads(optimizer: torch.optim.Optimizer) -> None:
    lost = sorted({_lost_grads[place[0]] for param_group in optimizer.param_groups
                   for param in param_group["params"]
                   if (place := _places.get(param)) is not None and place[0] in _lost_grads})
    if lost:
        raise RuntimeError(
            f"a backward reached the outputs of units {lost} and ended without computing their parameters' "
            "gradients (a backward over inputs only, torch.autograd.grad(outputs, inputs), as the input step of "
            "torch.distributed.pipelining's zero-bubble schedules runs: ScheduleInterleavedZeroBubble, "
            "ScheduleZBVZeroBubble, ScheduleDualPipeV): those gradients are lost. ShardedModule "
            "reduces a unit's gradients in the backward that computes them and frees its gathered weights at its "
            "end: use a schedule with a full backward (GPipe, 1F1B, Interleaved1F1B, LoopedBFS)")


def _signature(optimizer: torch.optim.Optimizer) -> tuple:
    return id(optimizer.state), tuple(len(group["params"]) for group in optimizer.param_groups)


def _before_step(optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
    if _lost_grads:
        _refuse_lost_grads(optimizer)
    signature = _signature(optimizer)
    if getattr(optimizer, _CHECKED, None) != signature:
        check_optimizer(optimizer)
        setattr(optimizer, _CHECKED, signature)


def check_optimizer(optimizer: torch.optim.Optimizer) -> None:
    """Reshard state of the whole parameters' shape, refuse what cannot be right (the note)."""
    partial = False
    for param_group in optimizer.param_groups:
        for param in param_group["params"]:
            name = left_behind(param)
            if name is not None:
                raise RuntimeError(
                    f"the optimizer holds parameter {name!r} as it was before ShardedModule wrapped the model, and "
                    "ShardedModule could not keep that object (something held a weak reference to it, such as a "
                    "function compiled before wrapping): build the optimizer from model.parameters() after wrapping")
            place = _places.get(param)
            if place is None:
                continue
            group, index = place
            # DTensor parameters (fully_shard) have DTensor state, saved as FSDP2's is.
            partial = partial or (group.collectives.world_size > 1 and not group.dtensor_params)
            state = optimizer.state.get(param)
            if state:
                _reshard(state, group, index)
    if not getattr(optimizer, _GUARDED, False):
        if partial:
            setattr(optimizer, _ASKED, [next(_guarded_numbers), 0])
            optimizer.register_state_dict_pre_hook(_arrivals)
            optimizer.register_state_dict_post_hook(_sharded_form)
        optimizer.register_load_state_dict_post_hook(check_optimizer)
        setattr(optimizer, _GUARDED, True)


def _reshard(state: dict[str, Any], group: FlatGroup, index: int) -> None:
    """Each state tensor of parameter `index` as this rank's rows, in the parameter's form (a
    plain tensor shaped like its part, or a DTensor over such a tensor under fully_shard)."""
    slot, part = group.slots[index], group.params[index]
    like = group.dtensor(part, index)
    for key, value in state.items():
        if isinstance(value, DTensor):          # the sharded form of `optimizer.state_dict()`, loaded
            if value.shape != group.global_shape(index):
                raise ValueError(f"optimizer state {key!r} of parameter {slot.name!r} is a DTensor of shape "
                                 f"{tuple(value.shape)}, the parameter's is {tuple(group.global_shape(index))}")
            if group.dtensor_params and same_layout(value, like):
                continue
            local = local_rows(value, like).reshape(part.shape).clone()
        elif not isinstance(value, torch.Tensor) or value.dim() == 0 or \
                (value.shape == part.shape and not group.dtensor_params):
            continue
        elif value.shape != group.global_shape(index):
            raise ValueError(f"optimizer state {key!r} of parameter {slot.name!r} has shape {tuple(value.shape)}: "
                             f"neither this rank's part {tuple(part.shape)} nor the whole parameter "
                             f"{tuple(group.global_shape(index))}")
        else:
            local = group.local_of_global(index, value).clone()
        state[key] = group.dtensor(local, index) if group.dtensor_params else local


def _numbered(optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
    """The optimizer's parameters in the order of its state dict's numbers (one in two groups once)."""
    return list({id(param): param for group in optimizer.param_groups for param in group["params"]}.values())


def _arrivals(optimizer: torch.optim.Optimizer) -> None:
    """Before `optimizer.state_dict()` builds anything: refuse a call made on one rank alone."""
    number_and_calls = getattr(optimizer, _ASKED)
    number_and_calls[1] += 1
    place = next((_places.get(param) for group in optimizer.param_groups for param in group["params"]
                  if _places.get(param) is not None), None)
    if place is not None:
        try:
            every_rank_asks(place[0].collectives.group, f"{number_and_calls[0]}/{number_and_calls[1]}",
                            "optimizer.state_dict()", FULL_OPTIMIZER)
        except PartialStateError:
            number_and_calls[1] -= 1
            raise


def _sharded_form(optimizer: torch.optim.Optimizer, state_dict: dict[str, Any]) -> RankPartStateDict:
    """`optimizer.state_dict()`: state shaped like a sharded parameter as a DTensor of the whole
    parameter's shape (what `torch.distributed.checkpoint` saves and reshards, as with FSDP2),
    in a dict that refuses to be pickled ([Note: a one-rank save of a sharded state])."""
    params = _numbered(optimizer)
    state = {}
    for number, values in state_dict["state"].items():
        place = _places.get(params[number]) if isinstance(number, int) and number < len(params) else None
        if place is not None:
            values = {key: place[0].dtensor(value, place[1])
                      if isinstance(value, torch.Tensor) and value.dim() >= 1 and value.shape == params[number].shape
                      else value for key, value in values.items()}
        state[number] = values
    return RankPartStateDict({**state_dict, "state": state}, "optimizer.state_dict()", FULL_OPTIMIZER)


def full_optimizer_state(optimizer: torch.optim.Optimizer, keep: bool) -> dict[str, Any]:
    """`optimizer.state_dict()` with each sharded parameter's state of its shape gathered
    whole, as CPU tensors ({} where not `keep`). A collective: every rank calls it."""
    check_optimizer(optimizer)
    params = _numbered(optimizer)
    if any(paged_of(param) is not None for param in params):
        raise NotImplementedError("full_optim_state_dict with offload='disk': the moments live in the state file; "
                                  "save with overlap.checkpoint.save(path, model, optimizer)")
    packed = dict(optimizer.state_dict())
    state = {index: {key: local_part(value)[0] if isinstance(value, DTensor) else value
                     for key, value in values.items()} for index, values in packed["state"].items()}
    # (flat group, state name) -> [(parameter index, slot)], in the same order on every rank.
    gathers: dict[tuple[int, str], list[tuple[int, int]]] = {}
    groups: dict[int, FlatGroup] = {}
    for number, param in enumerate(params):
        place = _places.get(param)
        if place is None or number not in state:
            continue
        group, index = place
        groups[id(group)] = group
        for key in sorted(state[number]):
            value = state[number][key]
            if isinstance(value, torch.Tensor) and value.dim() >= 1 and value.shape == param.shape:
                gathers.setdefault((id(group), key), []).append((number, index))
    for (group_id, key), members in gathers.items():
        group = groups[group_id]
        whole = group.gather_parts([state[number][key] for number, _ in members], [index for _, index in members])
        for (number, index), value in zip(members, whole):
            state[number][key] = value.cpu().clone() if keep else None
    if not keep:
        return {}
    packed["state"] = state
    return packed
