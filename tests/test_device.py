"""Which device a process group puts the shards on, for every way of initialising it.

A CUDA machine's process groups cannot exist here, so the pieces are stood in for: torch's
own BackendConfig turns each `init_process_group` form into the backend string a GPU machine
gets (with the accelerator reported as CUDA), and torch.cuda answers as a machine with 8 GPUs.
"""
from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist
from torch.distributed import distributed_c10d as c10d

from overlap.runtime.pending import Pending, StreamHandoff
from overlap.control.settings import device_for
from overlap.runtime.timing import CollectiveStamps, HostClock

FORMS = {"init_process_group()": "undefined", "nccl": "nccl", "cpu:gloo,cuda:nccl": "cpu:gloo,cuda:nccl",
         "gloo": "gloo"}


def _gpu_machine(monkeypatch, form: str, current: int = 2, local_rank: str | None = "2") -> None:
    monkeypatch.setattr(torch._C, "_get_accelerator", lambda: torch.device("cuda"))
    config = str(c10d.BackendConfig(c10d.Backend(FORMS[form])))
    monkeypatch.setattr(dist, "get_backend_config", lambda group=None: config)
    monkeypatch.setattr(dist, "get_rank", lambda group=None: 0)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 8)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: current)
    if local_rank is None:
        monkeypatch.delenv("LOCAL_RANK", raising=False)
    else:
        monkeypatch.setenv("LOCAL_RANK", local_rank)


UNBOUND = SimpleNamespace(bound_device_id=None)


@pytest.mark.parametrize("form", ["init_process_group()", "nccl", "cpu:gloo,cuda:nccl"])
def test_nccl_for_cuda_puts_shards_on_the_current_gpu(monkeypatch, form):
    _gpu_machine(monkeypatch, form)
    assert device_for(UNBOUND) == torch.device("cuda", 2)


def test_gloo_keeps_shards_on_the_cpu(monkeypatch):
    _gpu_machine(monkeypatch, "gloo")
    assert device_for(UNBOUND) == torch.device("cpu")


def test_bound_device_wins(monkeypatch):
    _gpu_machine(monkeypatch, "init_process_group()", current=0, local_rank="5")
    assert device_for(SimpleNamespace(bound_device_id=torch.device("cuda", 5))) == torch.device("cuda", 5)


def test_current_device_must_be_local_ranks(monkeypatch):
    _gpu_machine(monkeypatch, "nccl", current=0, local_rank="3")
    with pytest.raises(ValueError, match=r"cuda:0 but LOCAL_RANK is 3; call torch.cuda.set_device\(3\)"):
        device_for(UNBOUND)
    # One GPU visible per process (CUDA_VISIBLE_DEVICES set per rank): cuda:0 is right.
    _gpu_machine(monkeypatch, "nccl", current=0, local_rank="3")
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    assert device_for(UNBOUND) == torch.device("cuda", 0)
    _gpu_machine(monkeypatch, "nccl", current=4, local_rank=None)
    assert device_for(UNBOUND) == torch.device("cuda", 4)


def test_cpu_machine_uses_the_cpu(monkeypatch):
    monkeypatch.setattr(torch._C, "_get_accelerator", lambda: torch.device("cpu"))
    config = str(c10d.BackendConfig(c10d.Backend("undefined")))          # init_process_group() without a GPU
    monkeypatch.setattr(dist, "get_backend_config", lambda group=None: config)
    assert config == "cpu:gloo" and device_for(UNBOUND) == torch.device("cpu")


def test_wait_orders_the_collectives_own_device(monkeypatch):
    """The compute stream that waits is the collective's device's, not the current device's."""
    waited = []

    class Stream:
        def __init__(self, device):
            self.device = device

        def wait_event(self, event):
            waited.append((self.device, event))

    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: Stream(device))
    Pending(CollectiveStamps("all_gather", "u", 0, 0.0), HostClock(),
            StreamHandoff("done", torch.device("cuda", 3), ())).wait()
    assert waited == [(torch.device("cuda", 3), "done")]


STEPS, BATCH, LR = 3, 4, 0.1


def _net() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Tanh(), torch.nn.Linear(8, 2))


def _batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(step)
    return torch.randn(BATCH, 8, generator=g), torch.randn(BATCH, 2, generator=g)


def _train(rank: int, world: int) -> tuple[str, str, list[float], dict[str, torch.Tensor]]:
    """SGD steps on this rank's rows of each batch; the loss of the whole batch each step."""
    from overlap import ShardedModule

    model = ShardedModule(_net(), bucket_mb=1e-6)
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    rows = BATCH // world
    losses = []
    for step in range(STEPS):
        x, y = _batch(step)
        loss = torch.nn.functional.mse_loss(model(x[rank * rows:(rank + 1) * rows]), y[rank * rows:(rank + 1) * rows])
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        total = loss.detach().clone()
        dist.all_reduce(total)
        losses.append(total.item() / world)
    return dist.get_backend(), str(model.collectives.device), losses, model.full_state_dict()


def _reference() -> tuple[list[float], dict[str, torch.Tensor]]:
    """One process, the whole batch each step."""
    model = _net()
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    losses = []
    for step in range(STEPS):
        x, y = _batch(step)
        loss = torch.nn.functional.mse_loss(model(x), y)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return losses, model.state_dict()


@pytest.mark.timeout(120)
@pytest.mark.parametrize("world", [1, 2])
def test_init_process_group_without_a_backend_trains_on_this_machine(world):
    """`init_process_group()` names no backend ("undefined"): collectives still pick the CPU's
    (gloo's all-to-all reduction, not its reduce-scatter, whose work has no future), and the
    model trains as one process on the whole batch does."""
    from distributed import run_distributed

    reference_losses, reference_state = _reference()
    for backend, device, losses, state in run_distributed(_train, world, backend=None, timeout=100):
        assert backend == "undefined" and device == "cpu"
        torch.testing.assert_close(torch.tensor(losses), torch.tensor(reference_losses), rtol=1e-5, atol=1e-6)
        assert losses[-1] < losses[0]
        assert set(state) == set(reference_state)
        for name, value in reference_state.items():
            torch.testing.assert_close(state[name], value, rtol=1e-5, atol=1e-6, msg=name)
