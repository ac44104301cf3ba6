"""compare.py's summary of its launches: per (link, implementation) the step times pooled and
per round, phases, memory, bytes sent per rank and step (measured for ShardedModule, by the
algorithm for FSDP2 and DDP), and the per-round ratios the tables and targets pair."""
from __future__ import annotations

from typing import Optional, Sequence

import peers
from common import median, quartiles, slower_rank

# Implementations whose collectives ShardedModule records (their bytes are measured).
MEASURED = (*peers.SHARDED_MODULE, "overlap-base")
# ShardedModule of another checkout, run by that checkout's interpreter and worker (--baseline):
# before/after comparisons of a change, alternated with the rest in one run.
BASELINE = "overlap-base"
WORLD_SIZE = 2
PHASES = ("forward", "backward", "optimizer")


def _algorithm_bytes(impl: str, params: int, root_params: int, block_params: int, world: int) -> Optional[int]:
    """Bytes each rank sends per step by FSDP2's or DDP's algorithm, ring-equivalent (an
    all-gather or reduce-scatter of S bytes sends S(N-1)/N, an all-reduce twice that): FSDP2
    gathers each block twice and the root once (tuned: the last block once too), then
    reduce-scatters every gradient; DDP all-reduces every gradient. None for the others."""
    share = (world - 1) / world
    if impl in (peers.DDP, peers.DDP_TUNED):
        return int(2 * params * 4 * share)
    if impl == peers.DDP_FP16:
        return int(2 * params * 2 * share)
    if impl == peers.FSDP2:
        return int((2 * (params - root_params) + root_params + params) * 4 * share)
    if impl == peers.FSDP2_TUNED:  # the last block stays gathered from forward into backward
        return int((2 * (params - root_params) - block_params + root_params + params) * 4 * share)
    return None


def _median_ms_by_kind(steps: list[dict], key: str) -> dict[str, float]:
    return {kind: median([step[key][kind] for step in steps]) * 1e3 for kind in steps[0][key]}


def summarize(runs: list[dict]) -> dict[str, dict[str, dict]]:
    """link -> implementation -> step time statistics, memory, bytes per step."""
    summary: dict[str, dict[str, dict]] = {}
    for run in runs:
        entry = summary.setdefault(run["link"], {}).setdefault(
            run["impl"], dict(steps_s=[], phases_s=[], ranks_memory=None))
        ranks = run["ranks"]
        steps_s = slower_rank(r["step_s"] for r in ranks)
        entry["steps_s"] += steps_s
        entry["phases_s"] += ranks[0]["phase_s"]
        if ranks[0]["memory"] is not None:
            entry["ranks_memory"] = [r["memory"] for r in ranks]
            entry["peak_rss"] = [r["peak_rss"] for r in ranks]
        entry["params"], entry["root_params"] = run["params"], run["root_params"]
        entry["sent_bytes"] = _algorithm_bytes(peers.EAGER_TWIN.get(run["impl"], run["impl"]), run["params"],
                                               run["root_params"], run["block_params"], WORLD_SIZE)
        entry["sent_source"] = "algorithm" if entry["sent_bytes"] is not None else None
        entry["final_loss"] = ranks[0]["loss"][-1]
        entry.setdefault("round_step_ms", []).append(median(steps_s) * 1e3)
        entry.setdefault("rounds", []).append(run["round"])
        if run["impl"] in MEASURED:
            entry.setdefault("comm", []).extend(step for r in ranks[:1] for step in r["comm"])
            entry["trace"] = ranks[0]["trace"]
            entry["settings"] = run["settings"]
        if run["impl"] in peers.COMPILED:
            entry.setdefault("first_step_s", []).append(max(r.get("first_step_s") or 0.0 for r in ranks))
    for link, by_impl in compiled_over_eager(runs).items():
        for impl, ratios in by_impl.items():
            summary[link][impl]["compiled_over_eager"] = median(ratios)
            summary[link][impl]["compiled_over_eager_rounds"] = ratios
    for by_impl in summary.values():
        for impl, entry in by_impl.items():
            entry["step_ms"] = median(entry["steps_s"]) * 1e3
            entry["step_ms_quartiles"] = [q * 1e3 for q in quartiles(entry["steps_s"])]
            phases = entry.pop("phases_s")
            entry["phase_ms"] = {phase: median([p[i] for p in phases]) * 1e3 for i, phase in enumerate(PHASES)}
            entry["peak_tracked"] = [m["peak"].get("Total", 0) for m in entry["ranks_memory"] or []]
            if impl in MEASURED:
                comm = entry["comm"]
                entry["sent_bytes"] = int(median([c["bytes"] for c in comm]))
                entry["sent_source"] = "measured"
                entry["exposed_ms_by_kind"] = _median_ms_by_kind(comm, "exposed_s_by_kind")
                entry["comm_ms_by_kind"] = _median_ms_by_kind(comm, "duration_s_by_kind")
                entry["prefetch_misses"] = median([c["prefetch_misses"] for c in comm])
    return summary


def compiled_over_eager(runs: list[dict]) -> dict[str, dict[str, list[float]]]:
    """link -> compiled row -> per round, its median step ÷ its eager twin's in the same round."""
    per_round = {(run["link"], run["round"], run["impl"]): median(slower_rank(r["step_s"] for r in run["ranks"]))
                 for run in runs}
    ratios: dict[str, dict[str, list[float]]] = {}
    for (link, round_index, impl), step in per_round.items():
        twin = per_round.get((link, round_index, peers.EAGER_TWIN.get(impl, "")))
        if twin:
            ratios.setdefault(link, {}).setdefault(impl, []).append(step / twin)
    return ratios


def ratio_of(a: Optional[float], b: Optional[float]) -> Optional[float]:
    return None if a is None or not b else a / b


def step_ms(summary: dict, link: str, impl: str) -> Optional[float]:
    return summary[link].get(impl, {}).get("step_ms")


def peak_bytes(summary: dict, link: str, impl: str) -> Optional[float]:
    peaks = summary[link].get(impl, {}).get("peak_tracked")
    return max(peaks) if peaks else None


def _round_steps(summary: dict, link: str, impl: str) -> dict[int, float]:
    """`impl`'s median step (ms) in each round of `link` it ran in."""
    entry = summary[link].get(impl, {})
    return dict(zip(entry.get("rounds", []), entry.get("round_step_ms", [])))


def paired_rounds(summary: dict, link: str, impl: str, peers_: Sequence[str]) -> list[float]:
    """Per round, `impl`'s median step over the fastest of `peers_` in the same round: rows
    alternate within a round, so load that drifts between rounds cancels in the ratio."""
    mine = _round_steps(summary, link, impl)
    theirs = [_round_steps(summary, link, peer) for peer in peers_]
    return [mine[r] / min(t[r] for t in theirs if r in t) for r in sorted(mine) if any(r in t for t in theirs)]
