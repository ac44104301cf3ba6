"""A short timing of the real process group that fits the link's latency α and bandwidth β.

All-gathers and gradient reductions (the primitive the runtime uses on this backend) run at a
few sizes, smallest first; each timing is the slowest rank's (a collective finishes when its
last rank does) and the best of a few repeats. The first two sizes always run; the probe stops
adding sizes once the next one would overrun its time budget: every rank takes that decision
from the same all-reduced clock, so all ranks issue the same collectives. The fit is a
least-squares line time = α + bytes/β.
"""
from __future__ import annotations

import json
import logging
import os
import time
from typing import Optional, Sequence

import torch
import torch.distributed as dist

from overlap.control.agreement import decided_by_rank0
from overlap.runtime.process_group import all_gather_flat, device_backend, reduce_scatter_flat
from overlap.plan.links import LinkModel

logger = logging.getLogger("overlap")

# Gathered-buffer sizes (bytes), smallest first: a latency point and bandwidth points.
PROBE_SIZES = (64 * 2**10, 2 * 2**20, 16 * 2**20)
PROBE_REPEATS = 3
PROBE_BUDGET_S = 0.8
# Lower bound on a fitted α, so that a noisy fit never yields zero latency.
MIN_ALPHA_S = 1e-6


def fit_alpha_beta(samples: Sequence[tuple[float, float]], fallback: LinkModel) -> tuple[float, float]:
    """Least-squares α (s) and β (bytes/s) from (wire bytes, seconds) samples.

    With one distinct size, or a slope that noise made non-positive, β comes from `fallback`
    and α is what remains of the mean time.
    """
    if not samples:
        raise ValueError("fit_alpha_beta: no samples")
    xs = [float(x) for x, _ in samples]
    ys = [float(y) for _, y in samples]
    n = len(xs)
    mean_x, mean_y = sum(xs) / n, sum(ys) / n
    var_x = sum((x - mean_x) ** 2 for x in xs)
    slope = sum((x - mean_x) * (y - mean_y) for x, y in zip(xs, ys)) / var_x if var_x > 0 else 0.0
    if slope <= 0:
        beta = fallback.beta
        alpha = mean_y - mean_x / beta
    else:
        beta = 1.0 / slope
        alpha = mean_y - slope * mean_x
    return max(alpha, MIN_ALPHA_S), beta


def _cache_key(link: str, group: dist.ProcessGroup, device: torch.device, level: str) -> str:
    key = f"{link}/{device_backend(group, device.type)}/world{dist.get_world_size(group)}"
    return f"{key}/{level}" if level else key


def _read_cache(path: Optional[str], key: str) -> Optional[tuple[float, float]]:
    if not path or not os.path.exists(path):
        return None
    try:
        with open(path) as f:
            entry = json.load(f).get(key)
    except (OSError, ValueError) as exc:
        logger.warning("probe cache %s unreadable (%s); probing again", path, exc)
        return None
    return None if entry is None else (float(entry["alpha"]), float(entry["beta"]))


def _write_cache(path: Optional[str], key: str, alpha: float, beta: float) -> None:
    if not path:
        return
    entries = {}
    if os.path.exists(path):
        try:
            with open(path) as f:
                entries = json.load(f)
        except (OSError, ValueError):
            entries = {}
    entries[key] = {"alpha": alpha, "beta": beta}
    with open(path, "w") as f:
        json.dump(entries, f, indent=1)


class _Timer:
    """Times blocking collectives on this group's device."""

    def __init__(self, group: dist.ProcessGroup, device: torch.device) -> None:
        self.group = group
        self.device = device
        self.world = dist.get_world_size(group)
        self.use_all_to_all = device_backend(group, device.type) == "gloo"  # as overlap.runtime.collectives does

    def _sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def _timed(self, op) -> float:
        self._sync()
        start = time.perf_counter()
        op()
        self._sync()
        return time.perf_counter() - start

    def pair(self, nbytes: int) -> tuple[float, float]:
        """Seconds for one all-gather and one reduction of an `nbytes` gathered buffer."""
        shard = torch.ones(max(nbytes // 4 // self.world, 1), dtype=torch.float32, device=self.device)
        full = torch.empty(shard.numel() * self.world, dtype=torch.float32, device=self.device)
        gather = self._timed(lambda: all_gather_flat(full, shard, group=self.group))
        if self.use_all_to_all:
            out = torch.empty_like(full)
            reduce = self._timed(lambda: dist.all_to_all_single(out, full, group=self.group))
        else:
            reduce = self._timed(lambda: reduce_scatter_flat(shard, full, group=self.group))
        return gather, reduce


def _measure(group: dist.ProcessGroup, device: torch.device, budget_s: float) -> list[tuple[float, float]]:
    """(wire bytes, slowest rank's best seconds) for each size the budget allowed: the first
    two always (a fit needs two sizes), the second with as many repeats as the budget leaves
    room for, at least one."""
    timer = _Timer(group, device)
    timer.pair(PROBE_SIZES[0])  # warm-up: connection set-up is not latency
    world = timer.world
    samples: list[tuple[float, float]] = []
    spent = 0.0
    repeats = PROBE_REPEATS
    for index, nbytes in enumerate(PROBE_SIZES):
        times = torch.tensor([timer.pair(nbytes) for _ in range(repeats)], dtype=torch.float64)
        # Slowest rank per repeat, then the best repeat; the budget clock rides along.
        spent += float(times.sum())
        clock = torch.cat([times.flatten(), torch.tensor([spent], dtype=torch.float64)]).to(device)
        dist.all_reduce(clock, op=dist.ReduceOp.MAX, group=group)
        clock = clock.cpu()
        best = clock[:-1].view(repeats, 2).min(dim=0).values
        wire = nbytes * (world - 1) / world
        samples += [(wire, float(best[0])), (wire, float(best[1]))]
        spent = float(clock[-1])
        if index + 1 == len(PROBE_SIZES):
            break
        # The next size's repeat, as if its time grew with the bytes alone: from the latency
        # point that overestimates it many times over, which is why the second size is not
        # left to this guess (see [Note: the probe's second size]).
        next_repeat = float(best.sum()) * PROBE_SIZES[index + 1] / nbytes
        if index == 0:
            repeats = max(1, min(PROBE_REPEATS, int((budget_s - spent) / next_repeat)))
        elif spent + next_repeat * PROBE_REPEATS > budget_s:
            break
    return samples


# [Note: the probe's second size]
# With one size measured the fit has no slope, and β would be the link's default, not a
# measurement. The budget used to decide the second size from the first one's time grown by
# the ratio of sizes (32): at 64 KB the time is mostly latency, so a slow first point (a
# loaded host) made the guess overrun the budget and the probe stop there. On an emulated
# two-node cluster at 1 Gbit/s (two ranks a node, the host loaded), 4 probes of each group the
# planner probes: all ranks' stopped there 4 times, one rank per node's and a node's once
# each, and each of those read the default β for the link (0.6 GB/s for loopback, against
# 0.06-0.1 measured), which once made the planner choose hpZ where hybrid was faster. The
# second size now always runs, the budget setting only its repeats (at least one) and
# whether the third size runs; in 4 probes again all ranks' β read 0.081-0.095 GB/s.


def probe_link(group: dist.ProcessGroup, device: torch.device, default: LinkModel,
               cache_path: Optional[str] = None, level: str = "", budget_s: float = PROBE_BUDGET_S) -> LinkModel:
    """Fit α and β on `group` (or reuse a cached fit); every rank gets the answer of the
    group's rank 0. `level` tells apart, in the cache, groups of one size on different
    levels (a node's ranks, one rank per node)."""
    if dist.get_world_size(group) == 1:
        return default
    key = _cache_key(default.link, group, device, level)
    cached = decided_by_rank0(group, lambda: _read_cache(cache_path, key))
    if cached is not None:
        alpha, beta = cached
        return LinkModel(default.link, alpha, beta, "cache")
    start = time.perf_counter()
    samples = _measure(group, device, budget_s)

    def fit() -> tuple[float, float]:
        alpha, beta = fit_alpha_beta(samples, default)
        _write_cache(cache_path, key, alpha, beta)
        return alpha, beta

    alpha, beta = decided_by_rank0(group, fit)
    logger.debug("probe: %d samples in %.2f s -> α=%.0fµs β=%.3fGB/s", len(samples),
                 time.perf_counter() - start, alpha * 1e6, beta / 1e9)
    return LinkModel(default.link, alpha, beta, "probe")
