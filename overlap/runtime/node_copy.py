"""hpZ (ZeRO++ hierarchical partitioning): a node-local secondary copy of a unit's gathered
parameters, so that backward re-gathers inside the node instead of across nodes.

Primary shards (master weights, gradients, optimizer state) stay spread over every rank, as
with full sharding. When a unit's forward all-gather over every rank completes, each rank
keeps the slice of the gathered buffer its node position owns in the node: with
`L` ranks per node the buffer splits into `L` contiguous slices and node rank `local` keeps
slice `local`, in the gather dtype. Every flat buffer is padded to a multiple of the world
size, a multiple of `L`, so the slices are equal. Backward all-gathers these slices over the
node's ranks into the same buffer (the node group orders its ranks by local rank, as
torchrun numbers them node by node) and drops the copy.

A copy is only valid until the optimizer writes the shards again, so every forward pass drops
the copies left from the previous one (a unit that stayed gathered into backward, an
evaluation forward); gathers outside autograd (no_grad forwards, backward itself) make none.
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist

from overlap.runtime.collectives import Collectives
from overlap.runtime.pending import Pending


class NodeCopy:
    """The secondary copy of one flat group: made by forward's gather, used by backward's."""

    def __init__(self, collectives: Collectives, node_group: dist.ProcessGroup) -> None:
        self.collectives = collectives
        self.node_group = node_group
        self.node_size = dist.get_world_size(node_group)
        self.local = dist.get_rank(node_group)
        self.secondary: Optional[torch.Tensor] = None

    def gather(self, out: torch.Tensor, shard: torch.Tensor, unit: str) -> Pending:
        """Gather into `out` from the node copy if there is one (and drop it), else from the
        primary shards over every rank, keeping a node copy when autograd will need one."""
        if self.secondary is not None:
            secondary, self.secondary = self.secondary, None    # the pending keeps it alive
            return self.collectives.all_gather(out, secondary, unit, group=self.node_group)
        pending = self.collectives.all_gather(out, shard, unit)
        if torch.is_grad_enabled():
            # After the gather's own completion work (a compressed gather decodes into `out`).
            pending.then_run(lambda: self._keep(out))
        return pending

    def _keep(self, gathered: torch.Tensor) -> None:
        size = gathered.numel() // self.node_size
        self.secondary = gathered.detach().narrow(0, self.local * size, size).clone()

    def drop(self) -> None:
        self.secondary = None

    @property
    def nbytes(self) -> int:
        return 0 if self.secondary is None else self.secondary.numel() * self.secondary.element_size()
