"""FSDP2's own test behaviours under overlap, with FSDP2 as the control.

Every case of tests/conformance_cases.py runs at 1, 2 and 3 gloo ranks, one launch per world size
(the launches at once), each case under `ShardedModule` and under overlap's `fully_shard`. A
test per case, implementation and world size asserts that ours passes or refuses with an error
the registry accepts for that case. The control, torch's `fully_shard` passing every case (the
port is right), runs in launches of its own in the slow tier (`make test-all`).
docs/conformance.md is the same cases as a table (`python tests/conformance_table.py`).
"""
from __future__ import annotations

from typing import Iterator

import pytest

from conformance_cases import CASES, LAUNCH_TIMEOUT_S, OURS, REGISTRY, WORLDS, launch_cases
from distributed import CaseLaunch

# Contracts not met yet, by implementation, with the world sizes where they fail: the test fails
# there today and is expected to (strictly: it turns into a failure once the contract holds, and
# the mark goes).
KNOWN_FAILING: dict[str, dict[str, tuple[str, tuple[int, ...]]]] = {
    "overlap": {
    },
    "overlap-fully-shard": {},
}


class OverlapOutcome(AssertionError):
    """ShardedModule's outcome is not one the case accepts (what an xfail mark expects: a
    failing control is a plain AssertionError, never taken for an expected failure)."""


@pytest.fixture(scope="module")
def launches() -> dict[int, CaseLaunch]:
    """One launch per world size, every case on it under our implementations, all at once."""
    return launch_cases(list(CASES), impls=OURS)


def _cases() -> Iterator:
    for world in WORLDS:
        for case in REGISTRY:
            for impl in OURS:
                reason, worlds = KNOWN_FAILING[impl].get(case.name, ("", ()))
                marks = [pytest.mark.xfail(strict=True, raises=OverlapOutcome, reason=reason)] if world in worlds else []
                yield pytest.param(world, case.name, impl, marks=marks, id=f"{case.name}-{impl}-{world}")


@pytest.mark.timeout(LAUNCH_TIMEOUT_S + 60)
@pytest.mark.parametrize("world,name,impl", list(_cases()))
def test_conformance(world: int, name: str, impl: str, launches: dict[int, CaseLaunch]) -> None:
    outcomes = [outcome.result() for outcome in launches[world][name]]
    assert all(o == outcomes[0] for o in outcomes), f"ranks report different outcomes: {outcomes}"
    ours = outcomes[0][impl]
    if not CASES[name].accepts(ours):
        raise OverlapOutcome(f"{impl}: {ours} ({CASES[name].what})")


@pytest.mark.slow          # the control's own launches (about 20 s): in `make test-all`
@pytest.mark.timeout(LAUNCH_TIMEOUT_S + 60)
def test_fsdp2_itself_passes_every_case_at_every_world_size() -> None:
    """The control: torch's `fully_shard` passes each case as ported, so a case that ours fails
    tests a contract FSDP2 keeps."""
    runs = launch_cases(list(CASES), impls=("fsdp2",))
    failed = {(world, name): outcome.result()["fsdp2"] for world, run in runs.items() for name in CASES
              for outcome in run[name][:1] if outcome.result()["fsdp2"] != "pass"}
    assert not failed, "; ".join(f"world {world} {name}: FSDP2 {outcome} ({'; '.join(CASES[name].ports)})"
                                 for (world, name), outcome in failed.items())
