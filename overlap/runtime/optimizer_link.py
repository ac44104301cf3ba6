"""What optimizers must be told about one sharded model, in one object: `OptimizerLink`.

[Note: the optimizer link]
Each runtime has one `OptimizerLink` (`model.optimizer_link`). It knows the model's sharded
parameters (each one's flat group and slot), and it is the one way the runtime speaks to an
optimizer that steps them:
- state of the whole parameters' shape is resharded to this rank's rows, and state of any
  other shape refused ([Note: optimizers built before wrapping]);
- a step after a backward that lost weight gradients is refused ([Note: a backward over
  inputs only]);
- tensor parallelism's replaced DTensor parameters, held by an optimizer built before
  wrapping, are refused;
- `optimizer.state_dict()` is given in its sharded form and refuses a one-rank save
  ([Note: a one-rank save of a sharded state]);
- the disk tier asks it for the settings of a parameter's next step, to take that step
  during backward (`next_step_settings`, [Note: the speculative step]).

An optimizer is linked by `link(optimizer)`, which registers the optimizer's own hooks. Torch
gives no way to learn that an optimizer was built, and users build theirs before or after
wrapping from the module's parameters, so one process-wide optimizer step pre-hook links
each optimizer at its first step to the links that hold its parameters (and again when its
parameter groups change): it is the only process-wide piece, and it holds nothing but a weak
set of the live links. Linking earlier, `model.optimizer_link.link(optimizer)`, changes
nothing but when: an optimizer of the disk tier linked before its first backward has that
first step taken during backward too.

[Note: optimizers built before wrapping]
Parameters keep their identity ([Note: parameters keep their identity]), so an optimizer
built from the module before wrapping steps the shards like one built after. What can still
be wrong is its state: filled before wrapping (a resume that loaded a one-process
`optimizer.state_dict()` and then wrapped), or loaded later from a one-process state dict,
it holds tensors of the whole parameter's shape where the parameter now holds this rank's
rows. When it is linked, and again whenever its state dict or its groups were replaced,
state of the whole parameter's shape is resharded to this rank's rows (the same state one
process would have), any other shape is an error naming the parameter, and a parameter left
behind by a refused swap is an error saying what to do. The check costs one comparison per
step otherwise.
"""
from __future__ import annotations

import itertools
import weakref
from typing import Any, Iterable, Optional

import torch
from torch.utils.weak import WeakIdKeyDictionary
from torch.distributed.tensor import DTensor
from torch.optim.optimizer import register_optimizer_step_pre_hook

from overlap.optim.paged import Hyper, paged_of
from overlap.runtime.param_identity import left_behind
from overlap.runtime.row_dtensors import local_part, local_rows, same_layout
from overlap.runtime.unpicklable_state import FULL_OPTIMIZER, PartialStateError, RankPartStateDict, every_rank_asks

# A flat group (overlap.runtime.flat_group imports this module: no import back). It answers
# `params`, `slots`, `layout`, `collectives`, `global_shape`, `local_of_global`, `dtensor` and `gather_parts`.
FlatGroup = Any

# Links numbered in the order the models were wrapped, the same on every rank: the key of a
# guarded optimizer's arrival count (see unpicklable_state.py).
_link_numbers = itertools.count(1)


# [Note: a backward over inputs only]
# `torch.autograd.grad(outputs, inputs, retain_graph=True)` reaches a unit's outputs and ends
# without its weights' gradients; the unit is freed at the end of that backward, as after any
# other, so a later weight-only step over the kept graph (after the input step of the zero-
# bubble pipeline schedules, ScheduleInterleavedZeroBubble, ScheduleZBVZeroBubble and
# DualPipeV) finds no weights in it, and the gradients of that microbatch are lost whatever
# later microbatches compute. A pipeline stage's groups are made for those schedules ([Note: a
# pipeline stage's parameters as leaves] in overlap/runtime/flat_group.py); for any other group
# the optimizer's next step over its parameters is refused. The refusal waits for the step:
# raised inside the schedule, it would leave the other stages' ranks waiting on their sends; at
# the step, every rank has finished its schedule. A backward over inputs that keeps no graph (a
# probe of shapes, as a pipeline stage's first step runs) or builds its own
# (`create_graph=True`, a gradient penalty) is not one of these; a kept graph that a full
# backward of the same forward then uses is refused with them, since the two cannot be told
# apart from inside backward.


class _Linked:
    """What a link keeps of one optimizer: its state and groups when last checked, and the
    count of its `state_dict()` calls when that is guarded."""

    __slots__ = ("signature", "number", "asked")

    def __init__(self, number: int) -> None:
        self.signature: Optional[tuple] = None
        self.number = number
        self.asked = 0


class OptimizerLink:
    """One model's sharded parameters as optimizers must see them (see the note)."""

    def __init__(self) -> None:
        self._number = next(_link_numbers)
        self._places = WeakIdKeyDictionary()         # sharded parameter -> (flat group, slot)
        self._lost_grads = WeakIdKeyDictionary()     # flat group -> the unit whose backward lost its gradients
        self._replaced = WeakIdKeyDictionary()       # tensor parallel's DTensor parameters replaced at wrap
        self._linked: "weakref.WeakKeyDictionary[torch.optim.Optimizer, _Linked]" = weakref.WeakKeyDictionary()
        self._guarded = itertools.count(1)
        _live_links.add(self)
        _discover_at_first_step()

    # ---- what the runtime tells it ------------------------------------------------------------

    def add_group(self, group: FlatGroup) -> None:
        """`group`'s parameters are sharded: optimizers that step them are checked."""
        for index, param in enumerate(group.module_params):
            self._places[param] = (group, index)

    def add_replaced(self, params: Iterable[torch.Tensor]) -> None:
        """Tensor parallelism replaced `params` by their local tensors: refused if stepped."""
        for param in params:
            self._replaced[param] = None

    def note_lost_grads(self, group: FlatGroup, unit_name: str) -> None:
        """`group`'s unit ended a backward without `group`'s gradient (see the note)."""
        self._lost_grads[group] = unit_name

    def next_step_settings(self, param: torch.Tensor) -> Optional[Hyper]:
        """The settings of `param`'s next step by a linked optimizer that can say them (the
        project's AdamW), or None."""
        for optimizer in list(self._linked):
            settings = getattr(optimizer, "next_step_settings", None)
            hyper = None if settings is None else settings(param)
            if hyper is not None:
                return hyper
        return None

    # ---- optimizers ---------------------------------------------------------------------------

    def is_linked(self, optimizer: torch.optim.Optimizer) -> bool:
        return optimizer in self._linked

    def holds(self, optimizer: torch.optim.Optimizer) -> bool:
        """Whether `optimizer` steps a parameter of this model, or one it replaced."""
        return any(param in self._places or param in self._replaced
                   for group in optimizer.param_groups for param in group["params"])

    def link(self, optimizer: torch.optim.Optimizer) -> None:
        """Check `optimizer` now and at each later step, and guard its state dict."""
        if optimizer in self._linked:
            return
        self._linked[optimizer] = _Linked(next(self._guarded))
        optimizer.register_step_pre_hook(self._before_step)
        if self._holds_partial(optimizer):
            optimizer.register_state_dict_pre_hook(self._arrivals)
            optimizer.register_state_dict_post_hook(self._sharded_form)
        optimizer.register_load_state_dict_post_hook(self.check)
        self.check(optimizer)       # last: a refusal here is raised again at every step

    def _before_step(self, optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        if self._lost_grads:
            self._refuse_lost_grads(optimizer)
        if self._linked[optimizer].signature != _signature(optimizer):
            self.check(optimizer)

    def _holds_partial(self, optimizer: torch.optim.Optimizer) -> bool:
        """Whether any of its parameters is this rank's part of a plain tensor (DTensor
        parameters, under fully_shard, have DTensor state, saved as FSDP2's is)."""
        return any(place[0].collectives.world_size > 1 and not place[0].dtensor_params
                   for group in optimizer.param_groups for param in group["params"]
                   if (place := self._places.get(param)) is not None)

    def _refuse_lost_grads(self, optimizer: torch.optim.Optimizer) -> None:
        lost = sorted({self._lost_grads[place[0]] for param_group in optimizer.param_groups
                       for param in param_group["params"]
                       if (place := self._places.get(param)) is not None and place[0] in self._lost_grads})
        if lost:
            raise RuntimeError(
                f"a backward reached the outputs of units {lost} and ended without computing their parameters' "
                "gradients (a backward over inputs only, torch.autograd.grad(outputs, inputs), as the input step of "
                "torch.distributed.pipelining's zero-bubble schedules runs: ScheduleInterleavedZeroBubble, "
                "ScheduleZBVZeroBubble, ScheduleDualPipeV): those gradients are lost. Outside a pipeline stage (a "
                "module sharded over a mesh with a 'pp' dimension) the runtime reduces a unit's gradients in the "
                "backward that computes them and frees its gathered weights at its end: shard each stage over mesh['dp'] of a ('pp', 'dp') mesh, or use a schedule with a full "
                "backward (GPipe, 1F1B, Interleaved1F1B, LoopedBFS)")

    def check(self, optimizer: torch.optim.Optimizer) -> None:
        """Reshard state of the whole parameters' shape, refuse what cannot be right (the note)."""
        for param_group in optimizer.param_groups:
            for param in param_group["params"]:
                if param in self._replaced:
                    raise RuntimeError("the optimizer holds a tensor-parallel DTensor parameter as it was before "
                                       "ShardedModule wrapped the model; such parameters cannot keep their identity "
                                       "(see docs/tensor_parallel.md): build the optimizer from model.parameters() "
                                       "after wrapping, as with FSDP2")
                name = left_behind(param)
                if name is not None:
                    raise RuntimeError(
                        f"the optimizer holds parameter {name!r} as it was before ShardedModule wrapped the model, "
                        "and ShardedModule could not keep that object (something held a weak reference to it, such "
                        "as a function compiled before wrapping): build the optimizer from model.parameters() after "
                        "wrapping")
                place = self._places.get(param)
                state = optimizer.state.get(param) if place is not None else None
                if state:
                    _reshard(state, *place)
        if optimizer in self._linked:
            self._linked[optimizer].signature = _signature(optimizer)

    def _arrivals(self, optimizer: torch.optim.Optimizer) -> None:
        """Before `optimizer.state_dict()` builds anything: refuse a call made on one rank alone."""
        linked = self._linked[optimizer]
        linked.asked += 1
        place = next((self._places.get(param) for group in optimizer.param_groups for param in group["params"]
                      if self._places.get(param) is not None), None)
        if place is not None:
            try:
                every_rank_asks(place[0].collectives.group, f"{self._number}/{linked.number}/{linked.asked}",
                                "optimizer.state_dict()", FULL_OPTIMIZER)
            except PartialStateError:
                linked.asked -= 1
                raise

    def _sharded_form(self, optimizer: torch.optim.Optimizer, state_dict: dict[str, Any]) -> RankPartStateDict:
        """`optimizer.state_dict()`: state shaped like a sharded parameter as a DTensor of the
        whole parameter's shape (what `torch.distributed.checkpoint` saves and reshards, as
        with FSDP2), in a dict that refuses to be pickled ([Note: a one-rank save of a sharded
        state])."""
        params = _numbered(optimizer)
        state = {}
        for number, values in state_dict["state"].items():
            place = self._places.get(params[number]) if isinstance(number, int) and number < len(params) else None
            if place is not None:
                values = {key: place[0].dtensor(value, place[1])
                          if isinstance(value, torch.Tensor) and value.dim() >= 1 and value.shape == params[number].shape
                          else value for key, value in values.items()}
            state[number] = values
        return RankPartStateDict({**state_dict, "state": state}, "optimizer.state_dict()", FULL_OPTIMIZER)

    def full_state(self, optimizer: torch.optim.Optimizer, keep: bool) -> dict[str, Any]:
        """`optimizer.state_dict()` with each sharded parameter's state of its shape gathered
        whole, as CPU tensors ({} where not `keep`). A collective: every rank calls it."""
        self.check(optimizer)
        params = _numbered(optimizer)
        if any(paged_of(param) is not None for param in params):
            raise NotImplementedError("full_optim_state_dict with offload='disk': the moments live in the state "
                                      "file; save with overlap.checkpoint.save(path, model, optimizer)")
        packed = dict(optimizer.state_dict())
        state = {index: {key: local_part(value)[0] if isinstance(value, DTensor) else value
                         for key, value in values.items()} for index, values in packed["state"].items()}
        # (flat group, state name) -> [(parameter index, slot)], in the same order on every rank.
        gathers: dict[tuple[int, str], list[tuple[int, int]]] = {}
        groups: dict[int, FlatGroup] = {}
        for number, param in enumerate(params):
            place = self._places.get(param)
            if place is None or number not in state:
                continue
            group, index = place
            groups[id(group)] = group
            for key in sorted(state[number]):
                value = state[number][key]
                if group.slots[index].dim and isinstance(packed["state"][number][key], DTensor):
                    # Sharded on another dimension: the block as the flat shard lays it out.
                    value = state[number][key] = group.laid(index, value)
                # Shaped like this rank's part (under fully_shard the parameter is a DTensor of
                # the full shape, its state's local blocks are parts).
                if isinstance(value, torch.Tensor) and value.dim() >= 1 and value.shape == group.params[index].shape:
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


# The live links, for the one process-wide hook (see the note).
_live_links: "weakref.WeakSet[OptimizerLink]" = weakref.WeakSet()
_discovery: Optional[Any] = None
# Each optimizer's parameter groups when the hook last looked for links holding them.
_looked: "weakref.WeakKeyDictionary[torch.optim.Optimizer, tuple]" = weakref.WeakKeyDictionary()


def _discover_at_first_step() -> None:
    global _discovery
    if _discovery is None:
        _discovery = register_optimizer_step_pre_hook(_link_where_held)


def _link_where_held(optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
    """Link `optimizer` to every live link holding one of its parameters; after the first
    step, one comparison unless its parameter groups changed."""
    groups = _group_signature(optimizer)
    if _looked.get(optimizer) == groups:
        return
    for link in list(_live_links):
        if link.holds(optimizer):
            link.link(optimizer)
    _looked[optimizer] = groups


def _group_signature(optimizer: torch.optim.Optimizer) -> tuple:
    return tuple(len(group["params"]) for group in optimizer.param_groups)


def _signature(optimizer: torch.optim.Optimizer) -> tuple:
    return id(optimizer.state), _group_signature(optimizer)


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
            local = group.laid(index, local_rows(value, like)).reshape(part.shape).clone()
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
