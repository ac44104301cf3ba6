"""benchmarks/stale.py runs and lists the cited result files with the runtime lines changed
since their commit (it reruns no benchmark)."""
from __future__ import annotations

import json
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_stale_lists_every_cited_result_file_with_the_runtime_lines_changed_since() -> None:
    done = subprocess.run([sys.executable, os.path.join(ROOT, "benchmarks", "stale.py"), "--json"],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode in (0, 1), done.stderr
    rows = json.loads(done.stdout)
    files = {row["file"] for row in rows}
    assert "docs/results/order_check.json" in files and "docs/results/tp.json" in files
    for row in rows:
        assert row["cited_by"] and os.path.exists(os.path.join(ROOT, row["file"]))
        if row["cited_by"] == ["docs/history.md"]:
            assert row["history"], row
        if row["history"]:
            assert not row["stale"], row
        elif row["percent"] is not None:
            assert row["changed_lines"] >= 0 and row["stale"] == (row["percent"] > 5.0), row
        else:
            assert row["stale"], row
    assert done.returncode == (1 if any(row["stale"] for row in rows) else 0)


def test_a_threshold_above_every_change_lists_only_files_without_a_known_commit() -> None:
    done = subprocess.run([sys.executable, os.path.join(ROOT, "benchmarks", "stale.py"), "--threshold", "100"],
                          capture_output=True, text=True, timeout=120)
    listed = [line for line in done.stdout.splitlines() if line.startswith("docs/results/")]
    assert all("no commit recorded" in line for line in listed), listed
    assert "past 100% of the runtime's lines" in done.stdout.strip().splitlines()[-1]


def test_a_file_whose_script_left_the_tree_is_counted_apart() -> None:
    done = subprocess.run([sys.executable, os.path.join(ROOT, "benchmarks", "stale.py"), "--json"],
                          capture_output=True, text=True, timeout=120)
    rows = {row["file"]: row for row in json.loads(done.stdout)}
    # benchmarks/param_layout.py measured it and is no longer in the tree; docs/parameters.md
    # cites it beside the commit that holds the script.
    layout = rows["docs/results/param_layout.json"]
    assert "docs/parameters.md" in layout["cited_by"] and layout["history"] and not layout["stale"], layout
    assert not os.path.exists(os.path.join(ROOT, "benchmarks", "param_layout.py"))
    assert not rows["docs/results/tp.json"]["history"]
