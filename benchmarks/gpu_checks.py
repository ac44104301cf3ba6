"""The checks of benchmarks/gpu_check.sh that run Python, on one CUDA device, each printing
`PASS`, `FAIL` or `SKIP` with its name and figures, newest code first:

  offload       offload="cpu" against "none" on a small GPT, fp32 and bf16 gathers (equal
                losses, parameters and gradients pinned on the host); the offload copies'
                bandwidth (host->device as a gather's source, device->host as a reduced
                gradient going home) against a plain pinned copy of the same 256 MiB; and the
                share of each copy hidden when it runs beside matmuls on the compute stream;
                offload="disk" against "none" with bf16 gathers and overlap.optim.AdamW
                (losses and fp32 masters close, parameters and gradients pinned on the host,
                the gathered 16-bit shards on the GPU), and the bandwidth of the 16-bit
                shard's refresh, bucket by bucket, against one plain pinned copy
  compressed    ShardedModule with NCCL at world size 1 uncompressed, int8 and int8-int4:
                finite, losses close to uncompressed, bit-identical with delays injected on
                the side streams, every collective seen by the injection (the compressed
                gathers too), gathers compressed on the wire
  report_timing the step record's time of the collectives in flight (CUDA clock) against the
                side-stream kernels CUPTI saw (torch.profiler)
  sync_free     a few steady-state steps under `torch.cuda.set_sync_debug_mode("error")`,
                uncompressed and int8-int4, and the host waits that mode does not flag
  hybrid, hpz   hybrid sharding with a replicate group of one rank, and hpZ with a node group
                of one, collectives issued as with more ranks: the replicas' all-reduce on its
                own stream behind each reduce-scatter, and backward's re-gather from the node
                copy, under delays on every collective's stream and poisoned frees: identical
                to the plain run, equal to the unsharded model
  slow_link     a slow link emulated on one GPU: a sleep kernel sized to bytes / bandwidth
                on the stream of each collective, for ShardedModule and FSDP2; the share of
                the injected time that the step time exposes, against the overlap report
  device        `init_process_group()`, "cpu:gloo,cuda:nccl" and "nccl" each put the shards on
                the GPU, and a step runs there
  parity        seven configurations (among them odd parameter sizes and compile=True), each trained plainly and with delays injected on the side
                streams (`torch.cuda._sleep` before and after every collective) and every freed
                gathered buffer NaN-filled before its storage is released: bit-identical runs,
                finite, equal to the unsharded model, allocated memory flat from step 2 on
  sanitized     two steps of one parity configuration under TORCH_CUDA_SANITIZER=1
  large_index   every kernel backend on tensors past 2**31 elements against torch
  overhead      step time and peak memory of ShardedModule, FSDP2 and the plain model at world
                size 1 on a ~1B-parameter GPT in bf16

Without a GPU every check says SKIP and why. `--rehearse` runs the same code on the CPU with
gloo and small sizes (no delays, no timing verdicts): a test of this script, not of the GPU
paths. The checks live in gpu_parity_checks.py, gpu_offload_checks.py, gpu_sync_checks.py,
gpu_timing_checks.py and gpu_large_index.py, over gpu_harness.py, gpu_injection.py and
gpu_training.py.

    python benchmarks/gpu_checks.py [--only compressed,sync_free] [--rehearse]
"""
from __future__ import annotations

import argparse
import contextlib
import os
import sys
import time
from typing import Callable, Optional, Sequence

import torch

from gpu_harness import Checks
from gpu_large_index import check_large_index
from gpu_offload_checks import check_offload
from gpu_parity_checks import check_compressed, check_device, check_hpz, check_hybrid, check_parity, check_sanitized
from gpu_sync_checks import check_report_timing, check_sync_free
from gpu_timing_checks import check_overhead, check_slow_link

RUNNERS: dict[str, Callable[[Checks, bool], None]] = {
    "offload": check_offload, "compressed": check_compressed, "report_timing": check_report_timing,
    "sync_free": check_sync_free,
    "hybrid": check_hybrid, "hpz": check_hpz, "slow_link": check_slow_link, "device": check_device,
    "parity": check_parity, "sanitized": check_sanitized, "large_index": check_large_index, "overhead": check_overhead,
}
CHECKS = tuple(RUNNERS)


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--only", default=",".join(CHECKS), help="comma-separated checks to run")
    parser.add_argument("--rehearse", action="store_true", help="run on the CPU with gloo and small sizes")
    args = parser.parse_args(argv)
    names = [n.strip() for n in args.only.split(",") if n.strip()]
    unknown = [n for n in names if n not in RUNNERS]
    if unknown:
        parser.error(f"--only: unknown checks {unknown}; choose from {', '.join(CHECKS)}")
    checks = Checks()
    # See `deterministic`: before cuBLAS makes its handle.
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    if not args.rehearse and not torch.cuda.is_available():
        for name in names:
            checks.report("SKIP", name, "no CUDA device (torch.cuda.is_available() is False)")
        return 0
    from overlap.runtime.timing import records_one_step_late

    # A rehearsal takes its step records one step late, as the CUDA clock delivers them, so
    # that the checks read records the way they will on the GPU.
    with records_one_step_late() if args.rehearse else contextlib.nullcontext():
        for name in names:
            start = time.perf_counter()
            RUNNERS[name](checks, args.rehearse)
            print(f"      ({name}: {time.perf_counter() - start:.1f} s)", flush=True)
    return 1 if checks.failed else 0


if __name__ == "__main__":
    sys.exit(main())
