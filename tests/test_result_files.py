"""Every result file under docs/results/ records the run that wrote it: the commit, the command
and the host's load (this host is shared, and the load says how far its timings can be
trusted). The benchmarks write these through `benchmarks/common.RunRecord` (or their own
fields, older scripts). `EARLIER` names each file written before its script recorded all
three, with what it lacks; the second test keeps that list honest, so a re-run that adds the
record fails until the file leaves the list.
"""
from __future__ import annotations

import json
import os
import shutil
import subprocess
from typing import Any, Iterator

import pytest

RESULTS = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "docs", "results")

# file: why its record is incomplete. Files a doc still quotes are read by test_docs_figures.py.
EARLIER: dict[str, str] = {
    "compare_10gbit.json": "the 10 Gbit/s comparison of an earlier commit on an idle host, kept as the reference "
                           "for how fast this host ran then; written before compare.py recorded its commit and load",
    "hybrid-300mbit.json": "full against hybrid sharding at 300 Mbit/s with the benchmark's version before hpZ, the "
                           "one measurement of a link that slow",
    "param_shapes_step_time.json": "the step time of the row-aligned layout against the commit before it, from "
                                   "compare.py --baseline at that time",
}

# file: why the commit it records is `<sha>+changes`, a tree with changes not yet committed
# when it ran (benchmarks/common.git_commit appends "+changes"), so that no commit in the
# history holds the code measured. Each names the commit that brought the file in; a re-run
# from a clean tree records a plain commit and must leave this list (the last test).
UNCOMMITTED: dict[str, str] = {
    name: f"measured on {base} plus changes not yet committed; written by {written}, the nearest committed code"
    for name, base, written in (
        ("overhead_after.json", "7b189cb", "c808191"), ("overhead_after_two_ranks.json", "10d3665", "f758ace"))}
UNCOMMITTED["offload_disk_model_large_speculation.json"] = (
    "measured on 48a979b; the tree's changes not yet committed were documentation and another result file, "
    "no code (an 11-minute run that needs most of the drive, not repeated for that)")
UNCOMMITTED_SUFFIX = "+changes"
REPOSITORY = os.path.dirname(os.path.dirname(RESULTS))
needs_history = pytest.mark.skipif(shutil.which("git") is None or not os.path.isdir(os.path.join(REPOSITORY, ".git")),
                                   reason="not a git checkout: the recorded commits cannot be looked up")

# The names the benchmarks give the host's load average.
LOAD_KEYS = {"loadavg_before", "loadavg_after", "load_before", "load_after", "host_load", "load_average",
             "load_average_before", "load_average_after"}


def _mappings(data: Any, depth: int = 2) -> Iterator[dict]:
    """The JSON object and the objects nested in it down to `depth` levels (lists not entered):
    a run's record sits at the top, under "meta" or "host", or under each link's entry."""
    if isinstance(data, dict):
        yield data
        if depth:
            for value in data.values():
                yield from _mappings(value, depth - 1)


def missing(data: Any) -> list[str]:
    """What of commit, command and load `data` does not record."""
    keys = {key for mapping in _mappings(data) for key in mapping}
    lacks = []
    if "commit" not in keys:
        lacks.append("commit")
    if not keys & {"command", "commands"}:
        lacks.append("command")
    if not keys & LOAD_KEYS:
        lacks.append("load")
    return lacks


def _files() -> list[str]:
    return sorted(name for name in os.listdir(RESULTS) if name.endswith(".json"))


def _read(name: str) -> Any:
    with open(os.path.join(RESULTS, name)) as f:
        return json.load(f)


@pytest.mark.parametrize("name", [name for name in _files() if name not in EARLIER])
def test_result_file_records_its_run(name: str) -> None:
    assert not missing(_read(name)), f"docs/results/{name} does not record its {', '.join(missing(_read(name)))}"


def test_earlier_files_are_named_with_what_they_lack() -> None:
    for name, why in EARLIER.items():
        assert name in _files(), f"EARLIER names docs/results/{name}, which does not exist"
        assert missing(_read(name)), f"docs/results/{name} records its run now: remove it from EARLIER"
        assert why.strip(), name


def test_missing_reads_each_kind_of_record() -> None:
    assert missing({"command": "x"}) == ["commit", "load"]
    assert missing({"meta": {"commit": "a", "command": "x", "loadavg_before": [1.0]}}) == []
    assert missing({"fast": {"meta": {"commit": "a", "command": "x", "loadavg_after": [1.0]}}}) == []
    assert missing({"commands": ["x"], "commit": "a", "host": {"load_before": [1.0]}}) == []


def commits(data: Any) -> set[str]:
    """Every commit `data` records, where `missing` looks for one."""
    return {str(mapping["commit"]) for mapping in _mappings(data) if "commit" in mapping}


def _in_history(sha: str) -> bool:
    return subprocess.run(["git", "merge-base", "--is-ancestor", sha, "HEAD"], cwd=REPOSITORY,
                          capture_output=True).returncode == 0


@needs_history
@pytest.mark.parametrize("name", [name for name in _files() if name not in EARLIER])
def test_recorded_commit_is_in_the_history(name: str) -> None:
    recorded = commits(_read(name))
    for commit in recorded:
        sha, uncommitted, _ = commit.partition(UNCOMMITTED_SUFFIX)
        assert not uncommitted or name in UNCOMMITTED, \
            f"docs/results/{name} records {commit}, a tree no commit holds: re-run it from a clean tree"
        assert _in_history(sha), f"docs/results/{name} records commit {sha}, which is not in this history"


def test_uncommitted_files_say_why_and_still_record_changes() -> None:
    for name, why in UNCOMMITTED.items():
        assert name in _files(), f"UNCOMMITTED names docs/results/{name}, which does not exist"
        assert any(UNCOMMITTED_SUFFIX in commit for commit in commits(_read(name))), \
            f"docs/results/{name} records a clean commit now: remove it from UNCOMMITTED"
        assert why.strip(), name
