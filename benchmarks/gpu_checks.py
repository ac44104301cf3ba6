"""The Python checks of benchmarks/gpu_check.sh on one CUDA device, each printing `PASS`,
`FAIL` or `SKIP` with its name and figures:

  offload       offload="cpu" and "disk" against "none" under injected races; the host<->device
                copies' bandwidth and overlap with compute; the disk tier's 16-bit refresh
  compressed    uncompressed, int8 and int8-int4 under injected races: bit-identical, close to
                uncompressed, every collective seen, gathers compressed on the wire
  report_timing the step record's collective time against what CUPTI saw on the side streams
  sync_free     steady-state steps under `torch.cuda.set_sync_debug_mode("error")`
  hybrid, hpz   a second sharding level of one rank under injected races, against the plain run
  slow_link     a slow link emulated by sleeps on the collectives' streams; the exposed share
  device        where each form of `init_process_group` puts the shards
  parity        seven configurations plain, with injected races and poisoned frees, and unsharded
  sanitized     two parity steps under TORCH_CUDA_SANITIZER=1
  large_index   every kernel backend past 2**31 elements against torch
  overhead      step time and peak memory against FSDP2 and the plain model, ~1B-parameter GPT

Without a GPU every check says SKIP and why; `--rehearse` runs the same code on CPU with gloo
and small sizes (a test of this script, not of the GPU paths).

    python benchmarks/gpu_checks.py [--only compressed,sync_free] [--rehearse]
"""
from __future__ import annotations

import contextlib
import os
import sys
import time
from functools import partial
from typing import Callable, Optional, Sequence

import torch

from common import arg_parser
from gpu_harness import Checks
from gpu_large_index import check_large_index
from gpu_offload_checks import check_offload
from gpu_parity_checks import check_compressed, check_device, check_parity, check_sanitized, check_second_level
from gpu_sync_checks import check_report_timing, check_sync_free
from gpu_timing_checks import check_overhead, check_slow_link

RUNNERS: dict[str, Callable[[Checks, bool], None]] = {
    "offload": check_offload, "compressed": check_compressed, "report_timing": check_report_timing,
    "sync_free": check_sync_free, "hybrid": partial(check_second_level, kind="hybrid"),
    "hpz": partial(check_second_level, kind="hpz"), "slow_link": check_slow_link, "device": check_device,
    "parity": check_parity, "sanitized": check_sanitized, "large_index": check_large_index, "overhead": check_overhead,
}
CHECKS = tuple(RUNNERS)


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = arg_parser(__doc__)
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

    # A rehearsal reads step records one step late, as the CUDA clock delivers them.
    with records_one_step_late() if args.rehearse else contextlib.nullcontext():
        for name in names:
            start = time.perf_counter()
            RUNNERS[name](checks, args.rehearse)
            print(f"      ({name}: {time.perf_counter() - start:.1f} s)", flush=True)
    return 1 if checks.failed else 0


if __name__ == "__main__":
    sys.exit(main())
