"""overlap: ZeRO-3 sharded data parallelism that hides its communication behind compute."""
from overlap.base.config import Config, config_from_env
from overlap.base.mixed_precision import MixedPrecision
from overlap.sharded_module import ShardedModule

__all__ = ["Config", "MixedPrecision", "ShardedModule", "config_from_env"]
__version__ = "0.1.0"
