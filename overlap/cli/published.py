"""Published parallel layouts of large dense models, to print beside `overlap simulate`'s picks.

Each is what its authors ran, with the source; `throughput_tflops` is their achieved bf16
TFLOP/s per GPU where they published one (on their own cluster and global batch, not the
preset's).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional


@dataclass(frozen=True)
class PublishedLayout:
    model: str                       # a preset of overlap.cli.simulate.MODELS
    source: str
    gpus: int
    tp: int
    pp: int
    virtual: int                     # stages per rank (interleaved schedule), 1 without
    context_parallel: int
    global_batch: int                # sequences
    throughput_tflops: Optional[float] = None


PUBLISHED: tuple[PublishedLayout, ...] = (
    # Megatron-Bridge's H100 bf16 pretraining preset for Llama 3 70B (64 GPUs, sequence 8192).
    PublishedLayout("llama3-70b", "Megatron-Bridge, Llama 3 70B pretraining on 64 H100 (bf16)", 64, tp=4, pp=4,
                    virtual=5, context_parallel=2, global_batch=256),
    # The Llama 3 paper (Table 4): 8,192 H100s, TP 8, CP 1, PP 16, DP 64, 16M tokens a step.
    PublishedLayout("llama3-405b", "Llama 3 paper, 405B pretraining on 8,192 H100", 8192, tp=8, pp=16, virtual=1,
                    context_parallel=1, global_batch=2048, throughput_tflops=430.0),
)
