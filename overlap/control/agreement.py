"""How the ranks of a group come to one answer: rank 0 decides and every rank takes its value
(`decided_by_rank0`), or every rank checks at start-up that it wraps what rank 0 wraps with
the settings rank 0 has (`check_ranks_agree`). Either way an error is raised on every rank,
so no rank is left waiting in a collective the others never reach.

[Note: step-end decisions on the host]
The step-end controllers decide inside the end-of-backward callback. On the device group
(NCCL) `broadcast_object_list` would queue a broadcast behind the whole backward on the
device, then copy its answer to the host: the host would stall until the device drained,
and the prefetch of the next step would start late. They decide over the gloo group the
end-of-backward flags use (`Collectives.flags_group`), whose answer is host memory: the
cost is one host round trip between ranks, at the decision steps only.
"""
from __future__ import annotations

import pickle
from typing import Any, Callable, Optional, Sequence, TypeVar

import torch.distributed as dist

from overlap.base.config import Config
from overlap.base.units import UnitSpec

T = TypeVar("T")


def _portable(exc: Exception) -> Exception:
    """`exc` if it survives pickling (so the other ranks raise its type and message), else a
    RuntimeError that says what it was."""
    try:
        return pickle.loads(pickle.dumps(exc))
    except Exception:
        return RuntimeError(f"{type(exc).__name__}: {exc}")


def _from_rank0(group: dist.ProcessGroup, message: Any) -> Any:
    box = [message]
    dist.broadcast_object_list(box, src=dist.get_global_rank(group, 0), group=group)
    return box[0]


def decided_by_rank0(group: dist.ProcessGroup, decide: Callable[[], T]) -> T:
    """Run `decide` on the group's rank 0 and return its value on every rank (collective: every
    rank of `group` calls it at the same point; at step end, a host-side group: see [Note:
    step-end decisions on the host]). `decide` must not communicate: the other ranks
    are already waiting for its answer. An exception in `decide` is raised on every rank, on
    rank 0 as it was, elsewhere with the same type and message."""
    if dist.get_world_size(group) == 1:
        return decide()
    if dist.get_rank(group) != 0:
        value, error = _from_rank0(group, None)
        if error is not None:
            raise error
        return value
    try:
        value = decide()
    except Exception as exc:
        _from_rank0(group, (None, _portable(exc)))
        raise
    _from_rank0(group, (value, None))
    return value


def model_signature(root: UnitSpec, units: Sequence[UnitSpec]) -> list[tuple]:
    """Each unit's name with its parameters' names, shapes, dtypes and trainability."""
    return [(spec.name or "<root>", [(name, tuple(p.shape), str(p.dtype), p.requires_grad)
                                     for name, p, _ in spec.params]) for spec in [root, *units]]


def check_ranks_agree(group: dist.ProcessGroup, error: Optional[str], signature: list[tuple], config: Config) -> None:
    """Raise the same error on every rank if any rank failed to configure, sees another model
    (`model_signature`) or has other settings than rank 0 (collective)."""
    reports: list[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(reports, (error, signature, config), group=group)
    for rank, (rank_error, _, _) in enumerate(reports):
        if rank_error is not None:
            raise ValueError(f"ShardedModule: rank {rank}: {rank_error}")
    _, ref_signature, ref_config = reports[0]
    for rank, (_, rank_signature, rank_config) in enumerate(reports):
        if rank_signature != ref_signature:
            raise ValueError(f"ShardedModule: rank {rank} wraps a different model than rank 0: "
                             f"{_difference(ref_signature, rank_signature)}")
        if rank_config != ref_config:
            raise ValueError(f"ShardedModule: rank {rank} has settings {rank_config} but rank 0 has {ref_config}; "
                             "OVERLAP_* variables and arguments must match on every rank")


def _difference(ref_signature: list[tuple], rank_signature: list[tuple]) -> str:
    """The first unit, or the first parameter of a unit, where two signatures differ."""
    names = [u[0] for u in ref_signature], [u[0] for u in rank_signature]
    if names[0] != names[1]:
        return f"units {names[1]} vs rank 0's {names[0]}"
    unit = next(a for a, b in zip(ref_signature, rank_signature) if a != b)
    other = dict(rank_signature)[unit[0]]
    diff = next((a, b) for a, b in zip(unit[1] + [None], other + [None]) if a != b)
    return f"unit {unit[0]!r}: parameter {diff[1]} vs rank 0's {diff[0]}"
