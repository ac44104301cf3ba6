"""One group of a unit's parameters (same dtype, same requires_grad) stored as a flat shard.

Layout: the group's parameters are flattened in a fixed order into one buffer of
`padded_numel = world_size * shard_numel` elements (zero padding at the end); rank r keeps
elements [r * shard_numel, (r + 1) * shard_numel) as an fp32 (master dtype) `nn.Parameter`.
To compute, the shards are all-gathered into `full`, a leaf tensor in the gather dtype whose
views stand in for the original parameters on their modules. Autograd accumulates the
gradients of all those views into `full.grad`, which is already in the flat layout the
reduce-scatter wants: no copy-in or copy-out is needed on the way in or out.

[Note: freeing `full` by resizing its storage]
Tensors autograd saved in forward (a weight for a matmul's input gradient) are views of
`full`. Freeing by `untyped_storage().resize_(0)` and re-gathering into the same storage
keeps those views valid: backward reads the re-gathered data. Writes into `full` preserve
its version counter so autograd does not mistake the re-gather for an in-place change.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional

import torch
import torch.distributed as dist
from torch import nn

from overlap.collectives import Collectives, Pending, all_gather_flat


@dataclass
class ParamSlot:
    """Where one original parameter lives in the flat layout and on which modules."""

    name: str                                  # first fully qualified name
    owners: list[tuple[nn.Module, str]]        # (module, attribute) for every place it is used
    shape: torch.Size
    offset: int
    numel: int


class FlatGroup:
    def __init__(self, params: list[tuple[str, nn.Parameter, list[tuple[nn.Module, str]]]],
                 collectives: Collectives, gather_dtype: torch.dtype, reduce_dtype: torch.dtype) -> None:
        self.collectives = collectives
        self.kernels = collectives.kernels
        world, rank = collectives.world_size, collectives.rank
        device = collectives.device
        self.master_dtype = params[0][1].dtype
        self.requires_grad = params[0][1].requires_grad
        self.gather_dtype = gather_dtype
        self.reduce_dtype = reduce_dtype

        self.slots: list[ParamSlot] = []
        offset = 0
        for name, param, owners in params:
            self.slots.append(ParamSlot(name, owners, param.shape, offset, param.numel()))
            offset += param.numel()
        self.numel = offset
        self.shard_numel = -(-max(offset, 1) // world)
        self.padded_numel = self.shard_numel * world
        self._split_sizes = [s.numel for s in self.slots] + [self.padded_numel - self.numel]

        # Rank 0's initial values are the truth on every rank, as with DDP.
        flat = torch.zeros(self.padded_numel, dtype=self.master_dtype, device=device)
        self.kernels.pack([p.detach().to(device) for _, p, _ in params], flat, [s.offset for s in self.slots])
        if world > 1:
            dist.broadcast(flat, src=dist.get_global_rank(collectives.group, 0), group=collectives.group)
        start = rank * self.shard_numel
        self.shard = nn.Parameter(flat[start:start + self.shard_numel].clone(), requires_grad=self.requires_grad)
        del flat

        # The gathered parameters: a leaf so autograd accumulates all views' gradients here.
        self.full = torch.empty(self.padded_numel, dtype=gather_dtype, device=device)
        self.full.requires_grad_(self.requires_grad)
        self._full_nbytes = self.padded_numel * self.full.element_size()
        self.free()
        # Gradients summed locally while reduction is paused (no_sync), in the reduce dtype.
        self.unsynced_grad: Optional[torch.Tensor] = None

        for _, _, owners in params:
            for module, attr in owners:
                module._parameters.pop(attr, None)

    @property
    def gathered_nbytes(self) -> int:
        return self._full_nbytes

    @property
    def is_allocated(self) -> bool:
        return self.full.untyped_storage().size() > 0

    def start_gather(self, unit_name: str) -> Pending:
        """Allocate `full` and launch the all-gather into it."""
        with torch.autograd._unsafe_preserve_version_counter(self.full):
            if not self.is_allocated:
                self.full.untyped_storage().resize_(self._full_nbytes)
            return self.collectives.all_gather(self.full.detach(), self.shard, unit_name)

    def free(self) -> None:
        """Release the gathered parameters. See [Note: freeing `full` by resizing its storage]."""
        self.full.untyped_storage().resize_(0)

    def install_views(self) -> None:
        """Point every owner module's attribute at its parameter's view of `full`.

        One `split` makes all views: its backward writes every gradient into one flat tensor
        in a single pass, where a `narrow` per parameter would materialise a zero-filled
        full-size gradient per parameter and sum them.
        """
        pieces = torch.split(self.full, self._split_sizes)
        for slot, piece in zip(self.slots, pieces):
            view = piece.view(slot.shape)
            for module, attr in slot.owners:
                module.__dict__[attr] = view

    def register_grad_hook(self, hook: Callable[["FlatGroup", torch.Tensor], None]) -> None:
        """Call `hook(group, grad)` once the gradient of `full` is complete in a backward pass."""

        def on_grad(full: torch.Tensor) -> None:
            grad, full.grad = full.grad, None
            hook(self, grad)

        self.full.register_post_accumulate_grad_hook(on_grad)

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

    def ensure_shard_grad(self) -> torch.Tensor:
        if self.shard.grad is None:
            self.shard.grad = torch.zeros_like(self.shard)
        return self.shard.grad

    def full_values(self) -> torch.Tensor:
        """All-gather the master shards (no cast) into a new flat tensor: for state dicts."""
        out = torch.empty(self.padded_numel, dtype=self.master_dtype, device=self.collectives.device)
        all_gather_flat(out, self.shard.detach(), group=self.collectives.group)
        return out

    def load_full(self, tensors: list[torch.Tensor]) -> None:
        """Set this rank's shard from full parameter values given in slot order (every rank has them)."""
        flat = torch.zeros(self.padded_numel, dtype=self.master_dtype, device=self.collectives.device)
        self.kernels.pack([t.detach().to(flat.device) for t in tensors], flat, [s.offset for s in self.slots])
        start = self.collectives.rank * self.shard_numel
        with torch.no_grad():
            self.shard.copy_(flat[start:start + self.shard_numel])
