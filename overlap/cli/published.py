"""Published parallel layouts of large dense models, and published throughput of
mixture-of-experts models, to print beside `overlap simulate`'s picks.

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


@dataclass(frozen=True)
class PublishedThroughput:
    model: str                       # a preset of overlap.cli.simulate.MOE_MODELS
    source: str
    setup: str                       # hardware, precision and layout, as published
    tokens_per_s_per_gpu: float
    not_priced: str                  # what that run did that overlap.plan.expert_parallel does not model


# DeepSeek-V3's report gives GPU-hours per trillion tokens: 1e12 / (180e3 * 3600) tokens/s/GPU.
DEEPSEEK_V3_GPU_HOURS_PER_TRILLION = 180e3

PUBLISHED_MOE: tuple[PublishedThroughput, ...] = (
    PublishedThroughput("deepseek-v3", "DeepSeek-V3 Technical Report (arXiv 2412.19437)",
                        "2,048 H800, FP8 mixed precision, PP 16 (DualPipe) x EP 64 over 8 nodes x ZeRO-1 DP, "
                        "180K H800 GPU-hours per trillion tokens",
                        1e12 / (DEEPSEEK_V3_GPU_HOURS_PER_TRILLION * 3600),
                        "H800 for H100 (the same bf16 peak, NVLink at 400 GB/s against 900), FP8 GEMMs, DualPipe's "
                        "pipeline hiding the all-to-all behind both passes, multi-token prediction, node-limited "
                        "routing (a token reaches at most 4 nodes, each once), ZeRO-1 for ZeRO-3"),
    # The 25.09 release's DGX-H100 table has no precision column.
    PublishedThroughput("deepseek-v3", "Megatron-Bridge performance summary, NeMo 25.09 container",
                        "1,024 H100, TP 2 x PP 8 (VP 4) x EP 64, global batch 8192 x 4096 tokens, dropless with "
                        "forced-balanced routing",
                        1297.0, "tensor and pipeline parallelism, the precision (not stated)"),
    PublishedThroughput("qwen3-30b-a3b", "Megatron-Bridge performance summary, NeMo 26.02.01 container",
                        "16 H100, FP8, PP 2 (VP 12) x EP 8, global batch 1024 x 4096 tokens, dropless with "
                        "forced-balanced routing",
                        9058.0, "FP8 GEMMs, pipeline stages, 16 GPUs for 64"),
)
