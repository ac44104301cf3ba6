"""Which kind of link joins the ranks of a process group: detected on the running job (host
names, NVLink between the ranks' GPUs as NVML reports it, InfiniBand devices) or forced by
OVERLAP_LINK.
"""
from __future__ import annotations

import logging
import os
from typing import Optional

import torch.distributed as dist

from overlap.control.agreement import decided_by_rank0
from overlap.control.gpu_links import gpu_uuid, host_link
from overlap.control.settings import device_for

INFINIBAND_SYSFS = "/sys/class/infiniband"

logger = logging.getLogger("overlap")


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
    ranks: list = [None] * dist.get_world_size(group)
    dist.all_gather_object(ranks, (os.uname().nodename, gpu_uuid(device_for(group))), group=group)
    hosts = [host for host, _ in ranks]

    def decide() -> tuple[str, str, str]:
        # Rank 0's host stands for every host: the GPUs of the ranks that share it.
        inside, why = host_link([gpu for host, gpu in ranks if host == hosts[0]])
        return inside, inside if len(set(hosts)) == 1 else _network_link(), why

    inside, across, why = decided_by_rank0(group, decide)
    logger.info("link inside a node: %s (%s); across nodes: %s", inside, why, across)
    return inside, across


def detect_link(group: dist.ProcessGroup, forced: str = "auto", local_world_size: Optional[int] = None) -> str:
    """nvlink, pcie, infiniband, ethernet or loopback; `forced` (from OVERLAP_LINK) wins unless
    'auto'. With one value per level, a group inside one node gets the first, any other the
    second.

    Every rank reports its host name and its GPU. Ranks all on one host talk over NVLink when
    NVML reports NVLink between each pair of their GPUs, else over PCIe, and over loopback
    when they compute on CPU (`overlap.control.gpu_links.host_link`). Across hosts the slowest
    hop sets the pace of a ring: InfiniBand when the host has an IB device, else Ethernet.
    Rank 0's answer is used by all so that every rank plans the same way.
    """
    levels = forced_levels(forced)
    if levels is not None:
        return levels[0] if _within_one_node(group, local_world_size) else levels[1]
    return level_links(forced, group)[1]
