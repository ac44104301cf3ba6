"""`compression="auto"`: after the first measured training step, rank 0 replays the step with
and without compression (`overlap.plan.compression`) and every rank takes its choice at the
same step."""
from __future__ import annotations

import logging
import statistics
import time
from dataclasses import dataclass, field
from typing import Callable, Iterable, Optional, Sequence

import torch
import torch.distributed as dist

from overlap.runtime.compression import QuantizedCodec
from overlap.plan.compression import CodecCost, choose_compression
from overlap.plan.cost_model import Profile
from overlap.control.agreement import decided_by_rank0
from overlap.control.startup_plan import StartupPlan
from overlap.control.replanner import FIRST_DECISION_STEP, measure_profile
from overlap.control.step_end import PrefetchDepths
from overlap.base.step_record import StepKind
from overlap.observe.report import ClosedStep
from overlap.runtime.unit import Unit

logger = logging.getLogger("overlap")

# Elements the codec is timed on: large enough to time, a few milliseconds on one CPU core.
CODEC_PROBE_NUMEL = 1 << 20
# Launches timed per kernel. On CUDA they run back to back between two events, so the time
# per launch is the kernel's, not a launch and a host sync; on CPU the median launch is
# taken, so one launch slowed by another process does not set the cost.
CODEC_PROBE_REPEATS = 5
# Elements each kernel is warmed on at start-up: a few blocks, enough to compile each
# kernel for the dtypes training passes it.
WARM_NUMEL = 4096


def _seconds_per_launch(fn: Callable[[], None], device: torch.device, repeats: int) -> float:
    fn()                                              # warm-up (first-call compilation)
    if device.type == "cuda":
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(repeats):
            fn()
        end.record()
        end.synchronize()
        return start.elapsed_time(end) / 1e3 / repeats
    times = []
    for _ in range(repeats):
        begin = time.perf_counter()
        fn()
        times.append(time.perf_counter() - begin)
    return statistics.median(times)


def measure_codec(codec: QuantizedCodec, device: torch.device, gather_itemsize: int, reduce_itemsize: int,
                  repeats: int = CODEC_PROBE_REPEATS) -> CodecCost:
    """Seconds per element of int8 quantise and dequantise-accumulate with the codec's kernels."""
    kernels, block = codec.kernels, codec.settings.block
    src = torch.randn(CODEC_PROBE_NUMEL, device=device)
    values = torch.empty(CODEC_PROBE_NUMEL, dtype=torch.int8, device=device)
    scales = torch.empty(-(-CODEC_PROBE_NUMEL // block), dtype=torch.float32, device=device)
    quantize_s = _seconds_per_launch(lambda: kernels.quantize_int8(src, values, scales, block), device, repeats)
    dequantize_s = _seconds_per_launch(lambda: kernels.dequantize_accumulate(src, values, scales, block, 8),
                                       device, repeats)
    return CodecCost(quantize_s / CODEC_PROBE_NUMEL, dequantize_s / CODEC_PROBE_NUMEL, block, gather_itemsize,
                     reduce_itemsize, on_compute_lane=device.type != "cuda")


def warm_codec_kernels(codec: QuantizedCodec, device: torch.device, gather_dtypes: Iterable[torch.dtype],
                       reduce_dtypes: Iterable[torch.dtype]) -> None:
    """Run each quantised kernel once for the dtypes training passes it, on this rank, at
    start-up: the codec may be switched on at any step, and the first compressed collective
    must not wait on a rank compiling its kernels (JIT backends compile per dtype)."""
    kernels, block = codec.kernels, codec.settings.block
    scales = torch.empty(-(-WARM_NUMEL // block), dtype=torch.float32, device=device)
    int8 = torch.empty(WARM_NUMEL, dtype=torch.int8, device=device)
    int4 = torch.empty(-(-WARM_NUMEL // 2), dtype=torch.uint8, device=device)
    fp32 = torch.zeros(WARM_NUMEL, dtype=torch.float32, device=device)
    for dtype in set(gather_dtypes):
        weights = torch.zeros(WARM_NUMEL, dtype=dtype, device=device)
        kernels.quantize_int8(weights, int8, scales, block)
        kernels.dequantize_into(weights, int8, scales, block, 8)
    for dtype in set(reduce_dtypes):
        grads = torch.zeros(WARM_NUMEL, dtype=dtype, device=device)
        kernels.quantize_int8(grads, int8, scales, block)
        kernels.quantize_int4(grads, int4, scales, block, torch.zeros_like(fp32))
    kernels.dequantize_accumulate(fp32, int8, scales, block, 8)
    kernels.dequantize_accumulate(fp32, int4, scales, block, 4)
    if device.type == "cuda":
        torch.cuda.synchronize(device)


# Training steps at which rank 0 is asked for a proposal before the chooser gives up and
# stays uncompressed: each ask is a host round trip between ranks, so they are not repeated for
# ever on a job whose steps rank 0 cannot measure (a unit that does not run every step).
MAX_ASKS = 4


@dataclass
class CompressionChooser:
    """Step-end controller (`overlap.control.step_end`): from FIRST_DECISION_STEP on, rank 0
    proposes a mode at each training step once it has measured one (None until then); the
    proposal is broadcast, so every rank switches at the same step and then stops asking.
    After MAX_ASKS training steps without a proposal it stays uncompressed and stops asking.
    Evaluation steps are not asked at: every rank sees the same kind of step."""

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
    asks: int = 0
    # The codec's kernels timed once, when the chooser is made: timing them at a decision
    # would wait on the device for the step's queued work (a CUDA event's synchronize).
    cost: CodecCost = field(init=False)

    def __post_init__(self) -> None:
        self.cost = measure_codec(self.codec, self.device, *self.itemsizes)

    def on_step_end(self, step: ClosedStep) -> None:
        if self.decided is not None or step.record.step < FIRST_DECISION_STEP \
                or step.record.kind is not StepKind.TRAIN:
            return
        self.asks += 1
        choice = decided_by_rank0(self.group, lambda: self.propose(step))
        if choice is None:
            if self.asks < MAX_ASKS:
                return
            mode = self.codec.settings.mode
            choice = mode, f"compression {mode}: no training step measured in {self.asks} tries"
            logger.warning("plan at step %d: %s; not asked again", step.record.step, choice[1])
        else:
            logger.info("plan at step %d: %s", step.record.step, choice[1])
        self.decided, self.reason = choice
        self.codec.set_mode(self.decided)

    def propose(self, step: ClosedStep) -> Optional[tuple[str, str]]:
        """Rank 0's (mode, reason) from a measured training step, or None without one."""
        profile = measure_profile(step, self.base)
        if profile is None:
            return None
        forward_depth, backward_depth = self.depths.current
        choice = choose_compression(profile, self.startup.link, self.cost, forward_depth, backward_depth,
                                    self.startup.memory_budget_bytes)
        return choice.mode, choice.reason


def chooser_for(codec: QuantizedCodec, units: Sequence[Unit], base: Profile, startup: StartupPlan,
                group: dist.ProcessGroup, depths: PrefetchDepths, device: torch.device) -> CompressionChooser:
    """`units`: every unit, the root included; `group`: every rank, host-side (see [Note:
    step-end decisions on the host] in overlap/control/agreement.py). Warms the codec's
    kernels on this rank and times them."""
    gathered = [g for u in units for g in u.groups]
    reduced = [g for u in units for g in u.trainable_groups]
    warm_codec_kernels(codec, device, [g.gather_dtype for g in gathered if g.gather_dtype.is_floating_point],
                       [g.reduce_dtype for g in reduced])
    itemsizes = (max((g.gather_dtype.itemsize for g in gathered), default=4),
                 max((g.reduce_dtype.itemsize for g in reduced), default=4))
    return CompressionChooser(codec, base, startup, group, depths, itemsizes, device)
