"""Which kind of link joins the ranks of a process group: detected on the running job (host
names, CUDA peer access, InfiniBand devices) or forced by OVERLAP_LINK.
"""
from __future__ import annotations

import os
from typing import Optional

import torch
import torch.distributed as dist

from overlap.control.agreement import decided_by_rank0

INFINIBAND_SYSFS = "/sys/class/infiniband"


def _local_link() -> str:
    """Ranks on one host: NVLink when CUDA peer access works, otherwise loopback/PCIe."""
    if torch.cuda.is_available() and torch.cuda.device_count() > 1:
        if torch.cuda.can_device_access_peer(0, 1):
            return "nvlink"
    return "loopback"


def _network_link() -> str:
    has_ib = os.path.isdir(INFINIBAND_SYSFS) and bool(os.listdir(INFINIBAND_SYSFS))
    return "infiniband" if has_ib else "ethernet"


def forced_levels(forced: str) -> Optional[tuple[str, str]]:
    """OVERLAP_LINK as (inside a node, across nodes); one value names both; None for 'auto'."""
    if forced == "auto":
        return None
    levels = forced.split(",")
    return levels[0], levels[-1]


def _within_one_node(group: dist.ProcessGroup, local_world_size: Optional[int]) -> bool:
    """Whether the group's ranks share a node, by torchrun's numbering (node * L + local)."""
    if local_world_size is None:
        return True
    nodes = {dist.get_global_rank(group, r) // local_world_size for r in range(dist.get_world_size(group))}
    return len(nodes) == 1


def level_links(forced: str, group: dist.ProcessGroup) -> tuple[str, str]:
    """The link classes inside a node and across nodes: forced, or detected (see `detect_link`)."""
    levels = forced_levels(forced)
    if levels is not None:
        return levels
    hosts: list = [None] * dist.get_world_size(group)
    dist.all_gather_object(hosts, os.uname().nodename, group=group)
    one_host = len(set(hosts)) == 1
    return decided_by_rank0(group, lambda: (_local_link(), _local_link() if one_host else _network_link()))


def detect_link(group: dist.ProcessGroup, forced: str = "auto", local_world_size: Optional[int] = None) -> str:
    """nvlink, infiniband, ethernet or loopback; `forced` (from OVERLAP_LINK) wins unless 'auto'.
    With one value per level, a group inside one node gets the first, any other the second.

    Every rank reports its host name. Ranks all on one host talk over NVLink when CUDA peer
    access works between their GPUs, else over loopback. Across hosts the slowest hop sets the
    pace of a ring: InfiniBand when the host has an IB device, else Ethernet. Rank 0's answer
    is used by all so that every rank plans the same way.
    """
    levels = forced_levels(forced)
    if levels is not None:
        return levels[0] if _within_one_node(group, local_world_size) else levels[1]
    return level_links(forced, group)[1]
