"""One group of a unit's parameters (same dtype, same requires_grad) stored as a flat shard.

Layout (`overlap.base.layout`): the group's parameters are laid out in a fixed order in one
buffer of `padded_numel = world_size * shard_numel` elements, each shard boundary inside a
parameter on one of its row boundaries (see [Note: row-aligned shards]); rank r keeps
elements [r * shard_numel, (r + 1) * shard_numel) as its master shard, a plain tensor in the
parameters' own dtype. The user's parameters are views into that shard of their own number
of dimensions (see [Note: original parameters are views of the flat shard]). To compute,
the shards are all-gathered into `full`, a leaf tensor in the gather dtype whose views stand
in for the original parameters on their modules. Autograd accumulates the gradients of all
those views into `full.grad`, which is already in the flat layout the reduce-scatter wants:
no copy-in or copy-out is needed on the way in or out. With offload="cpu" the master shard
and the shard gradient live in host memory, and what a gather sends and what a reduction sums
are device copies of them (the group's `place`, overlap.runtime.host_tier).

[Note: original parameters are views of the flat shard]
Each original parameter stays on its modules (under its own names, a tied one once), the
same Python object ([Note: parameters keep their identity]), now holding this rank's part: the block of whole rows of the
parameter that falls inside the rank's slice of the flat buffer, shaped (local_rows,
*trailing_dims), so `p.dim()` is the module's own; (0, *trailing_dims) on ranks whose slice
misses it. Optimizer updates write the shard in place, so the next all-gather sends it as it
is; gradients are views of one flat shard gradient that the reduce-scatter accumulates into,
shaped like their parameters. Per-parameter DTensors (FSDP2's way) would instead copy every
shard into a send buffer before each all-gather and out of the received one after it;
docs/parameters.md has the measurements that decided for row-aligned views.

[Note: one rank computing in the master dtype]
With one rank (no replicas, no node copy, no compression) whose modules compute in the master
shards' dtype, the shard is already every parameter in full: `full` shares its storage, a
gather has nothing to do and a free nothing to release (`resident`). The optimizer's in-place
updates of the shard are what the next forward computes with, as after a gather. `full` keeps
a version counter of its own (`set_`, not a view), so those updates do not look to autograd
like changes of tensors it saved. Gathering and freeing each unit twice a step would otherwise
be most of the runtime's host work on one rank; the scheduler never frees such a unit
(`Unit.never_freed`): gathered at its first forward, it stays gathered from step to step, and
counts in no tally of gathered memory, since it holds none of its own. A `reshard()` asked for
outside a pass still frees it (nothing to release), and the next forward gathers it again.

[Note: a gradient that reaches a parameter directly]
Forward computes with views of the gathered buffer, so autograd never reaches the module's
own parameters (this rank's rows). It reaches one only when the loss was computed from the
parameters themselves outside the module's forward: an L2 penalty over `model.parameters()`,
say. That term sees this rank's rows only, and its gradient would land in `.grad` beside the
reduction's: training would go on, silently wrong. Each trainable parameter therefore carries a
tensor hook that notes its name; the end of a backward that syncs tells every rank (one more
flag in its flags all-reduce) and raises `DirectGradientError` on all of them before any
`.grad` is published.

[Note: a gradient that reaches a DTensor parameter directly]
Under `fully_shard` the parameters are DTensors of their whole shapes, and a penalty over them
(`loss + sum((p ** 2).sum() for p in model.parameters()).full_tensor()`) is a term FSDP2
computes: each rank's rows get the whole gradient of their own square, which is added to the
reduced gradient of the loss, not reduced with it. Autograd accumulates it into the parameter's
`.grad` in whatever order backward reaches it. Before the group's reduction began it is counted
there: the reduction starts from `.grad` as the sum so far. After, a tensor hook keeps it and
hands autograd zeros to accumulate instead (into the published `.grad` autograd may add in
place, and that is the flat gradient shard the reduction adds into); it is added when the
reduced gradient is published.

[Note: the parameters hold the gathered values during forward]
A module's own forward reads its attributes, the views of `full`; a hook reads what
`named_parameters()` yields, the registered parameters. From a unit's forward pre-hook to its
forward hook each of its parameters' `.data` is its view of `full` too, so a forward pre-hook
(or a forward hook registered before wrapping) reading `module.named_parameters()` sees the
gathered weights, as FSDP2's unsharded parameters are. The objects stay the optimizer's and
stay leaves (what torch's MemTracker hooks); only what they point at changes, and `.data =`
keeps their version counters, which the offload tiers read. At the unit's forward hook, before
any free and so before any gradient is published, they hold their rows again and are the
modules' attributes again (`getattr(module, name) is param` after forward, as under FSDP2), so
an optimizer step, a gradient hook, a checkpoint and a loss term over `model.parameters()`
(refused by [Note: a gradient that reaches a parameter directly]) see this rank's rows. The
views go back on the modules before the unit's backward, for a recompute that calls a module
without hooks of its own. Between a unit's forward and its backward, a module of it called
outside the hooks (not the unit's own module, which gathers) computes with the rows, as between
steps; under FSDP2 it would meet the sharded DTensors. Tensor-parallel parameters (their views are DTensors), a pipeline
stage's leaves and `fully_shard`'s DTensors (registered as the views already) are left as they
are.

[Note: post-accumulate-grad hooks of sharded parameters]
Autograd accumulates into the gathered buffer, never into the module's parameters, so a hook
a user registered on one with `register_post_accumulate_grad_hook` (an optimizer stepped
inside backward) would never run. The runtime runs it itself, once per parameter per synced
backward, right after it gives the parameter its reduced `.grad` (this rank's rows, or the
DTensor over them), as FSDP2 runs it on the reduced shard.

[Note: a pipeline stage's parameters as leaves]
The zero-bubble schedules of torch's pipelining (ScheduleInterleavedZeroBubble,
ScheduleZBVZeroBubble, ScheduleDualPipeV) split a microbatch's backward in two: an input step
(`torch.autograd.grad` over the stage's inputs, keeping the graph) and a later weight step. The
weight step finds the weights by the autograd nodes of what `stage.submod.parameters()` yields,
and writes their gradients into those tensors' `.grad` itself. The flat views cannot serve: they
are made anew at every forward (another microbatch's by the time of a weight step), off the
modules after each pass, and share one split node. So in a pipeline stage each parameter's
gathered value is a leaf of its own (`stage_leaves`; a tensor-parallel one, a DTensor over its
piece), made once over `full`'s storage (which a free resizes, as FSDP2's unsharded
parameters), on the modules as their attributes and registered parameters from the step's
first forward until its gradients are reduced. Autograd accumulates every microbatch's
gradient in the leaves' `.grad`, the weight steps add theirs there, and the step's reduction
folds them into the flat layout once (`take_leaf_grads`; after each backward instead where the
leaves' dtype is below the reduce dtype, to be summed in it). `full` itself needs no gradient.
A hook on each leaf says when a backward has brought all of a group's gradients (autograd's
accumulation; nothing fires when a weight step writes them), so that a unit is freed, and in
the step's last microbatch reduced, as soon as its backward is done (see [Note: the last
microbatch's reductions] in overlap/runtime/scheduler.py).

[Note: freeing `full` by resizing its storage]
Tensors autograd saved in forward (a weight for a matmul's input gradient) are views of
`full`. Freeing by `untyped_storage().resize_(0)` and re-gathering into the same storage
keeps those views valid: backward reads the re-gathered data. Writes into `full` preserve
its version counter so autograd does not mistake the re-gather for an in-place change.
"""
from __future__ import annotations

import dataclasses
import weakref
from dataclasses import dataclass
from typing import Any, Callable, Optional

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor

from overlap.base.layout import FlatLayout
from overlap.runtime.row_dtensors import (RowDTensor, RowShard, as_block_dtensor, as_dtensor, row_dtensor, shard_mesh,
                                         tp_dp_mesh)
from overlap.runtime.collectives import Collectives, Pending, all_gather_flat
from overlap.runtime.expert_dtensors import expert_dtensor, experts_shape
from overlap.runtime.expert_parallel import ExpertGroups, all_experts, my_experts
from overlap.runtime.pending import COMPLETED
from overlap.runtime.host_tier import ShardPlace
from overlap.runtime.node_copy import NodeCopy
from overlap.runtime.optimizer_link import OptimizerLink
from overlap.runtime.param_identity import rebind
from overlap.runtime.param_views import ParamViews
from overlap.runtime.shard_grad import plain, shard_grad
from overlap.runtime.tensor_parallel import TensorParallelSpec


def _weakly(method: Callable[..., Any]) -> Callable[..., Any]:
    """The bound `method`, called through a weak reference to its object. Autograd's nodes and
    tensors keep their hooks in C++, where Python's collector cannot see them: a hook holding
    its group strongly would make a cycle (group -> buffer or views -> node -> hook -> group)
    that outlives the model, shards and all."""
    ref = weakref.WeakMethod(method)

    def call(*args: Any) -> Any:
        bound = ref()
        return None if bound is None else bound(*args)
    return call


@dataclass
class ParamSlot:
    """Where one original parameter lives in the flat layout and on which modules."""

    name: str                                  # first fully qualified name
    owners: list[tuple[nn.Module, str]]        # (module, attribute) for every place it is used
    shape: torch.Size
    offset: int
    numel: int
    dim: int = 0                               # the dimension sharded by rows (fully_shard's Shard(dim))

    @property
    def laid_shape(self) -> torch.Size:
        """The shape the flat layout holds: `dim` first (see [Note: sharding another dimension])."""
        if self.dim == 0:
            return self.shape
        return torch.Size([self.shape[self.dim], *self.shape[:self.dim], *self.shape[self.dim + 1:]])


class FlatGroup:
    def __init__(self, params: list[tuple[str, nn.Parameter, list[tuple[nn.Module, str]]]],
                 collectives: Collectives, gather_dtype: torch.dtype, reduce_dtype: torch.dtype,
                 node_group: Optional[dist.ProcessGroup] = None, place: Optional[ShardPlace] = None,
                 tensor_parallel: Optional[list[Optional[TensorParallelSpec]]] = None,
                 dtensor_params: bool = False, experts: Optional[ExpertGroups] = None, *,
                 link: OptimizerLink, stage_leaves: bool = False, shard_dims: Optional[list[int]] = None) -> None:
        self.collectives = collectives
        # Expert parallelism: the parameters hold this rank's experts, and their DTensors,
        # shapes and whole values are every expert's; see [Note: expert parameters in state dicts].
        self.experts = experts
        # The modules hold DTensor parameters of the full shapes (`fully_shard`, FSDP2's form)
        # instead of the module's own Parameter objects as views; see [Note: DTensor parameters].
        self.dtensor_params = dtensor_params
        # Each parameter's split over a tp mesh (None: not split); see [Note: tensor-parallel
        # parameters in flat shards].
        self.tensor_parallel = tensor_parallel if tensor_parallel is not None else [None] * len(params)
        self._any_tensor_parallel = any(tp is not None for tp in self.tensor_parallel)
        # See [Note: the parameters hold the gathered values during forward].
        self.params_between_forwards = not (dtensor_params or stage_leaves or self._any_tensor_parallel)
        # A pipeline stage's gathered parameters as one leaf per parameter; see [Note: a
        # pipeline stage's parameters as leaves].
        self.stage_leaves = stage_leaves
        # Where the master and gradient shards live: on the device, or offloaded to the host
        # (overlap.runtime.host_tier).
        self.place = place if place is not None else ShardPlace()
        # hpZ: backward re-gathers from a copy kept inside the node (None: from the shards).
        self.node_copy = None if node_group is None else NodeCopy(collectives, node_group)
        self.kernels = collectives.kernels
        self.master_dtype = params[0][1].dtype
        self.requires_grad = params[0][1].requires_grad
        self.gather_dtype = gather_dtype
        self.reduce_dtype = reduce_dtype
        self._lay_out(params, shard_dims or [0] * len(params))
        on_meta = any(p.is_meta for _, p, _ in params)
        self.shard = self.place.place_master(self._first_shard(params, on_meta))
        self._bind_parameters(params, on_meta)
        self._start_gradients()
        self._make_gathered_buffer()
        self.place.adopt(self)
        link.add_group(self)

    def _lay_out(self, params: list[tuple[str, nn.Parameter, list[tuple[nn.Module, str]]]],
                 shard_dims: list[int]) -> None:
        """The flat layout: where each parameter lives, and this rank's part of each."""
        rank = self.collectives.rank
        slots = [ParamSlot(name, owners, param.shape, 0, param.numel(), dim)
                 for (name, param, owners), dim in zip(params, shard_dims)]
        self._refuse_other_dims(slots)
        self.layout = FlatLayout.of([slot.laid_shape for slot in slots], self.collectives.world_size)
        self.slots = [dataclasses.replace(slot, offset=offset) for slot, offset in zip(slots, self.layout.offsets)]
        self._moved = any(slot.dim for slot in self.slots)
        self.numel = self.layout.numel
        self.shard_numel = self.layout.shard_numel
        self.padded_numel = self.layout.padded_numel
        self._split_sizes = self.layout.split_sizes
        self.parts = self.layout.parts_on(rank)
        self.local_shapes = [self.layout.local_shape(index, rank, slot.laid_shape)
                             for index, slot in enumerate(self.slots)]
        # Each parameter's DTensor spec by dtype (see `dtensor`).
        self._specs: dict[tuple[int, torch.dtype], Any] = {}
        # The (tp, dp) mesh of tensor-parallel parameters' state-dict DTensors, made when first asked for.
        self._tp_plane: Optional[tuple[Optional[DeviceMesh]]] = None
        # Each parameter's rows on every rank: its state-dict DTensor's placement
        # ([Note: row-aligned shards as a DTensor placement]).
        self.rows_by_rank = [tuple(self.layout.local_shape(index, other, slot.laid_shape)[0]
                                   for other in range(self.collectives.world_size))
                             for index, slot in enumerate(self.slots)]

    def _first_shard(self, params: list[tuple[str, nn.Parameter, list[tuple[nn.Module, str]]]],
                     on_meta: bool) -> torch.Tensor:
        """This rank's master shard of rank 0's initial values (zeros for a meta model, whose
        values come later, one module at a time: overlap.runtime.materialize)."""
        collectives, device = self.collectives, self.collectives.device
        if on_meta:
            return torch.zeros(self.shard_numel, dtype=self.master_dtype, device=device)
        # Rank 0's initial values are the truth on every rank, as with DDP.
        flat = torch.zeros(self.padded_numel, dtype=self.master_dtype, device=device)
        self.kernels.pack([self._laid_whole(index, p.detach().to(device)) for index, (_, p, _) in enumerate(params)],
                          flat, [s.offset for s in self.slots])
        if collectives.world_size > 1:
            dist.broadcast(flat, src=dist.get_global_rank(collectives.group, 0), group=collectives.group)
        start = collectives.rank * self.shard_numel
        shard = flat[start:start + self.shard_numel].clone()
        del flat
        replicate = collectives.replicate_group
        if replicate is not None:
            # Replicas of this shard take the first replica's (so, in the end, rank 0's) values.
            dist.broadcast(shard, src=dist.get_global_rank(replicate, 0), group=replicate)
        return shard

    def _bind_parameters(self, params: list[tuple[str, nn.Parameter, list[tuple[nn.Module, str]]]],
                         on_meta: bool) -> None:
        """Make each module parameter (the same object: [Note: parameters keep their identity])
        this rank's part of it, a view of the shard. See [Note: original parameters are views
        of the flat shard]."""
        self.params = []
        for index, (name, param, _) in enumerate(params):
            before = param.detach() if on_meta and not param.is_meta else None
            if self.dtensor_params:
                self.params.append(self._shard_view(self.shard, index))
            else:
                self.params.append(rebind(param, self._shard_view(self.shard, index), name))
            if before is not None:
                # A meta model's parameter that already had values: its part goes in now.
                self.write_part(index, before)
        # What the modules hold: the parameters themselves, or DTensors over them.
        self.module_params = self.params if not self.dtensor_params else [
            nn.Parameter(self.dtensor(view, index), requires_grad=param.requires_grad)
            for index, (view, (_, param, _)) in enumerate(zip(self.params, params))]
        for slot, param in zip(self.slots, self.module_params):
            for module, attr in slot.owners:
                module._parameters[attr] = param
        # See [Note: a gradient that reaches a parameter directly]. Names seen since the last
        # backward that synced; hooks go on as parameters start to train.
        self.direct_grads: list[str] = []
        # DTensor parameters: gradients that reached them after their reduction began, by index.
        self._late_direct: dict[int, torch.Tensor] = {}
        self._direct_hooks = [False] * len(self.slots)
        self._hook_direct_grads()

    def _hook_direct_grads(self) -> None:
        if self.dtensor_params:
            # See [Note: a gradient that reaches a DTensor parameter directly].
            arrived = _weakly(self._direct_grad_arrived)
            for index, param in enumerate(self.module_params):
                if param.requires_grad and not self._direct_hooks[index]:
                    param.register_hook(lambda grad, index=index: arrived(index, grad))
                    self._direct_hooks[index] = True
            return
        note = _weakly(self._note_direct_grad)
        for index, param in enumerate(self.module_params):
            if param.requires_grad and not self._direct_hooks[index]:
                param.register_hook(lambda grad, name=self.slots[index].name: note(name, grad))
                self._direct_hooks[index] = True

    def _note_direct_grad(self, name: str, grad: torch.Tensor) -> None:
        self.direct_grads.append(name)

    def _direct_grad_arrived(self, index: int, grad: torch.Tensor) -> Optional[torch.Tensor]:
        """A gradient reaches DTensor parameter `index` itself, to be accumulated into its
        `.grad`. Before this backward's reduction began (which reads `.grad` as the sum so
        far) it is counted so; after, it is kept, and added when the reduced gradient is
        published, and autograd accumulates zeros instead (into the published `.grad` it may
        add in place, into the flat gradient shard the reduction adds into)."""
        if not self.reduced:
            return None
        local = grad.to_local() if isinstance(grad, DTensor) else grad
        held = self._late_direct.get(index)
        self._late_direct[index] = local.clone() if held is None else held.add_(local)
        return torch.zeros_like(grad)

    def _start_gradients(self) -> None:
        # Sum of the reduced gradients; each parameter's `.grad` is a view of it.
        self.grad_shard: Optional[torch.Tensor] = None
        self._grad_views: list[torch.Tensor] = []
        self._grad_dtensors: list[DTensor] = []
        # The gradient hook, until `full` requires a gradient and it is registered there.
        self._on_grad: Optional[Callable[[torch.Tensor], None]] = None
        self._views_installed = False          # on the modules since the last `remove_views`
        self._views_record_grads = False       # the views made last are connected to `full` where they train
        self._views: list[torch.Tensor] = []   # the views made last, in this pass
        # The parameters' own data while they show the gathered values (None when they hold
        # their rows). See [Note: the parameters hold the gathered values during forward].
        self._rows: Optional[list[torch.Tensor]] = None
        # Which parameters received a gradient in this rank's backward passes since the last
        # published gradients; only those (on any rank) get a `.grad`.
        self.got_grad = [False] * len(self.slots)
        # The hook on each forward's split node that fills `got_grad`, made once (a weak
        # method per forward costs about a microsecond per group).
        self._mark_grads_hook = _weakly(self._mark_grads)
        self.reduced = False
        # Gradients summed locally while reduction is paused (no_sync), in the reduce dtype.
        self.unsynced_grad: Optional[torch.Tensor] = None

    def _make_gathered_buffer(self) -> None:
        collectives = self.collectives
        # The gathered parameters: a leaf so autograd accumulates all views' gradients here.
        self.full = torch.empty(self.padded_numel, dtype=self.gather_dtype, device=collectives.device)
        # See [Note: one rank computing in the master dtype].
        self.resident = (collectives.world_size == 1 and collectives.local_when_alone
                         and collectives.replicate_group is None and self.node_copy is None
                         and collectives.codec is None and self.gather_dtype == self.master_dtype
                         and not self.place.offloaded)
        if self.resident:
            self.full.set_(self.shard.untyped_storage(), self.shard.storage_offset(), (self.padded_numel,))
        self.full.requires_grad_(self.requires_grad and not self.stage_leaves)
        self._full_nbytes = self.padded_numel * self.full.element_size()
        # See [Note: a pipeline stage's parameters as leaves]; made while `full` has its storage.
        self._leaves = [] if not self.stage_leaves else [
            nn.Parameter(tp.wrap(piece.view(slot.shape)) if tp is not None else
                         piece.view(slot.laid_shape).movedim(0, slot.dim) if slot.dim else piece.view(slot.shape),
                         requires_grad=param.requires_grad)
            for piece, slot, param, tp in zip(self.full.detach().split_with_sizes(self._split_sizes)[::2], self.slots,
                                              self.module_params, self.tensor_parallel)]
        self._leaves_pending = 0               # trainable leaves this backward has yet to bring
        self.free()
        self._param_views = ParamViews(self._split_sizes, [slot.laid_shape for slot in self.slots])

    def _shard_view(self, flat_shard: torch.Tensor, index: int) -> torch.Tensor:
        """This rank's part of parameter `index` in `flat_shard` (the master shard, or its
        gradient), shaped (local_rows, *trailing_dims)."""
        start, end = self.parts[index]
        offset = self.slots[index].offset + start - self.collectives.rank * self.shard_numel
        return flat_shard.narrow(0, min(max(offset, 0), self.shard_numel), end - start).view(self.local_shapes[index])

    @property
    def gathered_nbytes(self) -> int:
        return self._full_nbytes

    @property
    def is_allocated(self) -> bool:
        return self.full.untyped_storage().size() > 0

    def start_gather(self, unit_name: str) -> Pending:
        """Allocate `full` and launch the all-gather into it. Writes into `full` keep its
        version (see [Note: freeing `full` by resizing its storage])."""
        if self.resident:
            return COMPLETED
        full = self.full
        version = full._version
        storage = full.untyped_storage()
        if storage.size() == 0:
            storage.resize_(self._full_nbytes)
        if self.node_copy is not None and self.node_copy.secondary is not None:
            pending = self.node_copy.gather(full.detach(), self.shard, unit_name)   # from the node copy
        else:
            codec = self.collectives.codec
            source = self.place.gather_source(self.shard, self.gather_dtype,
                                              encoded=codec is not None and codec.gathers(full),
                                              local=self.node_copy is None and self.collectives.gathers_locally(full))
            gather = self.collectives.all_gather if self.node_copy is None else self.node_copy.gather
            pending = gather(full.detach(), source, unit_name)
        torch._C._autograd._unsafe_set_version_counter((full,), (version,))
        return pending

    def free(self) -> None:
        """Release the gathered parameters. See [Note: freeing `full` by resizing its storage].
        With DTensor parameters the modules' attributes fall back to them (FSDP2's sharded
        state); otherwise they stay what they are: after a unit's forward the registered
        parameters ([Note: the parameters hold the gathered values during forward]), within
        backward views of freed storage until the next gather (a use outside the hooks fails
        loudly instead of computing with this rank's rows)."""
        if self._rows is not None:
            self.hide_gathered()
        if not self.resident:
            self.full.untyped_storage().resize_(0)
        if self.dtensor_params and not self.stage_leaves:
            self._register_params()
            self._views_installed = False        # nothing left for the end of the pass to take off

    def _register_params(self) -> None:
        """The modules' attributes and registered parameters are the parameters again."""
        for slot, param in zip(self.slots, self.module_params):
            for module, attr in slot.owners:
                if attr in module.__dict__:
                    del module.__dict__[attr]          # a statement, not a call per parameter
                module._parameters[attr] = param

    def install_views(self) -> None:
        """Point every owner module's attribute at its parameter's view of `full`.

        One `split` makes all views: its backward writes every gradient into one flat tensor
        in a single pass, where a `narrow` per parameter would materialise a zero-filled
        full-size gradient per parameter and sum them. One hook on the split's node records
        which parameters a backward pass reached: it is handed every view's gradient, None
        for those no gradient reached (the split fills theirs with zeros).

        The views are made at every install, not once: autograd runs ready nodes newest first,
        so a split node kept from an earlier step would run after the whole of this step's
        backward, holding back every gradient hook (and so every reduction and free) to the end.
        """
        if self.stage_leaves:
            self._views, self._views_record_grads = self._leaves, True
            self._put_views()
            return
        split, views = self._param_views(self.full)
        if self._moved:
            views = [view.movedim(0, slot.dim) if slot.dim else view for view, slot in zip(views, self.slots)]
        if split is not None:
            split.register_prehook(self._mark_grads_hook)
        self._views_record_grads = split is not None or not self.requires_grad
        self._views = views if not self._any_tensor_parallel else \
            [view if tp is None else tp.wrap(view) for view, tp in zip(views, self.tensor_parallel)]
        self._put_views()

    def _put_views(self) -> None:
        self._views_installed = True
        for slot, view in zip(self.slots, self._views):
            for module, attr in slot.owners:
                module.__dict__[attr] = view
                if self.dtensor_params or self.stage_leaves:
                    # FSDP2's unsharded state: while gathered, the gathered values are the
                    # module's registered parameters too (what `named_parameters()` yields to a
                    # pre-hook); freeing registers the DTensors again.
                    module._parameters[attr] = view

    def show_gathered(self) -> None:
        """The parameters hold their gathered values (the views last put on the modules) until
        `hide_gathered`; for groups with `params_between_forwards` that are not resident (the
        unit asks only those). See [Note: the parameters hold the gathered values during forward]."""
        if self._rows is not None or not self._views:
            return
        self._rows = [param.data for param in self.params]
        for param, view in zip(self.params, self._views):
            param.data = view

    def hide_gathered(self) -> None:
        """The parameters hold this rank's rows again."""
        if self._rows is None:
            return
        for param, rows in zip(self.params, self._rows):
            param.data = rows
        self._rows = None

    def leave_forward(self) -> None:
        """The unit's forward ended: the modules hold the registered parameters, this rank's
        rows, until the views are put back for its backward or its next forward."""
        if self.params_between_forwards and self._views_installed:
            if self._rows is not None:
                self.hide_gathered()
            self._register_params()
            self._views_installed = False

    @property
    def views_installed(self) -> bool:
        """Whether the modules' attributes are views of `full` (not the registered parameters)."""
        return self._views_installed

    @property
    def views_current(self) -> bool:
        """Whether the modules still hold the views this pass's forward made, connected to
        `full` (nothing freed the group since): a restore would put the same views back."""
        return self._views_installed and self._views_record_grads and bool(self._views)

    def restore_views(self) -> None:
        """Before the group's backward: its views on the modules again, for a recompute that
        reads the attributes without a forward hook of its own (a wrapper's inner module). A
        resident group's buffer was never released, so the views its forward made, which
        autograd recorded, go back as they are; others are made again from `full`."""
        if self.resident and self._views_record_grads and self._views:
            self._put_views()
        else:
            self.install_views()

    def remove_views(self) -> None:
        """At the end of a pass: the modules' attributes are their registered parameters again
        (`module.weight.requires_grad_(False)` between steps reaches the parameter, as under
        FSDP2), not views of released memory. Within a pass the views stay after a free:
        backward re-gathers into the same memory, and a function recomputed by reentrant
        checkpointing reads the attributes without a forward hook to install them."""
        if self.stage_leaves:
            return                             # until the step's gradients are reduced: `release_leaves`
        if self._rows is not None:
            self.hide_gathered()
        self._views = []                       # their graph ends with the pass
        if self._views_installed and (self.dtensor_params or self.params_between_forwards or not self.resident):
            self._register_params()
            self._views_installed = False

    def release_leaves(self) -> None:
        """The step's gradients are reduced: the modules hold their registered parameters again."""
        if self.stage_leaves and self._views_installed:
            self._views = []
            self._register_params()
            self._views_installed = False

    def refresh_requires_grad(self) -> bool:
        """Whether any of the group's parameters trains now (read at each pass, so that
        `requires_grad_()` after wrapping counts); the gathered buffer follows it."""
        wanted = any([param.requires_grad for param in self.module_params])     # a list: no call per parameter
        if wanted and not all(self._direct_hooks):
            self._hook_direct_grads()
        if self.stage_leaves:
            for leaf, param in zip(self._leaves, self.module_params):
                leaf.requires_grad_(param.requires_grad)
        elif wanted != self.full.requires_grad:
            self.full.requires_grad_(wanted)
            if wanted and self._on_grad is not None:
                self.full.register_post_accumulate_grad_hook(self._on_grad)
                self._on_grad = None
        self.requires_grad = wanted
        return wanted

    def _mark_grads(self, grads: tuple[Optional[torch.Tensor], ...]) -> None:
        got = self.got_grad
        for index, piece in enumerate(self._param_views.param_pieces):    # not the padding's
            if grads[piece] is not None:
                got[index] = True

    def register_grad_hook(self, hook: Callable[["FlatGroup", Optional[torch.Tensor]], None]) -> None:
        """Call `hook(group, grad)` once the gradient of `full` is complete in a backward pass
        (registered on `full` once it requires a gradient: a frozen group may train later).
        A stage's leaves: `hook(group, None)` once every trainable leaf has accumulated its
        gradient in this backward (counted from `expect_leaf_grads`), which stays on the leaves."""
        self._grad_hook = hook
        self._on_grad = None
        if self.stage_leaves:
            arrived = _weakly(self._leaf_arrived)
            for leaf in self._leaves:
                leaf.register_post_accumulate_grad_hook(arrived)
            return
        self._on_grad = _weakly(self._take_grad)
        if self.full.requires_grad:
            self.full.register_post_accumulate_grad_hook(self._on_grad)
            self._on_grad = None

    def expect_leaf_grads(self) -> None:
        """A backward begins: count the trainable leaves whose gradients it will bring."""
        self._leaves_pending = sum([leaf.requires_grad for leaf in self._leaves])

    def _leaf_arrived(self, leaf: torch.Tensor) -> None:
        self._leaves_pending -= 1
        if self._leaves_pending == 0:
            self._grad_hook(self, None)

    def _take_grad(self, full: torch.Tensor) -> None:
        grad, full.grad = full.grad, None
        self._grad_hook(self, grad)

    def take_leaf_grads(self) -> Optional[torch.Tensor]:
        """A pipeline stage's gradients left on its leaves since the last call, in the flat
        layout (None if no leaf has one); the leaves' `.grad` are cleared. See [Note: a
        pipeline stage's parameters as leaves]."""
        got = [(index, leaf.grad) for index, leaf in enumerate(self._leaves) if leaf.grad is not None]
        if not got:
            return None
        # A tensor-parallel leaf's gradient in the parameter's own placements, then this rank's
        # part: what from_local's backward gives the flat views.
        got = [(index, grad if not isinstance(grad, DTensor) else
                grad.redistribute(placements=self.tensor_parallel[index].placements).to_local())
               for index, grad in got]
        flat = torch.zeros(self.padded_numel, dtype=got[0][1].dtype, device=self.full.device)
        self.kernels.pack([self._laid_whole(index, grad) for index, grad in got], flat,
                          [self.slots[index].offset for index, _ in got])
        for index, _ in got:
            self.got_grad[index] = True
            self._leaves[index].grad = None
        return flat

    def hold_unsynced(self, grad: torch.Tensor) -> None:
        """Sum `grad` into the local accumulator used while reduction is paused."""
        if self.unsynced_grad is None:
            self.unsynced_grad = grad.to(self.reduce_dtype)  # `grad` is the runtime's own buffer
        else:
            self.unsynced_grad.add_(grad)

    def take_grad_for_reduce(self, grad: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
        """This step's gradient plus any held back by no_sync, or None if there is neither."""
        held, self.unsynced_grad = self.unsynced_grad, None
        if held is None:
            return grad
        if grad is not None:
            held.add_(grad)
        return held

    def grad_for_reduce(self) -> torch.Tensor:
        """The flat shard gradient a reduction adds into, holding what the parameters' `.grad`
        hold now: zero where `.grad` is None (cleared by `zero_grad()`), so that reduced
        gradients accumulate across backward passes exactly as `.grad` does. Offloaded, a
        device buffer holding the same (see overlap.runtime.host_tier)."""
        zeros = False
        if self.grad_shard is None:
            self.grad_shard = self.place.zeros_like(self.shard)
            # See [Note: norms of sharded gradients].
            self._grad_views = [shard_grad(self._shard_view(self.grad_shard, index),
                                           self.collectives.norm_collectives if tp is None or tp.norm_group is None
                                           else tp.norm_group)
                                for index, tp in enumerate(self.tensor_parallel)]
            if self.dtensor_params:
                self._grad_dtensors = [self.dtensor(plain(view), index) for index, view in enumerate(self._grad_views)]
        if not self.reduced:
            grads = [param.grad for param in self.module_params]
            if grads.count(None) == len(grads):             # after zero_grad(): one fill
                zeros = True
            else:
                for index, (grad, view, published) in enumerate(zip(grads, self._grad_views, self._published())):
                    if grad is None:
                        view.zero_()
                    elif grad is not published:                     # one the user assigned
                        view.copy_(self.laid(index, grad.to_local()) if isinstance(grad, DTensor) else grad)
        self.reduced = True
        return self.place.reduce_target(self.grad_shard, zeros)

    def publish_grads(self, got_grad: list[bool]) -> None:
        """After this group's reductions completed: give `.grad` to every parameter that got a
        gradient on some rank; the others keep theirs (None after `zero_grad()`)."""
        self.place.grads_ready()
        if self.reduced:
            for index, late in self._late_direct.items():
                self._grad_views[index].add_(self.laid(index, late).view_as(self._grad_views[index]))
                got_grad[index] = True
            for param, grad, used in zip(self.module_params, self._published(), got_grad):
                # A parameter frozen after wrapping is reduced with its group, but gets no `.grad`.
                if param.requires_grad and (used or param.grad is not None):
                    param.grad = grad
            if any([param._post_accumulate_grad_hooks for param in self.module_params]):   # no call per parameter
                self._run_accumulate_hooks(got_grad)
        self.end_reduction()

    def end_reduction(self) -> None:
        """This backward's reduction is over (published, or dropped unpublished): the next one
        starts from the parameters' `.grad`; what reached the parameters directly is forgotten."""
        self.reduced = False
        self.got_grad = [False] * len(self.slots)
        self.direct_grads.clear()
        self._late_direct.clear()

    def _run_accumulate_hooks(self, got_grad: list[bool]) -> None:
        """See [Note: post-accumulate-grad hooks of sharded parameters]: the hooks of each
        parameter that trains and got a gradient in this backward, on any rank."""
        for param, used in zip(self.module_params, got_grad):
            hooks = param._post_accumulate_grad_hooks
            if used and hooks and param.requires_grad:
                for hook in list(hooks.values()):
                    hook(param)

    def _published(self) -> list[torch.Tensor]:
        """The `.grad` each parameter gets: its view of the flat gradient shard, or a DTensor over it."""
        return self._grad_dtensors if self.dtensor_params else self._grad_views

    def dtensor(self, part: torch.Tensor, index: int) -> DTensor:
        """`part` (shaped like this rank's part of parameter `index`: the parameter itself, or
        optimizer state of the same shape) as a DTensor of the parameter's full shape."""
        slot = self.slots[index]
        mesh = shard_mesh(self.collectives.group, self.collectives.device.type)
        tp = self.tensor_parallel[index]
        if tp is None:
            # One spec per parameter and dtype, shared by the parameter, its gradient and its
            # optimizer state: operators on them find their layouts equal by identity.
            key = (index, part.dtype)
            spec = self._specs.get(key)
            if slot.dim:                          # see [Note: sharding another dimension]
                local = self.oriented(index, part.detach())
                if spec is None:
                    rows = self.rows_by_rank[index]
                    spec = self._specs[key] = (
                        row_dtensor(local, mesh, [RowShard(slot.dim, rows)], slot.shape) if self.experts is None else
                        expert_dtensor(local, slot.shape, rows, self.experts, mesh.device_type, slot.dim))._spec
                return RowDTensor(local, spec, requires_grad=False)
            if spec is None:
                spec = self._specs[key] = (
                    as_dtensor(part, slot.shape, self.rows_by_rank[index], mesh) if self.experts is None else
                    expert_dtensor(part, slot.shape, self.rows_by_rank[index], self.experts, mesh.device_type))._spec
            return RowDTensor(part.detach().view(-1, *spec.shape[1:]), spec, requires_grad=False)
        if self._tp_plane is None:
            self._tp_plane = (tp_dp_mesh(tp.root, tp.mesh, self.collectives.group, self.collectives.device.type),)
        plane = self._tp_plane[0]
        if plane is not None:
            # Split over tp first, then rows of the TP-local tensor over the sharding group.
            local = part.detach().view(-1, *slot.shape[1:])
            return row_dtensor(local, plane, (*tp.placements, RowShard(0, self.rows_by_rank[index])), tp.shape,
                               tp.stride)
        first_row = self.layout.first_row(index, self.collectives.rank, slot.shape)
        # This rank's rows of its TP-local tensor, where that tensor lies in the global one; an
        # empty block past the end, as torch.chunk's are: DCP keeps one block per offset, and an
        # empty one at a real block's offset could be the one it keeps.
        offset = (tp.offset[0] + first_row, *tp.offset[1:]) if tp.offset else (first_row,)
        if self.rows_by_rank[index][self.collectives.rank] == 0:
            offset = (tp.shape[0], *offset[1:])
        return as_block_dtensor(part, tp.shape, list(slot.shape)[1:], offset, mesh)

    def global_shape(self, index: int) -> torch.Size:
        """Parameter `index`'s whole shape: its slot's, its global one if split over tp, or
        every expert's under expert parallelism."""
        tp = self.tensor_parallel[index]
        if self.experts is not None:
            return experts_shape(self.slots[index].shape, self.experts)
        return self.slots[index].shape if tp is None else tp.shape

    def _refuse_tensor_parallel(self, what: str) -> None:
        split = [slot.name for slot, tp in zip(self.slots, self.tensor_parallel) if tp is not None]
        if split:
            raise NotImplementedError(
                f"{what} of tensor-parallel parameters ({split[0]!r}): the flat group holds their TP-local parts; "
                "use state_dict() / overlap.checkpoint (torch.distributed.checkpoint), whose DTensors have the "
                "global shapes")

    def local_of_full(self, index: int, value: torch.Tensor) -> torch.Tensor:
        """This rank's part of a tensor of parameter `index`'s slot shape (its whole value, or
        optimizer state of that shape; split over tp, its whole TP-local tensor), shaped as the
        parameter's part."""
        start, end = self.parts[index]
        return self._laid_whole(index, value.detach()).reshape(-1)[start:end].view(self.local_shapes[index])

    def local_of_global(self, index: int, value: torch.Tensor) -> torch.Tensor:
        """`local_of_full` of a tensor of `global_shape(index)`."""
        return self.local_of_full(index, self.slot_whole(index, value))

    def slot_whole(self, index: int, value: torch.Tensor) -> torch.Tensor:
        """What of a tensor of `global_shape(index)` the slot holds whole: under expert
        parallelism this rank's experts' rows, split over tp this rank's TP-local block."""
        if self.experts is not None:
            return my_experts(value, self.experts, self.slots[index].name)
        tp = self.tensor_parallel[index]
        return value if tp is None else tp.local_block(value, self.slots[index].shape)

    def write_part(self, index: int, value: torch.Tensor) -> None:
        """Set this rank's part of parameter `index` from its full value (any device)."""
        with torch.no_grad():
            part = self.local_of_full(index, value).reshape(-1)
            self.params[index].view(-1).copy_(part)
            self.place.part_written(self, index, part)

    def full_values(self) -> torch.Tensor:
        """All-gather the master shards (no cast) into a new flat tensor: for state dicts."""
        self._refuse_tensor_parallel("full values")
        out = torch.empty(self.padded_numel, dtype=self.master_dtype, device=self.collectives.device)
        all_gather_flat(out, self.place.on_device(self.shard), group=self.collectives.group)
        return out

    def gather_parts(self, parts: list[torch.Tensor], indices: list[int]) -> list[torch.Tensor]:
        """Whole tensors from every rank's `parts` (each shaped like this rank's part of
        parameter `indices[i]`, all of one dtype), each of `global_shape`: one all-gather in the
        flat layout, then under expert parallelism one over the expert-parallel group per tensor
        (every expert), or split over tp one over tp per such tensor."""
        shard = torch.zeros(self.shard_numel, dtype=parts[0].dtype, device=self.collectives.device)
        for part, index in zip(parts, indices):
            self._shard_view(shard, index).copy_(part)
        flat = torch.empty(self.padded_numel, dtype=shard.dtype, device=shard.device)
        all_gather_flat(flat, shard, group=self.collectives.group)
        wholes = [self.whole_of_flat(flat, index) for index in indices]
        if self.experts is not None:
            return [all_experts(whole, self.experts) for whole in wholes]
        # Split over tp: the TP-local wholes gathered over tp too (a collective per parameter).
        return [whole if self.tensor_parallel[index] is None else
                self.tensor_parallel[index].wrap(whole.contiguous()).full_tensor()
                for whole, index in zip(wholes, indices)]

    def load_full(self, tensors: list[torch.Tensor]) -> None:
        """Set this rank's shard from each parameter's `slot_whole` value, given in slot order
        (every rank has them)."""
        flat = torch.zeros(self.padded_numel, dtype=self.master_dtype, device=self.collectives.device)
        self.kernels.pack([self._laid_whole(index, t.detach().to(flat.device)) for index, t in enumerate(tensors)],
                          flat, [s.offset for s in self.slots])
        start = self.collectives.rank * self.shard_numel
        self.shard.copy_(flat[start:start + self.shard_numel])

    # [Note: sharding another dimension]
    # FSDP2's `shard_placement_fn` may shard a parameter on a dimension other than its first
    # (`Shard(1)` for experts stacked on dimension 0, the largest dimension for an optimizer
    # that wants whole rows of it). The flat layout holds such a parameter with that dimension
    # moved to the front (its slot's `laid_shape`), so that each rank's block of whole rows is
    # a block of whole slices along the sharded dimension and everything that works on the flat
    # buffers (gathers, reductions, offload, codecs) is unchanged. Only the edges turn it back:
    # the gathered views the modules compute with are `movedim` views of the gathered buffer
    # (not contiguous; no copy, so freeing the buffer frees them as it frees any view), the
    # DTensor of a part is `RowShard(dim, rows)` over a `movedim` view of the part, and whole
    # values go in and come out in the parameter's own shape.

    def _refuse_other_dims(self, slots: list[ParamSlot]) -> None:
        moved = next((slot for slot in slots if slot.dim), None)
        if moved is None:
            return
        what = ("tensor parallelism" if any(tp is not None for tp in self.tensor_parallel) else
                "ShardedModule (fully_shard's DTensor parameters only)" if not self.dtensor_params else None)
        if what is not None:
            raise NotImplementedError(f"{moved.name!r}: sharding dimension {moved.dim} (shard_placement_fn) with "
                                      f"{what} is not supported; shard it on dimension 0 there")

    def _laid_whole(self, index: int, value: torch.Tensor) -> torch.Tensor:
        """A whole value of parameter `index` in its slot's `laid_shape` (contiguous)."""
        dim = self.slots[index].dim
        return value if dim == 0 else value.movedim(dim, 0).contiguous()

    def whole_of_flat(self, flat: torch.Tensor, index: int) -> torch.Tensor:
        """Parameter `index`'s whole value in a full flat tensor (the gathered layout), in its shape."""
        slot = self.slots[index]
        whole = flat[slot.offset:slot.offset + slot.numel].view(slot.laid_shape)
        return whole if slot.dim == 0 else whole.movedim(0, slot.dim)

    def laid(self, index: int, local: torch.Tensor) -> torch.Tensor:
        """A DTensor's local block of parameter `index` (or of state shaped like it) in the order
        the flat shard lays this rank's part out: itself where the parameter is sharded on
        dimension 0."""
        dim = self.slots[index].dim
        return local if dim == 0 else local.movedim(dim, 0)

    def oriented(self, index: int, part: torch.Tensor) -> torch.Tensor:
        """This rank's part of parameter `index` as its DTensor's local block (the inverse of `laid`)."""
        dim = self.slots[index].dim
        return part if dim == 0 else part.view(self.local_shapes[index]).movedim(0, dim)
