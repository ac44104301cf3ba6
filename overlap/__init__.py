"""overlap: ZeRO-3 sharded data parallelism that hides its communication behind compute."""
from __future__ import annotations

from typing import TYPE_CHECKING, Any

from overlap.base.config import Config, config_from_env
from overlap.base.mixed_precision import MixedPrecision

if TYPE_CHECKING:
    from overlap.fsdp import OverlapPolicy, fully_shard, register_fsdp_forward_method
    from overlap.schedule_prefetch import follow_schedule
    from overlap.sharded_module import ShardedModule

__all__ = ["Config", "MixedPrecision", "ShardedModule", "config_from_env", "fully_shard",
           "register_fsdp_forward_method", "OverlapPolicy", "MixedPrecisionPolicy", "OffloadPolicy", "CPUOffloadPolicy",
           "FSDPModule", "follow_schedule"]
# FSDP2's names, for `from overlap import fully_shard, MixedPrecisionPolicy` (the policies and
# FSDPModule are torch's own classes), and OverlapPolicy, fully_shard's settings beyond FSDP2's.
_FULLY_SHARD = ("fully_shard", "register_fsdp_forward_method", "OverlapPolicy", "MixedPrecisionPolicy",
                "OffloadPolicy", "CPUOffloadPolicy", "FSDPModule")
__version__ = "0.1.0"


def __getattr__(name: str) -> Any:
    # `ShardedModule` is imported at first use: it brings the runtime and torch's DTensor
    # (about a second of start-up), which the `overlap` command's launcher, `estimate` and
    # `simulate` never use.
    if name == "ShardedModule":
        from overlap.sharded_module import ShardedModule
        return ShardedModule
    if name == "follow_schedule":
        from overlap.schedule_prefetch import follow_schedule
        return follow_schedule
    if name in _FULLY_SHARD:
        from overlap import fsdp
        return getattr(fsdp, name)
    raise AttributeError(f"module 'overlap' has no attribute {name!r}")
