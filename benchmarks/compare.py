"""ShardedModule against FSDP2 and DDP (defaults and tuned), DeepSpeed ZeRO-3 and a single
process without communication.

Every implementation (`peers.py` builds them) trains the same GPT (`overlap.models.GPT`)
from the same seed on the same synthetic batches with the same AdamW implementation. Each
run is one launch (torchrun, 2 gloo ranks, one thread each; the single-process baseline
`local` runs rank 0's batches alone: the compute floor). Implementations alternate
A B C D A B C D ... over rounds so that load from other programs on the host falls on all
of them alike. Per (link, implementation): the median
step time over all timed steps of all rounds (a step's time is the slower rank's), peak
memory per rank by category (MemTracker, in one extra step outside the timed ones) and
peak RSS, and bytes sent per rank per step.

    python benchmarks/compare.py --links loopback,10gbit,2gbit --rounds 3 --steps 20
    python benchmarks/compare.py --quick            # tiny model, one round: a smoke run
    python benchmarks/compare.py --merge a/compare.json b/compare.json --out merged

Compiled rows, run when --impls names them (docs/compile.md): overlap-compiled
(`compile=True`), and fsdp2-tuned-compiled, ddp-tuned-compiled and local-compiled with each
block compiled before wrapping (torchtitan's recipe). Each is paired with its eager twin round
by round (compiled ÷ eager), and its first step (where it compiles) is reported per round.

`--merge` summarises the launches of earlier runs of the same model and settings as one run
(rounds measured at different times, or links measured separately), and runs nothing.

Writes <out>/compare.json, <out>/compare.md and <out>/compare.png, and prints the tables.
Emulated links (a rate such as 2gbit) need root: see netns.py.
"""
from __future__ import annotations

import argparse
import os
import platform
import resource
import sys
import tempfile
import time
from typing import TYPE_CHECKING, Any, Optional, Sequence

import torch

import peers
from common import (LOOPBACK, PROCESS_GROUP_TIMEOUT, checkout_python, git_commit, markdown_table, median, on_link,
                    parse_choices, parse_links, quartiles, read_json, run_with_deadline, script_main,
                    single_thread_env, torchrun, write_json, write_text)

if TYPE_CHECKING:
    from overlap.models import GPTConfig

IMPLEMENTATIONS = peers.IMPLEMENTATIONS
# Implementations whose collectives ShardedModule records (their bytes are measured).
MEASURED = (*peers.SHARDED_MODULE, "overlap-base")
# ShardedModule of another checkout, run by that checkout's interpreter and worker (--baseline):
# before/after comparisons of a change, alternated with the rest in one run.
BASELINE = "overlap-base"
WORLD_SIZE = 2
# GPTConfig's fields that the options set; their defaults are GPTConfig's (the benchmark model).
MODEL_FIELDS = ("n_layer", "n_embd", "n_head", "vocab_size", "block_size")
QUICK_MODEL = dict(n_layer=2, n_embd=64, n_head=4, vocab_size=256, block_size=32)
MIB = 2**20
# Targets for ShardedModule on every link: step time at most this share of tuned FSDP2's and
# of the faster DDP's, peak memory at most tuned FSDP2's (ZeRO-3 memory).
TIME_TARGET_VS_FSDP2_TUNED = 0.9
TIME_TARGET_VS_DDP = 1.0
# Compressed ShardedModule (docs/compression.md): step time at most this share of the
# uncompressed one, and no slower than DDP with fp16 compression; peak memory not higher.
COMPRESSED_TIME_TARGET = 0.6
# Compiled rows (docs/compile.md): ShardedModule's compiled ÷ eager at most 3% above the
# plain model's compiled ÷ eager.
COMPILED_KEEPS_GAIN = 1.03


# ---- worker: one launch of one implementation -------------------------------------------
# overlap and the torch.distributed parts are imported where they are used: the driver,
# which only launches runs and summarises them, does without them (and without the start-up
# time and memory they cost).

def _model_config(args: argparse.Namespace) -> "GPTConfig":
    from overlap.models import GPTConfig

    return GPTConfig(**{key: getattr(args, key) for key in MODEL_FIELDS})


def _batches(config, args: argparse.Namespace, rank: int, count: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Random tokens, different per rank and step, identical for every implementation."""
    batches = []
    for step in range(count):
        generator = torch.Generator().manual_seed(args.seed * 1_000_003 + rank * 10_007 + step)
        tokens = torch.randint(config.vocab_size, (args.batch, config.block_size + 1), generator=generator)
        batches.append((tokens[:, :-1], tokens[:, 1:]))
    return batches


def _algorithm_bytes(impl: str, params: int, root_params: int, block_params: int, world: int) -> Optional[int]:
    """Bytes each rank sends per step by the algorithm of FSDP2 or DDP, ring-equivalent: an
    all-gather or reduce-scatter of S bytes sends S(N-1)/N, an all-reduce twice that.

    FSDP2 gathers each block in forward and again in backward and the root (embeddings,
    final norm, tied head) once, as it keeps the root gathered from forward into backward,
    then reduce-scatters every gradient once; tuned, it keeps the last block gathered too.
    DDP all-reduces every gradient. ShardedModule records what it sends, so it needs no
    formula; DeepSpeed's traffic depends on its persistence threshold and is not counted.
    """
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


PHASES = ("forward", "backward", "optimizer")


def _overlap_step_comm(model) -> dict[str, Any]:
    """This step's collectives and prefetch outcome, from ShardedModule's record of it."""
    record = model.scheduler.last_step
    kinds = sorted({c.kind for c in record.collectives})
    marks = [e.mark.value for e in record.events]
    return {
        "bytes": sum(c.nbytes for c in record.collectives),
        "bytes_by_kind": {k: sum(c.nbytes for c in record.collectives if c.kind == k) for k in kinds},
        "exposed_s_by_kind": {k: sum(c.waited for c in record.collectives if c.kind == k) for k in kinds},
        "duration_s_by_kind": {k: sum(c.duration for c in record.collectives if c.kind == k) for k in kinds},
        "prefetch_hits": marks.count("hit"),
        "prefetch_misses": marks.count("miss"),
    }


def _overlap_trace(model) -> dict[str, list]:
    """One step's marks and collectives, times in ms from the step's start."""
    record = model.scheduler.last_step
    record = record.shifted(record.bounds()[0])

    def ms(t: Optional[float]) -> Optional[float]:
        return None if t is None else round(t * 1e3, 2)

    return {
        "events": [(e.mark.value, e.unit, ms(e.time)) for e in record.events],
        "collectives": [dict(kind=c.kind, unit=c.unit, nbytes=c.nbytes, start=ms(c.start), end=ms(c.end),
                             wait_start=ms(c.wait[0] if c.wait else None), wait_end=ms(c.wait[1] if c.wait else None))
                        for c in record.collectives],
    }


def _memory_step(impl: str, model: torch.nn.Module, optimizer: torch.optim.Optimizer, step, batch) -> dict[str, dict]:
    """One training step under MemTracker: the bytes of each category at the step's peak,
    and the peak total within forward and within backward (the optimizer step's is the
    overall peak when it exceeds both).

    ShardedModule's gathered parameters live in flat buffers that are not nn.Parameters;
    they are registered with the tracker and show as 'Other'. FSDP2's unsharded parameters
    are nn.Parameters while gathered and show as 'Parameter'.
    """
    # _ModState (private) names the per-module snapshots that hold forward and backward peaks.
    from torch.distributed._tools.mem_tracker import MemTracker, _ModState

    tracker = MemTracker()
    # DeepSpeed's ZeRO optimizer is a wrapper; the torch optimizer inside holds the state.
    tracker.track_external(model, getattr(optimizer, "optimizer", optimizer))
    if impl == peers.OVERLAP:
        tracker.track_external(*[group.full for unit in model.scheduler.all_units for group in unit.groups])
    with tracker:
        step(batch)
    peak = next(iter(tracker.get_tracker_snapshot("peak").values()), {})
    snapshots = tracker.memory_tracking[model].snapshots
    phases = {phase: max(next(iter(snap.values()))["Total"] for snap in snapshots[state])
              for phase, state in (("forward", _ModState.PEAK_FW), ("backward", _ModState.PEAK_BW))}
    return dict(peak={str(getattr(key, "value", key)): int(value) for key, value in peak.items()}, phases=phases)


def _build_model(args: argparse.Namespace, config: "GPTConfig") -> torch.nn.Module:
    """The benchmark model: the GPT, or (`--model mlp`) many narrow layers where compiling
    helps on CPU (narrow_mlp.py)."""
    if args.model == "mlp":
        from narrow_mlp import NarrowMLP

        return NarrowMLP(config.n_layer, config.n_embd, config.vocab_size)
    from overlap.models import GPT

    return GPT(config)


def run_worker(args: argparse.Namespace) -> None:
    import torch.distributed as dist

    impl = args.worker
    torch.set_num_threads(1)
    distributed = impl not in peers.SINGLE_PROCESS
    if distributed:
        dist.init_process_group("gloo", timeout=PROCESS_GROUP_TIMEOUT)
    rank = dist.get_rank() if distributed else 0
    world = dist.get_world_size() if distributed else 1

    config = _model_config(args)
    torch.manual_seed(args.seed)
    plain = _build_model(args, config)
    params = sum(p.numel() for p in plain.parameters())
    root_params = params - sum(p.numel() for p in plain.blocks.parameters())
    block_params = sum(p.numel() for p in plain.blocks[-1].parameters())
    model, optimizer, train_step = peers.wrap(impl, plain, args)
    total_steps = args.warmup + args.steps
    batches = _batches(config, args, rank, total_steps + 1)

    step_s, phase_s, losses, comm, trace = [], [], [], [], None
    first_step_s = None                      # compiled rows compile in it
    for step in range(total_steps):
        start = time.perf_counter()
        loss, phases = train_step(batches[step])
        elapsed = time.perf_counter() - start
        losses.append(loss)
        first_step_s = elapsed if first_step_s is None else first_step_s
        if step < args.warmup:
            continue
        step_s.append(elapsed)
        phase_s.append(phases)
        if impl in peers.SHARDED_MODULE:
            comm.append(_overlap_step_comm(model))
            trace = _overlap_trace(model)
    memory = _memory_step(impl, model, optimizer, train_step, batches[total_steps]) if args.memory else None
    peak_rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux reports KiB

    mine = dict(step_s=step_s, phase_s=phase_s, loss=losses, memory=memory, peak_rss=peak_rss, comm=comm,
                trace=trace, first_step_s=first_step_s)
    ranks = [mine]
    if distributed:
        ranks = [None] * world
        dist.all_gather_object(ranks, mine)
    if rank == 0:
        settings = {}
        if impl in peers.SHARDED_MODULE:
            from overlap.control.compression_auto import CompressionChooser

            codec = model.collectives.codec
            chooser = [c for c in model.step_end.controllers if isinstance(c, CompressionChooser)]
            settings = dict(prefetch_depth=model.overlap_config.prefetch_depth, bucket_mb=model.overlap_config.bucket_mb,
                            units=len(model.scheduler.units),
                            compression="none" if codec is None else codec.settings.mode,
                            compression_reason=chooser[0].reason if chooser else None)
        write_json(args.result, dict(impl=impl, world_size=world, params=params, root_params=root_params,
                                     block_params=block_params, settings=settings, ranks=ranks,
                                     optimizer=peers.optimizer_kwargs()))


# ---- driver: the runs, the summary, the outputs -----------------------------------------

def _worker_args(args: argparse.Namespace, impl: str, result: str, memory: bool) -> list[str]:
    out = ["--worker", impl, "--result", result]
    for key in ("model", "seed", "lr", "batch", "warmup", "steps", *MODEL_FIELDS, "prefetch_depth", "bucket_mb",
                "ddp_bucket_mb", "fsdp2_prefetch"):
        if getattr(args, key) is not None:
            out += [f"--{key.replace('_', '-')}", str(getattr(args, key))]
    return out + (["--memory"] if memory else [])


def _launch(args: argparse.Namespace, impl: str, prefix: list[str], result: str, memory: bool) -> dict:
    # The baseline runs its own checkout's worker: its package's modules may have other names.
    script = os.path.join(args.baseline, "benchmarks", "compare.py") if impl == BASELINE else os.path.abspath(__file__)
    python = checkout_python(args.baseline) if impl == BASELINE else sys.executable
    worker = _worker_args(args, peers.OVERLAP if impl == BASELINE else impl, result, memory)
    command = [python, script, *worker] if impl in peers.SINGLE_PROCESS else torchrun(script, WORLD_SIZE, worker, python)
    run_with_deadline(prefix + command, args.run_timeout, env=single_thread_env())
    return {**read_json(result), "impl": impl}


def run_all(args: argparse.Namespace) -> list[dict]:
    """Every (link, round, implementation) launch, implementations alternating within a round."""
    from tqdm import tqdm

    runs = []
    progress = tqdm(total=len(args.links) * args.rounds * len(args.impls), unit="run")
    with tempfile.TemporaryDirectory() as scratch:
        for link in args.links:
            with on_link(link) as prefix:
                for round_index in range(args.rounds):
                    for impl in args.impls:
                        progress.set_description(f"{link} round {round_index + 1} {impl}")
                        result = os.path.join(scratch, f"{link}-{round_index}-{impl}.json")
                        # Memory does not depend on the link: measured once, in the first round of the first link.
                        memory = round_index == 0 and link == args.links[0]
                        run = _launch(args, impl, prefix, result, memory)
                        runs.append({**run, "link": link, "round": round_index})
                        progress.update()
    progress.close()
    return runs


def _median_ms_by_kind(steps: list[dict], key: str) -> dict[str, float]:
    return {kind: median([step[key][kind] for step in steps]) * 1e3 for kind in steps[0][key]}


def summarize(runs: list[dict]) -> dict[str, dict[str, dict]]:
    """link -> implementation -> step time statistics, memory, bytes per step."""
    summary: dict[str, dict[str, dict]] = {}
    for run in runs:
        entry = summary.setdefault(run["link"], {}).setdefault(
            run["impl"], dict(steps_s=[], phases_s=[], ranks_memory=None))
        ranks = run["ranks"]
        entry["steps_s"] += [max(times) for times in zip(*(r["step_s"] for r in ranks))]
        entry["phases_s"] += ranks[0]["phase_s"]
        if ranks[0]["memory"] is not None:
            entry["ranks_memory"] = [r["memory"] for r in ranks]
            entry["peak_rss"] = [r["peak_rss"] for r in ranks]
        entry["params"], entry["root_params"] = run["params"], run["root_params"]
        entry["sent_bytes"] = _algorithm_bytes(peers.EAGER_TWIN.get(run["impl"], run["impl"]), run["params"], run["root_params"], run["block_params"],
                                               WORLD_SIZE)
        entry["sent_source"] = "algorithm" if entry["sent_bytes"] is not None else None
        entry["final_loss"] = ranks[0]["loss"][-1]
        round_ms = median([max(t) for t in zip(*(r["step_s"] for r in ranks))]) * 1e3
        entry.setdefault("round_step_ms", []).append(round_ms)
        entry.setdefault("rounds", []).append(run["round"])
        if run["impl"] in MEASURED:
            entry.setdefault("comm", []).extend(step for r in ranks[:1] for step in r["comm"])
            entry["trace"] = ranks[0]["trace"]
            entry["settings"] = run["settings"]
        if run["impl"] in peers.COMPILED:
            entry.setdefault("first_step_s", []).append(max(r.get("first_step_s") or 0.0 for r in ranks))
    for link, by_impl in _compiled_over_eager(runs).items():
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


def _compiled_over_eager(runs: list[dict]) -> dict[str, dict[str, list[float]]]:
    """link -> compiled row -> per round, its median step time ÷ its eager twin's in the same
    round (paired: load on the host that varies between rounds cancels)."""
    per_round = {(run["link"], run["round"], run["impl"]): median([max(times) for times in zip(*(
        r["step_s"] for r in run["ranks"]))]) for run in runs}
    ratios: dict[str, dict[str, list[float]]] = {}
    for (link, round_index, impl), step in per_round.items():
        twin = per_round.get((link, round_index, peers.EAGER_TWIN.get(impl, "")))
        if twin:
            ratios.setdefault(link, {}).setdefault(impl, []).append(step / twin)
    return ratios


def _ratio(a: Optional[float], b: Optional[float]) -> Optional[float]:
    return None if a is None or not b else a / b


def _fmt(value: Optional[float], digits: int = 0, suffix: str = "") -> str:
    return "–" if value is None else f"{value:.{digits}f}{suffix}"


def _step(summary: dict, link: str, impl: str) -> Optional[float]:
    return summary[link].get(impl, {}).get("step_ms")


def _peak(summary: dict, link: str, impl: str) -> Optional[float]:
    peaks = summary[link].get(impl, {}).get("peak_tracked")
    return max(peaks) if peaks else None


def _round_steps(summary: dict, link: str, impl: str) -> dict[int, float]:
    """`impl`'s median step (ms) in each round of `link` it ran in."""
    entry = summary[link].get(impl, {})
    return dict(zip(entry.get("rounds", []), entry.get("round_step_ms", [])))


def _paired(summary: dict, link: str, impl: str, peers_: Sequence[str]) -> list[float]:
    """Per round, `impl`'s median step over the fastest of `peers_` in the same round: rows
    alternate within a round, so load that drifts between rounds cancels in the ratio."""
    mine = _round_steps(summary, link, impl)
    theirs = [_round_steps(summary, link, peer) for peer in peers_]
    return [mine[r] / min(t[r] for t in theirs if r in t) for r in sorted(mine) if any(r in t for t in theirs)]


def _judged(link: str, what: str, limit: float, rounds: list[float]) -> dict:
    """A target judged round by round: the ratio reported is the median of the per-round
    ratios, and it is met only if every round meets it."""
    return dict(link=link, what=what, limit=limit, ratio=median(rounds) if rounds else None, rounds=rounds,
                held=sum(r <= limit for r in rounds), met=all(r <= limit for r in rounds) if rounds else None)


def _time_target(summary: dict, link: str, impl: str, peers_: Sequence[str], what: str, limit: float) -> dict:
    """A step-time target on the per-round paired ratios of `impl` to the fastest of `peers_`."""
    return _judged(link, what, limit, _paired(summary, link, impl, peers_))


def _memory_target(link: str, what: str, ratio: Optional[float], limit: float = 1.0) -> dict:
    """Peak memory does not vary with load: one ratio of the measured peaks."""
    return dict(link=link, what=what, limit=limit, ratio=ratio, rounds=None,
                met=None if ratio is None else ratio <= limit)


def check_targets(summary: dict) -> list[dict]:
    """ShardedModule's targets on each link measured: step time against tuned FSDP2 and the
    faster DDP of each round, paired per round; peak memory against tuned FSDP2 (ZeRO-3 memory)."""
    targets = []
    for link in summary:
        if peers.OVERLAP in summary[link]:
            targets.append(_time_target(summary, link, peers.OVERLAP, (peers.FSDP2_TUNED,), "step time / FSDP2 tuned",
                                        TIME_TARGET_VS_FSDP2_TUNED))
            targets.append(_time_target(summary, link, peers.OVERLAP, (peers.DDP, peers.DDP_TUNED),
                                        "step time / faster DDP", TIME_TARGET_VS_DDP))
        memory_ratio = _ratio(_peak(summary, link, peers.OVERLAP), _peak(summary, link, peers.FSDP2_TUNED))
        if memory_ratio is not None:
            targets.append(_memory_target(link, "peak memory / FSDP2 tuned", memory_ratio))
    return targets + compression_targets(summary) + compile_targets(summary)


def compression_targets(summary: dict) -> list[dict]:
    """Each compressed ShardedModule row against the uncompressed one, DDP with fp16
    compression (the compressed peer), and, where they ran, tuned FSDP2 and tuned DDP (step
    time, paired per round, the same limits as the uncompressed row), and the uncompressed one
    (peak memory)."""
    targets = []
    for link in summary:
        for impl in (peers.OVERLAP_INT8, peers.OVERLAP_INT8_INT4):
            if impl not in summary[link]:
                continue
            for peer, limit in ((peers.OVERLAP, COMPRESSED_TIME_TARGET), (peers.DDP_FP16, 1.0),
                                (peers.FSDP2_TUNED, TIME_TARGET_VS_FSDP2_TUNED), (peers.DDP_TUNED, TIME_TARGET_VS_DDP)):
                if peer in summary[link]:
                    targets.append(_time_target(summary, link, impl, (peer,), f"{impl} step time / {peer}", limit))
            memory = _ratio(_peak(summary, link, impl), _peak(summary, link, peers.OVERLAP))
            if memory is not None:
                targets.append(_memory_target(link, f"{impl} peak memory / overlap", memory))
    return targets


def compile_targets(summary: dict) -> list[dict]:
    """The runtime keeps what compiling gives: ShardedModule's compiled ÷ eager within 3% of the
    plain model's (a ratio of the two at most 1.03); compiled ShardedModule ahead of compiled
    tuned FSDP2."""
    targets = []
    for link, by_impl in summary.items():
        overlap = by_impl.get(peers.OVERLAP_COMPILED, {}).get("compiled_over_eager")
        local = by_impl.get(peers.LOCAL_COMPILED, {}).get("compiled_over_eager")
        if overlap is not None and local is not None:
            rounds = [o / l for o, l in zip(by_impl[peers.OVERLAP_COMPILED]["compiled_over_eager_rounds"],
                                            by_impl[peers.LOCAL_COMPILED]["compiled_over_eager_rounds"])]
            targets.append(_judged(link, "(overlap compiled ÷ eager) / (local compiled ÷ eager)", COMPILED_KEEPS_GAIN,
                                   rounds))
        if peers.OVERLAP_COMPILED in by_impl and peers.FSDP2_TUNED_COMPILED in by_impl:
            targets.append(_time_target(summary, link, peers.OVERLAP_COMPILED, (peers.FSDP2_TUNED_COMPILED,),
                                        "overlap-compiled step time / fsdp2-tuned-compiled", 1.0))
    return targets


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
                         _paired_cell(summary, link, impl, (peers.LOCAL,)),
                         "–" if sent is None else f"{sent / MIB:.1f} ({entry['sent_source']})",
                         "–" if exposed is None else " / ".join(f"{exposed.get(k, 0):.0f}"
                                                                for k in ("all_gather", "reduce_scatter")),
                         _paired_cell(summary, link, peers.OVERLAP, (impl,))])
    return markdown_table(["link", "impl", "step ms (median)", "IQR ms", "steps", "fwd / bwd / opt ms",
                           "× local per round", "MiB sent/rank/step", "exposed ms AG / RS", "overlap ÷ this per round"],
                          rows)


def _paired_cell(summary: dict, link: str, impl: str, peers_: Sequence[str]) -> str:
    """"median (min–max)" of the per-round paired ratios."""
    rounds = _paired(summary, link, impl, peers_)
    return "–" if not rounds else f"{median(rounds):.2f} ({min(rounds):.2f}–{max(rounds):.2f})"


def ratio_table(summary: dict) -> str:
    """Per link: every implementation's median step time, then ShardedModule's ratios to the
    tuned peers (paired per round: median and range)."""
    impls = [impl for impl in (*peers.ALL, BASELINE) if any(impl in by_impl for by_impl in summary.values())]
    rows = []
    for link in summary:
        rows.append([link, *(_fmt(_step(summary, link, impl)) for impl in impls),
                     _paired_cell(summary, link, peers.OVERLAP, (peers.FSDP2_TUNED,)),
                     _paired_cell(summary, link, peers.OVERLAP, (peers.DDP, peers.DDP_TUNED)),
                     _fmt(_ratio(_peak(summary, link, peers.OVERLAP), _peak(summary, link, peers.FSDP2_TUNED)), 2)])
    return markdown_table(["link", *(f"{impl} ms" for impl in impls), "overlap / fsdp2-tuned per round",
                           "overlap / faster ddp per round", "peak mem overlap / fsdp2-tuned"], rows)


MEMORY_CATEGORIES = ("Parameter", "Gradient", "Optstate", "Activation", "Temp", "Other", "Total")


def memory_table(summary: dict) -> str:
    link = next(iter(summary))
    rows = []
    for impl, entry in summary[link].items():
        for rank, memory in enumerate(entry["ranks_memory"] or []):
            rows.append([impl, rank, *(_fmt(memory["peak"].get(c, 0) / MIB, 1) for c in MEMORY_CATEGORIES),
                         " / ".join(_fmt(memory["phases"][p] / MIB) for p in ("forward", "backward")),
                         _fmt(entry["peak_rss"][rank] / MIB)])
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


def _rank0_peak(entry: dict) -> dict[str, int]:
    return entry["ranks_memory"][0]["peak"] if entry["ranks_memory"] else {}


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
        values = [_step(summary, link, impl) or 0 for link in links]
        tallest = max(tallest, *values)
        left.bar([x + i * width for x in range(len(links))], values, width, label=impl)
    left.set_xticks([x + 0.4 - width / 2 for x in range(len(links))], links)
    left.set_ylim(top=tallest * 1.15)  # room for the legend above the bars
    left.set_ylabel("median step time (ms)")
    left.set_title("step time per link")
    left.legend(ncol=len(impls), fontsize=8, loc="upper left")

    memory_link = links[0]
    bottoms = [0.0] * len(impls)
    for category in MEMORY_CATEGORIES[:-1]:
        values = [_rank0_peak(summary[memory_link][impl]).get(category, 0) / MIB for impl in impls]
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
    command = "python benchmarks/compare.py " + " ".join(args.argv)
    markdown = "\n\n".join([
        f"Command: `{command.strip()}`",
        f"Host load average (1, 5, 15 min) before: {_loads(args.load_before)}; after: {_loads(args.load_after)}"
        f" ({os.cpu_count()} CPUs, shared with other jobs).",
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
    meta = dict(command=command.strip(), argv=args.argv, skipped=args.skipped, sources=args.sources,
                model={"kind": args.model, **{key: getattr(args, key) for key in MODEL_FIELDS}},
                batch=args.batch, world_size=WORLD_SIZE, torch=torch.__version__, python=platform.python_version(),
                cpus=os.cpu_count(), time=time.strftime("%Y-%m-%d %H:%M:%S"),
                commit=git_commit(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))),
                loadavg_before=args.load_before, loadavg_after=args.load_after)
    write_json(os.path.join(args.out, "compare.json"),
               dict(meta=meta, results=summary, targets=targets, runs=runs))
    write_text(os.path.join(args.out, "compare.md"), markdown + "\n")
    plot(summary, os.path.join(args.out, "compare.png"))
    return markdown


def parse_args(argv: Sequence[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--impls", default=None, help="comma-separated, alternated in this order "
                        f"(default: {','.join(IMPLEMENTATIONS)}, less those not installed)")
    parser.add_argument("--links", default=LOOPBACK, help="loopback and/or tc rates, e.g. loopback,10gbit,2gbit")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--warmup", type=int, default=2, help="untimed steps at the start of each run")
    parser.add_argument("--steps", type=int, default=20, help="timed steps per run")
    parser.add_argument("--batch", type=int, default=4, help="sequences per rank per step")
    parser.add_argument("--model", choices=("gpt", "mlp"), default="gpt",
                        help="gpt: overlap.models.GPT; mlp: narrow_mlp.NarrowMLP (blocks of narrow "
                        "LayerNorm/GELU layers, where compiling helps on CPU; --n-head unused)")
    parser.add_argument("--n-layer", type=int, default=6)
    parser.add_argument("--n-embd", type=int, default=512)
    parser.add_argument("--n-head", type=int, default=8)
    parser.add_argument("--vocab-size", type=int, default=8192)
    parser.add_argument("--block-size", type=int, default=128)
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--prefetch-depth", type=int, default=None, help="ShardedModule's (default: its planner)")
    parser.add_argument("--bucket-mb", type=float, default=None, help="ShardedModule's (default: its planner)")
    parser.add_argument("--ddp-bucket-mb", type=float, default=10.0, help=f"{peers.DDP_TUNED}'s bucket_cap_mb")
    parser.add_argument("--fsdp2-prefetch", type=int, default=2,
                        help=f"{peers.FSDP2_TUNED}: blocks in each explicit forward/backward prefetch list")
    parser.add_argument("--baseline", help=f"another checkout with its environment in .venv (`make setup` there): "
                        f"adds {BASELINE!r}, that checkout's ShardedModule run by its own worker, to the "
                        "implementations")
    parser.add_argument("--out", default="bench_out", help="directory for compare.json/.md/.png")
    parser.add_argument("--run-timeout", type=float, default=600, help="seconds one launch may take")
    parser.add_argument("--quick", action="store_true", help="tiny model, one round, two timed steps")
    parser.add_argument("--merge", nargs="+", metavar="JSON", help="compare.json files of earlier runs to summarise "
                        "together (same model and settings); runs nothing")
    parser.add_argument("--worker", choices=peers.ALL, help=argparse.SUPPRESS)
    parser.add_argument("--result", help=argparse.SUPPRESS)
    parser.add_argument("--memory", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    args.argv = list(argv)
    args.sources = None
    if args.worker:
        return args
    if args.quick:
        for key, value in QUICK_MODEL.items():
            setattr(args, key, value)
        args.batch, args.rounds, args.warmup, args.steps = 2, 1, 1, 2
    try:
        args.links = parse_links(args.links)
        args.skipped = {} if args.impls else peers.unavailable()
        args.impls = parse_choices(args.impls or ",".join(i for i in IMPLEMENTATIONS if i not in args.skipped),
                                   (*peers.ALL, BASELINE), "--impls")
        if args.baseline and BASELINE not in args.impls:
            args.impls.append(BASELINE)
        if BASELINE in args.impls and not args.baseline:
            raise ValueError(f"--impls {BASELINE} needs --baseline")
    except ValueError as exc:
        parser.error(str(exc))
    for name in ("rounds", "steps", "batch", *MODEL_FIELDS):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    if args.warmup < 0:
        parser.error(f"--warmup must be >= 0, got {args.warmup}")
    if args.n_embd % args.n_head:
        parser.error(f"--n-embd {args.n_embd} is not divisible by --n-head {args.n_head}")
    return args


def merged_runs(args: argparse.Namespace) -> list[dict]:
    """The launches recorded in args.merge, rounds renumbered across files; args takes the
    first file's model and settings, and each file's meta is kept as a source."""
    runs, settings, args.sources = [], None, []
    for path in args.merge:
        data = read_json(path)
        recorded = parse_args(data["meta"]["argv"])
        these = {key: getattr(recorded, key) for key in ("model", "batch", "steps", "warmup", "seed", "lr", *MODEL_FIELDS)}
        if settings is None:
            settings = these
            args.skipped = data["meta"].get("skipped", {})
        elif these != settings:
            raise ValueError(f"--merge: {path} was run with {these}, the first file with {settings}")
        for run in data["runs"]:
            offset = 1 + max((r["round"] for r in runs if r["link"] == run["link"] and r["source"] < len(args.sources)),
                             default=-1)
            runs.append({**run, "round": run["round"] + offset, "source": len(args.sources)})
        args.sources.append(data["meta"])
    for key, value in settings.items():
        setattr(args, key, value)
    rounds = {link: len({r["round"] for r in runs if r["link"] == link}) for link in dict.fromkeys(r["link"] for r in runs)}
    args.rounds = next(iter(rounds.values())) if len(set(rounds.values())) == 1 else \
        ", ".join(f"{link} {count}" for link, count in rounds.items())
    return runs


def run_driver(args: argparse.Namespace) -> int:
    args.load_before = os.getloadavg()
    runs = merged_runs(args) if args.merge else run_all(args)
    args.load_after = os.getloadavg()
    summary = summarize(runs)
    targets = check_targets(summary)
    print(write_outputs(args, runs, summary, targets))
    return 0


def main(argv: Optional[Sequence[str]] = None) -> int:
    return script_main(argv, parse_args, run_worker, run_driver)


if __name__ == "__main__":
    sys.exit(main())
