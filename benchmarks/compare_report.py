"""compare.py's outputs: the markdown tables (ratios, step times, compiled rows, memory,
targets), the figure, and compare.json with the run's record."""
from __future__ import annotations

import argparse
import os
import platform
from typing import Optional, Sequence

import peers
from common import markdown_table, spread_cell, write_json, write_text
from compare_summary import BASELINE, PHASES, WORLD_SIZE, paired_rounds, peak_bytes, ratio_of, step_ms
from gpt_options import MODEL_FIELDS

MIB = 2**20
MEMORY_CATEGORIES = ("Parameter", "Gradient", "Optstate", "Activation", "Temp", "Other", "Total")


def _fmt(value: Optional[float], digits: int = 0, suffix: str = "") -> str:
    return "–" if value is None else f"{value:.{digits}f}{suffix}"


def _range(values: Optional[list[float]]) -> str:
    return "–" if not values else f"{min(values):.3f}–{max(values):.3f}"


def compile_table(summary: dict) -> str:
    rows = [[link, impl, _fmt(entry["step_ms"]), _fmt(entry.get("compiled_over_eager"), 3),
             _range(entry.get("compiled_over_eager_rounds")),
             " / ".join(f"{s:.1f}" for s in entry["first_step_s"])]
            for link, by_impl in summary.items() for impl, entry in by_impl.items() if impl in peers.COMPILED]
    return markdown_table(["link", "impl", "step ms (median)", "compiled ÷ eager (median of rounds)", "range",
                           "first step s, by round (compiles; cold cache in round 1)"], rows)


def time_table(summary: dict) -> str:
    rows = []
    for link, by_impl in summary.items():
        for impl, entry in by_impl.items():
            sent = entry["sent_bytes"]
            exposed = entry.get("exposed_ms_by_kind")
            q1, q3 = entry["step_ms_quartiles"]
            rows.append([link, impl, _fmt(entry["step_ms"]), f"{q1:.0f}–{q3:.0f}", len(entry["steps_s"]),
                         " / ".join(f"{entry['phase_ms'][p]:.0f}" for p in PHASES),
                         spread_cell(paired_rounds(summary, link, impl, (peers.LOCAL,))),
                         "–" if sent is None else f"{sent / MIB:.1f} ({entry['sent_source']})",
                         "–" if exposed is None else " / ".join(f"{exposed.get(k, 0):.0f}"
                                                                for k in ("all_gather", "reduce_scatter")),
                         spread_cell(paired_rounds(summary, link, peers.OVERLAP, (impl,)))])
    return markdown_table(["link", "impl", "step ms (median)", "IQR ms", "steps", "fwd / bwd / opt ms",
                           "× local per round", "MiB sent/rank/step", "exposed ms AG / RS", "overlap ÷ this per round"],
                          rows)


def ratio_table(summary: dict) -> str:
    """Per link: every implementation's median step time, then ShardedModule's ratios to the
    tuned peers (paired per round: median and range)."""
    impls = [impl for impl in (*peers.ALL, BASELINE) if any(impl in by_impl for by_impl in summary.values())]
    rows = [[link, *(_fmt(step_ms(summary, link, impl)) for impl in impls),
             spread_cell(paired_rounds(summary, link, peers.OVERLAP, (peers.FSDP2_TUNED,))),
             spread_cell(paired_rounds(summary, link, peers.OVERLAP, (peers.DDP, peers.DDP_TUNED))),
             _fmt(ratio_of(peak_bytes(summary, link, peers.OVERLAP), peak_bytes(summary, link, peers.FSDP2_TUNED)), 2)]
            for link in summary]
    return markdown_table(["link", *(f"{impl} ms" for impl in impls), "overlap / fsdp2-tuned per round",
                           "overlap / faster ddp per round", "peak mem overlap / fsdp2-tuned"], rows)


def memory_table(summary: dict) -> str:
    link = next(iter(summary))
    rows = [[impl, rank, *(_fmt(memory["peak"].get(c, 0) / MIB, 1) for c in MEMORY_CATEGORIES),
             " / ".join(_fmt(memory["phases"][p] / MIB) for p in ("forward", "backward")),
             _fmt(entry["peak_rss"][rank] / MIB)]
            for impl, entry in summary[link].items() for rank, memory in enumerate(entry["ranks_memory"] or [])]
    return markdown_table(["impl", "rank", *(f"{c} MiB" for c in MEMORY_CATEGORIES),
                           "peak in fwd / bwd MiB", "peak RSS MiB"], rows)


def target_lines(targets: list[dict]) -> str:
    """One line per target; a timed one says its median of per-round ratios, their range, and
    how many rounds held ("met" only when every round did)."""
    lines = []
    for t in targets:
        state = "not measured" if t["met"] is None else ("met" if t["met"] else "MISSED")
        rounds = t.get("rounds")
        spread = "" if not rounds else f" ({min(rounds):.2f}–{max(rounds):.2f}, held in {t['held']} of {len(rounds)} rounds)"
        by_round = "" if not rounds else "; by round: " + ", ".join(
            f"{r:.2f} ({'met' if r <= t['limit'] else 'missed'})" for r in rounds)
        lines.append(f"- {t['link']}: {t['what']} = {_fmt(t['ratio'], 2)}{spread} (target ≤ {t['limit']:.2f}): "
                     f"{state}{by_round}")
    return "\n".join(lines)


def plot(summary: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    links = list(summary)
    impls = [impl for impl in (*peers.ALL, BASELINE) if any(impl in summary[link] for link in links)]
    fig, (left, right) = plt.subplots(1, 2, figsize=(12, 4.5))
    width = 0.8 / len(impls)
    tallest = 0.0
    for i, impl in enumerate(impls):
        values = [step_ms(summary, link, impl) or 0 for link in links]
        tallest = max(tallest, *values)
        left.bar([x + i * width for x in range(len(links))], values, width, label=impl)
    left.set_xticks([x + 0.4 - width / 2 for x in range(len(links))], links)
    left.set_ylim(top=tallest * 1.15)  # room for the legend above the bars
    left.set_ylabel("median step time (ms)")
    left.set_title("step time per link")
    left.legend(ncol=len(impls), fontsize=8, loc="upper left")

    memory_link = links[0]
    bottoms = [0.0] * len(impls)
    peaks = [(summary[memory_link][impl]["ranks_memory"] or [{"peak": {}}])[0]["peak"] for impl in impls]  # rank 0's
    for category in MEMORY_CATEGORIES[:-1]:
        values = [peak.get(category, 0) / MIB for peak in peaks]
        right.bar(impls, values, bottom=bottoms, label=category)
        bottoms = [b + v for b, v in zip(bottoms, values)]
    right.set_ylabel("MiB (rank 0, MemTracker peak)")
    right.set_title(f"peak memory by category ({memory_link})")
    right.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.0, 1.0))
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _loads(loads: Sequence[float]) -> str:
    return ", ".join(f"{x:.2f}" for x in loads)


def write_outputs(args: argparse.Namespace, runs: list[dict], summary: dict, targets: list[dict]) -> str:
    """compare.json, compare.md and compare.png under args.out; returns the markdown."""
    record = args.record.fields()
    markdown = "\n\n".join([
        f"Command: `{record['command']}`",
        f"Host load average (1, 5, 15 min) before: {_loads(record['loadavg_before'])}; after: "
        f"{_loads(record['loadavg_after'])} ({os.cpu_count()} CPUs, shared with other jobs).",
        f"Model: {args.model}, {args.n_layer} blocks, d={args.n_embd}, vocab {args.vocab_size}, batch {args.batch}×{args.block_size}"
        f" per rank, {WORLD_SIZE} ranks (gloo); {args.rounds} round(s) × {args.steps} timed steps"
        f" after {args.warmup} warm-up.",
        *(f"{impl}: skipped ({reason})." for impl, reason in args.skipped.items()),
        ratio_table(summary), time_table(summary),
        *([compile_table(summary)] if any(i in peers.COMPILED for by in summary.values() for i in by) else []),
        f"Peak memory per rank (link {next(iter(summary))}):", memory_table(summary),
        "Targets:\n" + target_lines(targets)])
    for entry in (e for by_impl in summary.values() for e in by_impl.values()):
        entry.pop("steps_s")
    meta = dict(**record, argv=args.argv, skipped=args.skipped, sources=args.sources, batch=args.batch,
                model={"kind": args.model, **{key: getattr(args, key) for key in MODEL_FIELDS}},
                world_size=WORLD_SIZE, python=platform.python_version())
    write_json(os.path.join(args.out, "compare.json"),
               dict(meta=meta, results=summary, targets=targets, runs=runs))
    write_text(os.path.join(args.out, "compare.md"), markdown + "\n")
    plot(summary, os.path.join(args.out, "compare.png"))
    return markdown
