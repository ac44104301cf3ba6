"""The disk tier's optimizer step alone (overlap/optim/paged.py) at a few model sizes: IO alone,
update alone and the pipelined step, rotating per round, with per-round ratios
pipelined / (io + update) and pipelined / max(io, update), the disk bandwidth against `dd`'s
direct IO, the engine's own memory, and whether its kernel runs without the GIL
(docs/offload_disk.md).

    python benchmarks/offload_disk.py [--sizes 50M,200M,400M] [--rounds 3] [--dir DIR]
                                      [--out docs/results/offload_disk.json]
"""
from __future__ import annotations

import os
import re
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from typing import Optional

import torch

from common import (RunRecord, add_options, arg_parser, peak_rss, proc_status_kib, rotated, seconds_of, spread,
                    write_json)

from overlap.cli.estimate import parameter_count
from overlap.optim import adamw_step, extension_available
from overlap.optim.paged import Hyper, PagedAdamW, Segment
from overlap.optim.state_file import bucket_views

SHARD_PARAMS = 24 * 2**20     # one flat shard per this many parameters (a block of a large GPT)
MODES = ("io", "update", "pipelined")


def dd_direct(directory: str, mib: int = 1024) -> dict:
    """Write then read a file of `mib` MiB with dd's direct IO; GB/s each way (1e9 bytes)."""
    path = os.path.join(directory, "dd.bin")
    speeds = {}
    try:
        for way, args in (("write", [f"of={path}", "if=/dev/zero", "oflag=direct"]),
                          ("read", [f"if={path}", "of=/dev/null", "iflag=direct"])):
            out = subprocess.run(["dd", "bs=1M", f"count={mib}", *args], capture_output=True, text=True, check=True)
            seconds = float(re.search(r"copied, ([0-9.e-]+) s", out.stderr).group(1))
            speeds[f"{way}_gbps"] = mib * 2**20 / seconds / 1e9
    finally:
        if os.path.exists(path):
            os.remove(path)
    return speeds


def gil_check() -> dict:
    """Counts of a Python thread per second while idle-waiting and while the kernel runs."""
    n = 16 * 2**20
    p, g, m, v = torch.randn(n), torch.randn(n), torch.zeros(n), torch.zeros(n)
    counter, stop = [0], threading.Event()

    def count() -> None:
        while not stop.is_set():
            counter[0] += 1
    thread = threading.Thread(target=count)
    thread.start()
    try:
        time.sleep(0.05)
        start, before = time.perf_counter(), counter[0]
        time.sleep(0.3)
        idle_rate = (counter[0] - before) / (time.perf_counter() - start)
        start, before, calls = time.perf_counter(), counter[0], 0
        while time.perf_counter() - start < 0.3:
            adamw_step(p, g, m, v, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0, step=1.0)
            calls += 1
        kernel_rate = (counter[0] - before) / (time.perf_counter() - start)
    finally:
        stop.set()
        thread.join()
    return {"counts_per_s_idle_main": idle_rate, "counts_per_s_kernel_running": kernel_rate,
            "kernel_calls": calls, "bucket_params": n}


def _reset_peak_rss() -> bool:
    """Reset VmHWM to the current RSS (Linux 4.0+); False where that is not possible."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def measure(count: int, rounds: int, directory: str) -> dict:
    shard_sizes = [min(SHARD_PARAMS, count - s) for s in range(0, count, SHARD_PARAMS)]
    masters = [torch.randn(n) * 0.02 for n in shard_sizes]
    grads = [torch.randn(n) * 1e-3 for n in shard_sizes]
    resident = [torch.zeros(n, dtype=torch.bfloat16) for n in shard_sizes]
    # The engine's own memory: its peak RSS to the end of its first step over the RSS before it.
    reset = _reset_peak_rss()
    rss_before = 1024 * proc_status_kib("VmRSS")
    engine = PagedAdamW(shard_sizes, directory=directory)
    try:
        engine.load_masters(masters)
        step = [0]

        def segments() -> list[Segment]:
            # two parameter groups in every shard: weight decay on the first half only
            hypers = [Hyper(1e-4, (0.9, 0.95), 1e-8, wd, float(step[0])) for wd in (0.1, 0.0)]
            return [Segment(i, lo, hi, h) for i, n in enumerate(shard_sizes)
                    for (lo, hi), h in zip(((0, n // 2), (n // 2, n)), hypers)]

        def io() -> None:
            engine._run(range(len(engine.buckets)), lambda k, b, buf: None)

        def update() -> None:
            step[0] += 1
            hyper = segments()[0].hyper

            def kernel(k, bucket, buffer):
                master, m, v = bucket_views(buffer, bucket.numel)
                adamw_step(master, grads[bucket.shard][bucket.start:bucket.stop], m, v, lr=hyper.lr,
                           betas=hyper.betas, eps=hyper.eps, weight_decay=hyper.weight_decay, step=hyper.step)
                resident[bucket.shard][bucket.start:bucket.stop].copy_(master)
            engine._run(range(len(engine.buckets)), kernel, read=False, write=False)

        def pipelined() -> None:
            step[0] += 1
            engine.step(grads, segments(), resident)

        fns = {"io": io, "update": update, "pipelined": pipelined}
        pipelined()                          # untimed
        engine_rss_growth = 1024 * proc_status_kib("VmHWM") - rss_before if reset else None
        del masters
        raw = []
        for r in range(rounds):
            order = rotated(MODES, r)
            raw.append({mode: seconds_of(fns[mode]) for mode in order} | {"order": order})
            assert torch.isfinite(resident[0][:1000].float()).all(), "the step produced non-finite values"
        io_bytes = 2 * sum(b.nbytes for b in engine.buckets)
        peak = engine.peak_buffers
        buffer_bytes = engine.buffer_bytes
    finally:
        engine.close()
    vs_sum = [x["pipelined"] / (x["io"] + x["update"]) for x in raw]
    vs_max = [x["pipelined"] / max(x["io"], x["update"]) for x in raw]
    hidden = [(x["io"] + x["update"] - x["pipelined"]) / min(x["io"], x["update"]) for x in raw]
    return {"params": count, "shards": len(shard_sizes), "buckets": len(engine.buckets),
            "file_bytes": io_bytes // 2, "io_bytes_per_step": io_bytes, "buffer_bytes": buffer_bytes,
            "peak_buffers": peak, "engine_peak_rss_growth_bytes": engine_rss_growth, "rounds": raw,
            "pipelined_over_sum": spread(vs_sum), "pipelined_over_max": spread(vs_max),
            "share_of_shorter_hidden": spread(hidden),
            "disk_gbps_io_alone": spread([io_bytes / x["io"] / 1e9 for x in raw]),
            "disk_gbps_pipelined": spread([io_bytes / x["pipelined"] / 1e9 for x in raw]),
            "update_params_per_s": spread([count / x["update"] for x in raw])}


def main(argv: Optional[list[str]] = None) -> None:
    parser = arg_parser(__doc__)
    add_options(parser, sizes="50M,200M,400M", rounds=3, out="docs/results/offload_disk.json")
    parser.add_argument("--dir", default=None, help="where the state files go (default: a temporary directory "
                                                    "under the current one, on its disk)")
    parser.add_argument("--dd-mib", type=int, default=1024, help="size of the dd reference file")
    args = parser.parse_args(argv)
    if not extension_available():
        parser.error("overlap._C was not built: the paged step has no kernel to measure")
    sizes = [int(parameter_count(s)) for s in args.sizes.split(",")]
    record = RunRecord("offload_disk.py", sys.argv[1:] if argv is None else argv)
    with tempfile.TemporaryDirectory(prefix="offload-disk-bench-", dir=args.dir or ".") as directory:
        dd = dd_direct(directory, args.dd_mib) | {"mib": args.dd_mib}
        print(f"dd direct IO: write {dd['write_gbps']:.2f} GB/s, read {dd['read_gbps']:.2f} GB/s", flush=True)
        gil = gil_check()
        print(f"GIL: a Python thread counts {gil['counts_per_s_kernel_running']:.0f}/s while the kernel runs "
              f"({gil['counts_per_s_idle_main']:.0f}/s with the main thread asleep)", flush=True)
        entries = []
        for count in sizes:
            print(f"{count / 1e6:.0f}M parameters ({12 * count / 1e9:.1f} GB of state)...", flush=True)
            entry = measure(count, args.rounds, directory)
            entries.append(entry)
            med = {m: statistics.median(x[m] for x in entry["rounds"]) for m in MODES}
            print(f"  io {med['io']:.2f} s  update {med['update']:.2f} s  pipelined {med['pipelined']:.2f} s  "
                  f"pipelined/(io+update) {entry['pipelined_over_sum']['median']:.2f} "
                  f"[{entry['pipelined_over_sum']['min']:.2f}-{entry['pipelined_over_sum']['max']:.2f}]  "
                  f"pipelined/max {entry['pipelined_over_max']['median']:.2f}  "
                  f"disk {entry['disk_gbps_io_alone']['median']:.2f} GB/s  engine RSS growth "
                  f"{(entry['engine_peak_rss_growth_bytes'] or 0) / 2**20:.0f} MiB "
                  f"(buffers {entry['buffer_bytes'] / 2**20:.0f} MiB)", flush=True)
    write_json(args.out, {"commit": record.commit, "command": record.command,
                          "host": record.host(threads=torch.get_num_threads()), "dd_direct": dd, "gil": gil,
                          "peak_rss_gib": peak_rss() / 2**30,
                          "results": entries})
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
