"""Gradients that answer torch's norm functions for the whole parameter, not this rank's rows.

[Note: norms of sharded gradients]
A parameter's `.grad` holds this rank's rows only, so `torch.nn.utils.clip_grad_norm_`,
`get_total_norm` or `p.grad.norm()` on it would give this rank's part of the norm: each rank
would clip by another factor, silently. Each published gradient is therefore a `ShardGrad`, a
tensor subclass (a view of the flat gradient shard, as before) whose `__torch_function__`
passes every operation through untouched except the full reductions to a norm:
`torch._foreach_norm`, `torch.linalg.vector_norm` and `torch.linalg.norm` without `dim`,
`torch.norm` / `Tensor.norm` without `dim`. Those compute the local norms, then combine them
over the ranks that hold the parameter's rows in one all-reduce per call (p-th powers summed,
or the maximum for the infinity norm), so each gradient's norm is the whole parameter's and
torch's own total (the norm of those norms) is one process's. torch's clip then scales each
rank's rows by the same factor. This is what FSDP2's DTensor gradients give, without making
`.grad` a DTensor (which every optimizer and every line of user code reading `.grad` would
then have to accept).

The reduction is a collective: every rank must call it, with the same gradients, as torch's
clip is called in a training loop. Reductions along a `dim` (row-wise statistics), sums and
means stay this rank's: they are what the local block holds. Results are plain tensors, so
the subclass does not spread beyond `.grad`.

[Note: multiplying a gradient by one]
torch's clip multiplies every gradient by clamp(max_norm / (norm + eps), max=1) in place,
also when the clip does not bind and the factor is exactly 1. That changes no bit (x * 1 is
x for every float, NaN and -0 included) but bumps the gradient's `_version`, and offload="disk"
keeps a step taken during backward only if the gradient's version is unchanged ([Note: the
speculative step] in overlap.optim.speculation). So `Tensor.mul_` and `torch._foreach_mul_`
of ShardGrads by a factor that is exactly 1 (a Python number, or a 0-dim CPU tensor: a
device tensor is never read back, which would synchronise) are skipped: a clip that does
not bind keeps the speculation, one that binds invalidates it and the step recomputes.
"""
from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any, Callable, Optional, Sequence

import torch
import torch.distributed as dist

if TYPE_CHECKING:
    from overlap.runtime.collectives import Collectives


class ShardGrad(torch.Tensor):
    """A view of a flat gradient shard holding one parameter's rows (see the note)."""

    collectives: "Collectives"

    @classmethod
    def __torch_function__(cls, func: Callable, types: Any, args: Sequence = (), kwargs: Optional[dict] = None) -> Any:
        kwargs = kwargs or {}
        if func in _IN_PLACE_MULS and _is_one(args[1] if len(args) > 1 else kwargs.get("other",
                                                                                      kwargs.get("scalar"))):
            return args[0] if func is torch.Tensor.mul_ else None     # see [Note: multiplying a gradient by one]
        if func is torch._amp_foreach_non_finite_check_and_unscale_:
            return _global_non_finite_check(args, kwargs)
        combine = _NORMS.get(func)
        with torch._C.DisableTorchFunctionSubclass():
            out = func(*args, **kwargs) if combine is None else _local_norms(func, args, kwargs)
        return out if combine is None else combine(args, kwargs, out)


_IN_PLACE_MULS = (torch.Tensor.mul_, torch._foreach_mul_)


def _global_non_finite_check(args: Sequence, kwargs: dict) -> None:
    """GradScaler's unscale: each rank checks its rows, then `found_inf` is made the same on
    every rank (MAX over every rank taking part), so all of them skip a step or none does, and
    their scales stay equal. See [Note: norms of sharded gradients] for why `.grad` answers."""
    grads, found_inf = args[0] if args else kwargs["self"], args[1] if len(args) > 1 else kwargs["found_inf"]
    with torch._C.DisableTorchFunctionSubclass():
        torch._amp_foreach_non_finite_check_and_unscale_(*args, **kwargs)
    collectives = next(grad.collectives for grad in grads if isinstance(grad, ShardGrad))
    group = getattr(collectives, "all_group", collectives.group)
    value = found_inf.to(torch.float32)
    dist.all_reduce(value, op=dist.ReduceOp.MAX, group=group)
    found_inf.copy_(value)


def _is_one(factor: Any) -> bool:
    """Whether `factor` is exactly 1 without reading a device tensor back."""
    if isinstance(factor, torch.Tensor):
        return factor.device.type == "cpu" and factor.dim() == 0 and not factor.is_complex() and bool(factor == 1)
    return isinstance(factor, (int, float)) and not isinstance(factor, bool) and factor == 1


def shard_grad(view: torch.Tensor, collectives: "Collectives") -> ShardGrad:
    """`view` (sharing its storage and version counter) as a ShardGrad over `collectives`' group."""
    grad = view.as_subclass(ShardGrad)
    grad.collectives = collectives
    return grad


def plain(grad: torch.Tensor) -> torch.Tensor:
    """The same tensor without the norm behaviour (for the runtime's own arithmetic)."""
    return grad.as_subclass(torch.Tensor) if isinstance(grad, ShardGrad) else grad


def _empty_norm(tensor: torch.Tensor, order: float) -> torch.Tensor:
    """The norm of a rank's empty part: what the other ranks' parts combine with (torch
    refuses the infinity norms of an empty tensor)."""
    return torch.full((), math.inf if order == -math.inf else 0.0, dtype=tensor.dtype, device=tensor.device)


def _local_norms(func: Callable, args: Sequence, kwargs: dict) -> Any:
    """A norm function's result on this rank's parts, an empty part's norm included."""
    if func is torch._foreach_norm:
        tensors, order = args[0], _order(args[1] if len(args) > 1 else kwargs.get("ord", 2))
        full = [index for index, tensor in enumerate(tensors) if tensor.numel()]
        norms = func([tensors[index] for index in full], *args[1:], **kwargs) if full else []
        out = [_empty_norm(tensor, order) for tensor in tensors]
        for index, norm in zip(full, norms):
            out[index] = norm
        return out
    source = args[0] if args else kwargs.get("input", kwargs.get("x"))
    dim = args[2] if len(args) > 2 else kwargs.get("dim")
    if isinstance(source, ShardGrad) and source.numel() == 0 and dim is None:
        order = args[1] if len(args) > 1 else kwargs.get("ord", kwargs.get("p"))
        return _empty_norm(source, _order(order))
    return func(*args, **kwargs)


def _order(value: Any) -> float:
    if value is None or value == "fro":
        return 2.0
    if isinstance(value, str):
        raise NotImplementedError(f"the {value!r} norm of a sharded gradient: it is not a sum over rows; gather the "
                                  "parameter with ShardedModule.full_state_dict() to compute it")
    order = float(value)
    if order < 0 and order != -math.inf:
        raise NotImplementedError(f"the order-{order:g} norm of a sharded gradient is not supported")
    return order


def _combined(local: torch.Tensor, order: float, collectives: "Collectives") -> torch.Tensor:
    """The norms `local` (this rank's parts) of parameters sharded over `collectives`' group,
    as the whole parameters' norms."""
    value = local.detach().to(collectives.device, torch.float32)
    if order in (math.inf, -math.inf):
        dist.all_reduce(value, op=dist.ReduceOp.MAX if order > 0 else dist.ReduceOp.MIN, group=collectives.group)
    elif order == 0:
        dist.all_reduce(value, group=collectives.group)
    else:
        value = value.pow(order)
        dist.all_reduce(value, group=collectives.group)
        value = value.pow(1.0 / order)
    return value.to(local.device, local.dtype)


def _foreach_norm(args: Sequence, kwargs: dict, out: list[torch.Tensor]) -> list[torch.Tensor]:
    tensors = args[0]
    order = _order(args[1] if len(args) > 1 else kwargs.get("ord", 2))
    by_group: dict[int, list[int]] = {}
    for index, tensor in enumerate(tensors):
        if isinstance(tensor, ShardGrad):
            by_group.setdefault(id(tensor.collectives), []).append(index)
    out = list(out)
    for indices in by_group.values():
        combined = _combined(torch.stack([out[i] for i in indices]), order, tensors[indices[0]].collectives)
        for position, index in enumerate(indices):
            out[index] = combined[position]
    return out


def _full_norm(order_key: str, matrix_orders: bool = False) -> Callable[[Sequence, dict, Any], Any]:
    """Combines a norm function's result when it reduced its whole input (no `dim`); with
    `matrix_orders`, a numeric order of a 2-D input is a matrix norm (torch.linalg.norm)."""

    def combine(args: Sequence, kwargs: dict, out: Any) -> Any:
        source = args[0] if args else kwargs.get("input", kwargs.get("x"))
        dim = args[2] if len(args) > 2 else kwargs.get("dim")
        if not isinstance(source, ShardGrad) or dim is not None:
            return out
        order = args[1] if len(args) > 1 else kwargs.get(order_key)
        if matrix_orders and source.dim() == 2 and order not in (None, "fro"):
            raise NotImplementedError(f"the matrix norm ord={order!r} of a sharded gradient: it is not a sum over "
                                      "rows; gather the parameter with ShardedModule.full_state_dict() to compute it")
        return _combined(out, _order(order), source.collectives)

    return combine


_NORMS: dict[Callable, Callable[[Sequence, dict, Any], Any]] = {
    torch._foreach_norm: _foreach_norm,
    torch.linalg.vector_norm: _full_norm("ord"),
    torch.linalg.norm: _full_norm("ord", matrix_orders=True),
    torch.norm: _full_norm("p"),
    torch.Tensor.norm: _full_norm("p"),
}
