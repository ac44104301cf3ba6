"""Where a flat group's master shard and gradient shard live when they are offloaded
(`offload="cpu"`), and the copies between the device and host memory.
"""
from __future__ import annotations

from typing import Optional

# The offload tiers this runtime can hold state in; a tier missing here is refused at start-up
# with the reason given.
UNAVAILABLE_TIERS: dict[str, str] = {
    "cpu": "offload='cpu' is not available yet; use offload='none'",
    "disk": "offload='disk' (master shards and optimizer state in files) is not available; "
            "use offload='cpu' or offload='none'",
}


def offload_error(offload: str) -> Optional[str]:
    """Why `offload` cannot be used here, or None when it can."""
    return UNAVAILABLE_TIERS.get(offload)
