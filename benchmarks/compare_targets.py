"""compare.py's targets for ShardedModule: step time paired per round against tuned FSDP2 and
the faster DDP, peak memory against tuned FSDP2, and the compressed and compiled rows'."""
from __future__ import annotations

from typing import Optional

import peers
from common import median
from compare_summary import paired_rounds, peak_bytes, ratio_of

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


def _judged(link: str, what: str, limit: float, rounds: list[float]) -> dict:
    """A target judged round by round: the ratio reported is the median of the per-round
    ratios, and it is met only if every round meets it."""
    return dict(link=link, what=what, limit=limit, ratio=median(rounds) if rounds else None, rounds=rounds,
                held=sum(r <= limit for r in rounds), met=all(r <= limit for r in rounds) if rounds else None)


def _memory_target(link: str, what: str, ratio: Optional[float], limit: float = 1.0) -> dict:
    """Peak memory does not vary with load: one ratio of the measured peaks."""
    return dict(link=link, what=what, limit=limit, ratio=ratio, rounds=None,
                met=None if ratio is None else ratio <= limit)


def check_targets(summary: dict) -> list[dict]:
    """ShardedModule's targets (above) on each link measured, then the compressed and compiled rows'."""
    targets = []
    for link in summary:
        if peers.OVERLAP in summary[link]:
            targets.append(_judged(link, "step time / FSDP2 tuned", TIME_TARGET_VS_FSDP2_TUNED,
                                   paired_rounds(summary, link, peers.OVERLAP, (peers.FSDP2_TUNED,))))
            targets.append(_judged(link, "step time / faster DDP", TIME_TARGET_VS_DDP,
                                   paired_rounds(summary, link, peers.OVERLAP, (peers.DDP, peers.DDP_TUNED))))
        memory_ratio = ratio_of(peak_bytes(summary, link, peers.OVERLAP), peak_bytes(summary, link, peers.FSDP2_TUNED))
        if memory_ratio is not None:
            targets.append(_memory_target(link, "peak memory / FSDP2 tuned", memory_ratio))
    return targets + compression_targets(summary) + compile_targets(summary)


def compression_targets(summary: dict) -> list[dict]:
    """Each compressed row's step time, paired per round, against the uncompressed row, DDP with fp16
    compression and, with the uncompressed row's limits, tuned FSDP2 and tuned DDP where they ran;
    its peak memory against the uncompressed row's."""
    targets = []
    for link in summary:
        for impl in (peers.OVERLAP_INT8, peers.OVERLAP_INT8_INT4):
            if impl not in summary[link]:
                continue
            for peer, limit in ((peers.OVERLAP, COMPRESSED_TIME_TARGET), (peers.DDP_FP16, 1.0),
                                (peers.FSDP2_TUNED, TIME_TARGET_VS_FSDP2_TUNED), (peers.DDP_TUNED, TIME_TARGET_VS_DDP)):
                if peer in summary[link]:
                    targets.append(_judged(link, f"{impl} step time / {peer}", limit,
                                           paired_rounds(summary, link, impl, (peer,))))
            memory = ratio_of(peak_bytes(summary, link, impl), peak_bytes(summary, link, peers.OVERLAP))
            if memory is not None:
                targets.append(_memory_target(link, f"{impl} peak memory / overlap", memory))
    return targets


def compile_targets(summary: dict) -> list[dict]:
    """The compiled rows' targets (above), and compiled ShardedModule ahead of compiled tuned FSDP2."""
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
            targets.append(_judged(link, "overlap-compiled step time / fsdp2-tuned-compiled", 1.0,
                                   paired_rounds(summary, link, peers.OVERLAP_COMPILED, (peers.FSDP2_TUNED_COMPILED,))))
    return targets
