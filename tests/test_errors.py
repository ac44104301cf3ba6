"""Bad input raises a clear error on every rank instead of hanging or corrupting training.

Every case runs on the same two ranks, one after another (tests/distributed.py's
[Note: many cases on one launch]); each test reads its own case's outcome on each rank.
"""
from __future__ import annotations

import pytest
import torch
from torch import nn

from distributed import CaseLaunch, RankCase

BAD_ENVIRONMENT = [
    ("OVERLAP_PREFETCH_DEPTH", "-1"), ("OVERLAP_PREFETCH_DEPTH", "two"),
    ("OVERLAP_BUCKET_MB", "0"), ("OVERLAP_BUCKET_MB", "nan"),
    ("OVERLAP_KERNELS", "fastest"), ("OVERLAP_NVTX", "yes"), ("OVERLAP_LOG", "loud"),
    ("OVERLAP_LINK", "carrier-pigeon"), ("OVERLAP_MEMORY_BUDGET_MB", "-5"),
]


def _wrap(rank: int, world: int, widths: list[int], rank1_env: dict | None = None) -> str:
    import os

    from overlap import ShardedModule

    if rank == 1 and rank1_env:
        os.environ.update(rank1_env)
    width = widths[rank % len(widths)]
    ShardedModule(nn.Sequential(nn.Linear(4, width), nn.Linear(width, 2)))
    return "built"


def _bad_arguments(rank: int, world: int) -> list[str]:
    from overlap import ShardedModule

    messages = []
    for kwargs in ({"prefetch_depth": -1}, {"prefetch_depth": 1.5}, {"bucket_mb": 0}):
        try:
            ShardedModule(nn.Linear(2, 2), **kwargs)
        except ValueError as exc:
            messages.append(str(exc))
    return messages


def _unit_types(rank: int, world: int) -> tuple[list[str], str]:
    from models import Block

    from overlap import ShardedModule

    model = ShardedModule(nn.Sequential(Block(4, 6), nn.ReLU(), Block(4, 6)), unit_types=Block, bucket_mb=1e-6)
    try:
        ShardedModule(nn.Sequential(Block(4, 6)), unit_types="Block")
    except TypeError as exc:
        return [unit.name for unit in model.scheduler.units], str(exc)
    return [], "no error"


def _rank0_decides(rank: int, world: int) -> list[str]:
    import torch.distributed as dist

    from overlap.control.agreement import decided_by_rank0

    class Unpicklable(Exception):
        def __init__(self, a: int, b: int) -> None:
            super().__init__(f"needs {a} and {b}")

    def fail(exc: Exception):
        def decide():
            if rank == 0:
                raise exc
            raise AssertionError("decide ran on another rank than 0")
        return decide

    seen = [repr(decided_by_rank0(dist.group.WORLD, lambda: ("rank", rank)))]
    for exc in (KeyError("no such key"), Unpicklable(1, 2)):
        try:
            decided_by_rank0(dist.group.WORLD, fail(exc))
        except Exception as raised:
            seen.append(f"{type(raised).__name__}: {raised}")
    return seen


LAUNCH = CaseLaunch({
    **{f"env-{variable}={value}": RankCase(_wrap, ([3],), env={variable: value}) for variable, value in BAD_ENVIRONMENT},
    "rank1-bad-value": RankCase(_wrap, ([3], {"OVERLAP_PREFETCH_DEPTH": "x"})),
    "different-models": RankCase(_wrap, ([3, 5],)),
    "bad-arguments": RankCase(_bad_arguments),
    "unit-types": RankCase(_unit_types),
    "rank0-decides": RankCase(_rank0_decides),
}, world_size=2, timeout=240)


@pytest.mark.timeout(300)
@pytest.mark.parametrize("variable,value", BAD_ENVIRONMENT)
def test_invalid_environment_value_fails_on_every_rank(variable: str, value: str) -> None:
    for outcome in LAUNCH[f"env-{variable}={value}"]:
        message = outcome.error()
        assert "ValueError" in message and variable in message and repr(value) in message


@pytest.mark.timeout(300)
def test_one_rank_with_a_bad_value_stops_all_ranks() -> None:
    """Only rank 1's setting is invalid: rank 0 must not wait for it forever."""
    for outcome in LAUNCH["rank1-bad-value"]:
        message = outcome.error()
        assert "rank 1" in message and "OVERLAP_PREFETCH_DEPTH" in message


@pytest.mark.timeout(300)
def test_different_models_fail_on_every_rank_without_hanging() -> None:
    for outcome in LAUNCH["different-models"]:
        message = outcome.error()
        assert "different model" in message and "rank 1" in message


@pytest.mark.timeout(300)
def test_invalid_arguments_are_named() -> None:
    for outcome in LAUNCH["bad-arguments"]:
        per_rank = outcome.result()
        assert len(per_rank) == 3
        assert "prefetch_depth=-1" in per_rank[0] and "prefetch_depth=1.5" in per_rank[1]
        assert "bucket_mb=0" in per_rank[2]


@pytest.mark.timeout(300)
def test_unit_types_one_class_or_a_type_error() -> None:
    for outcome in LAUNCH["unit-types"]:
        units, message = outcome.result()
        assert units == ["0", "2"]
        assert "unit_types='Block' is invalid" in message and "expected a module class" in message


@pytest.mark.timeout(300)
def test_rank0_decides_and_its_error_is_raised_on_every_rank() -> None:
    results = [outcome.result() for outcome in LAUNCH["rank0-decides"]]
    assert results[0][0] == results[1][0] == "('rank', 0)"
    assert results[0][1] == results[1][1] == "KeyError: 'no such key'"
    # An exception that cannot cross to the other ranks arrives there as a RuntimeError naming it.
    assert results[0][2] == "Unpicklable: needs 1 and 2"
    assert results[1][2] == "RuntimeError: Unpicklable: needs 1 and 2"


def test_needs_an_initialised_process_group() -> None:
    from overlap import ShardedModule

    with pytest.raises(RuntimeError, match="init_process_group"):
        ShardedModule(nn.Linear(2, 2))


def test_mixed_precision_rejects_non_float_dtypes() -> None:
    from overlap import MixedPrecision

    with pytest.raises(ValueError, match="param_dtype"):
        MixedPrecision(param_dtype=torch.int8)
