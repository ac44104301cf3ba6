"""Settings shared by the whole test session."""
from __future__ import annotations

import os
from typing import Iterator

import pytest


@pytest.fixture(scope="session", autouse=True)
def shared_probe_cache(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """One link-probe cache for the session (unless the caller set OVERLAP_PROBE_CACHE).

    Each ShardedModule whose plan is not fixed by hand times the group's link at start-up, a
    second or more per wrap with several ranks on two loaded cores; hundreds of wraps paid it
    again for the same loopback link. With the cache, the first wrap of each world size
    probes and writes the fit, the later ones read it: both paths still run, the probe's own
    behaviour is tested with a cache of its own (tests/test_planner.py), and the ranks and
    jobs the tests launch inherit the setting.
    """
    if "OVERLAP_PROBE_CACHE" in os.environ:
        yield os.environ["OVERLAP_PROBE_CACHE"]
        return
    path = str(tmp_path_factory.mktemp("probe") / "probe.json")
    os.environ["OVERLAP_PROBE_CACHE"] = path
    try:
        yield path
    finally:
        os.environ.pop("OVERLAP_PROBE_CACHE", None)
