"""This rank's rows of a tensor as a DTensor of the tensor's full shape: the form FSDP2's
state dicts take, and the one torch's state-dict API, `torch.distributed.checkpoint` (DCP)
and DTensor's own collectives (`full_tensor()`, `redistribute`) understand.

[Note: row-aligned shards as a DTensor placement]
A rank keeps a block of whole rows of each parameter, from its first row on (see [Note:
row-aligned shards]): how many rows each rank holds follows the flat layout, not
`torch.chunk`, so DTensor's `Shard(0)` (even chunks) does not describe it. `RowShard(dim,
rows)` is a `Shard` that carries every rank's row count along the mesh dimension, and
answers DTensor's placement calls by them: where each rank's block starts (what DCP writes
each block under, so every rank's block has its own offset and an empty one sits past the
end, as torch.chunk's empty chunks do), the gather to `Replicate` (padded to the largest
block, then the real rows kept), and the split from `Replicate`. The local tensor is a view
of the rank's rows in the flat shard, so loading into the DTensor writes the shard in place.

DTensor's operators build their results' placements anew (`Shard(0)` where the input was
`RowShard(0, ...)`), which would describe an elementwise result's rows wrongly. `RowDTensor`
is the DTensor subclass that keeps them: after each operator it gives every result sharded
on a dimension the rows of the input it came from (scaled where the operator merged
trailing dimensions into that one, as a flatten does), and refuses a result whose rows it
cannot tell. Forward and backward never see these objects: the modules compute with plain
views of the gathered buffers. They are the form of state dicts and, under `fully_shard`, of
the registered parameters, their gradients and their optimizer state, which optimizers step
on the local rows ([Note: elementwise operators on one spec]).
"""
from __future__ import annotations

import math
from functools import lru_cache
from typing import Any, Optional, Sequence

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard
from torch.distributed.tensor._dtensor_spec import DTensorSpec, TensorMeta
from torch.distributed.tensor._shards_wrapper import LocalShardsWrapper
from torch.distributed.tensor.placement_types import Placement
from torch.utils._pytree import tree_flatten, tree_map, tree_unflatten


@lru_cache(maxsize=None)
def shard_mesh(group: dist.ProcessGroup, device_type: str) -> DeviceMesh:
    """The 1-D mesh over a sharding group (one per group, made once)."""
    return DeviceMesh.from_group(group, device_type)


def tp_dp_mesh(root: DeviceMesh, tp_mesh: DeviceMesh, group: dist.ProcessGroup,
               device_type: str) -> Optional[DeviceMesh]:
    """The 2-D mesh (tp, dp) over this rank's tp ranks and its sharding group, in that order
    (tensor parallelism splits a parameter first, the sharding group then takes rows of each
    rank's TP-local tensor), made from the two groups as they are; None where `root` (the mesh
    both were sliced from) has no dimension over the sharding group's ranks. Local: no group is made. (Not
    cached by its arguments: DeviceMesh compares equal by ranks and names, and two models'
    tp meshes can do so over different roots.)"""
    if root.mesh_dim_names is None or tp_mesh.mesh_dim_names is None:
        return None
    tp_dim = root.mesh_dim_names.index(tp_mesh.mesh_dim_names[0])
    ranks = dist.get_process_group_ranks(group)
    dp_dims = [dim for dim in range(root.ndim)
               if dim != tp_dim and dist.get_process_group_ranks(root.get_group(dim)) == ranks]
    if not dp_dims:
        return None
    coordinate = root.get_coordinate()
    index = tuple(slice(None) if dim in (tp_dim, dp_dims[0]) else coordinate[dim] for dim in range(root.ndim))
    plane = root.mesh[index]
    if dp_dims[0] < tp_dim:
        plane = plane.transpose(0, 1)
    return DeviceMesh.from_group([tp_mesh.get_group(), group], device_type, mesh=plane, mesh_dim_names=("tp", "dp"))


class RowShard(Shard):
    """`Shard(dim)` with each rank's number of rows along `dim` given (see the note)."""

    def __init__(self, dim: int, rows: Sequence[int]) -> None:
        super().__init__(dim)
        self.rows = tuple(int(r) for r in rows)
        self.starts = tuple(sum(self.rows[:rank]) for rank in range(len(self.rows)))

    # Equal only to a RowShard of the same rows: DTensor caches its sharding decisions and
    # redistribution plans by placement, and an entry made for even chunks must never serve
    # these rows (nor the reverse). `!=` against a plain `Shard(dim)` is False all the same:
    # DTensorSpec checks which mesh dimensions shard which tensor dimension with
    # `placement != Shard(dim)`, and that is all it asks of a shard there.
    def __eq__(self, other: object) -> bool:
        return isinstance(other, RowShard) and other.dim == self.dim and other.rows == self.rows

    def __ne__(self, other: object) -> bool:
        if type(other) is Shard:
            return other.dim != self.dim
        return not self.__eq__(other)

    def __hash__(self) -> int:
        return hash(self.dim)

    def __repr__(self) -> str:
        return f"RowShard(dim={self.dim}, rows={self.rows})"

    __str__ = __repr__

    def __reduce__(self) -> Any:
        return RowShard, (self.dim, self.rows)

    def _check_ranks(self, num_chunks: int) -> None:
        if num_chunks != len(self.rows):
            raise ValueError(f"{self!r} places rows on {len(self.rows)} ranks, the mesh dimension has {num_chunks}")

    def _local_shard_size_and_offset(self, curr_local_size: int, num_chunks: int, rank: Any) -> tuple[int, int]:
        self._check_ranks(num_chunks)
        return self.rows[rank], self.starts[rank] if self.rows[rank] else curr_local_size

    def local_shard_size_and_offset(self, curr_local_size: int, num_chunks: int,  # type: ignore[override]
                                    rank: Any) -> tuple[int, int]:
        return self._local_shard_size_and_offset(curr_local_size, num_chunks, rank)

    def _split_tensor(self, tensor: torch.Tensor, num_chunks: int, *, with_padding: bool = True,
                      contiguous: bool = True) -> tuple[list[torch.Tensor], list[int]]:
        self._check_ranks(num_chunks)
        widest = max(self.rows)
        pieces, pads = [], []
        for start, rows in zip(self.starts, self.rows):
            piece = tensor.narrow(self.dim, start, rows)
            pad = widest - rows if with_padding else 0
            if pad:
                piece = torch.cat([piece, piece.new_zeros(_with_size(piece.shape, self.dim, pad))], self.dim)
            pieces.append(piece.contiguous() if contiguous else piece)
            pads.append(pad)
        return pieces, pads

    def _select_split_tensor(self, tensor: torch.Tensor, num_chunks: int, index: Any, *, with_padding: bool = True,
                             contiguous: bool = True, clone: bool = True) -> torch.Tensor:
        pieces, _ = self._split_tensor(tensor, num_chunks, with_padding=with_padding, contiguous=False)
        piece = pieces[index]
        return piece.clone() if clone else piece.contiguous() if contiguous else piece

    def _shard_tensor(self, tensor: torch.Tensor, mesh: DeviceMesh, mesh_dim: int,
                      src_data_rank: Optional[int] = 0) -> torch.Tensor:
        rank = mesh.get_local_rank(mesh_dim)
        if src_data_rank is not None:
            tensor = tensor.contiguous()
            dist.broadcast(tensor, src=dist.get_global_rank(mesh.get_group(mesh_dim), src_data_rank),
                           group=mesh.get_group(mesh_dim))
        return tensor.narrow(self.dim, self.starts[rank], self.rows[rank]).clone()

    def _replicate_to_shard(self, local_tensor: torch.Tensor, mesh: DeviceMesh, mesh_dim: int,
                            shard_index: Any) -> torch.Tensor:
        return local_tensor.narrow(self.dim, self.starts[shard_index], self.rows[shard_index]).clone()

    def _to_replicate_tensor(self, local_tensor: torch.Tensor, mesh: DeviceMesh, mesh_dim: int,
                             current_logical_shape: Sequence[int]) -> torch.Tensor:
        self._check_ranks(mesh.size(mesh_dim))
        widest = max(self.rows)
        pad = widest - local_tensor.size(self.dim)
        if pad:
            local_tensor = torch.cat([local_tensor, local_tensor.new_zeros(_with_size(local_tensor.shape, self.dim,
                                                                                      pad))], self.dim)
        gathered = funcol.all_gather_single(local_tensor.contiguous(), gather_dim=self.dim, group=(mesh, mesh_dim))
        gathered = funcol.wait_tensor(gathered)
        if self._leading_blocks_whole():
            # Every rank but those holding the last rows holds the widest block: the rows lie in
            # order at the start of the gathered tensor, with padding only after them.
            return gathered.narrow(self.dim, 0, sum(self.rows)).contiguous()
        return torch.cat([gathered.narrow(self.dim, rank * widest, rows) for rank, rows in enumerate(self.rows)],
                         self.dim)

    def _leading_blocks_whole(self) -> bool:
        """Whether every rank before the last that holds rows holds the widest block."""
        holding = [rank for rank, rows in enumerate(self.rows) if rows]
        widest = max(self.rows)
        return not holding or all(self.rows[rank] == widest for rank in range(holding[-1]))

    def _reduce_shard_tensor(self, tensor: torch.Tensor, mesh: DeviceMesh, reduce_op: Any,
                             mesh_dim: int) -> torch.Tensor:
        total = funcol.wait_tensor(funcol.all_reduce(tensor.contiguous(), reduce_op, (mesh, mesh_dim)))
        return self._replicate_to_shard(total, mesh, mesh_dim, mesh.get_local_rank(mesh_dim))

    def _to_new_shard_dim(self, local_tensor: torch.Tensor, mesh: DeviceMesh, mesh_dim: int,
                          current_logical_shape: Sequence[int], new_shard_dim: int) -> torch.Tensor:
        whole = self._to_replicate_tensor(local_tensor, mesh, mesh_dim, current_logical_shape)
        return Shard(new_shard_dim)._replicate_to_shard(whole, mesh, mesh_dim, mesh.get_local_rank(mesh_dim))


def _with_size(shape: Sequence[int], dim: int, size: int) -> list[int]:
    out = list(shape)
    out[dim] = size
    return out


def _elementwise_ops() -> frozenset:
    """Operators that act element by element (DTensor's own lists of them, and the few it
    registers apart): on operands that share one layout, each rank's rows are the result's."""
    from torch.distributed.tensor._ops import _pointwise_ops

    aten = torch.ops.aten
    ops = set()
    for value in vars(_pointwise_ops).values():
        if isinstance(value, list) and value and all(isinstance(op, torch._ops.OpOverload) for op in value):
            ops.update(value)
    ops.update([aten.copy_.default, aten.zero_.default, aten.fill_.Scalar, aten.fill_.Tensor, aten._to_copy.default,
                aten.clone.default, aten.detach.default, aten.zeros_like.default, aten.ones_like.default,
                aten.empty_like.default, aten.full_like.default, aten.mul.Tensor, aten.mul_.Tensor, aten.mul.Scalar,
                aten.mul_.Scalar, aten.add.Tensor, aten.add_.Tensor, aten.sub.Tensor, aten.sub_.Tensor,
                aten.div.Tensor, aten.div_.Tensor])
    return frozenset(ops)


# In-place random fills: drawn whole on every rank, then each rank keeps its rows (see RowDTensor).
_RANDOM_FILLS = frozenset(getattr(torch.ops.aten, name).default for name in
                          ("uniform_", "normal_", "random_", "exponential_", "log_normal_", "cauchy_", "geometric_"))
_ELEMENTWISE = _elementwise_ops()


def _local_operand(value: Any, spec: DTensorSpec, replicated_rows: bool = False) -> Any:
    """`value` as the local operand of an elementwise operator whose result is laid out as
    `spec`: a DTensor of that layout gives its rows, a replicated one-element DTensor its value,
    and with `replicated_rows` a replicated DTensor of the same shape this rank's rows of it
    (DTensor would cut it into even chunks, which ragged rows are not: the gradient of a
    penalty on the parameters, `(p ** 2).sum()`, meets one); anything else that DTensor would
    have to move gives None."""
    if not isinstance(value, DTensor):
        # A plain tensor of more than one element would broadcast against the rows: DTensor's
        # dispatch refuses mixing it in, and so does this.
        return None if isinstance(value, torch.Tensor) and value.numel() > 1 else value
    if value._spec is spec:
        return value._local_tensor
    if value._spec.mesh == spec.mesh and tuple(value.shape) == tuple(spec.shape) and all(
            type(a) is type(b) and a == b for a, b in zip(value.placements, spec.placements)):
        return value._local_tensor
    if value.numel() == 1:
        # A one-element operand (a clip's coefficient): its value, summed first where it is
        # partial (every rank runs the same operator, so every rank takes part).
        return value._local_tensor if all(p.is_replicate() for p in value.placements) else value.full_tensor()
    if replicated_rows and len(spec.placements) == 1 and isinstance(spec.placements[0], RowShard) and \
            value._spec.mesh == spec.mesh and tuple(value.shape) == tuple(spec.shape) and \
            all(p.is_replicate() for p in value.placements):
        rows, rank = spec.placements[0], spec.mesh.get_local_rank()
        return value._local_tensor.narrow(rows.dim, rows.starts[rank], rows.rows[rank])
    return None


class RowDTensor(DTensor):
    """A DTensor whose results keep their rows' placement (see the note).

    Elementwise operators on operands of one layout (an optimizer's step, a clip's scaling,
    `.to(dtype)`) run on the local rows directly: DTensor's own dispatch would find the same
    answer, at a higher host cost, and refuses in-place ones on a placement it does not know.
    An in-place random fill (`nn.init`'s) draws the whole tensor on every rank and keeps this
    rank's rows, so a model initialised after sharding gets one process's values from the
    same seed (every rank draws the same numbers, as every rank seeded alike)."""

    @classmethod
    def __torch_dispatch__(cls, func: Any, types: Any, args: tuple = (), kwargs: Optional[dict] = None) -> Any:
        kwargs = kwargs or {}
        done = _on_one_spec(func, args, kwargs)
        if done is not _ELSEWHERE:
            return done
        if func in _RANDOM_FILLS and isinstance(args[0], RowDTensor):
            return _random_fill(func, args, kwargs)
        if func is torch.ops.aten._amp_foreach_non_finite_check_and_unscale_.default:
            return _global_non_finite_check(args)
        for ops, local_path in _LOCAL_PATHS:
            if func in ops:
                done = local_path(func, args, kwargs)
                if done is not _ELSEWHERE:
                    return done
        source = next((value for value in tree_flatten((args, kwargs))[0] if isinstance(value, RowDTensor)), None)
        out = super().__torch_dispatch__(func, types, args, kwargs)
        if source is None:
            return out
        return tree_map(lambda value: _keep_rows(value, source, func), out)

    def redistribute(self, device_mesh: Optional[DeviceMesh] = None, placements: Optional[Sequence[Placement]] = None,
                     *, async_op: bool = False, forward_dtype: Optional[torch.dtype] = None,
                     backward_dtype: Optional[torch.dtype] = None) -> DTensor:
        """As DTensor's, through `Replicate` where rows leave a RowShard for another sharding of
        the same dimension (DTensor would take same-dimension shards to need no move)."""
        target = list(placements) if placements is not None else list(self.placements)
        here = list(self.placements)
        if device_mesh in (None, self.device_mesh) and any(
                isinstance(a, RowShard) and isinstance(b, Shard) and a != b for a, b in zip(here, target)):
            through = [Replicate() if isinstance(a, RowShard) and a != b else a for a, b in zip(here, target)]
            whole = _plain(self).redistribute(self.device_mesh, through, async_op=async_op)
            return _with_rows(whole.redistribute(self.device_mesh, target, async_op=async_op))
        return _with_rows(_plain(self).redistribute(device_mesh, placements, async_op=async_op,
                                                    forward_dtype=forward_dtype, backward_dtype=backward_dtype))


# What a local path returns where it does not apply (DTensor's dispatch then decides): an
# in-place `_foreach_` operator's own result is None.
_ELSEWHERE = object()


def _elementwise(func: Any, args: tuple, kwargs: dict) -> Any:
    """`func` on the local rows, or `_ELSEWHERE` where an operand is laid out otherwise."""
    # Operands and keyword values side by side, without a tree walk when none is a container.
    flat = not any(isinstance(value, (list, tuple, dict)) for value in (*args, *kwargs.values()))
    leaves, tree = ([*args, *kwargs.values()], None) if flat else tree_flatten((args, kwargs))
    source = next(value for value in leaves if isinstance(value, RowDTensor))
    spec = source._spec
    # An in-place operator writes its first operand: only this rank's rows of a replicated one
    # would change, so that operand is never cut.
    mutable = func._schema.is_mutable
    local = [_local_operand(value, spec, replicated_rows=not (mutable and index == 0))
             for index, value in enumerate(leaves)]
    if any(value is None and leaf is not None for value, leaf in zip(local, leaves)):
        return _ELSEWHERE
    if flat:
        local_args, local_kwargs = local[:len(args)], dict(zip(kwargs, local[len(args):]))
    else:
        local_args, local_kwargs = tree_unflatten(local, tree)
    out = func(*local_args, **local_kwargs)
    if func._schema.is_mutable and isinstance(args[0], DTensor) and out is local_args[0]:
        return args[0]
    return _with_spec(out, source._local_tensor.shape, spec)


def _with_spec(out: Any, local_shape: torch.Size, spec: DTensorSpec) -> Any:
    """An elementwise operator's local result(s) as RowDTensors laid out as `spec` (a tensor
    of another shape stays as it is)."""

    def wrap(value: Any) -> Any:
        if isinstance(value, torch.Tensor) and value.shape == local_shape:
            if value.dtype == spec.tensor_meta.dtype:          # the source's spec serves the result
                return RowDTensor(value, spec, requires_grad=value.requires_grad)
            return row_dtensor(value, spec.mesh, spec.placements, spec.shape, spec.stride)
        return value

    return wrap(out) if isinstance(out, torch.Tensor) else tree_map(wrap, out)


# [Note: elementwise operators on one spec]
# An optimizer's single-tensor step (torch's default on CPU) calls one in-place operator per
# parameter and state tensor, say SGD's `param.add_(grad, alpha=-lr)`, and every tensor operand
# is a RowDTensor of the parameter's one spec: FlatGroup shares it, by identity, among the
# parameter, its gradient and its optimizer state. `_on_one_spec` serves exactly that case: it
# unwraps the operands and calls the operator's C++ entry, the answer `_elementwise` gives
# without its tree walk, its layout comparisons and `OpOverload`'s Python call. Operators are
# looked up by `id()`: `OpOverload` hashes in Python, and each is one object for the process's
# life, held by the table. Measured on SGD's `add_` of an 8x8 parameter (one core): 10 µs a call
# through `_elementwise`, 6 µs here, of which 3 µs is the dispatcher's call into Python alone; 1.3
# µs on plain tensors.
_ONE_SPEC_OPS = {id(op): (op._op, op._schema.is_mutable) for op in _ELEMENTWISE - _RANDOM_FILLS
                 if "foreach" not in op.name()}


def _on_one_spec(func: Any, args: tuple, kwargs: dict) -> Any:
    """`func` on the local rows where its first operand is a RowDTensor and every other tensor
    operand a RowDTensor of the same spec object, keywords holding none; else `_ELSEWHERE`."""
    entry = _ONE_SPEC_OPS.get(id(func))
    if entry is None or not args or type(args[0]) is not RowDTensor:
        return _ELSEWHERE
    first = args[0]
    spec = first._spec
    local = [first._local_tensor]
    for value in args[1:]:
        if isinstance(value, torch.Tensor):
            if type(value) is not RowDTensor or value._spec is not spec:
                return _ELSEWHERE
            value = value._local_tensor
        elif isinstance(value, (list, tuple)):
            return _ELSEWHERE
        local.append(value)
    for value in kwargs.values():
        if isinstance(value, (torch.Tensor, list, tuple)):
            return _ELSEWHERE
    op, mutable = entry
    out = op(*local, **kwargs)
    if mutable and out is local[0]:
        return first
    return _with_spec(out, local[0].shape, spec)


def _foreach_ops() -> frozenset:
    """In-place and out-of-place `_foreach_` operators of an elementwise kind (an optimizer's
    foreach step, a clip's scaling): each list element is an elementwise operation."""
    aten = torch.ops.aten
    names = {schema.name.split("::")[1] for schema in torch._C._jit_get_all_schemas()
             if schema.name.startswith("aten::_foreach_")}
    ops = set()
    for name in names - _FOREACH_REDUCTIONS:
        packet = getattr(aten, name)
        ops.update(getattr(packet, overload) for overload in packet.overloads())
    return frozenset(ops)


# `_foreach_` operators whose results are not shaped like their inputs.
_FOREACH_REDUCTIONS = frozenset(["_foreach_norm", "_foreach_max", "_foreach_mm", "_foreach_powsum"])


_FOREACH = _foreach_ops()
_NORMS = frozenset([torch.ops.aten._foreach_norm.Scalar, torch.ops.aten.linalg_vector_norm.default])


def _foreach(func: Any, args: tuple, kwargs: dict) -> Any:
    """A `_foreach_` operator on the local rows, element by element; `_ELSEWHERE` where an
    element's operands are laid out otherwise. Under DTensor's `implicit_replication()` an
    element of plain tensors (a parameter left out of sharding, its gradient) is a replicated
    value, computed as it is, as DTensor's own dispatch would."""
    lists = [arg for arg in args if isinstance(arg, (list, tuple))]
    if not lists or any(len(values) != len(lists[0]) for values in lists):
        return _ELSEWHERE
    specs = [next((v._spec for v in items if isinstance(v, RowDTensor)), None) for items in zip(*lists)]
    known = next((spec for spec in specs if spec is not None), None)
    if known is None or (None in specs and not DTensor._op_dispatcher._allow_implicit_replication):
        return _ELSEWHERE

    def element(value: Any, spec: Optional[DTensorSpec]) -> Any:
        if spec is not None:
            return _local_operand(value, spec)
        return None if isinstance(value, DTensor) else value

    def local(arg: Any) -> Any:
        if isinstance(arg, (list, tuple)):
            values = [element(value, spec) for value, spec in zip(arg, specs)]
            return None if any(v is None and a is not None for v, a in zip(values, arg)) else values
        if isinstance(arg, DTensor):
            return _local_operand(arg, known) if arg.numel() == 1 else None
        return None if isinstance(arg, torch.Tensor) and arg.numel() > 1 else arg

    local_args = [local(arg) for arg in args]
    if any(value is None and arg is not None for value, arg in zip(local_args, args)):
        return _ELSEWHERE
    out = func(*local_args, **kwargs)
    if out is None:                    # in place
        return None
    return [value if spec is None else row_dtensor(value, spec.mesh, spec.placements, spec.shape, spec.stride)
            for value, spec in zip(out, specs)]


# [Note: norms on another mesh]
# torch's clip stacks every gradient's norm, which DTensor allows only on one mesh. Under
# expert parallelism the expert parameters live on the (ep, efsdp) plane and the others on the
# 1-D mesh over the same ranks, and each element of either lies on exactly one rank: so the
# norm of a tensor on the plane is this rank's part combined over that 1-D mesh, where it
# stacks with the rest. The plane's maker names the 1-D mesh once, here.
_NORM_MESHES: dict[DeviceMesh, DeviceMesh] = {}


def combine_norms_over(mesh: DeviceMesh, flat: DeviceMesh) -> None:
    """Norms of tensors sharded (and nowhere replicated) on `mesh` combine over `flat`, a 1-D
    mesh over the same ranks."""
    if sorted(mesh.mesh.flatten().tolist()) != sorted(flat.mesh.flatten().tolist()) or flat.ndim != 1:
        raise ValueError(f"norms on {mesh} cannot combine over {flat}: another set of ranks")
    _NORM_MESHES[mesh] = flat


def _norm_mesh(tensor: DTensor) -> Optional[DeviceMesh]:
    """The 1-D mesh `tensor`'s norm combines over: its own, or the one named for its plane."""
    if len(tensor.placements) == 1:
        return tensor._spec.mesh
    if all(isinstance(p, Shard) for p in tensor.placements):
        return _NORM_MESHES.get(tensor._spec.mesh)
    return None


def _norms(func: Any, args: tuple, kwargs: dict) -> Any:
    """Whole-tensor norms of row-sharded tensors: each rank's rows' norm (an empty block's is
    0, where torch refuses an empty tensor's infinity norm), combined over the ranks when the
    result is read (a partial DTensor, as DTensor's own norm gives)."""
    from torch.distributed.tensor._ops._math_ops import _NormPartial

    if func is torch.ops.aten.linalg_vector_norm.default:
        tensors, single = [args[0]], True
        order = args[1] if len(args) > 1 else kwargs.get("ord", 2)
        if (len(args) > 2 and args[2] is not None) or kwargs.get("dim") is not None or kwargs.get("dtype"):
            return _ELSEWHERE
    else:
        tensors, single = list(args[0]), False
        order = args[1] if len(args) > 1 else kwargs.get("ord", 2)
    meshes = [_norm_mesh(t) if isinstance(t, RowDTensor) else None for t in tensors]
    if any(mesh is None for mesh in meshes):
        return _ELSEWHERE
    order = float(order)
    # How the ranks' norms combine: DTensor's own placements for these orders.
    partial = Partial("max") if order == math.inf else Partial("min") if order == -math.inf else \
        Partial("sum") if order == 0 else _NormPartial(norm_type=order)
    out = []
    for tensor, mesh in zip(tensors, meshes):
        local = tensor._local_tensor
        norm = torch.linalg.vector_norm(local, order) if local.numel() else torch.full(
            (), math.inf if order == -math.inf else 0.0, dtype=local.dtype, device=local.device)
        spec = DTensorSpec(mesh, (partial,),
                           tensor_meta=TensorMeta(torch.Size([]), (), norm.dtype))
        out.append(DTensor(norm, spec, requires_grad=False))
    return out[0] if single else out


_VIEWS = frozenset([torch.ops.aten.view.default, torch.ops.aten._unsafe_view.default])


def _views(func: Any, args: tuple, kwargs: dict) -> Any:
    """A view whose rows follow the input's (`p.view(p.shape[0], -1)`, `p.flatten()`, and
    back, as autograd's backward of one views a gradient): each input row is k consecutive
    rows of the result, or k consecutive input rows one row of it, where every rank's rows
    are whole groups of k; so each rank's view of its rows is its part. DTensor's own rule
    assumes even chunks: with ragged rows it refuses, or views the wrong number of elements.
    `_ELSEWHERE` for any other view."""
    source = args[0]
    if not isinstance(source, RowDTensor) or kwargs or len(source.placements) != 1:
        return _ELSEWHERE
    placement = source.placements[0]
    if not isinstance(placement, RowShard) or placement.dim != 0 or source.dim() == 0 or source.shape[0] == 0:
        return _ELSEWHERE
    shape = list(args[1])
    if shape.count(-1) == 1:
        known = math.prod(size for size in shape if size != -1)
        shape[shape.index(-1)] = source.numel() // known if known else 0
    if -1 in shape or not shape or shape[0] == 0 or math.prod(shape) != source.numel():
        return _ELSEWHERE
    if shape[0] % source.shape[0] == 0:
        rows = [count * (shape[0] // source.shape[0]) for count in placement.rows]
    elif source.shape[0] % shape[0] == 0 and all(count % (source.shape[0] // shape[0]) == 0
                                                  for count in placement.rows):
        rows = [count // (source.shape[0] // shape[0]) for count in placement.rows]
    else:
        return _ELSEWHERE
    out = func(source._local_tensor, [rows[source.device_mesh.get_local_rank()], *shape[1:]])
    return row_dtensor(out, source.device_mesh, [RowShard(0, rows)], shape)


# Operators answered on the local rows, in this order (see RowDTensor).
_LOCAL_PATHS = ((_ELEMENTWISE, _elementwise), (_FOREACH, _foreach), (_NORMS, _norms), (_VIEWS, _views))


def _global_non_finite_check(args: tuple) -> None:
    """GradScaler's unscale of row-sharded gradients: each rank checks and unscales its rows,
    then `found_inf` is made the same on every rank of the mesh (MAX), as DTensor's own rule
    makes it under FSDP2."""
    grads, found_inf, inv_scale = args[0], args[1], args[2]
    locals_ = [grad._local_tensor if isinstance(grad, DTensor) else grad for grad in grads]
    torch._amp_foreach_non_finite_check_and_unscale_(locals_, found_inf, inv_scale)
    mesh = next(grad.device_mesh for grad in grads if isinstance(grad, DTensor))
    value = found_inf.to(torch.float32)
    for dim in range(mesh.ndim):
        dist.all_reduce(value, op=dist.ReduceOp.MAX, group=mesh.get_group(dim))
    found_inf.copy_(value)


def _random_fill(func: Any, args: tuple, kwargs: dict) -> "RowDTensor":
    target: RowDTensor = args[0]
    whole = torch.empty(target.shape, dtype=target.dtype, device=target._local_tensor.device)
    func(whole, *args[1:], **kwargs)
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    shape, offset = compute_local_shape_and_global_offset(target.shape, target.device_mesh, target.placements)
    target._local_tensor.copy_(whole[tuple(slice(start, start + size) for start, size in zip(offset, shape))])
    return target


def _register_for_foreach() -> None:
    """Let torch's optimizers and clip take their `_foreach_` paths over RowDTensors, as they do
    over DTensors (which torch registers the same way): on devices that have those kernels, an
    optimizer would otherwise step each parameter in a Python loop. The `_foreach_` operators
    then run on the local rows (`_foreach`)."""
    from torch.optim.optimizer import _foreach_supported_types as optimizer_types
    from torch.utils._foreach_utils import _foreach_supported_types as utility_types

    for types in (optimizer_types, utility_types):
        if RowDTensor not in types:
            types.append(RowDTensor)


_register_for_foreach()


def _plain(value: DTensor) -> DTensor:
    """The same local tensor and spec as a base DTensor (DTensor's own methods on it)."""
    return DTensor(value._local_tensor, value._spec, requires_grad=value.requires_grad)


def _with_rows(value: DTensor) -> DTensor:
    """`value` as a RowDTensor where a placement is a RowShard."""
    if isinstance(value, RowDTensor) or not any(isinstance(p, RowShard) for p in value.placements):
        return value
    return row_dtensor(value._local_tensor, value.device_mesh, value.placements, value.shape, value.stride())


def _keep_rows(value: Any, source: DTensor, func: Any) -> Any:
    """`value` (an operator's result computed from `source`) with `source`'s rows on every
    mesh dimension where the operator left a plain `Shard`."""
    if not isinstance(value, DTensor) or isinstance(value, RowDTensor):
        return value
    placements, changed = [], False
    for mesh_dim, placement in enumerate(value.placements):
        origin = source.placements[mesh_dim] if mesh_dim < len(source.placements) else None
        if isinstance(placement, Shard) and not isinstance(placement, RowShard) and isinstance(origin, RowShard):
            placement = _scaled(origin, value.shape[placement.dim], source.shape[origin.dim], placement.dim, func)
            changed = True
        placements.append(placement)
    if not changed:
        return _with_rows(value)
    return row_dtensor(value._local_tensor, value.device_mesh, placements, value.shape, value.stride())


def _scaled(origin: RowShard, size: int, source_size: int, dim: int, func: Any) -> RowShard:
    if size == source_size:
        return RowShard(dim, origin.rows)
    if source_size and size % source_size == 0:
        factor = size // source_size
        return RowShard(dim, [rows * factor for rows in origin.rows])
    raise NotImplementedError(
        f"{func}: the result's size {size} along its sharded dimension does not follow the rows of its input "
        f"({origin!r}); gather the value first with .full_tensor()")


def row_dtensor(local: torch.Tensor, mesh: DeviceMesh, placements: Sequence[Placement], shape: Sequence[int],
                stride: Optional[Sequence[int]] = None) -> RowDTensor:
    """A RowDTensor over `local` (no copy) with the given global `shape`."""
    shape = torch.Size(shape)
    if stride is None:
        stride = torch.empty(shape, device="meta").stride()
    spec = DTensorSpec(mesh, tuple(placements), tensor_meta=TensorMeta(shape, tuple(stride), local.dtype))
    return RowDTensor(local, spec, requires_grad=local.requires_grad)


def as_dtensor(part: torch.Tensor, shape: Sequence[int], rows: Sequence[int], mesh: DeviceMesh) -> RowDTensor:
    """`part` (this rank's rows of a tensor of `shape`; each rank's row count in `rows`; any
    shape with that many elements) as a DTensor of `shape` whose local tensor is a view of
    `part`: loading into the result writes `part` in place. A 0-dim tensor is one element,
    shape [1]."""
    global_shape = list(shape) or [1]
    local = part.detach().view(-1, *global_shape[1:])
    return row_dtensor(local, mesh, [RowShard(0, rows)], global_shape)


def as_block_dtensor(part: torch.Tensor, shape: Sequence[int], trailing: Sequence[int], offset: Sequence[int],
                     mesh: DeviceMesh) -> DTensor:
    """`part` (a block of whole rows of `trailing` trailing dimensions, starting at `offset` in
    a tensor of `shape`) as a DTensor of `shape` for DCP: a tensor-parallel parameter's block is
    this rank's rows of its TP-local tensor, placed at its TP offset ([Note: tensor-parallel
    parameters in flat shards]). Its local tensor is torch's `LocalShardsWrapper`, which
    carries the block's offset in every dimension: DCP saves, loads and reshards it; DTensor's
    collectives (`full_tensor()`) do not take it."""
    global_shape = torch.Size(list(shape) or [1])
    wrapped = LocalShardsWrapper([part.detach().view(-1, *trailing)], [tuple(offset)])
    stride = torch.empty(global_shape, device="meta").stride()
    return DTensor.from_local(wrapped, mesh, [Shard(0)], run_check=False, shape=global_shape, stride=stride)


def local_part(value: DTensor) -> tuple[torch.Tensor, tuple[int, ...]]:
    """The local block of a DTensor and the global offset of its first element."""
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    local = value.to_local()
    if isinstance(local, LocalShardsWrapper):
        (block,) = local.local_shards()
        return block, tuple(local.local_offsets()[0])
    _, offset = compute_local_shape_and_global_offset(value.shape, value.device_mesh, value.placements)
    return local, tuple(offset)


def same_layout(value: DTensor, like: DTensor) -> bool:
    """Whether two DTensors place their elements alike on the same mesh (a RowShard only
    matches the same rows)."""
    return value.device_mesh == like.device_mesh and len(value.placements) == len(like.placements) and all(
        type(a) is type(b) and a == b for a, b in zip(value.placements, like.placements))


def local_rows(value: DTensor, like: DTensor) -> torch.Tensor:
    """This rank's block of `value` as `like` (a RowDTensor of the same shape) places its rows.
    Where `value` is sharded otherwise (FSDP2's even chunks: `distribute_tensor` makes plain
    `Shard`s, whatever placement it is given), the value is gathered first: a collective,
    decided by the placements alone, so every rank takes the same branch."""
    if tuple(value.shape) != tuple(like.shape):
        raise ValueError(f"a DTensor of shape {tuple(value.shape)} cannot be loaded into one of shape "
                         f"{tuple(like.shape)}")
    if same_layout(value, like):
        return local_part(value)[0]
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    whole = value.full_tensor()
    shape, offset = compute_local_shape_and_global_offset(like.shape, like.device_mesh, like.placements)
    return whole[tuple(slice(start, start + size) for start, size in zip(offset, shape))]


def copy_to_cpu(value: DTensor) -> DTensor:
    """A DTensor like `value` over a CPU copy of its local rows."""
    block, offset = local_part(value)
    block = block.detach().to("cpu", copy=True)
    if isinstance(value.to_local(), LocalShardsWrapper):
        return as_block_dtensor(block, value.shape, block.shape[1:], offset or (0,), value.device_mesh)
    return row_dtensor(block, value.device_mesh, value.placements, value.shape, value.stride())
