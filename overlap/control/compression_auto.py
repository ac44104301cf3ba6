"""`compression="auto"`: after the first measured training step, rank 0 replays the step with
and without compression (`overlap.plan.compression`) and every rank takes its choice at the
same step."""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Optional, Sequence

import torch
import torch.distributed as dist

from overlap.runtime.compression import QuantizedCodec
from overlap.plan.compression import CodecCost, choose_compression
from overlap.plan.cost_model import Profile
from overlap.control.agreement import decided_by_rank0
from overlap.control.startup_plan import StartupPlan
from overlap.control.replanner import FIRST_DECISION_STEP, measure_profile
from overlap.control.step_end import PrefetchDepths
from overlap.observe.report import ClosedStep
from overlap.runtime.unit import Unit

logger = logging.getLogger("overlap")

# Elements the codec is timed on: large enough to time, a few milliseconds on one CPU core.
CODEC_PROBE_NUMEL = 1 << 20


def measure_codec(codec: QuantizedCodec, device: torch.device, gather_itemsize: int, reduce_itemsize: int
                  ) -> CodecCost:
    """Seconds per element of int8 quantise and dequantise-accumulate with the codec's kernels."""
    kernels, block = codec.kernels, codec.settings.block
    src = torch.randn(CODEC_PROBE_NUMEL, device=device)
    values = torch.empty(CODEC_PROBE_NUMEL, dtype=torch.int8, device=device)
    scales = torch.empty(-(-CODEC_PROBE_NUMEL // block), dtype=torch.float32, device=device)

    def timed(fn) -> float:
        fn()                                          # warm-up (first-call compilation)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        start = time.perf_counter()
        fn()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        return (time.perf_counter() - start) / CODEC_PROBE_NUMEL

    quantize_s = timed(lambda: kernels.quantize_int8(src, values, scales, block))
    dequantize_s = timed(lambda: kernels.dequantize_accumulate(src, values, scales, block, 8))
    return CodecCost(quantize_s, dequantize_s, block, gather_itemsize, reduce_itemsize,
                     on_compute_lane=device.type != "cuda")


@dataclass
class CompressionChooser:
    """Step-end controller (`overlap.control.step_end`): from FIRST_DECISION_STEP on, rank 0
    proposes a mode once it has a measured training step (None until then); the proposal is
    broadcast at every step until one is taken, so every rank switches at the same step and
    then stops asking."""

    codec: QuantizedCodec
    base: Profile
    startup: StartupPlan
    group: dist.ProcessGroup
    depths: PrefetchDepths
    # Widest element each side of the wire carries uncompressed: gathered, reduced (bytes).
    itemsizes: tuple[int, int]
    device: torch.device
    decided: Optional[str] = None
    reason: str = ""

    def on_step_end(self, step: ClosedStep) -> None:
        if self.decided is not None or step.record.step < FIRST_DECISION_STEP:
            return
        choice = decided_by_rank0(self.group, lambda: self.propose(step))
        if choice is None:
            return
        self.decided, self.reason = choice
        self.codec.set_mode(self.decided)
        logger.info("plan at step %d: %s", step.record.step, self.reason)

    def propose(self, step: ClosedStep) -> Optional[tuple[str, str]]:
        """Rank 0's (mode, reason) from a measured training step, or None without one."""
        profile = measure_profile(step, self.base)
        if profile is None:
            return None
        codec = measure_codec(self.codec, self.device, *self.itemsizes)
        forward_depth, backward_depth = self.depths.current
        choice = choose_compression(profile, self.startup.link, codec, forward_depth, backward_depth,
                                    self.startup.memory_budget_bytes)
        return choice.mode, choice.reason


def chooser_for(codec: QuantizedCodec, units: Sequence[Unit], base: Profile, startup: StartupPlan,
                group: dist.ProcessGroup, depths: PrefetchDepths, device: torch.device) -> CompressionChooser:
    """`units`: every unit, the root included."""
    gathered = [g for u in units for g in u.groups]
    reduced = [g for u in units for g in u.trainable_groups]
    itemsizes = (max((g.gather_dtype.itemsize for g in gathered), default=4),
                 max((g.reduce_dtype.itemsize for g in reduced), default=4))
    return CompressionChooser(codec, base, startup, group, depths, itemsizes, device)
