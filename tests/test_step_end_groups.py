"""The step-end controllers (depth re-planner, automatic compression) decide over the host-side
gloo group the end-of-backward flags use, never over the device group: on NCCL a broadcast
there queues behind the whole backward and its read stalls the host until the device drains.

On CPU both groups are gloo and the flags' group is the device group itself, so the flags'
group is made a gloo group of its own here, as it is beside NCCL; every collective issued
while the controllers run is then recorded with its group.
"""
from __future__ import annotations

import contextlib
from collections import Counter

import pytest
import torch

STEPS = 4
# Every collective a controller could issue, by the name torch.distributed gives it.
COLLECTIVES = ("broadcast_object_list", "broadcast", "all_reduce", "all_gather_object", "all_gather",
               "all_gather_into_tensor", "reduce_scatter_tensor", "all_to_all_single", "barrier", "gather_object",
               "scatter_object_list", "monitored_barrier")


def _step_end_collectives(rank: int, world: int, late: bool) -> dict:
    """STEPS training steps with the re-planner and compression="auto"; the collectives the
    step-end controllers issued, by group ("device", "flags" or "other"), the device-clock
    probes rank 0 ran there, and the controllers' decisions."""
    import torch.distributed as dist

    from overlap import ShardedModule
    from overlap.control import compression_auto, step_end
    from overlap.runtime import collectives
    from overlap.runtime.timing import records_one_step_late

    made = []

    def own_gloo_group(group: dist.ProcessGroup) -> dist.ProcessGroup:
        flags = dist.new_group(dist.get_process_group_ranks(group), backend="gloo", use_local_synchronization=True)
        dist.barrier(group=flags)
        made.append(flags)
        return flags

    collectives.host_group = own_gloo_group
    inside = []
    issued: Counter = Counter()

    def recorded(name: str, fn):
        def run(*args, **kwargs):
            if inside:
                group = kwargs.get("group") or dist.group.WORLD
                where = "flags" if group in made else "device" if group is dist.group.WORLD else "other"
                issued[(name, where)] += 1
            return fn(*args, **kwargs)
        return run

    for name in COLLECTIVES:
        setattr(dist, name, recorded(name, getattr(dist, name)))
    probes = []                     # the steps at whose end the codec was timed

    def timed(*args, **kwargs):
        if inside:
            probes.append(inside[-1])
        return measure(*args, **kwargs)

    measure, compression_auto.measure_codec = compression_auto.measure_codec, timed
    call = step_end.StepEndControllers.__call__

    def controllers(self, scheduler) -> None:
        inside.append(scheduler.steps.step)
        try:
            call(self, scheduler)
        finally:
            inside.pop()

    step_end.StepEndControllers.__call__ = controllers
    torch.manual_seed(0)
    with records_one_step_late() if late else contextlib.nullcontext():
        model = ShardedModule(torch.nn.Sequential(*[torch.nn.Linear(32, 32) for _ in range(3)]), bucket_mb=1e-6,
                              compression="auto")
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    for _ in range(STEPS):
        model(torch.randn(8, 32) + rank).square().mean().backward()
        optimizer.step()
        optimizer.zero_grad()
    model.scheduler.steps.flush(model.scheduler.order)
    chooser = next(c for c in model.step_end.controllers if isinstance(c, compression_auto.CompressionChooser))
    return dict(issued={f"{n} on {g}": k for (n, g), k in issued.items()}, probes=probes,
                asks=chooser.asks, decided=chooser.decided)


@pytest.mark.timeout(200)
@pytest.mark.parametrize("late", [False, True], ids=["host_clock", "records_one_step_late"])
def test_step_end_controllers_issue_no_collective_on_the_device_group(late):
    from distributed import run_distributed

    for rank, got in enumerate(run_distributed(_step_end_collectives, 2, late, timeout=150)):
        assert got["decided"] is not None and got["asks"] >= 1, got          # the chooser decided
        assert got["issued"] and all(k.endswith(" on flags") for k in got["issued"]), got
        # The codec is timed at start-up, never while the step's work may still be queued.
        assert got["probes"] == [], got
