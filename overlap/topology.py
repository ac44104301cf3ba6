"""Which kind of link joins the ranks of a process group."""
from __future__ import annotations

import os

import torch
import torch.distributed as dist


def detect_link(group: dist.ProcessGroup, forced: str = "auto") -> str:
    """nvlink, infiniband, ethernet or loopback; `forced` (from OVERLAP_LINK) wins unless 'auto'.

    Every rank reports its host name; ranks all on one host talk over NVLink when CUDA peer
    access works between their GPUs, else over loopback (CPU) or PCIe, treated as loopback.
    Across hosts, InfiniBand when the host has an IB device, else Ethernet. Rank 0's answer
    is used by all so that every rank plans the same way.
    """
    if forced != "auto":
        return forced
    world = dist.get_world_size(group)
    hosts: list = [None] * world
    dist.all_gather_object(hosts, os.uname().nodename, group=group)
    if len(set(hosts)) == 1:
        link = "loopback"
        if torch.cuda.is_available() and torch.cuda.device_count() > 1:
            link = "nvlink" if torch.cuda.can_device_access_peer(0, 1) else "loopback"
    else:
        has_ib = os.path.isdir("/sys/class/infiniband") and bool(os.listdir("/sys/class/infiniband"))
        link = "infiniband" if has_ib else "ethernet"
    decision = [link]
    dist.broadcast_object_list(decision, src=dist.get_global_rank(group, 0), group=group)
    return decision[0]
