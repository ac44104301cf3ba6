"""`--trace DIR`: a torch.profiler Chrome trace per rank and a PNG timeline of one step.

The Chrome trace (`trace_rank<r>.json`, open in Perfetto or chrome://tracing) shows the
runtime's `overlap::<phase>::<unit>` labels next to the operators. The PNG (`timeline.png`)
draws, for every rank, one lane for compute (unit forward and backward compute, time blocked
on a collective, runtime work) and one for communication (each collective in flight), from
the record of the captured step (`overlap.base.step_record`: host clocks on CPU, CUDA events on
GPU), so the overlap can be read at a glance. Each rank's lanes start at its own step start:
clocks of different machines are not comparable.
"""
from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from typing import Optional, Sequence

import torch
import torch.distributed as dist
from torch.profiler import ProfilerActivity, profile, schedule

from overlap.observe.report import ClosedStep, Segment, segments
from overlap.base.step_record import Collective

logger = logging.getLogger("overlap")

HOST_COLORS = {"forward": "#4c78a8", "backward": "#54a24b", "wait": "#e45756", "runtime": "#bab0ac"}
COMM_COLORS = {"all_gather": "#f58518", "reduce_scatter": "#b279a2", "all_reduce": "#9d755d"}


@dataclass
class CapturedStep:
    """One rank's captured step, in seconds from its start."""

    rank: int
    segments: list[Segment]
    collectives: tuple[Collective, ...]
    summary: str


def capture(rank: int, step: ClosedStep) -> CapturedStep:
    """A training step's segments and collectives in seconds from its start, with its summary."""
    record, stats = step.record, step.stats
    shifted = record.shifted(record.bounds()[0])
    summary = (f"compute {stats.compute_s * 1e3:.0f} ms, communication {stats.comm_s * 1e3:.0f} ms, "
               f"{100 * stats.hidden_fraction:.0f}% hidden")
    return CapturedStep(rank, segments(shifted), shifted.collectives, summary)


def _pack_rows(collectives: Sequence[Collective]) -> list[int]:
    """Row per collective so that those in one row do not overlap (first fit, in order)."""
    row_ends: list[float] = []
    rows = []
    for collective in collectives:
        end = collective.start + collective.duration
        row = next((i for i, row_end in enumerate(row_ends) if row_end <= collective.start), len(row_ends))
        if row == len(row_ends):
            row_ends.append(end)
        row_ends[row] = end
        rows.append(row)
    return rows


def plot_timeline(steps: Sequence[CapturedStep], path: str, title: str) -> None:
    """Two lanes per rank: compute (unit compute / blocked / runtime) and communication."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    fig, ax = plt.subplots(figsize=(14, 1.0 + 1.4 * len(steps)))
    span = max((s.end for c in steps for s in c.segments), default=0.0)
    labels, ticks = [], []
    for index, captured in enumerate(sorted(steps, key=lambda c: c.rank)):
        host_y = 2 * index * 1.2
        comm_y = host_y + 1.2
        for kind, color in HOST_COLORS.items():
            bars = [(s.start * 1e3, (s.end - s.start) * 1e3) for s in captured.segments if s.kind == kind]
            ax.broken_barh(bars, (host_y, 0.9), facecolors=color, edgecolors="white", linewidth=0.4)
        # One label per unit and phase, on its longest stretch when that is wide enough to read.
        longest: dict[tuple[str, str], Segment] = {}
        for s in captured.segments:
            key = (s.unit, s.kind)
            if s.kind in ("forward", "backward") and (key not in longest or
                                                      s.end - s.start > longest[key].end - longest[key].start):
                longest[key] = s
        for s in longest.values():
            if s.end - s.start > span / 25:
                ax.text((s.start + s.end) * 500, host_y + 0.45, s.unit, ha="center", va="center", fontsize=6,
                        color="white")
        rows = _pack_rows(captured.collectives)
        height = 0.9 / (max(rows, default=0) + 1)
        for collective, row in zip(captured.collectives, rows):
            ax.broken_barh([(collective.start * 1e3, collective.duration * 1e3)],
                           (comm_y + row * height, height * 0.9),
                           facecolors=COMM_COLORS.get(collective.kind, "gray"), edgecolors="black", linewidth=0.3)
        labels += [f"rank {captured.rank} compute", f"rank {captured.rank} comm\n{captured.summary}"]
        ticks += [host_y + 0.45, comm_y + 0.45]
    ax.set_yticks(ticks, labels, fontsize=8)
    ax.invert_yaxis()      # rank 0 on top, each rank's compute lane above its comm lane
    ax.set_xlabel("ms since step start")
    ax.set_title(title)
    legend = [Patch(color=c, label=k) for k, c in HOST_COLORS.items()]
    legend += [Patch(color=c, label=k.replace("_", "-")) for k, c in COMM_COLORS.items()]
    ax.legend(handles=legend, loc="upper left", bbox_to_anchor=(1.005, 1.0), fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


class TraceRecorder:
    """Profiles training step `capture_step` (0-based) on every rank; call `step()` after each
    training step, then `finish()` on every rank (it gathers the captured steps to rank 0)."""

    def __init__(self, directory: str, capture_step: int, device: torch.device) -> None:
        if capture_step < 0:
            raise ValueError(f"capture_step={capture_step} is invalid; expected an integer >= 0")
        self.directory = directory
        self.capture_step = capture_step
        self.rank = dist.get_rank()
        self.iteration = 0
        self.captured: Optional[CapturedStep] = None
        os.makedirs(directory, exist_ok=True)
        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
        self.trace_path = os.path.join(directory, f"trace_rank{self.rank}.json")
        self._profiler = profile(
            activities=activities,
            schedule=schedule(wait=max(capture_step - 1, 0), warmup=min(capture_step, 1), active=1, repeat=1),
            on_trace_ready=lambda p: p.export_chrome_trace(self.trace_path),
        )
        self._profiler.start()

    def on_step_end(self, step: ClosedStep) -> None:
        """A step-end observer (see `overlap.control.step_end`): keeps the captured training step."""
        if self.iteration == self.capture_step and step.stats is not None:
            self.captured = capture(self.rank, step)

    def step(self) -> None:
        self._profiler.step()
        self.iteration += 1

    def finish(self) -> Optional[str]:
        """Stop profiling and write the PNG on rank 0; returns its path there (None elsewhere,
        or when the captured step was never reached)."""
        self._profiler.stop()
        gathered: list = [None] * dist.get_world_size()
        dist.all_gather_object(gathered, self.captured)
        if self.rank != 0:
            return None
        steps = [c for c in gathered if c is not None]
        if not steps:
            logger.warning("trace: step %d was never reached; no timeline written", self.capture_step)
            return None
        path = os.path.join(self.directory, "timeline.png")
        plot_timeline(steps, path, f"overlap timeline, training step {self.capture_step + 1}")
        return path
