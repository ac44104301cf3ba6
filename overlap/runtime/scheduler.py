"""The hooks that drive the units through a step: on the wrapped module and each unit's
modules in forward, on their outputs and gradients in backward, and at the end of backward.
They move each unit through its states (see [Note: the states of a unit] in
overlap/runtime/unit.py) and hand the rest to the parts they tie together: what to gather
when (overlap.runtime.prefetch), gradient reduction (overlap.runtime.grad_reduction) and
step accounting (overlap.runtime.step_counter).

[Note: when a unit is freed in backward]
A unit's gathered parameters are read by the backward nodes of its forward: frozen ones
too, to compute the gradient of the unit's input. The gradient hook of its trainable groups
says when their gradients are complete, but not when the last node reading a frozen weight
has run: autograd may run those after it (another device's queue, a reentrant backward).
So each forward call passes the unit's inputs that require a gradient through an identity
function whose backward runs once their gradients are complete, i.e. after every node of
the unit that leads to them (FSDP2 does the same). A unit is freed in backward once both its
trainable gradients and its input gradients are complete; a unit that never gets both is
freed when the backward pass ends. A unit that is never freed (one rank computing in the
master dtype) needs no identity.

[Note: the last microbatch's reductions]
A pipeline schedule runs every microbatch's backward without gradient sync and reduces once,
after the last, from its final gradient step. Reducing only there leaves the whole reduction
exposed after the stage's last backward. A stage's units therefore issue their reduce-scatters
during the backward the step's last microbatch runs, each as soon as its gradients are
complete, behind the backward of the units before it. Which backward is the last: the step's
count of backward passes, learned from the previous step of microbatches (one reduced from the
final gradient step; the same schedule each step). A wrong guess costs overlap, not
correctness: reductions add into the shard gradient, so gradients that arrive after an early
reduction (a later pass, a zero-bubble weight step) are reduced at the final gradient step with
the rest, and `.grad` is published there, once.

[Note: gathers kept across microbatches]
A pipeline schedule runs each microbatch's forward and backward as passes of their own, all
with the same weights, and reduces the gradients once after the last. A unit freed after
each pass is gathered twice per microbatch. Once asked (`keep_gathered`, FSDP2's
`set_reshard_after_backward(False)`, which the schedule calls), the chosen units are freed
neither after their forward or backward nor at the end of a pass, only when the step's
gradients are reduced, before the optimizer writes their shards (`_close_step`). The next
step keeps them again if the schedule asked in this one, its first forwards included. A
kept unit whose shards changed since its gather anyway (a step taken without reducing) is
gathered again at the next forward. Which units: overlap.plan.microbatch_keep.

[Note: the next pass, told by a pipeline schedule]
Between two passes of a stage, a pipeline schedule runs other work on the rank: another
stage's passes, or a wait for a neighbour's activations or gradients. Left to itself, the end
of a pass frees every unit that is not kept, and the next pass gathers its first units when it
begins; after a forward, the first units of backward are prefetched, which a forward that
comes first instead (1F1B's warm-up, GPipe) frees unused. Told which of the stage's passes
comes next and whether the rank runs it right after (`tell_next_pass`, by
overlap.schedule_prefetch from the schedule's list of actions), the last unit of a forward
stays gathered only where this stage's backward comes before its next forward, and where the
stage's next pass is the rank's next action, the end of a pass keeps the root gathered for it
and starts the gathers of that pass's first units, within the prefetch depth and the memory
budget, so that they run behind the schedule's work in between. A stage whose pass comes after
another stage's is asked by the rank's follower once that action has run (`prepare_pass`).
Such units are gathered early, not kept: they are freed after they compute as any other, and
with everything else when the step's gradients are reduced.
"""
from __future__ import annotations

from functools import partial
from typing import Any, Callable, Optional, Sequence

import torch
from torch.autograd import Variable

from overlap.base.profiling import phase
from overlap.base.step_record import Mark, StepKind, StepRecord
from overlap.runtime.activations import flatten
from overlap.runtime.collectives import Collectives
from overlap.runtime.compiled import eager_hook
from overlap.runtime.flat_group import FlatGroup
from overlap.runtime.grad_reduction import GradReduction
from overlap.runtime.optimizer_link import OptimizerLink
from overlap.runtime.order_check import BEGIN_FORWARD, END_BACKWARD, END_FORWARD, OrderCheck
from overlap.runtime.prefetch import Prefetcher
from overlap.runtime.step_counter import StepCounter
from overlap.runtime.unit import GatherState, Unit

# The passes a pipeline schedule tells a stage of: see [Note: the next pass, told by a
# pipeline schedule]. OTHER: none that gathers (a weight step, or none left in the step).
NEXT_FORWARD, NEXT_BACKWARD, NEXT_OTHER = "forward", "backward", "other"


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


def _hook_outputs(output: Any, hook: Callable[[torch.Tensor], None]) -> bool:
    """Register `hook` on every tensor of `output` that requires a gradient; False if none does."""
    if isinstance(output, torch.Tensor):               # the common case, without a tree walk
        if output.requires_grad:
            output.register_hook(hook)
        return output.requires_grad
    leaves, _ = flatten(output)
    hooked = False
    for leaf in leaves:
        if isinstance(leaf, torch.Tensor) and leaf.requires_grad:
            leaf.register_hook(hook)
            hooked = True
    return hooked


class Scheduler:
    def __init__(self, root: Optional[Unit], units: list[Unit], collectives: Collectives, prefetch_depth: int,
                 memory_budget_bytes: Optional[int], reshard_after_forward: bool, optimizer_link: OptimizerLink,
                 order_check: str = "collective", cast_dtype: Optional[torch.dtype] = None,
                 keep_units: Optional[int] = None) -> None:
        self.root = root
        # Where a backward that lost weight gradients is told, for the optimizer's next step.
        self.optimizer_link = optimizer_link
        # Mixed precision's compute dtype: floating-point inputs of every unit are cast to it.
        self.cast_dtype = cast_dtype
        # id(module) -> the dtype a unit's module casts its inputs to where that is not
        # `cast_dtype` (None: no cast): fully_shard's per-call `mp_policy`.
        self.module_cast_dtypes: dict[int, Optional[torch.dtype]] = {}
        self.units = units
        self.reshard_after_forward = reshard_after_forward
        self.sync_grads = True
        # See [Note: gathers kept across microbatches].
        self._keep_units = keep_units
        self._keeping = False              # keeping now: asked in this step or the last
        self._keep_asked = False           # set_reshard_after_backward(False) since the step began
        self.keep_decision: Optional[str] = None
        # See [Note: the next pass, told by a pipeline schedule]: the pass told to follow the
        # one running now (None: not told), and the pass gathered for since the last ended.
        self._next_pass: Optional[str] = None
        self._next_immediate = False
        self._prepared: Optional[str] = None
        self.schedule_decision: Optional[str] = None     # what tells it, for the report
        # From the first backward hook of a pass to its end-of-backward callback. A unit's
        # forward that runs meanwhile is activation checkpointing's recompute; the unit's own
        # state cannot tell (under reentrant checkpointing it is still FORWARD).
        self.in_backward = False
        # Backward passes begun in this step and in the last, and whether this one is the
        # step's last: see [Note: the last microbatch's reductions].
        self._backwards_this_step = 0
        self._backwards_last_step = 0
        self._reduce_early = False
        self._reduced_early = False        # some unit reduced early in this step
        # Whether this backward keeps its graph and builds none, and then which units it
        # reached and which got their gradients: see [Note: a backward over inputs only].
        self._graph_kept = False
        self._reached: set[Unit] = set()
        self._grads_came: set[Unit] = set()
        self.log = collectives.log
        self.prefetch = Prefetcher(units, self.log, prefetch_depth, memory_budget_bytes)
        self.reduction = GradReduction(collectives)
        self.steps: StepCounter[Scheduler] = StepCounter(self.log, self, root, self.all_units)
        self._index = {id(unit): i for i, unit in enumerate(self.all_units)}
        # A pipeline stage's groups whose gradients wait on their leaves (see FlatGroup's stage_leaves).
        self._leaf_groups = [group for unit in self.all_units for group in unit.groups if group.stage_leaves]
        # Those whose gradients are summed across microbatches in the reduce dtype, not on
        # their lower-precision leaves (FSDP2 accumulates in its reduce dtype too).
        self._upcast_groups = [group for group in self._leaf_groups if group.gather_dtype != group.reduce_dtype]
        # Ranks that run different units get an error (see overlap.runtime.order_check).
        self.order: Optional[OrderCheck] = None
        if collectives.world_size > 1:
            self.order = OrderCheck(collectives.group, [unit.name for unit in self.all_units],
                                    before_each_collective=order_check == "collective")
            collectives.watch = self.order

        # Units whose modules hold parameters of the root unit (a head tied to the embedding):
        # one called outside the root's forward (a loss computed on chunks) gathers the root too.
        root_owners = {id(module) for group in (root.groups if root is not None else [])
                       for slot in group.slots for module, _ in slot.owners}
        self._needs_root = {id(unit) for unit in units
                            if any(id(sub) in root_owners for member in unit.modules for sub in member.modules())}
        # A module that holds only root parameters is in no unit (a tied head): it gathers the
        # root itself when called outside the root's forward.
        in_units = {id(sub) for unit in units for member in unit.modules for sub in member.modules()}
        owners = {id(module): module for group in (root.groups if root is not None else [])
                  for slot in group.slots for module, _ in slot.owners}
        for key, module in owners.items():
            if key not in in_units:
                module.register_forward_pre_hook(eager_hook(self._gather_root), prepend=True)
        # Per-unit callbacks made once, not at every forward.
        self._input_grads_callbacks = {unit: partial(self._on_input_grads, unit) for unit in units}
        self._pre_backward_hooks = {unit: partial(self._pre_backward, unit) for unit in units}
        self._unit_of = {id(module): unit for unit in units for module in unit.modules}
        # Calls of a method of the wrapped module registered to run as its forward
        # (`ShardedModule.register_forward_method`) in progress: its own forward calls inside
        # are part of that one pass.
        self.root_methods_running = 0
        # From the wrapped module's forward pre-hook to its forward hook.
        self.in_forward = False
        for unit in units:
            for module in unit.modules:
                # Eager under torch.compile; see [Note: compiling forward, not __call__].
                # First of the module's pre-hooks: hooks registered before wrapping read its
                # weights gathered.
                module.register_forward_pre_hook(eager_hook(partial(self._pre_forward, unit)), with_kwargs=True,
                                                 prepend=True)
                module.register_forward_hook(eager_hook(partial(self._post_forward, unit)))
        for unit in self.all_units:
            for group in unit.groups:          # a frozen group may train later (requires_grad_ after wrapping)
                group.register_grad_hook(partial(self._on_grad, unit))

    # ---- read (and the depths set) by the planner, the report, benchmarks and tests -------

    @property
    def all_units(self) -> list[Unit]:
        return ([self.root] if self.root is not None else []) + self.units

    @property
    def prefetch_depth(self) -> int:
        return self.prefetch.prefetch_depth

    @prefetch_depth.setter
    def prefetch_depth(self, depth: int) -> None:
        self.prefetch.prefetch_depth = depth

    @property
    def backward_prefetch_depth(self) -> Optional[int]:
        return self.prefetch.backward_prefetch_depth

    @backward_prefetch_depth.setter
    def backward_prefetch_depth(self, depth: Optional[int]) -> None:
        self.prefetch.backward_prefetch_depth = depth

    @property
    def backward_depth(self) -> int:
        return self.prefetch.backward_depth

    @property
    def memory_budget_bytes(self) -> Optional[int]:
        return self.prefetch.memory_budget_bytes

    @memory_budget_bytes.setter
    def memory_budget_bytes(self, budget: Optional[int]) -> None:
        self.prefetch.memory_budget_bytes = budget

    @property
    def max_gathered_units(self) -> int:
        return self.prefetch.max_gathered_units

    @property
    def step(self) -> int:
        """Steps begun; see [Note: what a step is]."""
        return self.steps.step

    def backward_gather_decision(self) -> Optional[str]:
        """The units not gathered again for backward, for the report (None: none is)."""
        skipped = [unit.name for unit in self.units if not unit.gather_in_backward]
        if not skipped:
            return None
        return (f"not gathered again for backward, whose computation reads none of their weights (embeddings, or "
                f"set_unshard_in_backward(False)): {', '.join(skipped)}")

    def unit_of(self, module: torch.nn.Module) -> Optional[Unit]:
        """The unit `module` is a member of, or None."""
        return self._unit_of.get(id(module))

    @property
    def last_step(self) -> Optional[StepRecord]:
        return self.steps.last_step

    @property
    def step_end_callbacks(self) -> list[Callable[["Scheduler"], None]]:
        return self.steps.callbacks

    # ---- forward --------------------------------------------------------------------------

    def begin_forward(self) -> None:
        """Called before the wrapped module's forward: recover, gather the root, prefetch."""
        prepared, self._prepared = self._prepared, None
        self._recover(discard=prepared != NEXT_FORWARD)
        if self._keeping:
            for unit in self.all_units:
                if unit.kept and unit.gather_state is GatherState.GATHERED and unit.gathered_is_stale:
                    unit.discard()
                    self.log.mark(Mark.FREE, unit.name)
        self.in_forward = True
        if self.steps.forward_begins(self.order):
            self.prefetch.gathered.reset_most()
        if self.order is not None:
            self.order.boundary(BEGIN_FORWARD)
        for unit in self.all_units:
            unit.begin_pass()
        self.prefetch.begin_forward(self.root)
        if self.root is not None:
            self.root.finish_gather()
            self.log.mark(Mark.PRE_FORWARD, self.root.name)
            self.root.install_views()
            self.root.show_gathered()
            self.root.enter_forward()

    def _recover(self, discard: bool = True) -> None:
        """Bring every unit back to sharded after a forward or backward that did not finish
        (an exception in forward, or a forward with no backward); an unfinished backward's
        reductions are not published. Reductions issued early in this step (a guess of its last
        backward that another forward proved wrong) stay: see [Note: the last microbatch's
        reductions]. Units gathered for this forward, at the end of the pass before, stay
        (`discard` False): see [Note: the next pass, told by a pipeline schedule]."""
        if self._reduced_early:
            self.reduction.wait_all()
        else:
            self.reduction.abandon(self.all_units)
        for unit in self.all_units:
            unit.hide_gathered()               # a forward that raised: the rows, for what comes next
        if discard:
            self._discard_all()
        self.in_backward = False
        self._reached.clear()
        self._grads_came.clear()
        self.in_forward = False

    def _pre_forward(self, unit: Unit, module: torch.nn.Module, args: tuple, kwargs: dict
                     ) -> Optional[tuple[tuple, dict]]:
        cast = self._cast_inputs(args, kwargs, self.module_cast_dtypes.get(id(module), self.cast_dtype))
        if cast is not None:
            args, kwargs = cast
        if self.in_backward:
            # Activation checkpointing re-runs forward inside backward: the unit is gathered
            # for its backward (or is gathered now); only the views need to be (re)made.
            unit.finish_gather()
            unit.install_views()
            return cast
        with phase(f"overlap::pre_forward::{unit.name}"):
            if self.order is not None:
                self.order.ran(self._index[id(unit)], backward=False)
            self.prefetch.gather_for_forward(unit)
            unit.install_views()
            unit.show_gathered()
            if id(unit) in self._needs_root:
                self._gather_root()
            unit.enter_forward(module)
            self.log.mark(Mark.PRE_FORWARD, unit.name)
            unit.open_span("forward")
            return self._after_input_grads(unit, args, kwargs) or cast

    def _gather_root(self, *_: Any) -> None:
        """The root's parameters gathered and on their modules, for a module that holds some
        of them called outside the root's forward (an earlier backward may have freed them)."""
        if self.root.gather_state is not GatherState.GATHERED or not self.root.views_installed:
            self.root.finish_gather()
            self.root.install_views()

    def _cast_inputs(self, args: tuple, kwargs: dict, dtype: Optional[torch.dtype]) -> Optional[tuple[tuple, dict]]:
        """Floating-point inputs in the compute dtype `dtype`, as each of FSDP2's modules casts
        its own: a tensor made inside forward (a mask, positions) reaches the unit in it too.
        None where nothing is cast."""
        if dtype is None:
            return None
        leaves, rebuild = flatten((args, kwargs))
        if not any(leaf.is_floating_point() and leaf.dtype != dtype for leaf in leaves):
            return None
        return rebuild([leaf.to(dtype) if leaf.is_floating_point() else leaf for leaf in leaves])

    def call_as_forward(self, unit: Unit, module: torch.nn.Module, method: Callable[..., Any], args: tuple,
                        kwargs: dict) -> Any:
        """`method(*args, **kwargs)`, a method of `module` other than its forward, with the
        unit's forward hooks around it (FSDP2's `register_fsdp_forward_method`)."""
        replaced = self._pre_forward(unit, module, args, kwargs)
        if replaced is not None:
            args, kwargs = replaced
        output = method(*args, **kwargs)
        self._post_forward(unit, module, args, output)
        return output

    def _after_input_grads(self, unit: Unit, args: tuple, kwargs: dict) -> Optional[tuple[tuple, dict]]:
        """The call's arguments with those that require a gradient passed through
        `_AfterInputGrads`. See [Note: when a unit is freed in backward]."""
        if unit.never_freed or not torch.is_grad_enabled():
            return None
        flat = not kwargs and all(isinstance(arg, torch.Tensor) for arg in args)   # no tree walk needed
        leaves, rebuild = (list(args), None) if flat else flatten((args, kwargs))
        wanted = [i for i, leaf in enumerate(leaves) if isinstance(leaf, torch.Tensor) and leaf.requires_grad]
        if not wanted:
            return None
        unit.expect_input_grads()
        outputs = _AfterInputGrads.apply(self._input_grads_callbacks[unit], *(leaves[i] for i in wanted))
        for i, tensor in zip(wanted, outputs):
            leaves[i] = tensor
        return (tuple(leaves), kwargs) if flat else rebuild(leaves)

    def _post_forward(self, unit: Unit, module: torch.nn.Module, args: Any, output: Any) -> None:
        if self.in_backward:
            return
        unit.close_span()
        with phase(f"overlap::post_forward::{unit.name}"):
            self.log.mark(Mark.POST_FORWARD, unit.name)
            backward_follows = torch.is_grad_enabled() and _hook_outputs(output, self._pre_backward_hooks[unit])
            reshards = self.reshard_after_forward if unit.reshard_after_forward is None else unit.reshard_after_forward
            # A member called inside another member's forward (nested units merged into one
            # bucket, a registered method that calls forward) leaves the unit gathered for
            # the outer call.
            outermost = unit.leave_forward()
            if outermost:
                unit.leave_forward_views()
            # A unit that is never freed (one rank: [Note: one rank computing in the master
            # dtype]) stays gathered for its backward: a free would release nothing.
            backward_next = backward_follows and self._next_pass in (None, NEXT_BACKWARD)
            if (reshards and outermost and unit.all_members_ran and not self._stays_gathered(unit)
                    and not (backward_next and self.prefetch.ends_forward(unit))):
                self._reshard(unit)

    def end_forward(self, output: Any) -> None:
        """Called with the wrapped module's output."""
        self.in_forward = False
        self.prefetch.end_forward()
        if self.root is not None:
            self.root.leave_forward_views()
            self.log.mark(Mark.POST_FORWARD, self.root.name)
        if self.order is not None:
            self.order.boundary(END_FORWARD)
        next_pass, self._next_pass = self._next_pass, None
        if torch.is_grad_enabled() and _hook_outputs(output, self._root_pre_backward):
            if next_pass is None or (next_pass == NEXT_BACKWARD and self._next_immediate):
                self.prefetch.prefetch_backward_start()
            elif next_pass == NEXT_FORWARD and self._next_immediate:
                self.prepare_pass(NEXT_FORWARD)
        else:
            # No backward can follow: the step ends here (evaluation, generation). The root
            # stays gathered until the next forward, as FSDP2's root does: layers of the root
            # called after the model returns (a tied output head on hidden states) compute
            # with its parameters.
            self._end_pass(keep=self.root)
            for group in self._leaf_groups:
                group.release_leaves()
            self.steps.close(StepKind.FORWARD, self.order)

    # ---- asked for outside a pass (`fully_shard`'s unshard / reshard) -----------------------

    def unshard(self, unit: Unit) -> None:
        """Gather `unit` and put its views on its modules now; the next forward starts from
        sharded again (its `_recover` drops them)."""
        unit.finish_gather()
        unit.install_views()

    def reshard_now(self, unit: Unit) -> None:
        if unit.gather_state is not GatherState.SHARDED:
            unit.discard()
            self.log.mark(Mark.FREE, unit.name)

    def reset_pass(self) -> None:
        """Forget a pass that did not finish (FSDP2's `reset_iter_state`)."""
        self._recover()
        for unit in self.all_units:
            unit.end_pass()

    # ---- told by a pipeline schedule --------------------------------------------------------

    def tell_next_pass(self, next_pass: Optional[str], immediate: bool) -> None:
        """Which pass of this stage follows the one about to begin: NEXT_FORWARD,
        NEXT_BACKWARD or NEXT_OTHER (none this step, or not one that gathers; None: not told),
        and whether the rank runs it right after (`immediate`) or runs other stages' actions
        first. See [Note: the next pass, told by a pipeline schedule]."""
        if next_pass not in (None, NEXT_FORWARD, NEXT_BACKWARD, NEXT_OTHER):
            raise ValueError(f"tell_next_pass: {next_pass!r} is no pass")
        self._next_pass, self._next_immediate = next_pass, immediate

    def prepare_pass(self, next_pass: str) -> None:
        """Between passes: start gathering what the pass `next_pass` (NEXT_FORWARD or
        NEXT_BACKWARD) computes first, the root and the first units in its order (as many as
        the prefetch depth, at least one)."""
        root = self.root
        if root is not None and root.gather_state is GatherState.SHARDED:
            self.prefetch.start_gather(root, Mark.PREFETCH)
        # At least the first unit: the pass gathers it first in any case, here only earlier.
        if next_pass == NEXT_FORWARD:
            self.prefetch.prefetch_forward_start(minimum=1)
        else:
            self.prefetch.prefetch_backward_start(minimum=1)
        self._prepared = next_pass

    # ---- gathered parameters released ------------------------------------------------------

    def _reshard(self, unit: Unit) -> None:
        unit.reshard()
        self.log.mark(Mark.FREE, unit.name)

    def _discard_all(self, keep: Optional[Unit] = None) -> None:
        for unit in self.all_units:
            if unit.gather_state is not GatherState.SHARDED and unit is not keep and not self._stays_gathered(unit):
                unit.discard()
                self.log.mark(Mark.FREE, unit.name)

    # ---- gathers kept across microbatches ---------------------------------------------------

    def _stays_gathered(self, unit: Unit) -> bool:
        """Whether `unit` outlives the frees of a pass: kept across this step's microbatches, or
        never freed at all (one rank, see [Note: one rank computing in the master dtype])."""
        return unit.never_freed or (self._keeping and unit.kept)

    @property
    def keep_units(self) -> Optional[int]:
        """The user's count of units to keep gathered across microbatches (OVERLAP_KEEP_UNITS),
        None for the planner's choice."""
        return self._keep_units

    @keep_units.setter
    def keep_units(self, count: Optional[int]) -> None:
        """Chosen again when keeping next starts: from the next step a schedule asks in."""
        if count is not None and (isinstance(count, bool) or not isinstance(count, int) or count < 0):
            raise ValueError(f"keep_units={count!r} is invalid; expected an integer >= 0 or None")
        self._keep_units = count
        self._keeping = False

    def keep_gathered(self, choose: Callable[[list[Unit]], tuple[int, str]]) -> None:
        """Keep units gathered after backward, and from then on across the passes of this
        step and of each later step that asks again (FSDP2's `set_reshard_after_backward(False)`,
        which a pipeline schedule calls before each microbatch's backward). When keeping
        starts, `choose(units in forward order)` says how many of the first to keep, and how
        that was decided (for the report)."""
        self._keep_asked = True
        if self._keeping:
            return
        order = self.prefetch.forward_order
        if set(order) != set(self.units):
            order = list(self.units)             # no forward yet: their build order
        if self.root is not None:
            order = [self.root, *order]          # the first to compute and the last
        count, self.keep_decision = choose(order)
        chosen = set(order[:count])
        for unit in self.all_units:
            unit.kept = unit in chosen
        self._keeping = True

    def _close_step(self) -> None:
        """The step's gradients are reduced: free the kept units before the optimizer writes
        their shards, and keep again next step only if this one asked."""
        for unit in self.all_units:
            if unit.gather_state is not GatherState.SHARDED and not unit.never_freed:   # kept, or kept until re-chosen
                unit.discard()
                self.log.mark(Mark.FREE, unit.name)
                unit.remove_views()
        for group in self._leaf_groups:
            group.release_leaves()
        self._prepared = None
        self._backwards_this_step = 0
        self._reduced_early = False
        self._keeping, self._keep_asked = self._keep_asked, False
        self.steps.close(StepKind.TRAIN, self.order)

    def _end_pass(self, keep: Optional[Unit] = None) -> None:
        """Free everything but `keep` and leave every unit idle until the next forward, the
        modules holding their registered parameters until then."""
        self._discard_all(keep)
        for unit in self.all_units:
            unit.end_pass()
            if unit is not keep:
                unit.remove_views()

    # ---- backward -------------------------------------------------------------------------

    def _begin_backward(self) -> None:
        if self.in_backward:
            return
        self.in_backward = True
        self._prepared = None
        self._backwards_this_step += 1
        self._reduce_early = self._keeping and self._backwards_this_step == self._backwards_last_step
        for group in self._leaf_groups:
            group.expect_leaf_grads()
        # A backward that keeps its graph for a later one and builds none of its own (the input
        # step of a zero-bubble schedule): see [Note: a backward over inputs only].
        self._graph_kept = torch._C._autograd._get_current_graph_task_keep_graph() and not torch.is_grad_enabled()
        self.steps.backward_begins()
        self.prefetch.begin_backward()
        Variable._execution_engine.queue_callback(self._end_backward)

    def _root_pre_backward(self, grad: torch.Tensor) -> None:
        self._begin_backward()
        if self.root is not None and self.root.enter_backward():
            if self.root.gather_state is not GatherState.GATHERED:
                # An earlier backward of this step (a head run on chunks outside the forward,
                # each chunk its own backward) ended its pass and freed the root: gather again.
                self.root.finish_gather()
            if self.root.drops_views and not self.root.views_current:
                with torch.enable_grad():
                    self.root.restore_views()
            self.log.mark(Mark.PRE_BACKWARD, self.root.name)

    def _pre_backward(self, unit: Unit, grad: torch.Tensor) -> None:
        self._begin_backward()
        if self._graph_kept:
            self._reached.add(unit)
        if not unit.enter_backward():
            return
        with phase(f"overlap::pre_backward::{unit.name}"):
            if self.order is not None:
                self.order.ran(self._index[id(unit)], backward=True, synced=self.sync_grads)
            self.prefetch.gather_for_backward(unit)
            if unit.drops_views and unit.gather_state is GatherState.GATHERED and not unit.views_current:
                # Its views left the modules when it was freed; a recompute (activation
                # checkpointing) may call its modules without their own pre-hook (a wrapper's
                # inner module), so they are there again, connected to the gathered buffer.
                with torch.enable_grad():
                    unit.restore_views()
            self.log.mark(Mark.PRE_BACKWARD, unit.name)
            unit.open_span("backward")

    def _on_grad(self, unit: Unit, group: FlatGroup, grad: Optional[torch.Tensor]) -> None:
        """`group`'s gradient is complete in this backward: `grad`, or on a stage's leaves (None)."""
        if self._graph_kept:
            self._grads_came.add(unit)
        unit.close_span()
        with phase(f"overlap::post_backward::{unit.name}"):
            if unit.trainable_grad_arrived():
                self.log.mark(Mark.POST_BACKWARD, unit.name)
            if grad is None:                   # on the leaves: reduced now only when due or early
                if self.sync_grads or self._reduce_early:
                    self._hold_leaf_grads([group])
                    held = group.take_grad_for_reduce(None)
                    if held is not None:
                        self.reduction.reduce(unit, group, held)
                        self._reduced_early |= not self.sync_grads
            elif self.sync_grads:
                self.reduction.reduce(unit, group, group.take_grad_for_reduce(grad))
            else:
                group.hold_unsynced(grad)
            self._free_after_backward(unit)

    def _on_input_grads(self, unit: Unit) -> None:
        unit.input_grads_arrived()
        self._free_after_backward(unit)

    def _free_after_backward(self, unit: Unit) -> None:
        """See [Note: when a unit is freed in backward]."""
        if unit.backward_complete and unit.gather_state is not GatherState.SHARDED and not self._stays_gathered(unit):
            self._reshard(unit)

    def reduce_held_grads(self) -> None:
        """Reduce what backward passes without gradient sync held back and publish `.grad`, as
        the end of a backward that syncs does: for loops whose microbatches all run without
        sync and reduce once after the last (a pipeline schedule's final gradient step). After
        a step that ran no backward (torch's `schedule.eval()` takes this step too) there is
        nothing to reduce, and no training step to close."""
        if self._backwards_this_step == 0:
            return
        with phase("overlap::reduce_held_grads"):
            self._hold_leaf_grads()
            self.reduction.end_backward(self.all_units, True, self.order)
            backwards = self._backwards_this_step
            self._close_step()
            self._backwards_last_step = backwards      # a step of microbatches: the next one's guess

    def _hold_leaf_grads(self, groups: Optional[list[FlatGroup]] = None) -> None:
        """A pipeline stage's gradients, left on its leaves by autograd and by the schedule's
        weight steps, held for the reduction (see [Note: a pipeline stage's parameters as
        leaves] in overlap/runtime/flat_group.py); of `groups`, or of every such group."""
        for group in self._leaf_groups if groups is None else groups:
            grad = group.take_leaf_grads()
            if grad is not None:
                group.hold_unsynced(grad)

    def _end_backward(self) -> None:
        """Runs once when the backward pass finishes: every gradient is reduced and every
        gathered buffer freed before `backward()` returns."""
        with phase("overlap::end_backward"):
            for unit in self._reached:
                if unit.trainable_groups and unit not in self._grads_came:
                    for group in unit.trainable_groups:
                        if not group.stage_leaves:         # a weight step leaves theirs on the leaves
                            self.optimizer_link.note_lost_grads(group, unit.name)
            self._reached.clear()
            self._grads_came.clear()
            if self.order is not None:
                self.order.boundary(END_BACKWARD)
            self._hold_leaf_grads(None if self.sync_grads else self._upcast_groups)
            self.reduction.end_backward(self.all_units, self.sync_grads, self.order)
            next_pass, self._next_pass = self._next_pass, None
            prepare = not self.sync_grads and next_pass in (NEXT_FORWARD, NEXT_BACKWARD) and self._next_immediate
            self._end_pass(keep=self.root if prepare else None)
            self.prefetch.end_backward()
            self.in_backward = False
            self.log.mark(Mark.END_BACKWARD, "")
            if self.sync_grads:
                self._close_step()
            elif prepare:
                self.prepare_pass(next_pass)
