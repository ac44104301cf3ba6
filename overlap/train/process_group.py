"""The job's process group under torchrun, on a store of this worker group's own.

[Note: a store per worker group]
torchrun's c10d rendezvous serves its workers one TCP store for the whole job (hosted by the
rank-0 agent and reused by every rendezvous round), and what a process group writes there at
start-up (each rank's address, NCCL's id) outlives it: a restarted group that reads its
predecessor's entries connects to ranks that are gone. Keying the entries by
TORCHELASTIC_RESTART_COUNT does not help across nodes: that count is per agent (an agent
that restarts healthy workers because another node re-joined does not count a restart), so
nodes can disagree on it and wait on each other's keys forever.
Instead rank 0 opens a fresh store of its own and publishes its port and a random token in
the agent's store; the other ranks connect to what is published and use it only once its
token reads back. An entry left by an earlier group names a server that has exited with its
rank 0 (torchrun stops every worker before the next round starts), so it is passed over.
"""
from __future__ import annotations

import datetime
import os
import time
import uuid

import torch.distributed as dist

_ANNOUNCEMENT = "overlap/group-store"       # "<port> <token>" in the agent's store
_TOKEN = "overlap/token"                    # the token, in the group's own store
_CONNECT_S = 2.0                             # one attempt at a published store


def init_process_group(backend: str, timeout: datetime.timedelta) -> None:
    """`init_process_group` from torchrun's (or another launcher's) environment, safe across
    `--max-restarts` and elastic membership changes (see [Note: a store per worker group])."""
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
        dist.init_process_group(backend, timeout=timeout)      # rank 0 hosts a fresh store anyway
        return
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    host, port = os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"])
    agent_store = dist.TCPStore(host, port, world, is_master=False, timeout=timeout)
    store = _own_store(agent_store, host, rank, world, timeout)
    dist.init_process_group(backend, store=store, rank=rank, world_size=world, timeout=timeout)


def _own_store(agent_store: dist.Store, host: str, rank: int, world: int,
               timeout: datetime.timedelta) -> dist.Store:
    if rank == 0:
        store = dist.TCPStore(host, 0, world, is_master=True, timeout=timeout, wait_for_workers=False)
        token = uuid.uuid4().hex
        store.set(_TOKEN, token)
        agent_store.set(_ANNOUNCEMENT, f"{store.port} {token}")
        return store
    deadline = time.monotonic() + timeout.total_seconds()
    while True:
        port, token = agent_store.get(_ANNOUNCEMENT).decode().split()
        try:
            store = dist.TCPStore(host, int(port), world, is_master=False,
                                  timeout=datetime.timedelta(seconds=_CONNECT_S))
            if store.get(_TOKEN).decode() == token:
                store.set_timeout(timeout)
                return store
        except RuntimeError:           # torch's DistError: an earlier group's store, gone
            pass
        if time.monotonic() > deadline:
            raise TimeoutError(f"rank {rank}: no store of this worker group was published in the agent's store "
                               f"within {timeout.total_seconds():.0f} s")
        time.sleep(0.1)
