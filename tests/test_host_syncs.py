"""The steady-state training step makes none of the calls that block the host on CUDA, but
reads of host tensors exchanged between hosts over gloo: the `.tolist()` of the flags the end
of backward needs (see [Note: the flags stay on the host] in overlap/runtime/collectives.py)
and of the order word before each collective (overlap/runtime/order_check.py).

What a CPU run can prove: the same Python runs as on CUDA (only the stream branches
differ), so these are the calls overlap's step makes; whether a call would synchronise
depends on its tensor being on the device, which a CPU run cannot tell apart. The CUDA clock
and the stream protocol are checked with fakes (tests/test_timing.py,
tests/test_all_reduce_stream.py); benchmarks/gpu_checks.py's sync_free check runs the step on a
GPU under `torch.cuda.set_sync_debug_mode("error")`.
"""
from __future__ import annotations

import os
import sys

import pytest
import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(os.path.dirname(HERE), "benchmarks"))

WARMUP, STEPS = 2, 3


def _steady_state_calls(rank: int, world: int, compression: str | None, sharding: str | None) -> dict:
    from gpu_sync_checks import count_sync_calls

    from overlap import ShardedModule

    torch.manual_seed(0)
    model = ShardedModule(torch.nn.Sequential(torch.nn.Linear(16, 16), torch.nn.Tanh(), torch.nn.Linear(16, 4)),
                          bucket_mb=1e-6, compression=compression, sharding=sharding)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    batch = torch.randn(8, 16) + rank

    def step() -> float:
        loss = model(batch).square().mean()
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return loss.detach()

    for _ in range(WARMUP):
        step()
    with count_sync_calls() as counts:
        losses = [step() for _ in range(STEPS)]
    assert all(torch.isfinite(loss) for loss in losses)
    return dict(counts)


@pytest.mark.timeout(200)
@pytest.mark.parametrize("compression", [None, "int8-int4"])
def test_steady_state_step_reads_only_the_host_flags(compression):
    from distributed import run_distributed

    for counts in run_distributed(_steady_state_calls, 2, compression, None, timeout=150):
        # One read per step of the flags and one per collective of the order word: host
        # tensors all-reduced over gloo. Nothing is copied to the device to be all-reduced
        # there, nothing read back from it.
        flags = "Tensor.tolist in collectives.py:result"
        words = "Tensor.tolist in order_check.py:before_issue"
        assert set(counts) <= {flags, words}, counts
        assert counts[flags] == STEPS and counts[words] > 0


@pytest.mark.parametrize("config,new_group", [("cpu:gloo,cuda:nccl", False), ("cuda:nccl", True), ("cpu:gloo", False)])
def test_flags_go_over_gloo(monkeypatch, config, new_group):
    """The flags' group: the group itself where gloo serves its CPU tensors, else a gloo group
    over the same ranks, made only by them."""
    import torch.distributed as dist

    from overlap.runtime import collectives
    from overlap.runtime.collectives import host_group

    made, levelled = [], []
    # See [Note: groups made by some ranks only]: the members level their counts first.
    monkeypatch.setattr(collectives, "level_group_counts", levelled.append)
    monkeypatch.setattr(dist, "get_backend_config", lambda group=None: config)
    monkeypatch.setattr(dist, "get_world_size", lambda group=None: 2)
    monkeypatch.setattr(dist, "get_process_group_ranks", lambda group: [4, 5])
    monkeypatch.setattr(dist, "new_group", lambda ranks, **kwargs: made.append((ranks, kwargs)) or "gloo group")
    connected = []
    monkeypatch.setattr(dist, "barrier", lambda group=None: connected.append(group))
    group = object()
    assert host_group(group) == ("gloo group" if new_group else group)
    assert made == ([([4, 5], {"backend": "gloo", "use_local_synchronization": True})] if new_group else [])
    assert connected == (["gloo group"] if new_group else [])         # all connected before any goes on
    assert levelled == ([group] if new_group else [])


@pytest.mark.parametrize("nccl,found", [("eth", "eth0"), ("=eth1", "eth1"), ("ib,eth", "eth0"), ("^docker,lo", None),
                                        ("wlan", None)])
def test_gloo_interface_is_the_first_nccl_would_pick(nccl, found):
    from overlap.runtime.process_group import gloo_interface

    assert gloo_interface(nccl, ["lo", "docker0", "eth0", "eth1"]) == found


def _backend_env_outcome(monkeypatch, caplog, env: dict, backend: str = "cpu:gloo,cuda:nccl", world: int = 4,
                         loopback: bool = False) -> tuple[list[str], str | None]:
    import torch.distributed as dist

    from overlap.runtime import process_group

    monkeypatch.setattr(dist, "get_backend_config", lambda group=None: backend)
    monkeypatch.setattr(dist, "get_world_size", lambda group=None: world)
    monkeypatch.setattr(process_group.socket, "if_nameindex", lambda: [(1, "lo"), (2, "eth0")])
    monkeypatch.setattr(process_group, "_hostname_is_loopback", lambda: loopback)
    monkeypatch.setenv("GLOO_SOCKET_IFNAME", "")     # so that teardown restores it as it was
    monkeypatch.delenv("GLOO_SOCKET_IFNAME")
    caplog.clear()
    process_group.check_backend_env(object(), env)
    return [r.getMessage() for r in caplog.records], os.environ.get("GLOO_SOCKET_IFNAME")


def test_blocking_wait_is_warned_on_nccl_only(monkeypatch, caplog):
    warned, _ = _backend_env_outcome(monkeypatch, caplog, {"TORCH_NCCL_BLOCKING_WAIT": "1"})
    assert len(warned) == 1 and "TORCH_NCCL_BLOCKING_WAIT=1" in warned[0] and "does not overlap" in warned[0]
    assert _backend_env_outcome(monkeypatch, caplog, {"TORCH_NCCL_BLOCKING_WAIT": "1"}, backend="cpu:gloo")[0] == []
    assert _backend_env_outcome(monkeypatch, caplog, {"TORCH_NCCL_BLOCKING_WAIT": "0"})[0] == []


def test_gloo_side_groups_take_nccls_interface_or_warn_on_a_loopback_hostname(monkeypatch, caplog):
    # Only NCCL's interface set: gloo's side groups take the one it names.
    assert _backend_env_outcome(monkeypatch, caplog, {"NCCL_SOCKET_IFNAME": "eth"}) == ([], "eth0")
    # Neither set, ranks on several hosts, the hostname on loopback: warned, naming the variable.
    warned, name = _backend_env_outcome(monkeypatch, caplog, {"LOCAL_WORLD_SIZE": "2"}, loopback=True)
    assert name is None and len(warned) == 1 and "GLOO_SOCKET_IFNAME" in warned[0]
    # One host, or a hostname that resolves off loopback: nothing to say.
    assert _backend_env_outcome(monkeypatch, caplog, {"LOCAL_WORLD_SIZE": "4"}, loopback=True) == ([], None)
    assert _backend_env_outcome(monkeypatch, caplog, {"LOCAL_WORLD_SIZE": "2"}) == ([], None)
