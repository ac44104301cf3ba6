"""Write docs/conformance.md: every ported FSDP2 test behaviour under FSDP2, under
ShardedModule and under overlap's fully_shard, at 1, 2 and 3 gloo ranks, through the same
launches as the tests.

    python tests/conformance_table.py                # every case; writes docs/conformance.md
    python tests/conformance_table.py --print-only --worlds 2 --cases name,name
"""
from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from typing import Optional, Sequence

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from conformance_cases import CASES, OURS, REGISTRY, SKIPPED, WORLDS, launch_cases  # noqa: E402
from distributed import CaseLaunch  # noqa: E402

DOC = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "docs", "conformance.md")
IMPLS = ("fsdp2", *OURS)
LABELS = {"fsdp2": "FSDP2", "overlap": "ShardedModule", "overlap-fully-shard": "overlap fully_shard"}
Outcomes = dict[str, dict[str, str]]          # case -> implementation -> outcome


def collect(run: CaseLaunch, names: Sequence[str]) -> Outcomes:
    """Each case's outcomes as rank 0 reports them (every rank reports the same); a case that
    raised in the harness itself fails under both."""
    out = {}
    for name in names:
        first = run[name][0]
        out[name] = first.value if first.ok else {impl: f"fail: {first.value}" for impl in IMPLS}
    return out


def counts(outcomes: Outcomes) -> dict[str, int]:
    """Among the cases FSDP2 passes: how many each of ours passes, refuses by name, or fails."""
    controls = [o for o in outcomes.values() if o["fsdp2"] == "pass"]
    out = {"cases": len(outcomes), "FSDP2 passes": len(controls)}
    for impl in OURS:
        label = LABELS[impl]
        out[f"of those, {label} passes"] = sum(o[impl] == "pass" for o in controls)
        out[f"of those, {label} refuses by name"] = sum(o[impl].startswith("refused:") for o in controls)
        out[f"of those, {label} fails"] = sum(o[impl].startswith("fail:") for o in controls)
    return out


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def _ranks(world: int) -> str:
    return f"{world} rank" + ("s" if world > 1 else "")


def render(per_world: dict[int, Outcomes]) -> str:
    worlds = sorted(per_world)
    tallies = {w: counts(per_world[w]) for w in worlds}
    lines = ["# FSDP2 conformance", "",
             "Behaviours that PyTorch's own FSDP2 tests check (`test/distributed/_composable/fsdp/` and the FSDP2 "
             "paths of `test/distributed/checkpoint/test_state_dict.py`), ported case by case to "
             "`tests/conformance_cases.py`. Each case runs the same model, seed and global batch under "
             "torch's `fully_shard` (blocks, then the root, on a 1-D CPU mesh), under `ShardedModule` (the same "
             "blocks as units) and under `overlap.fully_shard` (called as torch's) on gloo ranks, against one "
             "process on the whole global batch where the behaviour is "
             "numeric. FSDP2 is the control: a case it does not pass is a port to fix. "
             "`tests/test_fsdp2_conformance.py` checks every case (the control in `make test-all`); "
             "`python tests/conformance_table.py` writes "
             "this page.", "",
             "Outcomes: `pass`; `refused: <error>`, the same clear error raised on purpose by the implementation "
             "on every rank; `fail: <what>`, wrong numbers, an error from deep inside (a crash), ranks that "
             "disagree, or a hang.", "",
             "## Counts", "",
             "| | " + " | ".join(_ranks(w) for w in worlds) + " |",
             "|---|" + "---|" * len(worlds)]
    for key in tallies[worlds[0]]:
        lines.append(f"| {key} | " + " | ".join(str(tallies[w][key]) for w in worlds) + " |")
    lines += ["", "## Cases", "",
              "| case | behaviour | ports | " + " | ".join(f"{LABELS[impl]}, {_ranks(w)}" for w in worlds
                                                       for impl in IMPLS) + " |",
              "|---|---|---|" + "---|" * (len(worlds) * len(IMPLS))]
    for case in REGISTRY:
        if case.name in per_world[worlds[0]]:
            cells = [_cell(per_world[w][case.name][impl]) for w in worlds for impl in IMPLS]
            lines.append(f"| `{case.name}` | {_cell(case.what)} | " + "<br>".join(f"`{p}`" for p in case.ports)
                         + " | " + " | ".join(cells) + " |")
    accepted = [f"- `{case.name}`: `{prefix}`: {reason}"
                for case in REGISTRY for prefix, reason in case.refusals.items()]
    lines += ["", "## Refusals accepted", "", *(accepted or ["None: every case expects ours to pass."])]
    lines += ["", "## Not ported", "", *(f"- `{test}`: {reason}." for test, reason in SKIPPED)]
    return "\n".join(lines) + "\n"


def run_worlds(worlds: Sequence[int], names: Sequence[str]) -> tuple[dict[int, Outcomes], float]:
    """Every case in `names` at each world size; returns the outcomes and the wall time."""
    with tempfile.TemporaryDirectory() as probe:
        os.environ.setdefault("OVERLAP_PROBE_CACHE", os.path.join(probe, "probe.json"))
        start = time.perf_counter()
        runs = launch_cases(names, worlds)
        seconds = time.perf_counter() - start
    for world, run in runs.items():
        if run.failure() is not None:
            raise SystemExit(f"the launch at {world} ranks failed: {run.failure()}")
    return {world: collect(run, names) for world, run in runs.items()}, seconds


def main(argv: Optional[Sequence[str]] = None) -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--worlds", default=",".join(map(str, WORLDS)), help="comma-separated world sizes")
    parser.add_argument("--cases", default="", help="comma-separated case names (default: all)")
    parser.add_argument("--print-only", action="store_true", help="print the outcomes, write nothing")
    args = parser.parse_args(argv)
    names = [n for n in args.cases.split(",") if n] or list(CASES)
    unknown = [n for n in names if n not in CASES]
    if unknown:
        raise SystemExit(f"unknown cases: {unknown}")
    per_world, seconds = run_worlds([int(w) for w in args.worlds.split(",")], names)
    print(f"{seconds:.1f} s")
    for world, outcomes in sorted(per_world.items()):
        print(f"{world} ranks: {counts(outcomes)}")
        for name in names:
            print(f"  {name}: {outcomes[name]}")
    if not args.print_only:
        with open(DOC, "w") as f:
            f.write(render(per_world))
        print(f"wrote {os.path.relpath(DOC)}")


if __name__ == "__main__":
    main()
