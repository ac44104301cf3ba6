"""The `ShardedModule` arguments a framework integration carries, and the framework precision
names they map to."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional, Sequence

import torch
import torch.distributed as dist
from torch import nn

from overlap.base.mixed_precision import MixedPrecision
from overlap.sharded_module import ShardedModule

# Precision names as Lightning spells them. "*-true" converts the module itself, so the shards
# keep that dtype and no policy is needed; "bf16-mixed" keeps fp32 master shards, gathers in
# bf16 and reduces in fp32.
_MIXED = {"bf16-mixed": MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)}
_SHARD_DTYPE_ONLY = ("32-true", "64-true", "bf16-true", "16-true", "32", "64")


def mixed_precision_for(precision: str) -> Optional[MixedPrecision]:
    """The policy for a framework's precision name; ValueError for one that sharding cannot keep."""
    precision = str(precision)
    if precision in _MIXED:
        return _MIXED[precision]
    if precision in _SHARD_DTYPE_ONLY:
        return None
    if precision in ("16-mixed", "16"):
        # GradScaler looks for non-finite gradients in this rank's parts only: ranks would
        # disagree about skipping a step.
        raise ValueError("overlap: precision='16-mixed' needs a gradient scaler that sees every rank's "
                         "gradients; use precision='bf16-mixed' (or pass mixed_precision=MixedPrecision(...))")
    raise ValueError(f"overlap: precision={precision!r} is not supported; use '32-true', 'bf16-mixed', "
                     "'bf16-true' or '16-true'")


@dataclass(frozen=True)
class ShardingOptions:
    """`ShardedModule`'s keyword arguments (see its docstring), held until the framework hands
    over the model. `mixed_precision` None: derived from the framework's precision setting."""

    unit_types: Optional[Sequence[type]] = None
    sharding: Optional[str] = None
    compression: Optional[str] = None
    offload: Optional[str] = None
    mixed_precision: Optional[MixedPrecision] = None
    prefetch_depth: Optional[int] = None
    bucket_mb: Optional[float] = None
    reshard_after_forward: bool = True
    param_init_fn: Optional[Callable[[nn.Module], None]] = None
    process_group: Optional[dist.ProcessGroup] = None

    def wrap(self, module: nn.Module, precision: str) -> ShardedModule:
        mixed = self.mixed_precision if self.mixed_precision is not None else mixed_precision_for(precision)
        return ShardedModule(module, unit_types=self.unit_types, process_group=self.process_group,
                             mixed_precision=mixed, prefetch_depth=self.prefetch_depth, bucket_mb=self.bucket_mb,
                             reshard_after_forward=self.reshard_after_forward, param_init_fn=self.param_init_fn,
                             sharding=self.sharding, compression=self.compression,
                             offload=self.offload)
