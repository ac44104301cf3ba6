"""The figures README.md and docs/*.md cite from docs/results/ still say what the result files say.

`FIGURES` is the table to keep up to date: one row per quoted figure (or table row), with the
doc, the doc's words with a format field where each number goes, the result file, and one
reader per number (`at(...)`: a path of keys and list indices into the JSON; `ratio` and
`row` for derived values and list rows). The test formats the numbers as the field says and
looks for the text in the doc with runs of whitespace folded, so a line break anywhere is
fine. A re-run that changes a number fails here until the doc follows; a doc edit that changes
a figure fails until the row (or the result file) follows.

`UNCHECKED` names each result file a doc links to whose figures no row checks yet, with the
reason; `test_every_linked_result_file_is_checked_or_named` keeps that list honest.
"""
from __future__ import annotations

import json
import os
import re
import statistics
from dataclasses import dataclass
from typing import Any, Callable

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
Reader = Callable[[Any], float]


def at(*path: Any) -> Reader:
    """The value at `path` (dict keys and list indices) in the JSON."""
    def read(data: Any) -> float:
        for key in path:
            data = data[key]
        return data
    return read


def ratio(numerator: Reader, denominator: Reader) -> Reader:
    return lambda data: numerator(data) / denominator(data)


def _paired_variants(variant: str, base: str) -> tuple[Reader, Reader, Reader]:
    """Median, least and most over rounds of `variant`'s step ÷ `base`'s in the same round, from
    the per-rank, per-round steps benchmarks/moe.py and pipeline.py keep (a round's step: its
    slowest rank's)."""
    def ratios(data: Any) -> list[float]:
        ranks = data["ranks"]
        return [max(r["step_s"][variant][i] for r in ranks) / max(r["step_s"][base][i] for r in ranks)
                for i in range(len(ranks[0]["step_s"][variant]))]
    return (lambda d: statistics.median(ratios(d)), lambda d: min(ratios(d)), lambda d: max(ratios(d)))


def row(list_path: tuple, field: str, **match: Any) -> Reader:
    """`field` of the one entry of the list at `list_path` whose keys equal `match`."""
    def read(data: Any) -> float:
        rows = [r for r in at(*list_path)(data) if all(r.get(k) == v for k, v in match.items())]
        assert len(rows) == 1, (list_path, match, len(rows))
        return rows[0][field]
    return read


def extreme(pick: Callable, readers: list[Reader]) -> Reader:
    return lambda data: pick(r(data) for r in readers)


@dataclass(frozen=True)
class Figure:
    doc: str                  # relative to the repository root
    text: str                 # the doc's words; `{0:.2f}`-style fields where the numbers go
    file: str                 # under docs/results/
    values: tuple             # one Reader per field, in order


def _per_round(variant: str) -> tuple:
    return tuple(at("variants", variant, "ratios_per_round", i) for i in range(4))


def _collective_ratios(link: str) -> list[Reader]:
    return [ratio(at("results", link, size, "reduce_scatter", "ms"), at("results", link, size, "all_to_all+sum", "ms"))
            for size in ("1", "8", "32")]


def _collective_row(size: str, op: str) -> Reader:
    """A row of collectives.py's table: per link, ms (with * for the fastest way to
    reduce-scatter) and GB/s."""
    def read(data: Any) -> str:
        cells = [size, op]
        for link in ("loopback", "2gbit"):
            by_op = data["results"][link][size]
            fastest = min(("reduce_scatter", "all_to_all+sum", "all_reduce+slice"), key=lambda o: by_op[o]["ms"])
            cells += [f"{by_op[op]['ms']:.1f}{' *' if op == fastest else ''}", f"{by_op[op]['gbps']:.2f}"]
        return "| " + " | ".join(cells) + " |"
    return read


def _block_row(index: int) -> Reader:
    """Row `index` of the block-size sweep as kernel_bandwidth.py prints it: block, bytes per element,
    the four round-trip errors, excess bits, then the two timings (median (IQR) CPU-median)."""
    def read(data: Any) -> str:
        r = data["block_sweep"][index]
        times = " ".join(f"{r[f'{op}_ms']:.2f} ({r[f'{op}_iqr_ms']:.2f}) {r[f'{op}_cpu_ms']:.2f}"
                         for op in ("quantize", "accumulate"))
        return (f"{r['block']} {r['bytes_int8']:.4f} {r['bytes_int4']:.4f} {r['rel_rms_int8_normal']:.5f} "
                f"{r['rel_rms_int8_student_t3']:.5f} {r['rel_rms_int4_normal']:.4f} {r['rel_rms_int4_student_t3']:.4f} "
                f"{r['excess_bits']:.3f} {times}")
    return read


def _quant(op: str, impl: str, field: str) -> Reader:
    return row(("rows",), field, case="quant_shard(block 128)", op=op, impl=impl)


def _quant_speedups() -> list[Reader]:
    ops = ("quantize_int8 fp32", "quantize_int8 bf16", "quantize_int4 +feedback", "dequant_acc int8 x2",
           "dequant_acc int4 x8", "dequant_into int8->bf16")
    return [row(("summary",), "vs_best_torch", case="quant_shard(block 128)", op=op, backend="ext") for op in ops]


_HYBRID_ROWS = (("overlap-full", "ShardedModule, full sharding over 4 ranks"),
                ("overlap-hybrid", "ShardedModule, hybrid (2 × 2)"),
                ("overlap-hybrid-int8", "ShardedModule, hybrid, int8 collectives"),
                ("overlap-hpz", "ShardedModule, hpZ"), ("overlap-auto", "ShardedModule, `sharding=\"auto\"`"),
                ("fsdp2-hsdp", "FSDP2 HSDP, defaults"), ("fsdp2-hsdp-tuned", "FSDP2 HSDP, tuned"),
                ("ddp", "DDP, defaults"), ("ddp-tuned", "DDP, tuned"), ("ddp-fp16", "DDP, tuned, fp16 hook"))
# docs/hybrid.md's table of paired ratios: (row words, impl, peers).
_HYBRID_PAIRS = [("`auto` ÷ best of full, hybrid, hpZ", "overlap-auto", ("overlap-full", "overlap-hybrid", "overlap-hpz")),
                 ("hybrid ÷ full", "overlap-hybrid", ("overlap-full",)),
                 ("hybrid ÷ tuned FSDP2 HSDP", "overlap-hybrid", ("fsdp2-hsdp-tuned",)),
                 ("`auto` ÷ tuned FSDP2 HSDP", "overlap-auto", ("fsdp2-hsdp-tuned",)),
                 ("hybrid ÷ FSDP2 HSDP, defaults", "overlap-hybrid", ("fsdp2-hsdp",)),
                 ("hybrid ÷ tuned DDP", "overlap-hybrid", ("ddp-tuned",)),
                 ("hybrid ÷ faster DDP of the round", "overlap-hybrid", ("ddp", "ddp-tuned")),
                 ("hybrid-int8 ÷ DDP with the fp16 hook", "overlap-hybrid-int8", ("ddp-fp16",)),
                 ("hybrid-int8 ÷ hybrid", "overlap-hybrid-int8", ("overlap-hybrid",)),
                 ("hybrid-int8 ÷ tuned FSDP2 HSDP", "overlap-hybrid-int8", ("fsdp2-hsdp-tuned",))]
_GRID = ("overlap-full", "overlap-hybrid", "overlap-hpz")
_GRID_NAMES = {"overlap-full": "full", "overlap-hybrid": "hybrid", "overlap-hpz": "hpZ"}


def _hybrid_rounds(data: Any) -> list[dict[str, float]]:
    """hybrid.py's 1 Gbit/s rounds as {impl: median step (s)}."""
    return [{impl: statistics.median(steps) for impl, steps in r.items()}
            for r in data["rates"]["1gbit"]["per_round_steps_s"]]


def _hybrid_paired(impl: str, peers_: tuple[str, ...]) -> Reader:
    """Per round, `impl`'s median step over the fastest of `peers_` in the same round."""
    return lambda data: [r[impl] / min(r[p] for p in peers_) for r in _hybrid_rounds(data)]


def _auto_choices(data: Any) -> list[str]:
    """The row of the sharding `auto` chose in each round (its log line starts with the name)."""
    rows = {"full": "overlap-full", "hybrid": "overlap-hybrid", "hpZ:": "overlap-hpz"}
    return [rows[d.split(" ", 1)[0]] for d in data["rates"]["1gbit"]["decisions"]["overlap-auto"]]


def _choice_name(k: int) -> Reader:
    return lambda data: _GRID_NAMES[_auto_choices(data)[k]]


def _choice_over_best(k: int) -> Reader:
    """Round k's chosen sharding's own row over the fastest of the grid in that round."""
    def read(data: Any) -> float:
        r = _hybrid_rounds(data)[k]
        return r[_auto_choices(data)[k]] / min(r[g] for g in _GRID)
    return read


def _auto_over_choice(k: int) -> Reader:
    """Round k's `auto` launch over the launch of the sharding it chose, set by hand."""
    def read(data: Any) -> float:
        r = _hybrid_rounds(data)[k]
        return r["overlap-auto"] / r[_auto_choices(data)[k]]
    return read


def _best_name(k: int) -> Reader:
    return lambda data: _GRID_NAMES[min(_GRID, key=_hybrid_rounds(data)[k].get)]


def _hybrid_row(impl: str, label: str) -> Reader:
    def read(data: Any) -> str:
        summary = data["rates"]["1gbit"]["summary"][impl]
        return (f"| {label} | {summary['step_ms']:.0f} | {summary['iqr_ms'][0]:.0f}–{summary['iqr_ms'][1]:.0f} | "
                f"{_spread_cell(_hybrid_paired(impl, ('overlap-full',)))(data)} |")
    return read


def _checkpoint(key: str) -> tuple:
    return at("summary", key, "median_ms"), at("summary", key, "iqr_ms", 0), at("summary", key, "iqr_ms", 1)


def _per_round_pairs(pick: Callable) -> Reader:
    """`pick` over the rounds of the steps run during an async save over the same steps alone."""
    return lambda data: pick(r["steps_during_write_s"] / r["steps_alone_s"] for r in data["rounds"])


def _host(ranks: str, impl: str, *fields: str) -> tuple:
    """Readers of overhead_*.json's 16-unit rows: for each field, its median, min and max
    ("host" is host µs per unit; anything else a ratio to that implementation)."""
    base = ("results", ranks, "16", impl)
    return tuple(at(*base, *(("host_us_per_unit",) if field == "host" else ("ratios", field)), stat)
                 for field in fields for stat in ("median", "min", "max"))


_HOST_ROW = "{0:.0f} ({1:.0f}–{2:.0f}) | {3:.2f} ({4:.2f}–{5:.2f}) | {6:.2f} ({7:.2f}–{8:.2f})"
# docs/host_cost.md's rows at the current code: (ranks, row, words).
_HOST_CURRENT = [("1", "overlap-full", "ShardedModule"), ("1", "overlap-full-int8", "ShardedModule, int8"),
                 ("1", "fsdp2", "FSDP2"), ("1", "fsdp2-tuned", "tuned FSDP2"), ("1", "deepspeed", "DeepSpeed ZeRO-3"),
                 ("2", "overlap-full", "ShardedModule"),
                 ("2", "overlap-full-order-step", "ShardedModule, `OVERLAP_ORDER_CHECK=step`"),
                 ("2", "overlap-hybrid", "ShardedModule, hybrid"), ("2", "overlap-hpz", "ShardedModule, hpZ"),
                 ("2", "overlap-full-int8", "ShardedModule, int8"), ("2", "fsdp2", "FSDP2"),
                 ("2", "fsdp2-tuned", "tuned FSDP2"), ("2", "deepspeed", "DeepSpeed ZeRO-3")]


def _timing(key: str) -> tuple:
    base = ("timings", key)
    return at(*base, "median_ms"), at(*base, "q1_ms"), at(*base, "q3_ms")


def _padding(model: str, world: int, unit: str) -> tuple:
    return tuple(row(("units",), field, model=model, world=world, unit=unit)
                 for field in ("numel", "padding_bytes", "extra_bytes"))


def _optim_row(index: int) -> tuple:
    """optim_step.json's row `index`: overlap's M params/s; for torch fused, DeepSpeed and torch
    foreach their M params/s and time over overlap's (median, range); copy GB/s, the bound's
    M params/s and overlap's share of it."""
    def impl(name: str) -> tuple:
        base = ("results", index, "implementations", name)
        return (lambda d: at(*base, "params_per_s")(d) / 1e6, at(*base, "time_over_overlap_median"),
                at(*base, "time_over_overlap_range", 0), at(*base, "time_over_overlap_range", 1))

    return (impl("overlap")[0], *impl("torch-fused"), *impl("deepspeed-cpu-adam"), *impl("torch-foreach"),
            at("results", index, "copy_GBps"), lambda d: d["results"][index]["bound_params_per_s"] / 1e6,
            at("results", index, "implementations", "overlap", "fraction_of_bound"))


def _round_steps(data: Any, link: str) -> list[dict[str, float]]:
    """compare.py's runs as one {impl: median step of the slower rank} per round of `link`."""
    rounds: dict[int, dict[str, float]] = {}
    for run in data["runs"]:
        if run["link"] == link:
            steps = [max(times) for times in zip(*(rank["step_s"] for rank in run["ranks"]))]
            rounds.setdefault(run["round"], {})[run["impl"]] = statistics.median(steps)
    return [rounds[k] for k in sorted(rounds)]


def _paired(link: str, impl: str, peers: tuple[str, ...]) -> Reader:
    """Per round, `impl`'s median step over the faster of `peers` in the same round."""
    return lambda data: [r[impl] / min(r[p] for p in peers if p in r) for r in _round_steps(data, link)
                         if impl in r and any(p in r for p in peers)]


def listed(ratios: Reader) -> Reader:
    return lambda data: ", ".join(f"{r:.2f}" for r in ratios(data))


def held(ratios: Reader, limit: float) -> Reader:
    return lambda data: sum(r <= limit for r in ratios(data))


def _spread_cell(ratios: Reader) -> Reader:
    """"median (min–max)" of per-round ratios, as compare.py's tables print them; – for none."""
    def read(data: Any) -> str:
        values = ratios(data)
        return "–" if not values else f"{statistics.median(values):.2f} ({min(values):.2f}–{max(values):.2f})"
    return read


def _peak_mib(data: Any, link: str, impl: str) -> float:
    """The larger rank's tracked peak of `impl`, MiB."""
    return max(r["peak"]["Total"] for r in data["results"][link][impl]["ranks_memory"]) / 2**20


def _behind_words(ratios: list[float]) -> str:
    """How far behind (ratios above 1) the rounds were, in the docs' words."""
    behind = [r for r in ratios if r > 1]
    if len(behind) == len(ratios):
        return f"behind in every round, by {100 * (min(ratios) - 1):.0f}–{100 * (max(ratios) - 1):.0f}%"
    return (f"behind in {len(behind)} of {len(ratios)} rounds, by up to {100 * (max(ratios) - 1):.0f}%, and "
            f"ahead in the rest by up to {100 * (1 - min(ratios)):.0f}%")


def _ahead_words(ratios: list[float]) -> str:
    """In how many rounds the ratios were below 1, in the docs' words."""
    ahead = sum(r < 1 for r in ratios)
    if ahead == len(ratios):
        return "ahead in every round"
    return "behind in every round" if ahead == 0 else f"ahead in {ahead} of {len(ratios)} rounds"


def held_words(ratios: Reader, limit: float) -> Reader:
    """How many rounds met `limit`, in the docs' words."""
    def read(data: Any) -> str:
        values = ratios(data)
        count = sum(r <= limit for r in values)
        if count == 0:
            return "missed in every round"
        return "held in every round" if count == len(values) else f"held in {count} of {len(values)} rounds"
    return read


_PHASES = ("forward", "backward", "optimizer")


def _time_row(link: str, impl: str) -> Reader:
    """One row of compare.py's per-implementation table, every cell derived again from the
    file: step statistics and phases from the summary, the per-round ratios from the raw steps."""
    def read(data: Any) -> str:
        entry = data["results"][link][impl]
        steps = sum(len(run["ranks"][0]["step_s"]) for run in data["runs"]
                    if run["link"] == link and run["impl"] == impl)
        sent = "–" if entry["sent_bytes"] is None else f"{entry['sent_bytes'] / 2**20:.1f} ({entry['sent_source']})"
        exposed = entry.get("exposed_ms_by_kind")
        cells = [link, impl, f"{entry['step_ms']:.0f}",
                 f"{entry['step_ms_quartiles'][0]:.0f}–{entry['step_ms_quartiles'][1]:.0f}", str(steps),
                 " / ".join(f"{entry['phase_ms'][p]:.0f}" for p in _PHASES),
                 _spread_cell(_paired(link, impl, ("local",)))(data), sent,
                 "–" if exposed is None else " / ".join(f"{exposed.get(k, 0):.0f}" for k in ("all_gather", "reduce_scatter")),
                 _spread_cell(_paired(link, "overlap", (impl,)))(data)]
        return "| " + " | ".join(cells) + " |"
    return read


_MEMORY = ("Parameter", "Gradient", "Optstate", "Activation", "Temp", "Other", "Total")


def _memory_row(link: str, impl: str, rank: int) -> Reader:
    """One row of compare.py's memory table (MiB), from the rank's tracked peak and RSS."""
    def read(data: Any) -> str:
        entry = data["results"][link][impl]
        memory = entry["ranks_memory"][rank]
        cells = [impl, str(rank), *(f"{memory['peak'].get(c, 0) / 2**20:.1f}" for c in _MEMORY),
                 " / ".join(f"{memory['phases'][p] / 2**20:.0f}" for p in ("forward", "backward")),
                 f"{entry['peak_rss'][rank] / 2**20:.0f}"]
        return "| " + " | ".join(cells) + " |"
    return read


_SLOW_LINKS = (("2gbit", "2 Gbit/s"), ("500mbit", "500 Mbit/s"))
_SPEED_IMPLS = ("overlap", "overlap-int8", "overlap-int8-int4", "overlap-auto", "fsdp2-tuned", "ddp-tuned", "ddp-fp16")
_COMPRESSED = ("overlap-int8", "overlap-int8-int4")
# docs/compression.md's targets table: (words, peer, limit), judged for int8 and int8-int4.
_COMPRESSED_TARGETS = [("compressed ≤ 0.6 × uncompressed", "overlap", 0.6),
                       ("ahead of DDP with the fp16 hook", "ddp-fp16", 1.0),
                       ("≤ 0.9 × tuned FSDP2", "fsdp2-tuned", 0.9), ("≤ tuned DDP", "ddp-tuned", 1.0)]


def _speed_row(link: str, label: str) -> Reader:
    def read(data: Any) -> str:
        cells = []
        for impl in _SPEED_IMPLS:
            entry = data["results"][link][impl]
            q1, q3 = entry["step_ms_quartiles"]
            cells.append(f"{entry['step_ms']:.0f} ({q1:.0f}–{q3:.0f})")
        return f"| {label} | " + " | ".join(cells) + " |"
    return read


def _compressed_targets(link: str, peer: str, limit: float) -> Reader:
    """"int8 m (a–b), <held words>; int8-int4 ...": both compressed rows against `peer`."""
    return lambda data: "; ".join(
        f"{name} {_spread_cell(_paired(link, impl, (peer,)))(data)}, {held_words(_paired(link, impl, (peer,)), limit)(data)}"
        for name, impl in (("int8", "overlap-int8"), ("int8-int4", "overlap-int8-int4")))


def _peak0(link: str, impl: str) -> Reader:
    return lambda data: data["results"][link][impl]["ranks_memory"][0]["peak"]["Total"] / 2**20


def _category0(link: str, impl: str, category: str) -> Reader:
    return lambda data: data["results"][link][impl]["ranks_memory"][0]["peak"][category] / 2**20


def _exposed(link: str, impl: str) -> tuple:
    return tuple(at("results", link, impl, "exposed_ms_by_kind", kind) for kind in ("all_gather", "reduce_scatter"))


def _extremes(ratios: Reader) -> tuple:
    return (lambda d: min(ratios(d)), lambda d: max(ratios(d)))


def _auto_runs(data: Any) -> list[dict]:
    return [run for run in data["runs"] if run["impl"] == "overlap-auto"]


def _replay(run: dict) -> list[float]:
    """The planner's predicted steps (ms) in its log line: uncompressed, int8, int8-int4."""
    return [float(ms) for ms in re.findall(r"(\d+) ms", run["settings"]["compression_reason"])]


def _replay_errors(data: Any, which: int, measured_impl: str) -> list[float]:
    """Each auto run's prediction `which` over `measured_impl`'s median step in the same round."""
    errors = []
    for run in _auto_runs(data):
        measured = _round_steps(data, run["link"])[run["round"]][measured_impl] * 1e3
        errors.append(_replay(run)[which] / measured)
    return errors


def _int4_gain(data: Any) -> list[float]:
    return [100 * (1 - _replay(run)[2] / _replay(run)[1]) for run in _auto_runs(data)]


def _auto_row(link: str, label: str, round_index: int) -> Reader:
    """docs/compression.md's row of one auto run: its log line, its choice, and the round's steps."""
    def read(data: Any) -> str:
        run = next(r for r in _auto_runs(data) if r["link"] == link and r["round"] == round_index)
        reason = run["settings"]["compression_reason"].split(": ", 1)[1]
        steps = _round_steps(data, link)[round_index]
        measured = " / ".join(f"{steps[impl] * 1e3:.0f}" for impl in ("overlap", "overlap-int8", "overlap-auto"))
        return f"| {label} | {round_index + 1} | {reason} | {run['settings']['compression']} | {measured} |"
    return read




# docs/compile.md's runs: (row label, result file suffix, link, format of the local rows' ms).
_COMPILE_RUNS = [("GPT, loopback", "gpt_loopback", "loopback", ".0f"), ("GPT, 2 Gbit/s", "gpt_2gbit", "2gbit", ".0f"),
                 ("MLP, loopback", "mlp_loopback", "loopback", ".1f"), ("MLP, 2 Gbit/s", "mlp_2gbit", "2gbit", ".1f")]
# The targets of the compiled rows, as compare.py records them; the doc says for each whether it is met.
_COMPILE_TARGETS = ("(overlap compiled ÷ eager) / (local compiled ÷ eager)",
                    "overlap-compiled step time / fsdp2-tuned-compiled")


def _target_cell(link: str, what: str) -> Reader:
    """"0.93 met; rounds 0.84 met, 0.93 met, 1.09 missed": the overall ratio and each round's,
    each against the target's limit."""
    def read(data: Any) -> str:
        target = next(t for t in data["targets"] if t["link"] == link and t["what"] == what)
        word = lambda value: "met" if value <= target["limit"] else "missed"  # noqa: E731
        rounds = ", ".join(f"{value:.2f} {word(value)}" for value in target["rounds"])
        return f"{target['ratio']:.2f} {word(target['ratio'])}; rounds {rounds}"
    return read
_CAPTURED = [("traced, one collective per parameter | 79 all-gathers, 54 all-reduce", "traced"),
             ("traced, Inductor's bucketing and reordering passes, default cap (2000 MB) | 2 all-gathers, 2 all-reduce",
              "traced-bucketed"),
             ("traced, buckets capped at one block's bytes | 11 all-gathers, 7 all-reduce", "traced-block-buckets")]


def _compiled_cells(local_fmt: str) -> str:
    """Four cells "eager → compiled, median (min–max)" of compiled ÷ eager per round."""
    cells = []
    for i, fmt in enumerate((".0f", ".0f", ".0f", local_fmt)):
        k = 5 * i
        cells.append(f"{{{k}:{fmt}}} → {{{k + 1}:{fmt}}}, {{{k + 2}:.2f}} ({{{k + 3}:.2f}}–{{{k + 4}:.2f}})")
    return " | ".join(cells)


def _compiled_pair(link: str, impl: str) -> tuple:
    rounds = at("results", link, f"{impl}-compiled", "compiled_over_eager_rounds")
    return (at("results", link, impl, "step_ms"), at("results", link, f"{impl}-compiled", "step_ms"),
            at("results", link, f"{impl}-compiled", "compiled_over_eager"),
            lambda d: min(rounds(d)), lambda d: max(rounds(d)))


def _compile_target(link: str, what: str) -> tuple:
    target = lambda d: next(t for t in d["targets"] if t["link"] == link and t["what"] == what)  # noqa: E731
    return (lambda d: target(d)["ratio"], *[lambda d, i=i: target(d)["rounds"][i] for i in range(3)])


def _captured(key: str) -> tuple:
    rounds = at("summary", key, "over_per_unit_rounds")
    return (at("summary", key, "step_ms"), at("summary", key, "over_per_unit"),
            lambda d: min(rounds(d)), lambda d: max(rounds(d)))


def _engine_row(index: int) -> tuple:
    """docs/offload_disk.md's engine table: the per-round ratios of one size."""
    def field(name: str, key: str, scale: float = 1.0) -> Reader:
        return lambda d: scale * d["results"][index][name][key]
    return (*[field("pipelined_over_sum", k) for k in ("median", "min", "max")],
            *[field("pipelined_over_max", k) for k in ("median", "min", "max")],
            *[field("share_of_shorter_hidden", k, 100) for k in ("median", "min", "max")],
            field("disk_gbps_io_alone", "median"), field("disk_gbps_pipelined", "median"))


_ENGINE_ROW = ("| {0:.2f} [{1:.2f}–{2:.2f}] | {3:.2f} [{4:.2f}–{5:.2f}] | {6:.0f}% [{7:.0f}–{8:.0f}] | "
               "{9:.2f} / {10:.2f} GB/s |")


def _model_ranks(field: Callable[[dict], float], scale: float = 1.0) -> tuple:
    """One figure of benchmarks/offload_disk.py --model-params, rank 0 and rank 1."""
    return tuple(lambda d, r=r: scale * field(d["ranks"][r]) for r in (0, 1))


_LAST = lambda name: (lambda rank: rank["steps"][-1][name])  # noqa: E731


def _with_without(field: Callable[[dict], float]) -> tuple:
    """One figure of offload_disk.py's rounds mode, round 0: without (rank 0, 1), with (rank 0, 1)."""
    return tuple(lambda d, m=m, r=r: field(d["rounds"][0][m][r]) for m in ("without", "with") for r in (0, 1))


def _step_total(mode: str) -> Callable[[dict], float]:
    """Rank 0's last step, compute and optimizer.step(), in offload_disk.py's rounds mode."""
    return lambda d: sum(d["rounds"][0][mode][0]["steps"][-1][k] for k in ("compute_s", "optimizer_s"))


def _spread(ratios: Reader) -> tuple:
    """The median, smallest and largest of per-round ratios."""
    return (lambda d: statistics.median(ratios(d)), lambda d: min(ratios(d)), lambda d: max(ratios(d)))



def _paired_rounds(impl: str, base: str, link: str = "loopback") -> tuple[Reader, Reader, Reader]:
    """Median, least and most over rounds of compare.py's `impl` step ÷ `base`'s in the same round."""
    def ratios(data: Any) -> list[float]:
        rows = data["results"][link]
        return [a / b for a, b in zip(rows[impl]["round_step_ms"], rows[base]["round_step_ms"])]
    return (lambda d: statistics.median(ratios(d)), lambda d: min(ratios(d)), lambda d: max(ratios(d)))

_CURRENT = {"loopback": "compare_current_loopback.json", "2gbit": "compare_current.json"}
_AGAINST_26 = "compare_against_26a39e3.json"
_AGAINST_26_LOOPBACK = "compare_against_26a39e3_loopback.json"
_TEN = "compare_current_10gbit.json"
_TEN_IMPLS = ("overlap", "fsdp2-tuned", "ddp-tuned", "overlap-int8", "ddp-fp16", "fsdp2", "ddp", "deepspeed")
# README's ratio table of the 10 Gbit/s run: (row words, impl, peers, target or None).
_TEN_RATIOS = [("overlap ÷ fsdp2-tuned", "overlap", ("fsdp2-tuned",), 0.9),
               ("overlap ÷ faster DDP of the round", "overlap", ("ddp", "ddp-tuned"), 1.0),
               ("overlap-int8 ÷ ddp-fp16", "overlap-int8", ("ddp-fp16",), 1.0),
               ("overlap-int8 ÷ overlap", "overlap-int8", ("overlap",), 0.6),
               ("overlap ÷ fsdp2 (defaults)", "overlap", ("fsdp2",), None),
               ("overlap ÷ deepspeed", "overlap", ("deepspeed",), None)]


def _run_steps(data: Any, link: str, impl: str, round_index: int) -> list[float]:
    """One run's steps (s), each the slower rank's."""
    run = next(r for r in data["runs"] if r["link"] == link and r["impl"] == impl and r["round"] == round_index)
    return [max(times) for times in zip(*(rank["step_s"] for rank in run["ranks"]))]

def logged(pattern: str) -> Reader:
    """The number a log's first line matching `pattern` captures (its one group)."""
    def read(text: str) -> float:
        found = re.search(pattern, text, re.MULTILINE)
        assert found, f"no line matches {pattern!r}"
        return float(found.group(1))
    return read


def _overlap_over_ddp_both_links(two_gbit: Any) -> list[float]:
    """overlap ÷ tuned DDP per round, the loopback run's rounds and then the 2 Gbit/s run's."""
    return (_paired("loopback", "overlap", ("ddp-tuned",))(_result(_CURRENT["loopback"]))
            + _paired("2gbit", "overlap", ("ddp-tuned",))(two_gbit))


_CURRENT_IMPLS = ("overlap", "fsdp2-tuned", "ddp-tuned", "overlap-int8", "ddp-fp16")
# README's table of the current run's paired ratios: (row words, impl, peer, target, words after the cells).
_CURRENT_RATIOS = [
    ("overlap ÷ fsdp2-tuned", "overlap", "fsdp2-tuned", 0.9, "≤ 0.9: held in {0} and {1} of 3 rounds"),
    ("overlap ÷ ddp-tuned", "overlap", "ddp-tuned", 1.0, "≤ 1: held in {0} and {1} of 3 rounds"),
    ("overlap-int8 ÷ ddp-fp16", "overlap-int8", "ddp-fp16", 1.0, "≤ 1: held in {0} and {1} of 3 rounds"),
    ("overlap-int8 ÷ fsdp2-tuned", "overlap-int8", "fsdp2-tuned", None, ""),
    ("overlap-int8 ÷ overlap", "overlap-int8", "overlap", 0.6, "≤ 0.6: held in {0} and {1} of 3 rounds"),
]

def _tp_median_step(impl: str) -> Reader:
    """benchmarks/tp.py's pooled median step of `impl` over every round."""
    return lambda data: statistics.median([step for steps in data["per_round_steps_s"] for step in steps[impl]])


def _tp_peak(impl: str, field: str) -> Reader:
    """benchmarks/tp.py's peak memory of `impl`, the largest rank's, in MiB."""
    return lambda data: max(data["memory"][impl][field]) / 2**20


def _habit(cells: tuple, habit: str) -> Reader:
    """A cell of the drop-in habits table as docs/parameters.md writes it."""
    def read(data: Any) -> str:
        cell = at(*cells, habit)(data)
        if cell["verdict"] != "refused":
            return cell["verdict"]
        return f"refused: `{cell['error'].split(':')[0]}` after {cell['seconds']:.0f} s"
    return read


def _recovery_cell(point: str, column: int) -> Reader:
    """A cell of a recovery table's row (benchmarks/recovery.py), times as docs/train.md writes them."""
    def read(data: Any) -> str:
        for line in data["table"].splitlines():
            cells = [cell.strip() for cell in line.strip().strip("|").split("|")]
            if cells[0] == point:
                return cells[column].replace(" (median ", " s (median ").replace(")", " s)") if column == 7 \
                    else cells[column]
        raise KeyError(point)
    return read


FIGURES: list[Figure] = [
    # README.md: framework overhead.
    Figure("README.md", "| hand-written loop, `ShardedModule` | {0:.0f} | {1:.2f}, {2:.2f}, {3:.2f}, {4:.2f} | {5:.2f} |",
           "integrations.json", (at("variants", "loop", "step_ms_median"), *_per_round("loop"),
                                 at("variants", "loop", "ratio_to_loop_median"))),
    Figure("README.md", "| Lightning `Trainer` + `OverlapStrategy` | {0:.0f} | {1:.2f}, {2:.2f}, {3:.2f}, {4:.2f} | {5:.2f} |",
           "integrations.json", (at("variants", "lightning", "step_ms_median"), *_per_round("lightning"),
                                 at("variants", "lightning", "ratio_to_loop_median"))),
    Figure("README.md", "| `transformers.Trainer` as `OverlapTrainer` | {0:.0f} | {1:.2f}, {2:.2f}, {3:.2f}, {4:.2f} | "
                        "{5:.2f} |", "integrations.json",
           (at("variants", "hf", "step_ms_median"), *_per_round("hf"), at("variants", "hf", "ratio_to_loop_median"))),
    Figure("README.md", "(FSDP2, `fully_shard` per block) | {0:.0f} | {1:.2f}, {2:.2f}, {3:.2f}, {4:.2f} | {5:.2f} |",
           "integrations.json", (at("variants", "lightning-fsdp2", "step_ms_median"), *_per_round("lightning-fsdp2"),
                                 at("variants", "lightning-fsdp2", "ratio_to_loop_median"))),
    Figure("README.md", "`fsdp_version: 2` | {0:.0f} | {1:.2f}, {2:.2f}, {3:.2f}, {4:.2f} | {5:.2f} |",
           "integrations.json", (at("variants", "hf-fsdp", "step_ms_median"), *_per_round("hf-fsdp"),
                                 at("variants", "hf-fsdp", "ratio_to_loop_median"))),
    Figure("README.md", "costs what the hand-written loop costs ({0:.2f}×, rounds {1:.2f}–{2:.2f}); `OverlapTrainer` ran "
                        "{3:.2f}× at the median, but from {4:.2f}× to {5:.2f}× by round", "integrations.json",
           (at("variants", "lightning", "ratio_to_loop_median"), *_extremes(at("variants", "lightning", "ratios_per_round")),
            at("variants", "hf", "ratio_to_loop_median"), *_extremes(at("variants", "hf", "ratios_per_round")))),
    Figure("README.md", "Trainer's FSDP2 ran at {0:.2f}× the loop, ahead of it in every round ({1:.2f}–{2:.2f})",
           "integrations.json", (at("variants", "hf-fsdp", "ratio_to_loop_median"),
                                 *_extremes(at("variants", "hf-fsdp", "ratios_per_round")))),
    Figure("README.md", "`ModelParallelStrategy` (FSDP2) at {0:.2f}×", "integrations.json",
           (at("variants", "lightning-fsdp2", "ratio_to_loop_median"),)),
    Figure("README.md", "1-min load average {0:.2f} before, {1:.2f} after", "integrations.json",
           (at("loadavg_before", 0), at("loadavg_after", 0))),
    # ARCHITECTURE.md: the order check and gloo's reduce-scatter.
    Figure("ARCHITECTURE.md", "a step makes {0:d} order words of {1:.2f} ms\neach, {2:.0f} ms against a {3:.1f} s step "
                              "({4:.1f} %)",
           "order_check.json", (at("summary", "words_per_step"), lambda d: d["summary"]["word_us"] / 1e3,
                                at("summary", "words_ms_per_step"), lambda d: d["summary"]["step_ms_without"] / 1e3,
                                lambda d: 100 * d["summary"]["words_ms_per_step"] / d["summary"]["step_ms_without"])),
    Figure("ARCHITECTURE.md", "has median {0:.2f} and range {1:.2f} to {2:.2f} over {3:d} rounds", "order_check.json",
           (at("summary", "ratio_median"), at("summary", "ratio_min"), at("summary", "ratio_max"), at("rounds"))),
    Figure("ARCHITECTURE.md", "the bookkeeping is {0:.0f} µs a step", "order_check.json", (at("summary", "bookkeeping_us"),)),
    Figure("ARCHITECTURE.md", "{0:.1f}–{1:.1f}× faster than gloo's `reduce_scatter_tensor` on loopback and "
                        "{2:.2f}–{3:.2f}× on an emulated 2 Gbit/s link", "collectives.json",
           (extreme(min, _collective_ratios("loopback")), extreme(max, _collective_ratios("loopback")),
            extreme(min, _collective_ratios("2gbit")), extreme(max, _collective_ratios("2gbit")))),
    Figure("docs/benchmarks.md", "{0:.1f}–{1:.1f}× faster than `reduce_scatter_tensor` on loopback and "
                                 "{2:.1f}–{3:.1f}× on the 2 Gbit/s link", "collectives.json",
           (extreme(min, _collective_ratios("loopback")), extreme(max, _collective_ratios("loopback")),
            extreme(min, _collective_ratios("2gbit")), extreme(max, _collective_ratios("2gbit")))),
    *[Figure("docs/benchmarks.md", "{0}", "collectives.json", (_collective_row(size, op),))
      for size in ("1", "8", "32") for op in ("reduce_scatter", "all_to_all+sum", "all_reduce+slice", "all_gather")],
    Figure("docs/benchmarks.md", "emulated link at 8 and 32 MB (within {0:.0f}%); at 1 MB the all-gather took {1:.1f} ms "
                                 "and the all-to-all {2:.1f} ms", "collectives.json",
           (lambda d: 100 * max(abs(d["results"]["2gbit"][size]["all_gather"]["ms"] / d["results"]["2gbit"][size]["all_to_all+sum"]["ms"] - 1)
                                for size in ("8", "32")),
            at("results", "2gbit", "1", "all_gather", "ms"), at("results", "2gbit", "1", "all_to_all+sum", "ms"))),
    # README.md and docs/planner.md: the planner against the grid.
    Figure("README.md", "was {0:.3f} [interquartile range {1:.3f}–{2:.3f}] and {3:.3f} [{4:.3f}–{5:.3f}]",
           "planner_grid.json", (at("fast", "auto_to_best", "median"), at("fast", "auto_to_best", "iqr", 0),
                                 at("fast", "auto_to_best", "iqr", 1), at("slow", "auto_to_best", "median"),
                                 at("slow", "auto_to_best", "iqr", 0), at("slow", "auto_to_best", "iqr", 1))),
    *[Figure("docs/planner.md", "ratio to the best {0:.3f} [{1:.3f}-{2:.3f}]", "planner_grid.json",
             (at(link, "auto_to_best", "median"), at(link, "auto_to_best", "iqr", 0), at(link, "auto_to_best", "iqr", 1)))
      for link in ("fast", "slow")],
    # docs/compression.md: speed, the automatic choice, accuracy.
    *[Figure("docs/compression.md", "{0}", "compression.json", (_speed_row(link, label),))
      for link, label in _SLOW_LINKS],
    *[Figure("docs/compression.md", f"| {label} | {{0}} | {{1}} |", "compression.json",
             (_compressed_targets("2gbit", peer, limit), _compressed_targets("500mbit", peer, limit)))
      for label, peer, limit in _COMPRESSED_TARGETS],
    Figure("docs/compression.md", "| peak memory ≤ uncompressed | **missed**: {0:.2f} (int8), {1:.2f} (int8-int4) |",
           "compression.json", tuple(ratio(_peak0("2gbit", impl), _peak0("2gbit", "overlap"))
                                     for impl in ("overlap-int8", "overlap-int8-int4"))),
    Figure("docs/compression.md", "overlap {0:.1f} MiB, int8 {1:.1f} MiB, int8-int4 {2:.1f} MiB", "compression.json",
           tuple(_peak0("2gbit", impl) for impl in ("overlap", "overlap-int8", "overlap-int8-int4"))),
    Figure("docs/compression.md", "*Activation* category ({0:.1f} against {1:.1f} MiB)", "compression.json",
           tuple(_category0("2gbit", impl, "Activation") for impl in ("overlap-int8", "overlap"))),
    Figure("docs/compression.md", "*Temp* {0:.1f} against {1:.1f} MiB", "compression.json",
           tuple(_category0("2gbit", impl, "Temp") for impl in ("overlap-int8-int4", "overlap"))),
    *[Figure("docs/compression.md", "{0}", "compression.json", (_auto_row(link, label, k),))
      for link, label in _SLOW_LINKS for k in range(3)],
    Figure("docs/compression.md", "`auto` ran at {0} of the uncompressed step at 2 Gbit/s and {1} at 500 Mbit/s",
           "compression.json", tuple(_spread_cell(_paired(link, "overlap-auto", ("overlap",))) for link, _ in _SLOW_LINKS)),
    Figure("docs/compression.md", "within {0:+.0f}% to {1:+.0f}% of the uncompressed steps measured in the same round; "
                                  "it over-predicts the int8 step by {2:.0f}–{3:.0f}%", "compression.json",
           (lambda d: 100 * (min(_replay_errors(d, 0, "overlap")) - 1), lambda d: 100 * (max(_replay_errors(d, 0, "overlap")) - 1),
            lambda d: 100 * (min(_replay_errors(d, 1, "overlap-int8")) - 1),
            lambda d: 100 * (max(_replay_errors(d, 1, "overlap-int8")) - 1))),
    Figure("docs/compression.md", "int8-int4 was predicted {0:.1f}–{1:.1f}% faster than int8", "compression.json",
           (lambda d: min(_int4_gain(d)), lambda d: max(_int4_gain(d)))),
    Figure("docs/compression.md", "uncompressed at 2 Gbit/s\n{0:.0f} ms here", "compression.json",
           (at("results", "2gbit", "overlap", "step_ms"),)),
    Figure("docs/compression.md", "falls from {0:.0f} + {1:.0f} ms to {2:.0f} + {3:.0f} ms a step", "compression.json",
           (*_exposed("2gbit", "overlap"), *_exposed("2gbit", "overlap-int8"))),
    Figure("docs/compression.md", "(int8 {0:.2f}–{1:.2f} per round)", "compression.json",
           _extremes(_paired("2gbit", "overlap-int8", ("overlap",)))),
    Figure("docs/compression.md", "int8 is ahead ({0:.2f}, held in {1} of 3 rounds) and int8-int4 about as far "
                                  "({2:.2f}, {3} of 3)", "compression.json",
           (_spread(_paired("2gbit", "overlap-int8", ("ddp-fp16",)))[0], held(_paired("2gbit", "overlap-int8", ("ddp-fp16",)), 1.0),
            _spread(_paired("2gbit", "overlap-int8-int4", ("ddp-fp16",)))[0],
            held(_paired("2gbit", "overlap-int8-int4", ("ddp-fp16",)), 1.0))),
    Figure("docs/compression.md", "(exposed {0:.0f} + {1:.0f} ms of a {2:.1f} s step)", "compression.json",
           (*_exposed("500mbit", "overlap"), lambda d: d["results"]["500mbit"]["overlap"]["step_ms"] / 1e3)),
    Figure("docs/compression.md", "brings the step to {0:.2f}–{1:.2f} of the uncompressed one in every round", "compression.json",
           (lambda d: min(_paired("500mbit", i, ("overlap",))(d)[k] for i in _COMPRESSED for k in range(3)),
            lambda d: max(_paired("500mbit", i, ("overlap",))(d)[k] for i in _COMPRESSED for k in range(3)))),
    Figure("docs/compression.md", "(int8 {0:.2f}–{1:.2f}, int8-int4 {2:.2f}–{3:.2f}) and {4:.2f}–{5:.2f} of tuned FSDP2",
           "compression.json",
           (*_extremes(_paired("500mbit", "overlap-int8", ("ddp-fp16",))),
            *_extremes(_paired("500mbit", "overlap-int8-int4", ("ddp-fp16",))),
            lambda d: min(_paired("500mbit", i, ("fsdp2-tuned",))(d)[k] for i in _COMPRESSED for k in range(3)),
            lambda d: max(_paired("500mbit", i, ("fsdp2-tuned",))(d)[k] for i in _COMPRESSED for k in range(3)))),
    *[Figure("docs/compression.md", f"| {mode} | {{0:.4f}} |", "compression_accuracy.json",
             (at("runs", mode, "final_val_loss"),)) for mode in ("none", "int8", "int8-int4")],
    # docs/checkpoint.md
    Figure("docs/checkpoint.md", "| synchronous save: blocking (with checksums) | {0:.0f} | {1:.0f}–{2:.0f} |",
           "checkpoint.json", _checkpoint("sync_s")),
    Figure("docs/checkpoint.md", "| synchronous save without checksums | {0:.0f} | {1:.0f}–{2:.0f} |",
           "checkpoint.json", _checkpoint("plain_sync_s")),
    Figure("docs/checkpoint.md", "| async save: blocking (staging a copy in host memory) | {0:.0f} | {1:.0f}–{2:.0f} |",
           "checkpoint.json", _checkpoint("async_blocking_s")),
    Figure("docs/checkpoint.md", "| 3 steps with an async save writing | {0:.0f} | {1:.0f}–{2:.0f} |",
           "checkpoint.json", _checkpoint("steps_during_write_s")),
    Figure("docs/checkpoint.md", "| the same 3 steps alone | {0:.0f} | {1:.0f}–{2:.0f} |",
           "checkpoint.json", _checkpoint("steps_alone_s")),
    Figure("docs/checkpoint.md", "| load, same world size, verified | {0:.0f} | {1:.0f}–{2:.0f} |",
           "checkpoint.json", _checkpoint("load_s")),
    Figure("docs/checkpoint.md", "| load without verification | {0:.0f} | {1:.0f}–{2:.0f} |",
           "checkpoint.json", _checkpoint("unverified_load_s")),
    Figure("docs/checkpoint.md", "| save with checksums / without | {0:.2f} | {1:.2f}–{2:.2f} |", "checkpoint.json",
           (at("summary", "sync_s_over_plain_sync_s", "median"), at("summary", "sync_s_over_plain_sync_s", "range", 0),
            at("summary", "sync_s_over_plain_sync_s", "range", 1))),
    Figure("docs/checkpoint.md", "| load verified / unverified | {0:.2f} | {1:.2f}–{2:.2f} |", "checkpoint.json",
           (at("summary", "load_s_over_unverified_load_s", "median"),
            at("summary", "load_s_over_unverified_load_s", "range", 0),
            at("summary", "load_s_over_unverified_load_s", "range", 1))),
    Figure("docs/checkpoint.md", "crc32 hashed {0:.2f} GiB/s per rank (both ranks at once), blake2b {1:.2f} GiB/s",
           "checkpoint.json", (at("hash_gib_s", "crc32"), at("hash_gib_s", "blake2b"))),
    Figure("docs/checkpoint.md", "write took {0:.2f}× as long as the same steps alone (median; range {1:.2f}–{2:.2f} over 8 "
                                 "rounds)", "checkpoint.json",
           tuple(_per_round_pairs(pick) for pick in (statistics.median, min, max))),
    Figure("docs/checkpoint.md", "| 3 steps with an async save writing / the same 3 steps alone | {0:.2f} | {1:.2f}–{2:.2f} |",
           "checkpoint.json", tuple(_per_round_pairs(pick) for pick in (statistics.median, min, max))),
    # docs/hybrid.md
    *[Figure("docs/hybrid.md", "{0}", "hybrid.json", (_hybrid_row(impl, label),)) for impl, label in _HYBRID_ROWS],
    *[Figure("docs/hybrid.md", f"| {words} | {{0}} | {{1}} |", "hybrid.json",
             (_spread_cell(_hybrid_paired(impl, peers_)), listed(_hybrid_paired(impl, peers_))))
      for words, impl, peers_ in _HYBRID_PAIRS],
    Figure("README.md", "hybrid sharding ran at {0} of tuned FSDP2 HSDP's step and {1} of full sharding's, against "
                        "tuned DDP {2}; the planner chose {3} in round 1 and {4} in rounds 2 and 3, whose own rows ran "
                        "{5:.2f}, {6:.2f} and {7:.2f} of the best of full, hybrid and hpZ in those rounds, and the "
                        "`auto` launch ran {8} of the best row's step: its 5% target {9}",
           "hybrid.json",
           (_spread_cell(_hybrid_paired("overlap-hybrid", ("fsdp2-hsdp-tuned",))),
            _spread_cell(_hybrid_paired("overlap-hybrid", ("overlap-full",))),
            _spread_cell(_hybrid_paired("overlap-hybrid", ("ddp-tuned",))),
            _choice_name(0), _choice_name(1), *[_choice_over_best(k) for k in range(3)],
            _spread_cell(_hybrid_paired("overlap-auto", _GRID)), held_words(_hybrid_paired("overlap-auto", _GRID), 1.05))),
    Figure("README.md", "`{0}; compute not measured before the first step", "hybrid.json",
           (lambda d: d["rates"]["1gbit"]["decisions"]["overlap-auto"][1].split(" (", 1)[1][:-1],)),
    *[Figure("docs/hybrid.md", f"- round {k + 1}: `{{0}}`", "hybrid.json",
             (lambda d, k=k: d["rates"]["1gbit"]["decisions"]["overlap-auto"][k].split(" (", 1)[1][:-1],))
      for k in range(3)],
    Figure("docs/hybrid.md", "It chose {0} in round 1 and {1} in rounds 2 and 3; the rows of\n  those shardings ran "
                             "{2:.2f}, {3:.2f} and {4:.2f} of the best of the three ({5}, {6} and {7})\n  in those "
                             "rounds. The `auto` launch ran {8:.2f}, {9:.2f} and {10:.2f} of the launch of\n  its own "
                             "choice in the same round", "hybrid.json",
           (_choice_name(0), _choice_name(1), *[_choice_over_best(k) for k in range(3)],
            *[_best_name(k) for k in range(3)], *[_auto_over_choice(k) for k in range(3)])),
    *[Figure("docs/history.md", f"| {label} | {{0:.0f}} | {{1:.0f}}–{{2:.0f}} | {{3:.2f}} |", "hybrid-300mbit.json",
             (at("summary", impl, "step_ms"), at("summary", impl, "iqr_ms", 0), at("summary", impl, "iqr_ms", 1),
              ratio(at("summary", impl, "step_ms"), at("summary", "overlap-full", "step_ms"))))
      for impl, label in (("overlap-full", "ShardedModule, full sharding over 4 ranks"),
                          ("overlap-hybrid", "ShardedModule, hybrid (2 × 2)"),
                          ("fsdp2-hsdp", "FSDP2 HSDP (same mesh, defaults)"), ("ddp", "DDP"))],
    # docs/kernels.md and docs/compression.md: the quantised kernels.
    *[Figure("docs/kernels.md", "{0}", "quant_blocks_cpu.json", (_block_row(k),)) for k in range(6)],

    *[Figure("docs/kernels.md", f"| {op} | {{0:.2f}} | {{1:.2f}} | {{2:.2f}} | {{3:.1f}} |", "kernels_cpu.json",
             (_quant(op, "overlap ext", "ms"), _quant(op, "torch (preallocated)", "ms"),
              _quant(op, "overlap torch", "ms"),
              row(("summary",), "vs_best_torch", case="quant_shard(block 128)", op=op, backend="ext")))
      for op in ("quantize_int8 fp32", "quantize_int8 bf16", "quantize_int4 +feedback", "dequant_acc int8 x2",
                 "dequant_acc int4 x8", "dequant_into int8->bf16")],
    *[Figure("docs/kernels.md", f"{case} {op} ext {{0:.2f}} {{1}} {{2:.2f}}", "kernels_cpu.json",
             (row(("summary",), "GB/s", case=case, op=op, backend="ext"),
              lambda d, case=case, op=op: _percent(row(("summary",), "of_copy", case=case, op=op, backend="ext")(d)),
              row(("summary",), "vs_best_torch", case=case, op=op, backend="ext")))
      for case, op in (("llama7b_block(/4 per dim)", "pack float32->float32"),
                       ("llama7b_block(/4 per dim)", "pack float32->bfloat16"),
                       ("small_x200", "pack float32->float32"), ("small_x200", "pack float32->bfloat16"),
                       ("bucket_1b_x64(/64)", "pack float32->float32"), ("bucket_1b_x64(/64)", "pack float32->bfloat16"),
                       ("runtime_shard", "cast fp32->bf16"), ("runtime_shard", "grad /= N in place"),
                       ("runtime_shard", "accumulate 2 chunks"))],
    Figure("docs/kernels.md", "the cast of a shard to bf16 {0:.2f}x, the in-place division of a gradient {1:.2f}x",
           "kernels_cpu.json", tuple(row(("summary",), "vs_best_torch", case="runtime_shard", op=op, backend="ext")
                                     for op in ("cast fp32->bf16", "grad /= N in place"))),
    Figure("docs/kernels.md", "the sum of two received chunks into the sharded gradient {0:.2f}x", "kernels_cpu.json",
           (row(("summary",), "vs_best_torch", case="runtime_shard", op="accumulate 2 chunks", backend="ext"),)),
    Figure("docs/kernels.md", "The extension is {0:.1f}x to {1:.1f}x faster than the best plain torch expression",
           "kernels_cpu.json", (extreme(min, _quant_speedups()), extreme(max, _quant_speedups()))),
    Figure("docs/compression.md", "quantising this model's 11.6M-element shard to int8 takes {0:.1f} ms (int4 with "
                                  "error feedback {1:.1f} ms); summing two received int8 chunks into the fp32 gradient "
                                  "takes {2:.1f} ms and dequantising a gathered int8 shard into bf16 {3:.1f} ms",
           "kernels_cpu.json", (_quant("quantize_int8 fp32", "overlap ext", "ms"),
                                _quant("quantize_int4 +feedback", "overlap ext", "ms"),
                                _quant("dequant_acc int8 x2", "overlap ext", "ms"),
                                _quant("dequant_into int8->bf16", "overlap ext", "ms"))),
    # docs/optim.md: one row per size and thread count, on the idle host and on the loaded one.
    *[Figure("docs/optim.md" if name == "optim_step_idle.json" else "docs/history.md", f"| {size} | {threads} | " + "{0:.0f} | {1:.0f} ({2:.2f}, {3:.2f}–{4:.2f}) | "
             "{5:.0f} ({6:.2f}, {7:.2f}–{8:.2f}) | {9:.0f} ({10:.2f}, {11:.2f}–{12:.2f}) | {13:.1f} | {14:.0f} | {15:.2f} |",
             name, _optim_row(index))
      for name in ("optim_step.json", "optim_step_idle.json")
      for index, (size, threads) in enumerate((("50M", 1), ("50M", 2), ("100M", 1), ("100M", 2), ("250M", 1),
                                               ("250M", 2), ("500M", 1), ("500M", 2)))],
    # docs/memory.md: the wrap.
    Figure("docs/memory.md", "From meta the wrap stays within {0:.2f} GiB of imports + final shard + largest unit",
           "wrap_memory.json", (lambda d: (d["summary"]["meta"]["rss_after_wrap"] - sum(
               d["summary"]["meta"][k] for k in ("rss_before", "shard_bytes", "largest_unit_bytes"))) / 2**30,)),
    Figure("README.md", "peaked at {0:.2f} GiB per rank from meta against {1:.2f} GiB built eagerly, and took {2:.1f} s "
                        "against {3:.1f} s", "wrap_memory.json",
           (lambda d: d["summary"]["meta"]["rss_after_wrap"] / 2**30, lambda d: d["summary"]["eager"]["rss_after_wrap"] / 2**30,
            at("summary", "meta", "wrap_s"), at("summary", "eager", "wrap_s"))),
    *[Figure("docs/memory.md", f"| {build} | {{0:.1f}} | {{1:.2f}} | {{2:.2f}} | {{3:.2f}} | {{4:.2f}} |", "wrap_memory.json",
             (at("summary", build, "wrap_s"), *[lambda d, b=build, k=k: d["summary"][b][k] / 2**30
                                                for k in ("rss_before", "rss_after_wrap")],
              lambda d, b=build: sum(d["summary"][b][k] for k in ("rss_before", "shard_bytes", "largest_unit_bytes")) / 2**30,
              lambda d, b=build: d["summary"][b]["rss_after_step"] / 2**30))
      for build in ("eager", "meta")],
    # docs/parameters.md
    Figure("docs/history.md", "| step-time ratio | {0:.2f} | {1:.2f} | {2:.2f} | {3:.2f} | {4:.2f} | {5:.2f} | {6:.2f} |",
           "param_shapes_step_time.json", (*[at("summary", "paired_ratios", i) for i in range(6)],
                                           at("summary", "median_ratio"))),
    *[Figure("docs/parameters.md", f"| {label} | {{0:,}} | {{1:,}} B | {{2:,}} B |", "layout_padding.json",
             _padding(model, world, unit))
      for model, world, unit, label in (
          ("benchmark GPT fp32", 2, "blocks.0", "benchmark GPT (fp32) | 2 | each block"),
          ("benchmark GPT fp32", 8, "blocks.0", "benchmark GPT (fp32) | 8 | each block"),
          ("benchmark GPT fp32", 8, "<root>", "benchmark GPT (fp32) | 8 | root"),
          ("Llama-3-8B bf16", 8, "decoder layer", "Llama-3-8B (bf16) | 8 | decoder layer"),
          ("Llama-3-8B bf16", 8, "embedding + head", "Llama-3-8B (bf16) | 8 | embedding + head"),
          ("Llama-3-8B bf16", 64, "decoder layer", "Llama-3-8B (bf16) | 64 | decoder layer"),
          ("Llama-3-8B bf16", 64, "embedding + head", "Llama-3-8B (bf16) | 64 | embedding + head"))],
    Figure("docs/parameters.md", "| all-gather of every unit into per-parameter tensors | {0:.1f} [{1:.1f}–{2:.1f}] | "
                                 "{3:.1f} [{4:.1f}–{5:.1f}] | – | +{6:.1f} [+{7:.1f}–+{8:.1f}] |", "param_layout.json",
           (*_timing("forward/A/total"), *_timing("forward/B/total"), *_timing("forward/B-A/total"))),
    Figure("docs/parameters.md", "| of which (B)'s copy-in + copy-out | – | {0:.1f} [{1:.1f}–{2:.1f}] |",
           "param_layout.json", _timing("forward/B/copies")),
    Figure("docs/parameters.md", "| gradient reduce-scatter path, every unit | {0:.1f} [{1:.1f}–{2:.1f}] | "
                                 "{3:.1f} [{4:.1f}–{5:.1f}] | – | +{6:.1f} [+{7:.1f}–+{8:.1f}] |", "param_layout.json",
           (*_timing("gradient/A/total"), *_timing("gradient/B/total"), *_timing("gradient/B-A/total"))),
    Figure("docs/parameters.md", "| AdamW default (per-tensor loop on CPU) | {0:.1f} [{1:.1f}–{2:.1f}] | "
                                 "{3:.1f} [{4:.1f}–{5:.1f}] | {6:.1f} [{7:.1f}–{8:.1f}] | +{9:.1f} [+{10:.1f}–+{11:.1f}] |",
           "param_layout.json", (*_timing("adamw_default/A/total"), *_timing("adamw_default/B/total"),
                                 *_timing("adamw_default/C/total"), *_timing("adamw_default/B-A/total"))),
    # docs/history.md: overhead.py before the host-cost work.
    *[Figure("docs/history.md", f"| {ranks} | {impl} | " + _HOST_ROW + " | {9:.2f} ({10:.2f}–{11:.2f}) | {12:.2f} |",
             "overhead_before.json", (*_host(ranks, impl, "host", "fsdp2-tuned", "fsdp2", f"{impl}-base"),
                                      at("results", ranks, "16", impl, "cpu_per_wall", "median")))
      for ranks, impl in (("1", "overlap-full"), ("2", "overlap-full"), ("2", "overlap-hpz"))],
    *[Figure("docs/history.md", f"| {ranks} | deepspeed | " + _HOST_ROW + " | – | {9:.2f} |", "overhead_before.json",
             (*_host(ranks, "deepspeed", "host", "fsdp2-tuned", "fsdp2"),
              at("results", ranks, "16", "deepspeed", "cpu_per_wall", "median")))
      for ranks in ("1", "2")],
    # docs/compile.md: eager and compiled rows of two models on two links (one file each), their
    # targets, the collectives captured in the graph, compile times.
    *[Figure("docs/compile.md", f"| {label} | {_compiled_cells(local_fmt)} |", f"compile_compare_{name}.json",
             tuple(reader for impl in ("overlap", "fsdp2-tuned", "ddp-tuned", "local")
                   for reader in _compiled_pair(link, impl)))
      for label, name, link, local_fmt in _COMPILE_RUNS],
    *[Figure("docs/compile.md", f"| {label} | {{0}} | {{1}} |", f"compile_compare_{name}.json",
             tuple(_target_cell(link, what) for what in _COMPILE_TARGETS))
      for label, name, link, _ in _COMPILE_RUNS],
    Figure("docs/history.md", "| per-unit compile (`compile=True`) | 8 all-gathers, 5 all-to-all (reduce-scatter), "
                              "2 all-reduce | {0:.1f} |", "compile_capture_loopback.json",
           (at("summary", "per-unit", "step_ms"),)),
    Figure("docs/history.md", "2 all-reduce | 70.7 | {0:.1f} |", "compile_capture_2gbit.json",
           (at("summary", "per-unit", "step_ms"),)),
    *[Figure("docs/history.md", f"| {label} | {{0:.1f}}, {{1:.2f}} ({{2:.2f}}–{{3:.2f}}) |",
             "compile_capture_loopback.json", _captured(key)) for label, key in _CAPTURED],
    *[Figure("docs/history.md", "| {0:.1f}, {1:.2f} ({2:.2f}–{3:.2f}) |", "compile_capture_2gbit.json", _captured(key))
      for _, key in _CAPTURED],
    Figure("docs/compile.md", "local compiled ÷ eager {0:.2f} ({1:.2f}–{2:.2f}), overlap {3:.2f} ({4:.2f}–{5:.2f}); the "
                              "first target met overall ({6:.2f}) and in {9} of 5 rounds, the second in {10} of 5 "
                              "({7:.2f}–{8:.2f})", "compile_compare_mlp_loopback_pinned.json",
           (*_compiled_pair("loopback", "local")[2:], *_compiled_pair("loopback", "overlap")[2:],
            _compile_target("loopback", "(overlap compiled ÷ eager) / (local compiled ÷ eager)")[0],
            lambda d: min(row(("targets",), "rounds", what="overlap-compiled step time / fsdp2-tuned-compiled")(d)),
            lambda d: max(row(("targets",), "rounds", what="overlap-compiled step time / fsdp2-tuned-compiled")(d)),
            lambda d: sum(r <= 1.03 for r in row(("targets",), "rounds",
                                                   what="(overlap compiled ÷ eager) / (local compiled ÷ eager)")(d)),
            lambda d: sum(r <= 1 for r in row(("targets",), "rounds",
                                                what="overlap-compiled step time / fsdp2-tuned-compiled")(d)))),
    Figure("docs/compile.md", "| overlap-compiled | {0:.1f} s | {1:.1f} s |", "compile_time_default.json",
           tuple(at("results", "loopback", "overlap-compiled", "first_step_s", i) for i in (0, 1))),
    Figure("docs/compile.md", "| local-compiled | {0:.1f} s (after overlap-compiled's round: the block's graph was "
                              "cached) | {1:.1f} s |", "compile_time_default.json",
           tuple(at("results", "loopback", "local-compiled", "first_step_s", i) for i in (0, 1))),
    Figure("docs/compile.md", "| GPT above (4 layers, d=128) | overlap-compiled | {0:.1f} s | {1:.1f}, {2:.1f} s |",
           "compile_compare_gpt_loopback.json",
           tuple(at("results", "loopback", "overlap-compiled", "first_step_s", i) for i in range(3))),
    Figure("docs/compile.md", "| narrow MLP | overlap-compiled | {0:.1f} s | {1:.1f}, {2:.1f} s |",
           "compile_compare_mlp_loopback.json",
           tuple(at("results", "loopback", "overlap-compiled", "first_step_s", i) for i in range(3))),
    # docs/checkpoint.md: torch's state-dict API against FSDP2.
    *[Figure("docs/checkpoint.md", f"| {call} | {{0}} | {{1}} | {{2:.2f}} ({{3:.2f}}–{{4:.2f}}) | {{5}} | "
             "{6:.2f} ({7:.2f}–{8:.2f}) |", "state_dict_api.json",
             (at("summary", "FSDP2", call, "ms"),
              *[reader for variant in ("overlap ShardedModule", "overlap fully_shard")
                for reader in (at("summary", variant, call, "ms"),
                               *[at("summary", variant, call, "over_fsdp2", k) for k in ("median", "min", "max")])]))
      for call in ("model.state_dict()", "get_model_state_dict (full, cpu_offload)",
                   "get_optimizer_state_dict (full, cpu_offload)", "set_model_state_dict (full, broadcast_from_rank0)",
                   "dcp.save(model.state_dict())", "dcp.load + load_state_dict")],
    # README.md: the index of headline figures.
    *[Figure("README.md", f"| ShardedModule ÷ tuned {peer_words}, {link_words} | {{0}} |", file,
             (_spread_cell(_paired(link, "overlap", (peer,))),))
      for link, link_words, file in (("loopback", "loopback", _CURRENT["loopback"]), ("2gbit", "2 Gbit/s", _CURRENT["2gbit"]))
      for peer, peer_words in (("fsdp2-tuned", "FSDP2"), ("ddp-tuned", "DDP"))],
    *[Figure("README.md", f"| ShardedModule ÷ {words}, 10 Gbit/s | {{0}} |", _TEN, (_spread_cell(_paired("10gbit", "overlap", (peer,))),))
      for peer, words in (("fsdp2-tuned", "tuned FSDP2"), ("deepspeed", "DeepSpeed ZeRO-3"))],
    Figure("README.md", "| ShardedModule + TP ÷ FSDP2 + TP (defaults) | {0:.2f} ({1:.2f}–{2:.2f}) |", "tp.json",
           tuple(at("paired", "overlap-tp/fsdp2-tp", k) for k in ("median", "min", "max"))),
    Figure("README.md", "| Lightning + `OverlapStrategy` ÷ the hand-written loop | {0:.2f} ({1:.2f}–{2:.2f}) |",
           "integrations.json", (at("variants", "lightning", "ratio_to_loop_median"),
                                 lambda d: min(d["variants"]["lightning"]["ratios_per_round"]),
                                 lambda d: max(d["variants"]["lightning"]["ratios_per_round"]))),
    *[Figure("README.md", f"| the planner's plan ÷ the best fixed cell, {words} | {{0:.3f}} (IQR {{1:.3f}}–{{2:.3f}}) |",
             "planner_grid.json", (at(link, "auto_to_best", "median"), at(link, "auto_to_best", "iqr", 0),
                                   at(link, "auto_to_best", "iqr", 1)))
      for link, words in (("fast", "10 Gbit/s"), ("slow", "2 Gbit/s"))],
    *[Figure("README.md", f"| {words} | {{0:.2f}} ({{1:.2f}}–{{2:.2f}}) |", "pipeline.json",
             tuple(at("summary", variant, k) for k in ("ratio_to_best_fsdp2_median", "ratio_min", "ratio_max")))
      for variant, words in (("overlap fully_shard", "pipeline (pp 2, dp 2, 1F1B): `fully_shard` stages ÷ FSDP2's faster"),
                             ("overlap ShardedModule", "pipeline: `ShardedModule` stages ÷ FSDP2's faster"))],
    Figure("README.md", "| pipeline: peak tensor memory per rank and step, planner's choice (`fully_shard`) / FSDP2 "
                        "resharding | {0:.1f} / {1:.1f} MB |", "pipeline.json",
           (at("summary", "overlap fully_shard", "peak_tensor_rise_mb_per_rank"),
            at("summary", "FSDP2 reshard", "peak_tensor_rise_mb_per_rank"))),
    Figure("README.md", "| MoE at 2 Gbit/s: EP 4 ÷ no EP | {0:.2f} ({1:.2f}–{2:.2f}) |", "moe_2gbit.json",
           tuple(at("summary", "EP 4", k) for k in ("ratio_median", "ratio_min", "ratio_max"))),
    Figure("README.md", "| MoE at 2 Gbit/s: all-to-all hidden, EP 4 | {0:.0%} |", "moe_2gbit.json",
           (at("summary", "EP 4", "all_to_all_hidden_share"),)),
    Figure("README.md", "| `fully_shard` host µs per unit, 1 rank | {0:.0f} ({1:.0f}–{2:.0f}) |",
           "overhead_kept_gathered_one_rank.json",
           tuple(at("results", "1", "16", "overlap-fully-shard", "host_us_per_unit", k) for k in ("median", "min", "max"))),
    Figure("README.md", "| MoE on loopback: all-to-all hidden, EP 2 with 4 chunks (`OVERLAP_EXPERT_CHUNKS=4`) | {0:.0%} |",
           "moe_chunks_loopback.json", (at("summary", "EP 2/4", "all_to_all_hidden_share"),)),
    *[Figure("README.md", f"| MoE {where}: EP {ep} step, {words} ÷ 2 chunks | {{0:.2f}} ({{1:.2f}}–{{2:.2f}}) |", name,
             _paired_variants(f"EP {ep}/{chunks}", f"EP {ep}"))
      for where, ep, chunks, words, name in (("on loopback", 2, 4, "4 chunks", "moe_chunks_loopback.json"),
                                             ("on loopback", 2, 1, "1 chunk", "moe_chunks_loopback.json"),
                                             ("at 2 Gbit/s", 4, 1, "1 chunk", "moe_chunks_2gbit.json"))],
    # docs/history.md: one rank, units kept gathered until backward, against the checkout before.
    *[Figure("docs/history.md", f"| {label} | {{0:.0f}} ({{1:.0f}}–{{2:.0f}}) | {{3:.2f}} ({{4:.2f}}–{{5:.2f}}) | "
             "{6:.2f} ({7:.2f}–{8:.2f}) |", "overhead_one_rank.json",
             (*[at("results", "1", "16", impl, "host_us_per_unit", k) for k in ("median", "min", "max")],
              *[at("results", "1", "16", impl, "ratios", f"{impl}-base", k) for k in ("median", "min", "max")],
              *[at("results", "1", "16", impl, "ratios", "fsdp2-tuned", k) for k in ("median", "min", "max")]))
      for impl, label in (("overlap-fully-shard", "`fully_shard`"), ("overlap-full", "`ShardedModule`"))],
    Figure("docs/history.md", "| before: `fully_shard` / `ShardedModule` | {0:.0f} / {1:.0f} |",
           "overhead_one_rank.json", tuple(at("results", "1", "16", f"{impl}-base", "host_us_per_unit", "median")
                                           for impl in ("overlap-fully-shard", "overlap-full"))),
    Figure("docs/history.md", "`fully_shard` costs {0:.0f} µs per unit against {1:.0f} before it", "overhead_one_rank.json",
           tuple(at("results", "1", "16", impl, "host_us_per_unit", "median")
                 for impl in ("overlap-fully-shard", "overlap-fully-shard-base"))),
    *[Figure("README.md", f"| {words}, `ShardedModule` ÷ FSDP2 | {{0:.2f}} ({{1:.2f}}–{{2:.2f}}) |", "state_dict_api.json",
             tuple(at("summary", "overlap ShardedModule", call, "over_fsdp2", k) for k in ("median", "min", "max")))
      for call, words in (("dcp.save(model.state_dict())", "`dcp.save(model.state_dict())`"),
                          ("get_model_state_dict (full, cpu_offload)", "`get_model_state_dict(full_state_dict=True)`"))],
    Figure("README.md", "| disk tier ÷ cpu tier, step without clipping (297M GPT, 2 ranks) | {0:.3f} ({1:.3f}–{2:.3f}) |",
           "offload_disk_vs_cpu.json", tuple(at("summary", "step_disk_over_cpu", k) for k in ("median", "min", "max"))),
    Figure("README.md", "| disk tier ÷ cpu tier, step with a binding clip (297M GPT, 2 ranks) | {0:.3f} ({1:.3f}–{2:.3f}) |",
           "offload_disk_vs_cpu_clip.json", tuple(at("summary", "step_disk_over_cpu", k) for k in ("median", "min", "max"))),
    Figure("README.md", "| `fully_shard` host cost ÷ tuned FSDP2's, 2 ranks | {0:.2f} ({1:.2f}–{2:.2f}) |",
           "overhead_kept_gathered.json",
           tuple(at("results", "2", "16", "overlap-fully-shard", "ratios", "fsdp2-tuned", k)
                 for k in ("median", "min", "max"))),
    # docs/fully_shard.md: the runtime through fully_shard, ShardedModule and FSDP2.
    *[Figure("docs/fully_shard.md", f"| {ranks} | {label} | " + _HOST_ROW + " |", "overhead_kept_gathered.json",
             _host(ranks, impl, "host", "fsdp2-tuned", "fsdp2"))
      for ranks in ("1", "2") for impl, label in (("overlap-fully-shard", "`fully_shard`"),
                                                  ("overlap-full", "`ShardedModule`"))],
    *[Figure("docs/fully_shard.md", f"| {ranks} | FSDP2 / tuned FSDP2 | {{0:.0f}} / {{1:.0f}} |",
             "overhead_kept_gathered.json",
             (at("results", ranks, "16", "fsdp2", "host_us_per_unit", "median"),
              at("results", ranks, "16", "fsdp2-tuned", "host_us_per_unit", "median")))
      for ranks in ("1", "2")],
    Figure("README.md", "({0:.2f}× tuned FSDP2's host cost per unit at two ranks", "overhead_kept_gathered.json",
           (at("results", "2", "16", "overlap-fully-shard", "ratios", "fsdp2-tuned", "median"),)),
    Figure("docs/fully_shard.md", "costs {0:.2f}× tuned FSDP2's\nhost time per unit ({1:.2f}–{2:.2f} over the rounds)",
           "overhead_kept_gathered.json",
           tuple(at("results", "2", "16", "overlap-fully-shard", "ratios", "fsdp2-tuned", k)
                 for k in ("median", "min", "max"))),
    Figure("docs/fully_shard.md", "`fully_shard` costs {0:.0f} ({1:.0f}–{2:.0f}) µs per unit", "overhead_kept_gathered_one_rank.json",
           _host("1", "overlap-fully-shard", "host")),
    Figure("docs/fully_shard.md", "`ShardedModule` {0:.0f} ({1:.0f}–{2:.0f}). The goal", "overhead_kept_gathered_one_rank.json",
           _host("1", "overlap-full", "host")),
    Figure("docs/host_cost.md", "ShardedModule's row\ncosts {0:.0f} ({1:.0f}–{2:.0f}) µs per unit at one rank, {3:.2f} of the commit before",
           "overhead_kept_gathered_one_rank.json",
           (*_host("1", "overlap-full", "host"), at("results", "1", "16", "overlap-full", "ratios", "overlap-full-base",
                                                    "median"))),
    # docs/fully_shard.md: the figures of 77d6228, before the one-rank cut.
    Figure("docs/fully_shard.md", "at 77d6228 ([results/overhead_fully_shard_buckets.json](results/overhead_fully_shard_buckets.json)) "
           "{0:.2f} ({1:.2f}–{2:.2f})", "overhead_fully_shard_buckets.json",
           tuple(at("results", "2", "16", "overlap-fully-shard", "ratios", "fsdp2-tuned", k)
                 for k in ("median", "min", "max"))),
    Figure("docs/fully_shard.md", "At 77d6228 `fully_shard` cost {0:.0f} µs per unit at one rank, {1:.0f} more than `ShardedModule`",
           "overhead_fully_shard_buckets.json",
           (at("results", "1", "16", "overlap-fully-shard", "host_us_per_unit", "median"),
            lambda d: round(d["results"]["1"]["16"]["overlap-fully-shard"]["host_us_per_unit"]["median"])
            - round(d["results"]["1"]["16"]["overlap-full"]["host_us_per_unit"]["median"]))),
    # docs/history.md: one rank, units kept gathered from step to step, against the checkout before.
    *[Figure("docs/history.md", f"| {label} | {{0:.0f}} ({{1:.0f}}–{{2:.0f}}) | {{3:.2f}} ({{4:.2f}}–{{5:.2f}}) | "
             "{6:.2f} ({7:.2f}–{8:.2f}) |", "overhead_kept_gathered_one_rank.json",
             _host("1", impl, "host", f"{impl}-base", "fsdp2-tuned"))
      for impl, label in (("overlap-fully-shard", "`fully_shard`"), ("overlap-full", "`ShardedModule`"))],
    Figure("docs/history.md", "| before: `fully_shard` / `ShardedModule` | {0:.0f} / {1:.0f} |",
           "overhead_kept_gathered_one_rank.json",
           tuple(at("results", "1", "16", f"{impl}-base", "host_us_per_unit", "median")
                 for impl in ("overlap-fully-shard", "overlap-full"))),
    Figure("docs/history.md", "`fully_shard` was\n{0:.2f} ({1:.2f}–{2:.2f}) of the checkout before and `ShardedModule` "
           "{3:.2f} ({4:.2f}–{5:.2f})", "overhead_kept_gathered.json",
           (*_host("2", "overlap-fully-shard", "overlap-fully-shard-base"), *_host("2", "overlap-full", "overlap-full-base"))),
    # docs/fully_shard.md: the build hook removed, against the commit before.
    Figure("docs/fully_shard.md", "{0:.0f} against {1:.0f} µs, {2:.2f} ({3:.2f}–{4:.2f}) per round",
           "overhead_build_hook.json",
           (*[at("results", "1", "16", impl, "host_us_per_unit", "median")
              for impl in ("overlap-fully-shard", "overlap-fully-shard-base")],
            *[at("results", "1", "16", "overlap-fully-shard", "ratios", "overlap-fully-shard-base", k)
              for k in ("median", "min", "max")])),
    # docs/history.md: fully_shard before its units were merged into buckets.
    *[Figure("docs/history.md", f"| {ranks} | {label} | " + _HOST_ROW + " |", "overhead_fully_shard.json",
             _host(ranks, impl, "host", "fsdp2-tuned", "fsdp2"))
      for ranks in ("1", "2") for impl, label in (("overlap-fully-shard", "`fully_shard`"),
                                                  ("overlap-full", "`ShardedModule`"))],
    *[Figure("docs/history.md", f"| {ranks} | FSDP2 / tuned FSDP2 | {{0:.0f}} / {{1:.0f}} |",
             "overhead_fully_shard.json", (at("results", ranks, "16", "fsdp2", "host_us_per_unit", "median"),
                                           at("results", ranks, "16", "fsdp2-tuned", "host_us_per_unit", "median")))
      for ranks in ("1", "2")],
    Figure("docs/history.md", "is not met ({0:.0f} µs)", "overhead_fully_shard.json",
           (at("results", "1", "16", "overlap-fully-shard", "host_us_per_unit", "median"),)),
    Figure("docs/history.md", "fell to {0:.2f}× ({1:.2f}–{2:.2f}; {3:.0f} → {4:.0f} µs", "overhead_fully_shard.json",
           (*[at("results", "1", "16", "overlap-fully-shard", "ratios", "overlap-fully-shard-base", k)
              for k in ("median", "min", "max")],
            at("results", "1", "16", "overlap-fully-shard-base", "host_us_per_unit", "median"),
            at("results", "1", "16", "overlap-fully-shard", "host_us_per_unit", "median"))),
    *[Figure("docs/history.md", f"| {ranks} | {label} | {{0:.0f}} ({{1:.0f}}–{{2:.0f}}) | {{3:.2f}} ({{4:.2f}}–{{5:.2f}}) |",
             "overhead_views_registered.json",
             (*[at("results", ranks, "16", impl, "host_us_per_unit", k) for k in ("median", "min", "max")],
              *[at("results", ranks, "16", impl, "ratios", f"{impl}-base", k) for k in ("median", "min", "max")]))
      for ranks in ("1", "2") for impl, label in (("overlap-fully-shard", "`fully_shard`"),
                                                  ("overlap-full", "`ShardedModule`"))],
    Figure("docs/history.md", "registration ({0:.0f} before, in the", "overhead_views_registered.json",
           (at("results", "1", "16", "overlap-fully-shard-base", "host_us_per_unit", "median"),)),
    Figure("docs/history.md", "`ShardedModule` {0:.0f} ({1:.0f}–{2:.0f}) µs per unit per step against {3:.0f} before, "
           "{4:.2f} ({5:.2f}–{6:.2f}) of the baseline per round; `fully_shard`, whose path this does not change, "
           "{7:.2f} ({8:.2f}–{9:.2f})", "overhead_one_rank_registered_after_forward.json",
           (*_host("1", "overlap-full", "host"), at("results", "1", "16", "overlap-full-base", "host_us_per_unit", "median"),
            *_host("1", "overlap-full", "overlap-full-base"), *_host("1", "overlap-fully-shard", "overlap-fully-shard-base"))),
    Figure("docs/history.md", "`ShardedModule` {0:.0f} ({1:.0f}–{2:.0f}) µs per unit per step, {3:.2f} ({4:.2f}–{5:.2f}) of "
           "the baseline per round", "overhead_registered_after_forward.json",
           (*_host("2", "overlap-full", "host"), *_host("2", "overlap-full", "overlap-full-base"))),
    Figure("docs/history.md", "Its one-rank rows, 5 rounds at a noisier moment (the plain model's step too was half again "
           "as long in some), read {0:.2f} ({1:.2f}–{2:.2f})", "overhead_registered_after_forward.json",
           _host("1", "overlap-full", "overlap-full-base")),
    Figure("docs/history.md", "{0:.0f} ms against {1:.0f} ms, {2:.2f} ({3:.2f}–{4:.2f}) of the baseline per round",
           "compare_registered_after_forward_loopback.json",
           (lambda d: statistics.median(d["results"]["loopback"]["overlap"]["round_step_ms"]),
            lambda d: statistics.median(d["results"]["loopback"]["overlap-base"]["round_step_ms"]),
            *_paired_rounds("overlap", "overlap-base"))),
    # docs/host_cost.md
    *[Figure("docs/host_cost.md", f"| {ranks} | {label} | " + _HOST_ROW + " |", "overhead_current.json",
             _host(ranks, impl, "host", "fsdp2-tuned", "fsdp2")) for ranks, impl, label in _HOST_CURRENT],
    Figure("docs/host_cost.md", "At one rank ShardedModule costs {0:.2f}–{1:.2f} of tuned FSDP2's", "overhead_current.json",
           tuple(at("results", "1", "16", "overlap-full", "ratios", "fsdp2-tuned", k) for k in ("min", "max"))),
    Figure("docs/host_cost.md", "the absolute figure, {0:.0f} µs, is above", "overhead_current.json",
           (at("results", "1", "16", "overlap-full", "host_us_per_unit", "median"),)),
    Figure("docs/history.md", "| 1 | ShardedModule | " + _HOST_ROW + " | {9:.2f} ({10:.2f}–{11:.2f}) |",
           "overhead_after.json", _host("1", "overlap-full", "host", "fsdp2-tuned", "fsdp2", "overlap-full-base")),
    Figure("docs/history.md", "| 1 | before (4e25dfe) | " + _HOST_ROW + " |", "overhead_after.json",
           _host("1", "overlap-full-base", "host", "fsdp2-tuned", "fsdp2")),
    Figure("docs/history.md", "| 1 | FSDP2 / tuned FSDP2 | {0:.0f} / {1:.0f} |", "overhead_after.json",
           (at("results", "1", "16", "fsdp2", "host_us_per_unit", "median"),
            at("results", "1", "16", "fsdp2-tuned", "host_us_per_unit", "median"))),
    Figure("docs/history.md", "| 1 | DeepSpeed ZeRO-3 | {0:.0f} | {3:.2f} ({4:.2f}–{5:.2f}) |", "overhead_after.json",
           _host("1", "deepspeed", "host", "fsdp2-tuned")),
    Figure("docs/history.md", "| 2 | ShardedModule | " + _HOST_ROW + " | {9:.2f} ({10:.2f}–{11:.2f}) |",
           "overhead_after.json", _host("2", "overlap-full", "host", "fsdp2-tuned", "fsdp2", "overlap-full-base")),
    Figure("docs/history.md", "| 2 | ShardedModule, `OVERLAP_ORDER_CHECK=step` | " + _HOST_ROW + " |",
           "overhead_after.json", _host("2", "overlap-full-order-step", "host", "fsdp2-tuned", "fsdp2")),
    Figure("docs/history.md", "| 2 | FSDP2 / tuned FSDP2 | {0:.0f} / {1:.0f} |", "overhead_after.json",
           (at("results", "2", "16", "fsdp2", "host_us_per_unit", "median"),
            at("results", "2", "16", "fsdp2-tuned", "host_us_per_unit", "median"))),
    Figure("docs/history.md", "| 2 | DeepSpeed ZeRO-3 | {0:.0f} | {3:.2f} ({4:.2f}–{5:.2f}) | {6:.2f} ({7:.2f}–{8:.2f}) |",
           "overhead_after.json", _host("2", "deepspeed", "host", "fsdp2-tuned", "fsdp2")),
    Figure("docs/history.md", "ShardedModule {0:.0f} µs per unit per step ({1:.0f}–{2:.0f}), {3:.2f} ({4:.2f}–{5:.2f}) "
                                "of tuned FSDP2's and {6:.2f} of FSDP2's; with `OVERLAP_ORDER_CHECK=step` {9:.0f} µs "
                                "({12:.2f} of tuned FSDP2's)", "overhead_after_two_ranks.json",
           (*_host("2", "overlap-full", "host", "fsdp2-tuned", "fsdp2"),
            *_host("2", "overlap-full-order-step", "host", "fsdp2-tuned"))),
    Figure("docs/history.md", "the report's runtime share of the step is {0:.1f}% ({1:.1f}–{2:.1f}%), against {3:.1f}% "
                                "before this work, and the step is {4:.2f} ({5:.2f}–{6:.2f}) of the step before it",
           "runtime_share.json", (*[lambda d, k=k: 100 * d["summary"]["this"]["runtime_share"][k]
                                    for k in ("median", "min", "max")],
                                  lambda d: 100 * d["summary"]["baseline"]["runtime_share"]["median"],
                                  at("summary", "step_this_over_baseline", "median"),
                                  at("summary", "step_this_over_baseline", "min"),
                                  at("summary", "step_this_over_baseline", "max"))),
    # docs/offload_disk.md's engine tables, one row per size (the ratios and bandwidths of the row).
    *[Figure("docs/offload_disk.md", _ENGINE_ROW, "offload_disk_engine.json", _engine_row(index)) for index in range(3)],
    Figure("docs/offload_disk.md", "the kernel ran at\n  {0:.0f}–{1:.0f}M parameters/s", "offload_disk_engine.json",
           (lambda d: min(r["update_params_per_s"]["median"] for r in d["results"]) / 1e6,
            lambda d: max(r["update_params_per_s"]["median"] for r in d["results"]) / 1e6)),
    *[Figure("docs/history.md", _ENGINE_ROW, name, _engine_row(index))
      for name in ("offload_disk.json", "offload_disk_first.json") for index in range(3)],
    # docs/offload_disk.md: the 2.46B-parameter run and the two 107M runs.
    *[Figure("docs/history.md", text, "offload_disk_model_large.json", _model_ranks(field, scale))
      for text, field, scale in (
          ("| state file per rank (fp32 master and both moments) | {0:.2f} / {1:.2f} GiB |",
           lambda r: r["state_file_bytes"], 2**-30),
          ("| wrap (meta → sharded, written to the file) | {0:.1f} / {1:.1f} s |", lambda r: r["wrap_s"], 1),
          ("| peak RSS | {0:.2f} / {1:.2f} GiB |", lambda r: r["peak_rss_gib"], 1),
          ("| host buffers of the engine | {0:.0f} / {1:.0f} MiB |", lambda r: r["buffer_bytes"], 2**-20),
          ("| compute, forward + backward, last step | {0:.1f} / {1:.1f} s |", _LAST("compute_s"), 1),
          ("| optimizer step, last step | {0:.1f} / {1:.1f} s |", _LAST("optimizer_s"), 1),
          ("| of which in the kernel | {0:.1f} / {1:.1f} s |", _LAST("update_s"), 1),
          ("| IO alone (read and write every bucket once) | {0:.1f} / {1:.1f} s |", lambda r: r["io_alone_s"], 1),
          ("| disk per rank, IO alone | {0:.2f} / {1:.2f} GB/s |", lambda r: r["disk_gbps"], 1))],
    Figure("README.md", "a {0:.2f}B-parameter GPT ({1:.1f} GB of training state) trained at 2 ranks with "
                        "{2:.1f}–{3:.1f} GiB peak RSS per rank", "offload_disk_model_large.json",
           (lambda d: d["ranks"][0]["params"] / 1e9, lambda d: 16 * d["ranks"][0]["params"] / 1e9,
            lambda d: min(r["peak_rss_gib"] for r in d["ranks"]), lambda d: max(r["peak_rss_gib"] for r in d["ranks"]))),
    Figure("docs/history.md", "{0:,.0f} parameters", "offload_disk_model_large.json",
           (lambda d: d["ranks"][0]["params"],)),
    Figure("docs/history.md", "Its training state at 16 bytes per parameter is {0:.1f} GB ({1:.1f} GiB)",
           "offload_disk_model_large.json", (lambda d: 16 * d["ranks"][0]["params"] / 1e9,
                                             lambda d: 16 * d["ranks"][0]["params"] / 2**30)),
    Figure("README.md", "its step took {0:.2f} times the longer of compute", "offload_disk_model_large_speculation.json",
           (at("step_over_longer_of_compute_and_io", 0, "without"),)),
    Figure("README.md", "and IO with every bucket stepped in `optimizer.step()`, and {0:.2f} times",
           "offload_disk_model_large_speculation.json", (at("step_over_longer_of_compute_and_io", 0, "with"),)),
    # docs/offload_disk.md: asynchronous saves of the disk tier, staged against streamed.
    *[Figure("docs/offload_disk.md", f"| {words} | " + f"{{0:{fmt}}} ({{1:{fmt}}}–{{2:{fmt}}}) {unit} | "
             f"{{3:{fmt}}} ({{4:{fmt}}}–{{5:{fmt}}}) {unit} |", "disk_async_save.json",
             tuple(at("summary", f"{key}_{mode}", stat) for mode in ("staged", "streamed")
                   for stat in ("median", "min", "max")))
      for words, key, fmt, unit in (("`async_save` blocked", "blocked_s", ".2f", "s"),
                                    ("save complete after", "complete_s", ".1f", "s"),
                                    ("peak anonymous memory above before the save", "anon_growth_gib", ".2f", "GiB"))],
    Figure("docs/offload_disk.md", "took {0:.2f} times as long as", "disk_async_save.json",
           (at("summary", "step_during_save_s_streamed_over_staged", "median"),)),
    Figure("docs/offload_disk.md", "a {0:.0f}M GPT at one rank", "disk_async_save.json",
           (lambda d: d["meta"]["params"] / 1e6,)),
    # docs/offload_disk.md and docs/offload.md: the disk tier against the cpu tier at 297M.
    Figure("docs/offload_disk.md", "| step, disk ÷ cpu (paired per round) | {0:.3f} | {1:.3f}, {2:.3f}, {3:.3f} |",
           "offload_disk_vs_cpu.json", (at("summary", "step_disk_over_cpu", "median"),
                                        *[at("summary", "step_disk_over_cpu", "per_round", i) for i in range(3)])),
    *[Figure(doc, text, "offload_disk_vs_cpu.json", tuple(at("summary", key, "median") for key in keys))
      for doc, text, keys in (
          ("docs/offload_disk.md", "| step, cpu | {0:.0f} ms |", ("median_step_ms_cpu",)),
          ("docs/offload_disk.md", "| step, disk | {0:.0f} ms |", ("median_step_ms_disk",)),
          ("docs/offload_disk.md", "| left in `optimizer.step()`, disk | {0:.0f} ms |", ("median_update_ms_disk",)),
          ("docs/offload.md", "update takes {0:.0f} ms of a {1:.0f} ms step", ("median_update_ms_cpu",
                                                                               "median_step_ms_cpu")),
          ("docs/offload.md", "each rank's thread was on a CPU {0:.0%} of the time", ("busy_in_compute_cpu",)))],
    Figure("docs/offload_disk.md", "| step, disk ÷ cpu, clip binding (paired per round) | {0:.3f} | {1:.3f}, {2:.3f}, "
                                   "{3:.3f} |", "offload_disk_vs_cpu_clip.json",
           (at("summary", "step_disk_over_cpu", "median"),
            *[at("summary", "step_disk_over_cpu", "per_round", i) for i in range(3)])),
    Figure("docs/offload_disk.md", "| step, cpu / disk | {0:.0f} / {1:.0f} ms |", "offload_disk_vs_cpu_clip.json",
           (at("summary", "median_step_ms_cpu", "median"), at("summary", "median_step_ms_disk", "median"))),
    Figure("docs/offload_disk.md", "| clip and `optimizer.step()`, cpu / disk | {0:.0f} / {1:.0f} ms |",
           "offload_disk_vs_cpu_clip.json",
           (at("summary", "median_update_ms_cpu", "median"), at("summary", "median_update_ms_disk", "median"))),
    Figure("docs/offload_disk.md", "The clip bound in {0} of\nboth tiers", "offload_disk_vs_cpu_clip.json",
           (lambda d: (lambda least: "every step" if least == 1 else f"{least:.0%} of the steps at least")(
               min(d["summary"][f"clip_binding_share_{m}"]["min"] for m in ("cpu", "disk"))),)),
    Figure("docs/history.md", "The two ranks' peaks add up to {0:.1f} GiB", "offload_disk_model_large.json",
           (lambda d: sum(r["peak_rss_gib"] for r in d["ranks"]),)),
    *[Figure("docs/history.md", text, "offload_disk_model_large_speculation.json", values)
      for text, values in (
          ("| compute, forward + backward | {0:.1f} / {1:.1f} s | {2:.1f} / {3:.1f} s |",
           _with_without(_LAST("compute_s"))),
          ("| of it, the worker's steps during backward | 0 / 0 s | {2:.1f} / {3:.1f} s |",
           _with_without(_LAST("speculated_s"))),
          ("| `optimizer.step()` | {0:.1f} / {1:.1f} s | {2:.2f} / {3:.2f} s |", _with_without(_LAST("optimizer_s"))),
          ("| shards committed / recomputed | 0 / 0 | {2:.0f} / {3:.0f} |",
           _with_without(_LAST("commits"))[:3] + (lambda d: d["rounds"][0]["with"][0]["steps"][-1]["recomputes"],)),
          ("| IO alone | {0:.1f} / {1:.1f} s | {2:.1f} / {3:.1f} s |", _with_without(lambda r: r["io_alone_s"])),
          ("| step ÷ max(compute, IO), the slower rank | {0:.2f} | {1:.2f} |",
           (at("step_over_longer_of_compute_and_io", 0, "without"), at("step_over_longer_of_compute_and_io", 0, "with"))),
          ("Compute + step went from {0:.1f} s to {1:.1f} s on rank 0 ({2:.2f} of it)",
           (_step_total("without"), _step_total("with"), lambda d: _step_total("with")(d) / _step_total("without")(d))),
          ("longer than without them ({0:.1f} against {1:.1f} s", _with_without(_LAST("compute_s"))[2::-2]),
          ("The state file per rank is {0:.1f} GiB", (lambda d: d["rounds"][0]["with"][0]["state_file_bytes"] / 2**30,)),
      )],
    *[Figure("docs/history.md", text, name, _model_ranks(field, scale))
      for name, text, field, scale in (
          ("offload_disk_model_first.json", "| peak RSS | {0:.2f} / {1:.2f} GiB |", lambda r: r["peak_rss_gib"], 1),
          ("offload_disk_model.json", "GiB | {0:.2f} / {1:.2f} GiB |", lambda r: r["peak_rss_gib"], 1),
          ("offload_disk_model_first.json", "| compute (forward + backward) | {0:.2f} / {1:.2f} s |",
           _LAST("compute_s"), 1),
          ("offload_disk_model.json", "s | {0:.2f} / {1:.2f} s |", _LAST("compute_s"), 1),
          ("offload_disk_model_first.json", "| optimizer step | {0:.2f} / {1:.2f} s |", _LAST("optimizer_s"), 1),
          ("offload_disk_model_first.json", "| IO alone | {0:.2f} / {1:.2f} s |", lambda r: r["io_alone_s"], 1),
          ("offload_disk_model.json", "| disk, per rank | 0.93 / 0.87 GB/s | {0:.2f} / {1:.2f} GB/s |",
           lambda r: r["disk_gbps"], 1),
          ("offload_disk_model_first.json", "| disk, per rank | {0:.2f} / {1:.2f} GB/s |", lambda r: r["disk_gbps"], 1))],
    Figure("docs/optim.md", "the limit is twice that column, and overlap's step reaches {0:.2f}–{1:.2f} of it",
           "optim_step_idle.json",
           (lambda d: min(r["implementations"]["overlap"]["fraction_of_bound"] / 2 for r in d["results"]),
            lambda d: max(r["implementations"]["overlap"]["fraction_of_bound"] / 2 for r in d["results"]))),
    # README: the comparison at the current code, one file per link.
    *[Figure("README.md", f"| {label} | " + " | ".join(f"{{{i}:.0f}}" for i in range(5)) + " |", _CURRENT[link],
             tuple(at("results", link, impl, "step_ms") for impl in _CURRENT_IMPLS))
      for link, label in (("loopback", "loopback"), ("2gbit", "2 Gbit/s"))],
    *[Figure("README.md", f"| {words} | {{0:.2f}} ({{1:.2f}}–{{2:.2f}}) |", _CURRENT["loopback"],
             _spread(_paired("loopback", impl, (peer,)))) for words, impl, peer, _, _ in _CURRENT_RATIOS],
    *[Figure("README.md", f"| {{0:.2f}} ({{1:.2f}}–{{2:.2f}}) | {after}", _CURRENT["2gbit"],
             _spread(_paired("2gbit", impl, (peer,)))) for _, impl, peer, _, after in _CURRENT_RATIOS
      if "{" not in after],
    *[Figure("README.md", "| {0:.2f} ({1:.2f}–{2:.2f}) | " + after.format("{3}", "{4}"), _CURRENT["2gbit"],
             (*_spread(_paired("2gbit", impl, (peer,))),
              lambda d, i=impl, p=peer, t=limit: held(_paired("loopback", i, (p,)), t)(
                  _result("compare_current_loopback.json")),
              held(_paired("2gbit", impl, (peer,)), limit)))
      for _, impl, peer, limit, after in _CURRENT_RATIOS if "{" in after],
    Figure("README.md", "against tuned FSDP2, {0} at 2 Gbit/s ({3})\nand {1} on loopback ({4}; the 0.9× target\n{2})",
           _CURRENT["2gbit"],
           (listed(_paired("2gbit", "overlap", ("fsdp2-tuned",))),
            lambda d: listed(_paired("loopback", "overlap", ("fsdp2-tuned",)))(_result(_CURRENT["loopback"])),
            lambda d: held_words(_paired("loopback", "overlap", ("fsdp2-tuned",)), 0.9)(_result(_CURRENT["loopback"])),
            lambda d: _ahead_words(_paired("2gbit", "overlap", ("fsdp2-tuned",))(d)),
            lambda d: _ahead_words(_paired("loopback", "overlap", ("fsdp2-tuned",))(_result(_CURRENT["loopback"]))))),
    Figure("README.md", "against tuned DDP, {0} on loopback and {1} at\n2 Gbit/s: {2}", _CURRENT["2gbit"],
           (lambda d: listed(_paired("loopback", "overlap", ("ddp-tuned",)))(_result(_CURRENT["loopback"])),
            listed(_paired("2gbit", "overlap", ("ddp-tuned",))),
            lambda d: _behind_words(_overlap_over_ddp_both_links(d)))),
    Figure("README.md", "int8 against DDP's fp16 hook at 2 Gbit/s: {0} ({1})", _CURRENT["2gbit"],
           (listed(_paired("2gbit", "overlap-int8", ("ddp-fp16",))),
            lambda d: _ahead_words(_paired("2gbit", "overlap-int8", ("ddp-fp16",))(d)))),
    Figure("docs/history.md", "The file's `io_hidden_share` ({0:.2f} on rank 0, {1:.2f} on rank 1)",
           "offload_disk_model_large.json", tuple(at("ranks", rank, "io_hidden_share") for rank in (0, 1))),
    # README: `overlap train` at its defaults, from the run's log.
    Figure("README.md", "took {0:.0f} s from start to exit on 2 CPU cores with nothing else running: the loss fell "
                        "from {1:.2f} to {2:.2f} (validation {3:.2f}), and the report read \"communication {4:.1f} "
                        "ms/step, {5:.0f}% hidden, exposed {6:.1f} ms\" in a {7:.0f} ms step", "train_defaults.txt",
           (logged(r"wall ([\d.]+) s from start to exit"), logged(r"^# first step.*loss ([\d.]+),"),
            logged(r"^final step \d+: loss ([\d.]+)"), logged(r"^final step .*val loss ([\d.]+)"),
            logged(r"^communication ([\d.]+) ms/step"), logged(r"^communication .*, (\d+)% hidden"),
            logged(r"^communication .*exposed ([\d.]+) ms"), logged(r"^step ([\d.]+) ms \(forward\+backward\)"))),
    Figure("README.md", "Peak memory per rank on loopback: {0:.0f} MiB for ShardedModule (int8 too), {1:.0f} for tuned "
                        "FSDP2, {2:.0f} for\nDDP", _CURRENT["loopback"],
           tuple(lambda d, i=impl: max(r["peak"]["Total"] for r in d["results"]["loopback"][i]["ranks_memory"]) / 2**20
                 for impl in ("overlap", "fsdp2-tuned", "ddp-tuned"))),
    Figure("README.md", "at 2 Gbit/s ShardedModule's is {0:.0f} MiB ({1:.2f}× tuned FSDP2's; {2:.0f} with int8)",
           _CURRENT["2gbit"],
           (lambda d: _peak_mib(d, "2gbit", "overlap"),
            lambda d: _peak_mib(d, "2gbit", "overlap") / _peak_mib(d, "2gbit", "fsdp2-tuned"),
            lambda d: _peak_mib(d, "2gbit", "overlap-int8"))),
    # README: the 10 Gbit/s run with every peer.
    Figure("README.md", "| 10 Gbit/s, step ms | " + " | ".join(f"{{{i}:.0f}}" for i in range(len(_TEN_IMPLS))) + " |",
           _TEN, tuple(at("results", "10gbit", impl, "step_ms") for impl in _TEN_IMPLS)),
    *[Figure("README.md", f"| {words} | {{0}} | ≤ {limit:g}: {{1}} |" if limit else f"| {words} | {{0}} | |", _TEN,
             (_spread_cell(_paired("10gbit", impl, peers_)),
              *((held_words(_paired("10gbit", impl, peers_), limit),) if limit else ())))
      for words, impl, peers_, limit in _TEN_RATIOS],
    Figure("README.md", "(tuned FSDP2 {0:.0f} ms against {1:.0f} then, DeepSpeed {2:.0f} against {3:.0f})", _TEN,
           (at("results", "10gbit", "fsdp2-tuned", "step_ms"),
            lambda d: _result("compare_10gbit.json")["results"]["10gbit"]["fsdp2-tuned"]["step_ms"],
            at("results", "10gbit", "deepspeed", "step_ms"),
            lambda d: _result("compare_10gbit.json")["results"]["10gbit"]["deepspeed"]["step_ms"])),
    Figure("README.md", "(tuned DDP {0:.2f} s → {1:.2f} s within its first run)", _TEN,
           (lambda d: min(_run_steps(d, "10gbit", "ddp-tuned", 0)), lambda d: max(_run_steps(d, "10gbit", "ddp-tuned", 0)))),
    Figure("README.md", "ShardedModule {0:.0f}–{1:.0f}% ahead of FSDP2's defaults and of DeepSpeed ZeRO-3, and behind "
                        "the faster DDP of each round by {2:.0f}–{3:.0f}%", _TEN,
           (lambda d: 100 * (1 - max(_paired("10gbit", "overlap", (p,))(d)[i] for p in ("fsdp2", "deepspeed") for i in range(3))),
            lambda d: 100 * (1 - min(_paired("10gbit", "overlap", (p,))(d)[i] for p in ("fsdp2", "deepspeed") for i in range(3))),
            lambda d: 100 * (min(_paired("10gbit", "overlap", ("ddp", "ddp-tuned"))(d)) - 1),
            lambda d: 100 * (max(_paired("10gbit", "overlap", ("ddp", "ddp-tuned"))(d)) - 1))),
    # docs/benchmarks.md: what the rows say, per round.
    Figure("docs/benchmarks.md", "{4} at 2 Gbit/s ({0}); on loopback {5} ({1}), the 0.9 target {2}; {3} at "
                                 "10 Gbit/s", _CURRENT["2gbit"],
           (listed(_paired("2gbit", "overlap", ("fsdp2-tuned",))),
            lambda d: listed(_paired("loopback", "overlap", ("fsdp2-tuned",)))(_result(_CURRENT["loopback"])),
            lambda d: held_words(_paired("loopback", "overlap", ("fsdp2-tuned",)), 0.9)(_result(_CURRENT["loopback"])),
            lambda d: listed(_paired("10gbit", "overlap", ("fsdp2-tuned",)))(_result(_TEN)),
            lambda d: _ahead_words(_paired("2gbit", "overlap", ("fsdp2-tuned",))(d)),
            lambda d: _ahead_words(_paired("loopback", "overlap", ("fsdp2-tuned",))(_result(_CURRENT["loopback"]))))),
    Figure("docs/benchmarks.md", "per round against tuned DDP: {0} on loopback, {1} at 2 Gbit/s; {2:.2f}–{3:.2f} "
                                 "against the faster DDP of each round at 10 Gbit/s", _CURRENT["2gbit"],
           (lambda d: listed(_paired("loopback", "overlap", ("ddp-tuned",)))(_result(_CURRENT["loopback"])),
            listed(_paired("2gbit", "overlap", ("ddp-tuned",))),
            lambda d: min(_paired("10gbit", "overlap", ("ddp", "ddp-tuned"))(_result(_TEN))),
            lambda d: max(_paired("10gbit", "overlap", ("ddp", "ddp-tuned"))(_result(_TEN))))),
    # docs/benchmarks.md: compare.py's tables of the three runs.
    *[Figure("docs/benchmarks.md", "{0}", file, (_time_row(link, impl),))
      for file, link in ((_CURRENT["loopback"], "loopback"), (_CURRENT["2gbit"], "2gbit"), (_TEN, "10gbit"))
      for impl in (_TEN_IMPLS if link == "10gbit" else _CURRENT_IMPLS)],
    *[Figure("docs/benchmarks.md", "{0}", _TEN, (_memory_row("10gbit", impl, rank),))
      for impl in _TEN_IMPLS for rank in (0, 1)],
    Figure("docs/offload.md", '| step time, offload="cpu" / "none", paired per round | {0:.2f} | {1:.2f}–{2:.2f} |',
           "offload_cpu.json", tuple(at("summary", "step_cpu_over_none", k) for k in ("median", "min", "max"))),
    # docs/pipeline.md: ZeRO-3 inside 1F1B stages against FSDP2.
    *[Figure("docs/pipeline.md", f"| {variant} | {{0:.1f}} | {{1}} ({{2}}–{{3}}) | {{4:.1f}} | {{5:.1f}} | {{6:.1f}} |",
             "pipeline.json", tuple(at("summary", variant, key) for key in (
                 "step_ms", "ratio_to_best_fsdp2_median", "ratio_min", "ratio_max", "gathered_mb_per_rank",
                 "reduced_mb_per_rank", "peak_tensor_rise_mb_per_rank")))
      for variant in ("overlap ShardedModule", "overlap fully_shard", "overlap fully_shard, regather",
                      "FSDP2 reshard", "FSDP2 no reshard", "overlap fully_shard, followed",
                      "overlap fully_shard, regather, followed", "overlap fully_shard, keep 3",
                      "overlap fully_shard, keep 3, followed")],
    Figure("docs/pipeline.md", "followed ÷ not followed per round {0:.3f} ({1:.3f}–{2:.3f})", "pipeline.json",
           _paired_variants("overlap fully_shard, followed", "overlap fully_shard")),
    Figure("docs/pipeline.md", "831.8 (the backward prefetch that 1F1B's warm-up forwards freed unused is gone, and the\n"
                               "  first unit of the next pass is gathered behind the send and receive waits): {0:.3f}\n"
                               "  ({1:.3f}–{2:.3f}) per round", "pipeline.json",
           _paired_variants("overlap fully_shard, regather, followed", "overlap fully_shard, regather")),
    Figure("docs/pipeline.md", "`fully_shard` stages run {0:.3f}× ({1:.3f}–{2:.3f} per round) and `ShardedModule` "
                               "stages {3:.3f}×\n  ({4:.3f}–{5:.3f})", "pipeline.json",
           (*_paired_variants("overlap fully_shard", "FSDP2 reshard"),
            *_paired_variants("overlap ShardedModule", "FSDP2 reshard"))),
    # docs/moe.md: expert parallelism against ZeRO-3 without it and FSDP2, each link.
    *[Figure("docs/moe.md", "| no EP | {0:.1f} | 1 | {1:.1f} | {2:.1f} | – | {3:.1f} |", f"moe_{link}.json",
             (at("summary", "no EP", "step_ms"), at("summary", "no EP", "gathered_mb_per_rank"),
              at("summary", "no EP", "reduced_mb_per_rank"), at("summary", "no EP", "peak_tensor_rise_mb_per_rank")))
      for link in ("loopback", "2gbit")],
    *[Figure("docs/moe.md", f"| {variant} | {{0:.1f}} | {{1:.3f}} ({{2:.3f}}–{{3:.3f}}) | {{4:.2f}} | {{5:.2f}} | "
             "{6:.1f} | {7:.1f} |", f"moe_{link}.json",
             tuple(at("summary", variant, key) for key in ("step_ms", "ratio_median", "ratio_min", "ratio_max",
                                                          "gathered_mb_per_rank", "reduced_mb_per_rank",
                                                          "all_to_all_blocked_ms", "peak_tensor_rise_mb_per_rank")))
      for link in ("loopback", "2gbit") for variant in ("EP 2", "EP 4")],
    *[Figure("docs/moe.md", "| FSDP2 | {0:.1f} | {1:.3f} ({2:.3f}–{3:.3f}) | – | – | – | {4:.1f} |",
             f"moe_{link}.json",
             tuple(at("summary", "FSDP2", key) for key in ("step_ms", "ratio_median", "ratio_min", "ratio_max",
                                                          "peak_tensor_rise_mb_per_rank")))
      for link in ("loopback", "2gbit")],
    # docs/moe.md's expert backward in two steps: split against unsplit, same rounds.
    *[Figure("docs/moe.md", f"| {where} | {e} | {{0:.1f}}, {{1:.0%}} | {{2:.1f}}, {{3:.0%}} | "
             "{4:.3f} ({5:.3f}–{6:.3f}) | {7:.1f} / {8:.1f} |", f"moe_{link}.json",
             (at("summary", f"EP {e}", "step_ms"), at("summary", f"EP {e}", "all_to_all_hidden_share"),
              at("summary", f"EP {e} unsplit", "step_ms"), at("summary", f"EP {e} unsplit", "all_to_all_hidden_share"),
              *_paired_variants(f"EP {e} unsplit", f"EP {e}"),
              at("summary", f"EP {e}", "peak_tensor_rise_mb_per_rank"),
              at("summary", f"EP {e} unsplit", "peak_tensor_rise_mb_per_rank")))
      for link, where in (("2gbit", "2 Gbit/s"), ("loopback", "loopback")) for e in (2, 4)],
    # docs/moe.md's chunk counts: each row of the three tables, step ÷ two chunks in the same rounds.
    *[Figure("docs/moe.md", f"| {ep} | {chunks} | {{0:.1f}} | {{1:.3f}} ({{2:.3f}}–{{3:.3f}}) | {{4:.1f}} | {{5:.0%}} |",
             name, (at("summary", f"EP {ep}/{chunks}", "step_ms"), *_paired_variants(f"EP {ep}/{chunks}", f"EP {ep}"),
                    at("summary", f"EP {ep}/{chunks}", "all_to_all_blocked_ms"),
                    at("summary", f"EP {ep}/{chunks}", "all_to_all_hidden_share")))
      for name, ep, chunks in (("moe_chunks_loopback.json", 2, 1), ("moe_chunks_loopback.json", 2, 4),
                               ("moe_chunks_loopback.json", 4, 4), ("moe_chunks_2gbit.json", 2, 1),
                               ("moe_chunks_2gbit.json", 4, 1), ("moe_chunks4_2gbit.json", 2, 4),
                               ("moe_chunks4_2gbit.json", 4, 4))],
    *[Figure("docs/moe.md", f"| {ep} | 2 | {{0:.1f}} | 1 | {{1:.1f}} | {{2:.0%}} |", name,
             tuple(at("summary", f"EP {ep}", key) for key in ("step_ms", "all_to_all_blocked_ms",
                                                              "all_to_all_hidden_share")))
      for name in ("moe_chunks_loopback.json", "moe_chunks_2gbit.json", "moe_chunks4_2gbit.json") for ep in (2, 4)],
    # docs/moe.md's expert parallelism under fully_shard against ShardedModule's, same rounds.
    *[Figure("docs/moe.md", f"| `fully_shard`, E {e} | {{0:.3f}} ({{1:.3f}}–{{2:.3f}}) | {{3:.3f}} ({{4:.3f}}–{{5:.3f}}) | "
             "{6:.0%} (`ShardedModule`: {7:.0%}) |", "moe_fully_shard_2gbit.json",
             (*(at("summary", f"fully_shard EP {e}", f"ratio_to_EP_{e}", key) for key in ("median", "min", "max")),
              *(at("summary", f"fully_shard EP {e}", key) for key in ("ratio_median", "ratio_min", "ratio_max")),
              at("summary", f"fully_shard EP {e}", "all_to_all_hidden_share"),
              at("summary", f"EP {e}", "all_to_all_hidden_share")))
      for e in (2, 4)],
    Figure("docs/moe.md", "on the slow link: EP 2 {0:.3f}, EP 4\n{1:.3f}", "moe_2gbit.json",
           (at("summary", "EP 2", "ratio_median"), at("summary", "EP 4", "ratio_median"))),
    Figure("docs/moe.md", "The all-to-alls hand {0:.2f} MB a step to gloo", "moe_2gbit.json",
           (at("summary", "EP 2", "all_to_all_mb_per_step"),)),
    Figure("docs/moe.md", "the others; {0:.2f} MB at E = 4)", "moe_2gbit.json", (at("summary", "EP 4", "all_to_all_mb_per_step"),)),
    Figure("docs/moe.md", "On the slow link E = 2 hides {0:.0%} of it and E = 4 {1:.0%};", "moe_2gbit.json",
           tuple(at("summary", variant, "all_to_all_hidden_share") for variant in ("EP 2", "EP 4"))),
    Figure("docs/moe.md", "on loopback {0:.0%} and {1:.0%}.", "moe_loopback.json",
           tuple(at("summary", variant, "all_to_all_hidden_share") for variant in ("EP 2", "EP 4"))),
    # docs/moe.md's chunk counts: each row's step, its paired ratio to two chunks, its waits.
    *[Figure("docs/moe.md", f"| {variant[3]} | {variant[5] if '/' in variant else 2} | {{0:.1f}} | "
             + ("{1:.3f} ({2:.3f}–{3:.3f})" if "/" in variant else "1") + " | {4:.1f} | {5:.0%} |",
             "moe_chunks_loopback.json",
             (at("summary", variant, "step_ms"), *_paired_variants(variant, variant.split("/")[0]),
              at("summary", variant, "all_to_all_blocked_ms"), at("summary", variant, "all_to_all_hidden_share")))
      for variant in ("EP 2/1", "EP 2", "EP 2/4", "EP 4", "EP 4/4")],
    *[Figure("docs/moe.md", f"| {variant[3]} | {variant[5] if '/' in variant else 2} | {{0:.1f}} | "
             + ("{1:.3f} ({2:.3f}–{3:.3f})" if "/" in variant else "1") + " | {4:.1f} | {5:.0%} |",
             "moe_chunks_2gbit.json",
             (at("summary", variant, "step_ms"), *_paired_variants(variant, variant.split("/")[0]),
              at("summary", variant, "all_to_all_blocked_ms"), at("summary", variant, "all_to_all_hidden_share")))
      for variant in ("EP 2/1", "EP 2", "EP 4/1", "EP 4")],
    Figure("docs/moe.md", "four chunks reach {0:.0%} on loopback", "moe_chunks_loopback.json",
           (at("summary", "EP 2/4", "all_to_all_hidden_share"),)),
    Figure("README.md", "{0:.2f}× FSDP2 + TP's step with torch's defaults, {1:.2f}× the tuned one's", "tp.json",
           (at("paired", "overlap-tp/fsdp2-tp", "median"), at("paired", "overlap-tp/fsdp2-tp-tuned", "median"))),
    Figure("docs/tensor_parallel.md", "{0:.2f} ({1:.2f}-{2:.2f}, 3 rounds) against FSDP2 + TP with torch's defaults, "
           "{3:.2f} ({4:.2f}-{5:.2f}) against tuned FSDP2 + TP", "tp.json",
           tuple(at("paired", f"overlap-tp/{peer}", k) for peer in ("fsdp2-tp", "fsdp2-tp-tuned")
                 for k in ("median", "min", "max"))),
    *[Figure("docs/tensor_parallel.md", f"| {impl} | {{0:.2f}} | {{1:.1f}} | {{2:.0f}} |", "tp.json",
             (_tp_median_step(impl), _tp_peak(impl, "peak_tracked"), _tp_peak(impl, "peak_rss")))
      for impl in ("overlap-tp", "fsdp2-tp", "fsdp2-tp-tuned")],
    *[Figure("docs/history.md", "| {0} | {1} | {2} | {3} |", "dropin_habits.json",
             (_habit(("cells", "ddp"), habit), _habit(("cells", "fsdp2"), habit),
              _habit(("before", "cells", "overlap"), habit), _habit(("cells", "overlap"), habit)))
      for habit in ("optimizer_before", "torch_clip", "ddp_switch", "rank0_save", "rank0_eval", "numel")],
    *[Figure("docs/train.md", f"| {label} | {{0}} | {{1}} | {{2}} | {{3}} | {{4}} | {{5}} | {{6}} |", file,
             tuple(_recovery_cell(point, column) for column in range(1, 8)))
      for point, label, file in (("start", "start (node 0)", "recovery.json"), ("step", "step (node 1)", "recovery.json"),
                                 ("save", "save (node 0)", "recovery.json"),
                                 ("node", "node (node 1 for good, `--nnodes 1:2`)", "recovery_node.json"))],
    Figure("docs/train.md", "| node, then rejoin | {0} | {1} + {1} | {2} + {3} | {4} | {5} | {6} |", "recovery_rejoin.json",
           tuple(_recovery_cell("node", column) for column in (1, 2, 3)) + (_recovery_cell("rejoin", 3),)
           + tuple(_recovery_cell("node", column) for column in (4, 5, 6))),
    Figure("docs/train.md", "node: {0} s", "recovery_rejoin.json",
           (lambda data: _recovery_cell("node", 7)(data).split(" s (")[0].replace("-", " / "),)),
    Figure("docs/train.md", "rejoin: {0} s", "recovery_rejoin.json",
           (lambda data: _recovery_cell("rejoin", 7)(data).split(" s (")[0].replace("-", " / "),)),
    # docs/history.md: 0a3e162's code against a checkout at 26a39e3, side by side.
    Figure("docs/history.md", "**{0:.2f} ({1:.2f}–{2:.2f})** per round, medians {3:.0f} against {4:.0f} ms", _AGAINST_26,
           (*_spread(_paired("2gbit", "overlap", ("overlap-base",))), at("results", "2gbit", "overlap", "step_ms"),
            at("results", "2gbit", "overlap-base", "step_ms"))),
    Figure("docs/history.md", "÷ tuned DDP was {0:.2f} ({1:.2f}–{2:.2f}) and ÷ tuned FSDP2\n{3:.2f} ({4:.2f}–{5:.2f})",
           _AGAINST_26, (*_spread(_paired("2gbit", "overlap", ("ddp-tuned",))),
                         *_spread(_paired("2gbit", "overlap", ("fsdp2-tuned",))))),
    Figure("docs/history.md", "on loopback **{0:.2f} ({1:.2f}–{2:.2f})**, {3:.0f} against {4:.0f} ms", _AGAINST_26_LOOPBACK,
           (*_spread(_paired("loopback", "overlap", ("overlap-base",))), at("results", "loopback", "overlap", "step_ms"),
            at("results", "loopback", "overlap-base", "step_ms"))),
    Figure("docs/history.md", "loopback {0:.2f} ({1:.2f}–{2:.2f}) and {3:.2f} ({4:.2f}–{5:.2f})", _AGAINST_26_LOOPBACK,
           (*_spread(_paired("loopback", "overlap", ("ddp-tuned",))),
            *_spread(_paired("loopback", "overlap", ("fsdp2-tuned",))))),
    Figure("docs/benchmarks.md", "the side\n  by side run against 26a39e3 in history.md measured {0:.2f} ({1:.2f}–{2:.2f}) on the "
                                 "same link", _AGAINST_26_LOOPBACK, _spread(_paired("loopback", "overlap", ("fsdp2-tuned",)))),
]

# Result files a doc links to whose figures no row above checks, and why.
UNCHECKED = {
    "overhead_profile_before.txt": "a profiler listing, quoted as such",
    **{f"compile_compare_{name}.md": f"the markdown report of compile_compare_{name}.json, whose figures are checked"
       for name in ("gpt_loopback", "gpt_2gbit", "mlp_loopback", "mlp_2gbit", "mlp_loopback_pinned")},
    "compile_time_default.md": "the markdown report of compile_time_default.json, whose figures are checked",
}


def _percent(share: Any) -> str:
    return "-" if share is None else f"{share:.0%}"


def _folded(text: str) -> str:
    return re.sub(r"\s+", " ", text)


def _doc(path: str) -> str:
    with open(os.path.join(ROOT, path), encoding="utf-8") as f:
        return _folded(f.read())


def _result(name: str) -> Any:
    """A result file's JSON; a log (.txt) as its text, for `logged` to read."""
    with open(os.path.join(ROOT, "docs", "results", name), encoding="utf-8") as f:
        return f.read() if name.endswith(".txt") else json.load(f)


@pytest.mark.parametrize("figure", FIGURES, ids=[f"{f.doc}:{f.file}:{i}" for i, f in enumerate(FIGURES)])
def test_the_doc_says_what_the_result_file_says(figure: Figure) -> None:
    data = _result(figure.file)
    expected = _folded(figure.text.format(*[read(data) for read in figure.values]))
    assert expected in _doc(figure.doc), f"{figure.doc} should say {expected!r} (from docs/results/{figure.file})"


def test_every_linked_result_file_is_checked_or_named() -> None:
    docs = ["README.md"] + [os.path.join("docs", n) for n in sorted(os.listdir(os.path.join(ROOT, "docs")))
                            if n.endswith(".md")]
    linked = {name for doc in docs for name in re.findall(r"results/([\w.-]+\.(?:json|txt|md))", _doc(doc))}
    checked = {f.file for f in FIGURES}
    assert linked - checked - set(UNCHECKED) == set(), "result files cited but neither checked nor named in UNCHECKED"
    assert checked & set(UNCHECKED) == set()
    for name in linked | checked | set(UNCHECKED):
        assert os.path.exists(os.path.join(ROOT, "docs", "results", name)), name


def test_the_kernel_backend_order_in_the_docs_is_the_codes() -> None:
    from overlap.kernels.backends import AUTO_ORDER

    kernels = _doc("docs/kernels.md")
    for device, label in (("cpu", "CPU"), ("cuda", "CUDA")):
        listed = ", ".join(f"`{name}`" for name in AUTO_ORDER[device])
        assert f"- {label}: {listed}." in kernels, (device, AUTO_ORDER[device])


def _recorded(data: Any, key: str) -> list[str]:
    """Every value of `key` a result file records (at its top, under "meta", per link or run)."""
    if isinstance(data, dict):
        return [v for k, v in data.items() if k == key and isinstance(v, str)] + \
            [found for v in data.values() for found in _recorded(v, key)]
    if isinstance(data, list):
        return [found for v in data for found in _recorded(v, key)]
    return []


def _without_outputs(command: str) -> str:
    """A command without the options that only name where its results went."""
    return re.sub(r" --(out|json|profile) \S+", "", command.strip())


def test_the_readme_index_gives_each_figure_s_file_commit_and_command() -> None:
    """Every row of README's index names a result file that records the row's commit and the
    row's command (its --out aside); its figure is checked by a row of FIGURES."""
    with open(os.path.join(ROOT, "README.md"), encoding="utf-8") as f:
        text = f.read()
    section = text.split("### Every headline figure in one place", 1)[1].split("\n### ", 1)[0]
    rows = [line for line in section.splitlines() if line.startswith("| ") and "results/" in line]
    assert len(rows) >= 15, len(rows)
    for line in rows:
        cells = [cell.strip() for cell in line.strip("|").split("|")]
        name = re.search(r"docs/results/([A-Za-z0-9_.-]+\.json)", cells[3]).group(1)
        commit, command = cells[4], cells[5].strip("`")
        data = _result(name)
        assert any(recorded.startswith(commit) for recorded in _recorded(data, "commit")), (name, commit)
        assert command in {_without_outputs(c) for c in _recorded(data, "command")}, (name, command)
