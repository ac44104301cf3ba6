"""Which result files the docs cite were measured on a runtime that has since moved on: for every
file under docs/results that README.md, ARCHITECTURE.md or docs/*.md links to, the runtime's
lines (overlap/, kernels/, csrc/) changed between its recorded commit and HEAD, as a share of
the runtime's lines at HEAD; files past the threshold are listed. Files cited only by
docs/history.md (a past change's before and after), and files whose script has left the tree (a
decided experiment, kept under its commit), are counted apart.

    python benchmarks/stale.py                  # exit status 1 when a cited file is stale
    python benchmarks/stale.py --threshold 10   # percent of the runtime's lines (default 5)
"""
from __future__ import annotations

import argparse
import glob
import json
import os
import re
import subprocess
import sys
from typing import Iterator, Optional, Sequence

REPOSITORY = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RUNTIME = ("overlap", "kernels", "csrc")
SOURCE_SUFFIXES = (".py", ".cu", ".cpp", ".h", ".cuh")
# A result file linked as itself, or through the table a script rendered from it (NAME.md
# beside NAME.json).
CITATION = re.compile(r"results/([A-Za-z0-9_.-]+)\.(?:json|md)")
HISTORY = os.path.join("docs", "history.md")
SCRIPT = re.compile(r"\bbenchmarks/[A-Za-z0-9_]+\.py\b")


def _git(*args: str) -> str:
    return subprocess.run(["git", "-C", REPOSITORY, *args], check=True, capture_output=True, text=True).stdout


def cited_files() -> dict[str, list[str]]:
    """Each cited result file (docs/results/NAME) -> the docs that cite it."""
    cited: dict[str, list[str]] = {}
    docs = [os.path.join(REPOSITORY, "README.md"), os.path.join(REPOSITORY, "ARCHITECTURE.md"),
            *sorted(glob.glob(os.path.join(REPOSITORY, "docs", "*.md")))]
    for doc in docs:
        with open(doc, encoding="utf-8") as f:
            for stem in sorted(set(CITATION.findall(f.read()))):
                path = os.path.join("docs", "results", stem + ".json")
                if os.path.exists(os.path.join(REPOSITORY, path)):
                    cited.setdefault(path, []).append(os.path.relpath(doc, REPOSITORY))
    return cited


def runtime_lines() -> int:
    """The runtime's source lines at HEAD."""
    total = 0
    for path in _git("ls-tree", "-r", "--name-only", "HEAD", "--", *RUNTIME).split():       # HEAD's files, not the index's
        if path.endswith(SOURCE_SUFFIXES):
            total += _git("show", f"HEAD:{path}").count("\n")
    return total


def changed_lines(commit: str) -> Optional[int]:
    """Runtime lines added plus removed from `commit` to HEAD; None for a commit git does not know."""
    try:
        _git("cat-file", "-e", f"{commit}^{{commit}}")
    except subprocess.CalledProcessError:
        return None
    total = 0
    for line in _git("diff", "--numstat", commit, "HEAD", "--", *RUNTIME).splitlines():
        added, removed, path = line.split("\t", 2)
        if path.endswith(SOURCE_SUFFIXES) and added != "-":
            total += int(added) + int(removed)
    return total


def recorded(data: object, field: str) -> Iterator[str]:
    """Every string a result file records as `field`, anywhere in it, in order."""
    if isinstance(data, dict):
        for key, value in data.items():
            yield from [value] if key == field and isinstance(value, str) else recorded(value, field)
    elif isinstance(data, list):
        for value in data:
            yield from recorded(value, field)


def recorded_commits(data: object) -> list[str]:
    """Every commit a result file records, anywhere in it, without the "+changes" mark."""
    return list(dict.fromkeys(commit.split("+")[0] for commit in recorded(data, "commit")))


def recorded_scripts(data: object) -> set[str]:
    """The benchmark scripts named by the commands a result file records, anywhere in it."""
    return {script for command in recorded(data, "command") for script in SCRIPT.findall(command)}


def retired(data: object) -> bool:
    """Whether every script that measured the file has left the tree: its figures cannot be
    measured again at HEAD, only read under their commit."""
    scripts = recorded_scripts(data)
    return bool(scripts) and not any(os.path.exists(os.path.join(REPOSITORY, script)) for script in scripts)


def staleness(threshold: float) -> list[dict]:
    """One row per cited result file: its oldest commit, the runtime lines changed since, their
    share of the runtime's lines and whether that passes `threshold` percent."""
    lines = runtime_lines()
    rows = []
    for path, docs in sorted(cited_files().items()):
        with open(os.path.join(REPOSITORY, path), encoding="utf-8") as f:
            data = json.load(f)
        commits = recorded_commits(data)
        counted = [(changed_lines(commit), commit) for commit in commits]
        known = [(changed, commit) for changed, commit in counted if changed is not None]
        changed, recorded = max(known) if known and len(known) == len(counted) else (None, ",".join(commits) or None)
        share = None if changed is None else 100.0 * changed / lines
        history = docs == [HISTORY] or retired(data)
        rows.append(dict(file=path, cited_by=docs, commit=recorded, changed_lines=changed,
                         percent=share, history=history,
                         stale=not history and (share is None or share > threshold)))
    return rows


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--threshold", type=float, default=5.0, help="percent of the runtime's lines (default 5)")
    parser.add_argument("--json", action="store_true", help="print every row as JSON instead of the stale list")
    args = parser.parse_args(argv)
    rows = staleness(args.threshold)
    if args.json:
        print(json.dumps(rows, indent=1))
    else:
        stale = [row for row in rows if row["stale"]]
        for row in stale:
            why = ("no commit recorded, or one git does not know" if row["percent"] is None else
                   f"{row['changed_lines']} runtime lines ({row['percent']:.1f}%) changed since {row['commit'][:12]}")
            print(f"{row['file']}: {why}; cited by {', '.join(row['cited_by'])}")
        history = sum(row["history"] for row in rows)
        print(f"{len(stale)} of {len(rows) - history} cited result files are past {args.threshold:g}% of the runtime's "
              f"lines ({history} more are cited by {HISTORY} alone or measured by a script that left the tree, under their "
              "commits)")
    return 1 if any(row["stale"] for row in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
