"""The tables of benchmarks/overhead.py: each row's host time per unit per step, its per-round
ratios to FSDP2 (and to the baseline checkout's same row), and the overlap report's runtime
share of the step, from the launches' records."""
from __future__ import annotations

import peers
from typing import Iterator

from common import markdown_table, median, slower_rank, spread, spread_cell

OVERLAP, FSDP2, FSDP2_TUNED, DEEPSPEED = "overlap", peers.FSDP2, peers.FSDP2_TUNED, peers.DEEPSPEED
# The same runtime through `from overlap import fully_shard`: DTensor parameters, the optimizer
# stepping DTensors as under FSDP2.
OVERLAP_FULLY_SHARD = "overlap-fully-shard"
REFERENCES = (FSDP2_TUNED, FSDP2)       # every row's ratios are taken against these
BASELINE_SUFFIX = "-base"


def _per_step(run: dict, key: str) -> list[float]:
    """Each timed step's time, the slower rank's."""
    return slower_rank(rank[key] for rank in run["ranks"])


def host_s_per_unit(run: dict) -> float:
    return (median(_per_step(run, "wrapped_s")) - median(_per_step(run, "plain_s"))) / run["units"]


def _entries(summary: dict) -> Iterator[tuple[str, str, str, dict]]:
    """(world, units, row, entry) of every row `summarize` wrote."""
    for world, by_units in summary.items():
        for units, by_row in by_units.items():
            for row, entry in by_row.items():
                yield world, units, row, entry


def summarize(runs: list[dict], baseline: bool) -> dict[str, dict[str, dict[str, dict]]]:
    """world -> units -> row -> host time per unit, step times, per-round ratios, report share."""
    summary: dict[str, dict[str, dict[str, dict]]] = {}
    by_key = {(run["world"], run["units"], run["row"], run["round"]): run for run in runs}
    for run in runs:
        entry = summary.setdefault(str(run["world"]), {}).setdefault(str(run["units"]), {}).setdefault(
            run["row"], dict(rounds=[]))
        entry["rounds"].append(run["round"])
    for world, units, row, entry in _entries(summary):
        mine = [by_key[(int(world), int(units), row, r)] for r in entry.pop("rounds")]
        entry["host_us_per_unit"] = spread([host_s_per_unit(run) * 1e6 for run in mine])
        entry["step_ms"] = spread([median(_per_step(run, "wrapped_s")) * 1e3 for run in mine])
        entry["plain_ms"] = spread([median(_per_step(run, "plain_s")) * 1e3 for run in mine])
        entry["final_loss"] = [run["ranks"][0]["loss"][-1] for run in mine]
        # The busiest rank's CPU time over its wall time in the timed steps: well below 1, the
        # launch waited for the cores (other programs, gloo's threads).
        entry["cpu_per_wall"] = spread([max(rank["cpu_s"] / rank["wall_s"] for rank in run["ranks"]) for run in mine])
        references = list(REFERENCES)
        if baseline and row.startswith(OVERLAP) and not row.endswith(BASELINE_SUFFIX):
            references.append(row + BASELINE_SUFFIX)
        entry["ratios"] = {}
        for reference in references:
            pairs = [(run, by_key.get((int(world), int(units), reference, run["round"]))) for run in mine]
            ratios = [host_s_per_unit(a) / host_s_per_unit(b) for a, b in pairs if b is not None]
            if ratios:
                entry["ratios"][reference] = spread(ratios)
        if "report" in mine[0]:
            entry["settings"] = {key: mine[0][key] for key in ("runtime_units", "prefetch_depth", "bucket_mb",
                                                               "sharding", "compression")}
            entry["runtime_share"] = spread([run["report"]["runtime_s"] / run["report"]["span_s"] for run in mine])
            entry["report_ms"] = {key[:-2]: median([run["report"][key] for run in mine]) * 1e3
                                  for key in mine[0]["report"]}
    return summary


def host_table(summary: dict) -> str:
    rows = [[world, units, row, f"{entry['step_ms']['median']:.2f}", f"{entry['plain_ms']['median']:.2f}",
             spread_cell(entry["cpu_per_wall"]), spread_cell(entry["host_us_per_unit"], 0),
             *(spread_cell(entry["ratios"].get(ref)) for ref in (FSDP2_TUNED, FSDP2, row + BASELINE_SUFFIX))]
            for world, units, row, entry in _entries(summary)]
    return markdown_table(["ranks", "units", "row", "step ms", "plain ms", "CPU/wall", "host µs/unit/step (range)",
                           f"÷ {FSDP2_TUNED}", f"÷ {FSDP2}", "÷ baseline"], rows)


def share_table(summary: dict) -> str:
    """The report's runtime share of the step for every ShardedModule row."""
    rows = [[world, units, row, entry["settings"]["runtime_units"], spread_cell(entry["runtime_share"], 0, 100),
             *(f"{report[key]:.2f}" for key in ("runtime", "span", "compute")),
             f"{report['gather_wait'] + report['reduce_wait']:.2f}"]
            for world, units, row, entry in _entries(summary) if "runtime_share" in entry
            for report in [entry["report_ms"]]]
    return markdown_table(["ranks", "units", "row", "runtime units", "runtime % of step (range)", "runtime ms",
                           "step ms (fwd+bwd)", "compute ms", "waits ms"], rows)
