"""ARCHITECTURE.md's Files section names every source file of the package, the kernels and the
extension, each under its own directory's entry, and names no file that is gone."""
from __future__ import annotations

import pathlib
import re

ROOT = pathlib.Path(__file__).resolve().parent.parent
SUFFIXES = {".py", ".cu", ".cpp", ".h"}
# Directories the map describes, as their entries in the Files section start ("**base/**").
DIRECTORIES = {
    "overlap/": ROOT / "overlap",
    **{f"{d.name}/": d for d in sorted((ROOT / "overlap").iterdir())
       if d.is_dir() and not d.is_symlink() and d.name not in {"__pycache__", "data"}},
    "kernels/": ROOT / "kernels",
    "csrc/": ROOT / "csrc",
}


def _entries() -> dict[str, set[str]]:
    """Each directory entry of the Files section and the file names it mentions in backticks."""
    text = (ROOT / "ARCHITECTURE.md").read_text()
    section = text.split("\n## Files\n", 1)[1].split("\n## ", 1)[0]
    entries: dict[str, set[str]] = {}
    for paragraph in section.split("\n\n"):
        heading = re.match(r"\*\*([\w/]+)\*\*", paragraph.strip())
        if heading:
            entries[heading.group(1)] = set(re.findall(r"`([^`\s]+)`", paragraph))
    return entries


def _named_here(names: set[str], directory: pathlib.Path) -> set[str]:
    """The names that are files of `directory` (a path in another directory, such as
    `csrc/adamw_cpu.cpp` under optim/, names that file, not one here)."""
    return {n for n in names if "/" not in n and pathlib.PurePosixPath(n).suffix in SUFFIXES}


def _files(directory: pathlib.Path) -> set[str]:
    return {p.name for p in directory.iterdir() if p.is_file() and p.suffix in SUFFIXES}


def test_every_source_file_is_on_the_map() -> None:
    entries = _entries()
    missing = {label: sorted(_files(path) - _named_here(entries.get(label, set()), path))
               for label, path in DIRECTORIES.items()}
    missing = {label: names for label, names in missing.items() if names}
    assert not missing, f"files ARCHITECTURE.md's Files section does not name: {missing}"


def test_the_map_names_no_missing_file() -> None:
    entries = _entries()
    gone = {}
    for label, names in entries.items():
        path = DIRECTORIES.get(label)
        assert path is not None, f"ARCHITECTURE.md has an entry for {label}, which is no directory of the map"
        # A name is this directory's file, or a path from the checkout's root (`setup.py`).
        stale = sorted(n for n in names if pathlib.PurePosixPath(n).suffix in SUFFIXES
                       and not (path / n).exists() and not (ROOT / n).exists())
        if stale:
            gone[label] = stale
    assert not gone, f"ARCHITECTURE.md names files that do not exist: {gone}"
