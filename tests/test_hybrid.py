"""Hybrid sharding (shard inside a node, replicate across nodes) and hpZ (shard over every
rank, re-gather inside the node for backward) on an emulated two-node cluster: two network
namespaces of 2 ranks each, joined by a throttled link, equal one process on the same global
batches."""
from __future__ import annotations

import functools
import json
import os
import shutil
import subprocess
import sys

import pytest
import torch

from parity import train
from parity_cases import CASES

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(os.path.dirname(HERE), "benchmarks"))


def _namespaces_work() -> str | None:
    """Why the emulated cluster cannot run here, or None."""
    if os.geteuid() != 0:
        return "needs root for ip netns and tc"
    if shutil.which("ip") is None or shutil.which("tc") is None:
        return "needs the ip and tc commands (iproute2)"
    probe = subprocess.run(["ip", "netns", "add", f"ovlprobe{os.getpid()}"], capture_output=True, text=True)
    if probe.returncode != 0:
        return f"cannot create network namespaces: {probe.stderr.strip()}"
    subprocess.run(["ip", "netns", "del", f"ovlprobe{os.getpid()}"], capture_output=True)
    return None


REASON = _namespaces_work()
needs_cluster = pytest.mark.skipif(REASON is not None, reason=f"emulated cluster: {REASON}")


# (case, wrap, how the sharding describes itself) for each run on the emulated cluster.
CLUSTER_RUNS = [
    ("features_bucketed", {"sharding": "hybrid"}, "hybrid sharding: 2 ranks per shard group, 2 replicas"),
    ("gpt_adamw_groups", {"sharding": "hybrid"}, "hybrid sharding: 2 ranks per shard group, 2 replicas"),
    ("gpt_adamw_groups", {"sharding": "hpz"}, "hpZ: full sharding over 4 ranks, backward gathers over 2 ranks per node"),
]


@functools.lru_cache(maxsize=None)
def _cluster_results(directory: str) -> list[dict]:
    """Every run of CLUSTER_RUNS, one after another in one torchrun job on the two nodes (one
    cluster set-up and one start of 4 ranks, which costs far more than the training)."""
    from cluster import run_on_cluster

    out = os.path.join(directory, "results.pt")
    runs = json.dumps([[name, wrap] for name, wrap, _ in CLUSTER_RUNS])
    results = run_on_cluster("1gbit", 2, [os.path.join(HERE, "cluster_worker.py"), runs, out],
                             timeout_s=300, env={"OMP_NUM_THREADS": "1"})
    for node, result in enumerate(results):
        assert result.returncode == 0, f"node {node}:\n{result.stdout[-4000:]}"
    return torch.load(out, weights_only=False)


@pytest.fixture(scope="module")
def cluster_dir(tmp_path_factory) -> str:
    return str(tmp_path_factory.mktemp("cluster"))


@needs_cluster
@pytest.mark.timeout(400)
@pytest.mark.parametrize("run", range(len(CLUSTER_RUNS)),
                         ids=[f"{name}-{wrap['sharding']}" for name, wrap, _ in CLUSTER_RUNS])
def test_sharding_on_two_nodes_equals_one_process(run: int, cluster_dir: str) -> None:
    name, _, described = CLUSTER_RUNS[run]
    got = _cluster_results(cluster_dir)[run]
    ref, case = train(CASES[name]), CASES[name]
    assert got["sharding"] == described
    tol = {"rtol": case.rtol, "atol": case.atol}
    torch.testing.assert_close(torch.tensor(got["losses"]), torch.tensor(ref["losses"]), **tol)
    for key, expected in ref["state"].items():
        torch.testing.assert_close(got["state"][key], expected, **tol, msg=lambda m: f"{key}: {m}")


def _train_on_mesh_and_save(rank: int, world: int, path: str) -> dict:
    from torch.distributed.device_mesh import init_device_mesh

    from overlap import ShardedModule, checkpoint
    from overlap.models import GPT
    from parity import _optimizer, _slice, token_batches
    from parity_cases import SMALL_GPT

    mesh = init_device_mesh("cpu", (2, world // 2), mesh_dim_names=("replicate", "shard"))
    torch.manual_seed(0)
    model = ShardedModule(GPT(SMALL_GPT), mesh=mesh)
    optimizer = _optimizer("adamw_groups", model)
    for inputs, targets in token_batches(SMALL_GPT.vocab_size, 12, steps=2)():
        model(*_slice((inputs, targets), rank, world)).backward()
        optimizer.step()
        optimizer.zero_grad()
    checkpoint.save(path, model, optimizer)
    return {"sharding": model.sharding.describe(), "state": model.full_state_dict()}


def _load_fully_sharded(rank: int, world: int, path: str) -> dict:
    from overlap import ShardedModule, checkpoint
    from overlap.models import GPT
    from parity import _optimizer
    from parity_cases import SMALL_GPT

    torch.manual_seed(1)
    model = ShardedModule(GPT(SMALL_GPT))
    checkpoint.load(path, model, _optimizer("adamw_groups", model))
    return model.full_state_dict()


@pytest.mark.timeout(300)
def test_a_2d_mesh_checkpoint_loads_fully_sharded(tmp_path) -> None:
    """A (2 replicas × 2 shards) mesh on one host; its checkpoint loads at full sharding."""
    from distributed import run_distributed

    saved = run_distributed(_train_on_mesh_and_save, 4, str(tmp_path / "ckpt"))
    assert saved[0]["sharding"] == "hybrid sharding: 2 ranks per shard group, 2 replicas"
    for result in saved[1:]:
        for key, value in saved[0]["state"].items():
            assert torch.equal(result["state"][key], value), key          # replicas agree
    for state in run_distributed(_load_fully_sharded, 2, str(tmp_path / "ckpt")):
        for key, value in saved[0]["state"].items():
            assert torch.equal(state[key], value), key
