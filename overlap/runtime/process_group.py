"""What a process group runs: which backend serves a device type, the flat tensor
collectives under the name this torch gives them, and the backends' variables start-up
checks before the side groups are made.
"""
from __future__ import annotations

import logging
import os
import socket
from typing import Mapping, Optional

import torch.distributed as dist

from overlap.base.config import backend_env, local_world_size_from_env

logger = logging.getLogger("overlap")

# Newer torch names the tensor-in/tensor-out collectives `*_single`; older releases only
# have the `*_tensor` spelling.
all_gather_flat = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
reduce_scatter_flat = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


# [Note: groups made by some ranks only]
# A group that only its members make (`new_group(..., use_local_synchronization=True)`: a
# pipeline stage's expert groups, the side groups of a model over some ranks) is named by torch
# after its ranks and how many groups the caller belongs to already. Members whose counts
# differ (one of them took part in a group the other did not: a tied head's group over the
# first and last stage, an earlier job in the same processes) name it differently and wait for
# each other until the timeout. So before making such groups the members, who share `parent`,
# bring their counts level: each one below the highest makes groups of itself alone until it
# reaches it. Then they make the same groups in the same order and agree on every name.


def level_group_counts(parent: dist.ProcessGroup) -> None:
    """See [Note: groups made by some ranks only]. Every rank of `parent` calls it."""
    from torch.distributed.distributed_c10d import _world

    if dist.get_world_size(parent) == 1:
        return
    counts: list[Optional[int]] = [None] * dist.get_world_size(parent)
    dist.all_gather_object(counts, len(_world.pg_names), group=parent)
    for _ in range(max(counts) - len(_world.pg_names)):
        dist.new_group([dist.get_rank()], backend="gloo", use_local_synchronization=True)


def device_backend(group: dist.ProcessGroup, device_type: str) -> Optional[str]:
    """The backend that runs `device_type` tensors in `group` ("gloo", "nccl"), None if none
    does. `dist.get_backend` cannot say: a group from `init_process_group()` without a
    backend is "undefined" there, one from "cpu:gloo,cuda:nccl" is that string."""
    pairs = dict(pair.split(":", 1) for pair in dist.get_backend_config(group).split(","))
    return pairs.get(device_type)


def gloo_interface(nccl_ifname: str, interfaces: list[str]) -> Optional[str]:
    """The interface gloo should bind to for NCCL_SOCKET_IFNAME's value: NCCL matches name
    prefixes ("eth" is eth0, eth1...), "=name" exactly, "^..." excludes; gloo needs one exact
    name. The first of `interfaces` (the machine's, in index order) that NCCL would pick, None
    for an exclusion list or no match."""
    if nccl_ifname.startswith("^"):
        return None
    exact = nccl_ifname.startswith("=")
    wanted = [w.strip() for w in nccl_ifname.lstrip("=").split(",") if w.strip()]
    return next((name for name in interfaces for w in wanted if (name == w if exact else name.startswith(w))), None)


def check_backend_env(group: dist.ProcessGroup, environ: Optional[Mapping[str, str]] = None) -> None:
    """Before the side groups (flags, order words) are made, at start-up on every rank:

    - TORCH_NCCL_BLOCKING_WAIT=1 makes every collective issued on a side stream block the
      host until it completes (see [Note: collectives synchronous on their side stream] in
      overlap/runtime/issue.py), so nothing overlaps: warned, not refused, since it is the
      user's setting and results stay correct.
    - The gloo side groups bind to the interface the hostname resolves to; where that is a
      loopback address (127.0.1.1 in many images), ranks on other hosts cannot connect and
      wrapping waits until the group's timeout. GLOO_SOCKET_IFNAME is taken from
      NCCL_SOCKET_IFNAME when only that is set, and its absence is warned where it matters."""
    env = backend_env(environ)
    blocking = env.get("TORCH_NCCL_BLOCKING_WAIT", env.get("NCCL_BLOCKING_WAIT", "0")).strip().lower()
    if device_backend(group, "cuda") == "nccl" and blocking in ("1", "true", "yes", "on"):
        logger.warning("TORCH_NCCL_BLOCKING_WAIT=1: each collective blocks the host until it completes, so "
                       "communication does not overlap compute; unset it (TORCH_NCCL_ASYNC_ERROR_HANDLING and the "
                       "process group's timeout still catch a stuck collective)")
    if dist.get_world_size(group) == 1 or "GLOO_SOCKET_IFNAME" in env:
        return
    if "NCCL_SOCKET_IFNAME" in env:
        name = gloo_interface(env["NCCL_SOCKET_IFNAME"], [n for _, n in socket.if_nameindex()])
        if name is not None:
            # Read by gloo when each group is made: the side groups made after this bind there.
            os.environ["GLOO_SOCKET_IFNAME"] = name
            return
    local = local_world_size_from_env(environ)
    if local is not None and local < dist.get_world_size(group) and _hostname_is_loopback():
        logger.warning("the hostname %s resolves to a loopback address and the ranks span several hosts: the gloo "
                       "groups of the end-of-backward flags and the order check would bind there and wrapping would wait for "
                       "the other hosts until the timeout; set GLOO_SOCKET_IFNAME (or NCCL_SOCKET_IFNAME) to the "
                       "interface between the hosts", socket.gethostname())


def _hostname_is_loopback() -> bool:
    try:
        return socket.gethostbyname(socket.gethostname()).startswith("127.")
    except OSError:
        return False
