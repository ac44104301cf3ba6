"""The names a user chooses among, one definition each: the settings validate against these,
the command line offers them, the runtime and the planner look their meaning up here.
"""
from __future__ import annotations

from typing import Optional

from overlap.kernels.backends import BACKEND_NAMES

# Flat-buffer kernel backends; defined beside the backends themselves (overlap.kernels).
KERNEL_CHOICES = BACKEND_NAMES

# Link classes the planner has a latency-bandwidth model for (overlap.plan.links).
LINK_CLASSES = ("nvlink", "pcie", "infiniband", "ethernet", "loopback")
LINK_CHOICES = ("auto", *LINK_CLASSES)

# Shard over every rank; inside each node, replicated across nodes; or over every rank with a
# node-local copy for backward (ZeRO++ hpZ). "auto": the planner chooses among them.
SHARDINGS = ("full", "hybrid", "hpz")
SHARDING_CHOICES = (*SHARDINGS, "auto")

# When ranks compare what they run (overlap.runtime.order_check): before each collective (an
# order word wherever their steps could part from verified ones, so a divergence is an error
# before a mismatched collective is issued), or once a step at the end of backward and when a
# collective waits too long (no order words at all).
ORDER_CHECKS = ("collective", "step")

# What crosses the wire quantised (overlap.runtime.compression): mode -> (bits of gathered
# weights, bits of reduced gradients), None where it is not compressed. Listed cheapest in
# accuracy first, the order in which `auto` considers them.
COMPRESSION_BITS: dict[str, tuple[Optional[int], Optional[int]]] = {
    "none": (None, None),
    "int8": (8, 8),
    "int8-int4": (8, 4),
}
COMPRESSION_MODES = tuple(COMPRESSION_BITS)
COMPRESS_CHOICES = (*COMPRESSION_MODES, "auto")

# Where a rank keeps its fp32 master shard, gradient shard and optimizer state: on the device
# it computes on, in (pinned) host memory, or in files on local disk streamed through a few
# host buffers. The planner and `overlap estimate` price all three (overlap.plan.offload).
OFFLOAD_CHOICES = ("none", "cpu", "disk")
