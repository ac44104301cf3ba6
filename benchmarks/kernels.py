"""Bandwidth of the flat-buffer kernels per backend, next to torch's own ops and a plain copy.

    python benchmarks/kernels.py [--device cpu|cuda] [--threads N] [--out bench_out/kernels_cpu.json]

Shapes (GB/s counts bytes read + bytes written):
  llama7b_block   the 9 parameters of one Llama-7B decoder block (up to 4096 x 11008)
  small_x200      a block of 200 small parameters (64 to 16384 elements)
  bucket_1b_x64   a 1B-parameter bucket split into 64 tensors
  runtime_shard   the per-step calls on one rank's shard of the 23.2M-parameter benchmark
                  GPT over 2 ranks: cast to bf16, in-place pre-division, 2-chunk accumulate
On CPU the two big shapes are scaled down (each Llama dimension / 4, the bucket / 64) so a
run fits in memory and minutes; the table says which shapes were used.
"""
from __future__ import annotations

import argparse
import json
import pathlib
import statistics
import time
from typing import Callable, Optional

import torch

from overlap.kernels import available_backends, get_backend

LLAMA_BLOCK = [(4096, 4096)] * 4 + [(11008, 4096), (11008, 4096), (4096, 11008), (4096,), (4096,)]


def shapes(device: torch.device) -> dict[str, list[tuple[int, ...]]]:
    small_gen = torch.Generator().manual_seed(0)
    small = [(int(2 ** torch.randint(6, 15, (), generator=small_gen)),) for _ in range(200)]
    if device.type == "cuda":
        return {"llama7b_block": LLAMA_BLOCK, "small_x200": small, "bucket_1b_x64": [(15_625_000,)] * 64}
    return {"llama7b_block(/4 per dim)": [tuple(d // 4 for d in s) for s in LLAMA_BLOCK], "small_x200": small,
            "bucket_1b_x64(/64)": [(244_140,)] * 64}


def _once(fn: Callable[[], None], device: torch.device) -> float:
    if device.type == "cuda":
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        return start.elapsed_time(end) / 1e3
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def timed(candidates: dict[str, Callable[[], None]], device: torch.device, repeats: int) -> dict[str, float]:
    """Median seconds of each candidate. Candidates take turns within every repeat, so a
    change in machine load (this host is shared) moves all of them alike."""
    for fn in candidates.values():
        fn()
    times: dict[str, list[float]] = {label: [] for label in candidates}
    for _ in range(repeats):
        for label, fn in candidates.items():
            times[label].append(_once(fn, device))
    return {label: statistics.median(t) for label, t in times.items()}


def _flatten_offsets(tensors: list[torch.Tensor]) -> tuple[list[int], int]:
    offsets, end = [], 0
    for t in tensors:
        offsets.append(end)
        end += t.numel()
    return offsets, end


def torch_ops_for_pack(srcs: list[torch.Tensor], flat: torch.Tensor) -> dict[str, Callable[[], None]]:
    """torch's own ways to fill `flat` with `srcs`, where this torch has them for these dtypes."""
    offsets, _ = _flatten_offsets(srcs)
    views = [flat.narrow(0, o, s.numel()) for o, s in zip(offsets, srcs)]
    flat_srcs = [s.view(-1) for s in srcs]
    ops: dict[str, Callable[[], None]] = {"torch._foreach_copy_": lambda: torch._foreach_copy_(views, flat_srcs)}
    if all(s.dtype == flat.dtype for s in srcs):
        ops["torch.cat"] = lambda: torch.cat(flat_srcs, out=flat)
        if hasattr(torch, "_chunk_cat"):
            ops["torch._chunk_cat"] = lambda: torch._chunk_cat(srcs, 0, 1, out=flat.view(1, -1))
    working = {}
    for label, op in ops.items():
        try:
            op()
        except (RuntimeError, TypeError) as exc:  # not implemented for this device or these dtypes
            print(f"skipping {label}: {exc}")
        else:
            working[label] = op
    return working


def measure_case(name: str, sizes: list[tuple[int, ...]], src_dtype: torch.dtype, dst_dtype: torch.dtype,
                 device: torch.device, backends: list[str], repeats: int) -> list[dict]:
    srcs = [torch.randn(s, device=device).to(src_dtype) for s in sizes]
    offsets, total = _flatten_offsets(srcs)
    flat = torch.empty(total, dtype=dst_dtype, device=device)
    nbytes = total * (srcs[0].element_size() + flat.element_size())
    candidates: dict[str, Callable[[], None]] = {}
    same = torch.empty(total, dtype=dst_dtype, device=device)
    plain = torch.randn(total, device=device).to(src_dtype)
    candidates["copy (one flat tensor)" if src_dtype == dst_dtype else "copy+cast (one flat tensor)"] = \
        lambda: same.copy_(plain)
    candidates.update(torch_ops_for_pack(srcs, flat))
    for backend_name in backends:
        backend = get_backend(backend_name, device)
        candidates[f"overlap {backend_name}"] = lambda b=backend: b.pack(srcs, flat, offsets)
    op = f"pack {str(src_dtype)[6:]}->{str(dst_dtype)[6:]}"
    return [{"case": name, "op": op, "impl": label, "tensors": len(srcs), "elements": total, "ms": seconds * 1e3,
             "GB/s": nbytes / seconds / 1e9} for label, seconds in timed(candidates, device, repeats).items()]


def measure_runtime_calls(device: torch.device, backends: list[str], repeats: int) -> list[dict]:
    """The calls the runtime makes every step on one rank's shard (23.2M parameters / 2 ranks)."""
    numel = 23_200_000 // 2
    shard = torch.randn(numel, device=device)
    gathered = torch.empty(numel, dtype=torch.bfloat16, device=device)
    grad = torch.randn(numel, device=device)
    chunks = torch.randn(2 * numel, device=device)
    shard_grad = torch.zeros(numel, device=device)
    calls = {
        "cast fp32->bf16": (lambda b: b.pack([shard], gathered, [0]), numel * 6),
        "grad /= N in place": (lambda b: b.pack([grad], grad, [0], 0.5), numel * 8),
        "accumulate 2 chunks": (lambda b: b.accumulate(shard_grad, chunks, 1.0, 2), numel * 16),
    }
    rows = []
    for op, (call, nbytes) in calls.items():
        candidates = {f"overlap {name}": (lambda b=get_backend(name, device): call(b)) for name in backends}
        rows += [{"case": "runtime_shard", "op": op, "impl": label, "tensors": 1, "elements": numel,
                  "ms": seconds * 1e3, "GB/s": nbytes / seconds / 1e9}
                 for label, seconds in timed(candidates, device, repeats).items()]
    return rows


def print_table(rows: list[dict]) -> None:
    header = f"{'case':<26} {'op':<22} {'impl':<28} {'tensors':>7} {'elements':>11} {'ms':>9} {'GB/s':>8}"
    print(header)
    print("-" * len(header))
    for r in rows:
        print(f"{r['case']:<26} {r['op']:<22} {r['impl']:<28} {r['tensors']:>7} {r['elements']:>11} "
              f"{r['ms']:>9.3f} {r['GB/s']:>8.2f}")


def summarise(rows: list[dict]) -> list[dict]:
    """Per case and op, each overlap backend against the plain copy and against torch's best op."""
    summary = []
    groups: dict[tuple[str, str], list[dict]] = {}
    for r in rows:
        groups.setdefault((r["case"], r["op"]), []).append(r)
    for (case, op), group in groups.items():
        copy = next((r["GB/s"] for r in group if r["impl"].startswith("copy")), None)
        torch_ops = [r["GB/s"] for r in group if r["impl"].startswith("torch.") or r["impl"] == "overlap torch"]
        best_torch = max(torch_ops) if torch_ops else None
        for r in group:
            if r["impl"].startswith("overlap ") and r["impl"] != "overlap torch":
                summary.append({"case": case, "op": op, "backend": r["impl"].removeprefix("overlap "),
                                "GB/s": r["GB/s"], "of_copy": None if copy is None else r["GB/s"] / copy,
                                "vs_best_torch": None if best_torch is None else r["GB/s"] / best_torch})
    return summary


def print_summary(summary: list[dict]) -> None:
    print(f"\n{'case':<26} {'op':<22} {'backend':<8} {'GB/s':>8} {'% of copy':>10} {'x best torch':>13}")
    for s in summary:
        of_copy = "-" if s["of_copy"] is None else f"{100 * s['of_copy']:.0f}%"
        vs_torch = "-" if s["vs_best_torch"] is None else f"{s['vs_best_torch']:.2f}"
        print(f"{s['case']:<26} {s['op']:<22} {s['backend']:<8} {s['GB/s']:>8.2f} {of_copy:>10} {vs_torch:>13}")


def main(argv: Optional[list[str]] = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--threads", type=int, default=None, help="CPU threads (default: torch's)")
    parser.add_argument("--repeats", type=int, default=None)
    parser.add_argument("--out", default=None, help="JSON file (default bench_out/kernels_<device>.json)")
    args = parser.parse_args(argv)
    device = torch.device(args.device)
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    repeats = args.repeats or (20 if device.type == "cuda" else 11)
    backends = [b for b in available_backends(device) if not (device.type == "cpu" and b == "triton")]
    print(f"device {device}, threads {torch.get_num_threads()}, backends {backends}, median of {repeats}")
    rows = []
    for name, sizes in shapes(device).items():
        for src_dtype, dst_dtype in ((torch.float32, torch.float32), (torch.float32, torch.bfloat16)):
            rows += measure_case(name, sizes, src_dtype, dst_dtype, device, backends, repeats)
    rows += measure_runtime_calls(device, backends, repeats)
    print_table(rows)
    summary = summarise(rows)
    print_summary(summary)
    out = pathlib.Path(args.out or f"bench_out/kernels_{device.type}.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    meta = {"device": str(device), "threads": torch.get_num_threads(), "torch": torch.__version__,
            "gpu": torch.cuda.get_device_name(device) if device.type == "cuda" else None}
    out.write_text(json.dumps({"meta": meta, "rows": rows, "summary": summary}, indent=1))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
