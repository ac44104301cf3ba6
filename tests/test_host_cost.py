"""The runtime's host work per step has the right shape: Python calls made by overlap's own
code in one steady-state training step do not grow with the parameters in a unit (flat
groups are handled as a whole, never parameter by parameter), and grow at most linearly
with the number of units.

Calls are counted with `sys.setprofile` on the training thread: 'call' events of functions
defined under the `overlap` package (and `overlap.kernels`), and 'c_call' events (builtins,
torch ops) made from those functions. On CPU, autograd runs backward and its hooks on the
calling thread, so the whole step is seen; gloo's own threads (completion callbacks) are not.
benchmarks/overhead.py measures the time the same work costs.
"""
from __future__ import annotations

import os
import sys
from typing import Callable

import pytest
import torch

WIDTH = 8
WARMUP = 3
COUNTED = 3                 # steady-state steps counted; the fewest calls among them is kept
UNITS = 8
# Parameters per unit -> nn.Linear(WIDTH, WIDTH) layers in one unit: 1 (no bias), 8 and 32.
LAYOUTS = {1: (1, False), 8: (4, True), 32: (16, True)}
# Calls a step may make beyond the 1-parameter model's, whatever the parameters per unit: a
# constant. Branches that depend on timing (a collective already complete when it is waited
# for, or not) move the count by up to ~20 calls from run to run; work done per parameter
# costs at least one call each, 8 × 31 = 248 calls at 32 parameters per unit.
PARAM_SLACK_CALLS = 64
# Doubling the units may at most double the calls, give or take this constant.
UNIT_SLACK_CALLS = 64


class Unit(torch.nn.Module):
    def __init__(self, layers: int, bias: bool) -> None:
        super().__init__()
        self.layers = torch.nn.ModuleList(torch.nn.Linear(WIDTH, WIDTH, bias=bias) for _ in range(layers))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        return x


# Not the runtime's own work: a gradient's `__torch_function__` passes each of the optimizer's
# operations on `.grad` through (overlap/runtime/shard_grad.py). A per-tensor optimizer (torch's
# default on CPU) makes some per parameter, each about 2.3 us more than on a plain tensor.
PASSED_THROUGH = os.path.join("overlap", "runtime", "shard_grad.py")


def _package_dirs() -> tuple[str, ...]:
    import overlap
    import overlap.kernels

    # overlap.kernels is a namespace package (kernels/, no __init__.py): its one directory.
    return (os.path.dirname(os.path.abspath(overlap.__file__)) + os.sep,
            os.path.abspath(list(overlap.kernels.__path__)[0]) + os.sep)


def _count_calls(fn: Callable[[], object]) -> int:
    """Calls made by the runtime's own code while `fn` runs (see the module notes)."""
    dirs = _package_dirs()
    ours: dict[str, bool] = {}
    count = 0

    def profile(frame, event: str, arg) -> None:
        nonlocal count
        if event not in ("call", "c_call"):
            return
        filename = frame.f_code.co_filename
        mine = ours.get(filename)
        if mine is None:
            path = os.path.abspath(filename)
            mine = ours[filename] = path.startswith(dirs) and not path.endswith(PASSED_THROUGH)
        count += mine

    sys.setprofile(profile)
    try:
        fn()
    finally:
        sys.setprofile(None)
    return count


def _calls_per_step(units: int, layers: int, bias: bool) -> int:
    """The fewest runtime calls in one of COUNTED steady-state steps of a ShardedModule."""
    from overlap import ShardedModule

    torch.manual_seed(0)
    # Settings fixed by hand, so that the planner cannot choose differently for different
    # models: every unit its own bucket, one unit gathered ahead.
    model = ShardedModule(torch.nn.Sequential(*(Unit(layers, bias) for _ in range(units))), unit_types=(Unit,),
                          bucket_mb=1e-6, prefetch_depth=1)
    assert len(model.scheduler.units) == units
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)
    batch = torch.randn(2, WIDTH)
    losses = []

    def step() -> None:
        loss = model(batch).square().mean()
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(loss.item())

    for _ in range(WARMUP):
        step()
    counts = [_count_calls(step) for _ in range(COUNTED)]
    assert all(torch.isfinite(torch.tensor(losses))), losses
    return min(counts)


def _measure(rank: int, world: int) -> dict[str, int]:
    counts = {f"{UNITS} units x {params} params": _calls_per_step(UNITS, *LAYOUTS[params]) for params in LAYOUTS}
    for units in (2 * UNITS, 4 * UNITS):
        counts[f"{units} units x 8 params"] = _calls_per_step(units, *LAYOUTS[8])
    return counts


@pytest.fixture(scope="module")
def calls() -> dict[str, int]:
    from distributed import run_distributed

    (counts,) = run_distributed(_measure, 1, timeout=240)
    return counts


@pytest.mark.timeout(300)
def test_calls_do_not_grow_with_parameters_per_unit(calls):
    one = calls[f"{UNITS} units x 1 params"]
    for params in (8, 32):
        many = calls[f"{UNITS} units x {params} params"]
        assert many <= one + PARAM_SLACK_CALLS, (
            f"{UNITS} units: {many} runtime calls per step with {params} parameters per unit against {one} with 1 "
            f"(+{(many - one) / UNITS / (params - 1):.1f} per unit per extra parameter); all counts: {calls}")


@pytest.mark.timeout(300)
def test_calls_grow_at_most_linearly_with_units(calls):
    for units in (UNITS, 2 * UNITS):
        fewer, more = calls[f"{units} units x 8 params"], calls[f"{2 * units} units x 8 params"]
        assert more <= 2 * fewer + UNIT_SLACK_CALLS, (
            f"{2 * units} units: {more} runtime calls per step, more than twice the {fewer} of {units} units; "
            f"all counts: {calls}")
