"""Bandwidth of the flat-buffer kernels per backend, next to torch's own ops and a plain copy
(GB/s counts bytes read + written; docs/kernels.md describes the shapes).

    python benchmarks/kernel_bandwidth.py [--device cpu|cuda] [--threads N] [--out bench_out/kernels_cpu.json]

`--quant-only`: the quantised-communication kernels alone; `--quant-blocks 64,128,...`: their
error, bytes and time per block size. On CPU the two big shapes are scaled down.
"""
from __future__ import annotations

import itertools
import math
import statistics
import sys
import time
from typing import Callable, NamedTuple, Optional

import torch

from common import RunRecord, arg_parser, device_seconds, markdown_table, require_min, write_json
from overlap.kernels.backends import available_backends, get_backend
from overlap.kernels.quantized import DEFAULT_BLOCK

LLAMA_BLOCK = [(4096, 4096)] * 4 + [(11008, 4096), (11008, 4096), (4096, 11008), (4096,), (4096,)]


def shapes(device: torch.device) -> dict[str, list[tuple[int, ...]]]:
    small_gen = torch.Generator().manual_seed(0)
    small = [(int(2 ** torch.randint(6, 15, (), generator=small_gen)),) for _ in range(200)]
    if device.type == "cuda":
        return {"llama7b_block": LLAMA_BLOCK, "small_x200": small, "bucket_1b_x64": [(15_625_000,)] * 64}
    return {"llama7b_block(/4 per dim)": [tuple(d // 4 for d in s) for s in LLAMA_BLOCK], "small_x200": small,
            "bucket_1b_x64(/64)": [(244_140,)] * 64}


def _flatten_offsets(tensors: list[torch.Tensor]) -> tuple[list[int], int]:
    offsets = [0, *itertools.accumulate(t.numel() for t in tensors)]
    return offsets[:-1], offsets[-1]


def torch_ops_for_pack(srcs: list[torch.Tensor], flat: torch.Tensor) -> dict[str, Callable[[], None]]:
    """torch's own ways to fill `flat` with `srcs`, where this torch has them for these dtypes."""
    offsets, _ = _flatten_offsets(srcs)
    views = [flat.narrow(0, o, s.numel()) for o, s in zip(offsets, srcs)]
    flat_srcs = [s.view(-1) for s in srcs]
    # cat and _chunk_cat cast to `flat`'s dtype where this torch allows a different out dtype.
    ops: dict[str, Callable[[], None]] = {"torch._foreach_copy_": lambda: torch._foreach_copy_(views, flat_srcs),
                                          "torch.cat": lambda: torch.cat(flat_srcs, out=flat)}
    if hasattr(torch, "_chunk_cat"):
        ops["torch._chunk_cat"] = lambda: torch._chunk_cat(srcs, 0, 1, out=flat.view(1, -1))
    return _working(ops)


def _working(ops: dict[str, Callable[[], None]]) -> dict[str, Callable[[], None]]:
    """The ops that run here (each tried once; one this torch lacks is left out, saying why)."""
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
    same = torch.empty(total, dtype=dst_dtype, device=device)
    plain = torch.randn(total, device=device).to(src_dtype)
    copy = "copy (one flat tensor)" if src_dtype == dst_dtype else "copy+cast (one flat tensor)"
    candidates = {copy: lambda: same.copy_(plain), **torch_ops_for_pack(srcs, flat)}
    candidates = _with_backends(candidates, lambda b: b.pack(srcs, flat, offsets), device, backends)
    op = f"pack {str(src_dtype)[6:]}->{str(dst_dtype)[6:]}"
    return _rows(name, op, len(srcs), total, nbytes, timed(candidates, device, repeats))


def measure_runtime_calls(device: torch.device, backends: list[str], repeats: int) -> list[dict]:
    """The calls the runtime makes every step on one rank's shard (23.2M parameters / 2 ranks)."""
    numel = 23_200_000 // 2
    shard = torch.randn(numel, device=device)
    gathered = torch.empty(numel, dtype=torch.bfloat16, device=device)
    grad_start = torch.randn(numel, device=device)
    grad = grad_start.clone()
    chunks = torch.randn(2 * numel, device=device)
    shard_grad = torch.zeros(numel, device=device)
    first, second = chunks.narrow(0, 0, numel), chunks.narrow(0, numel, numel)
    resets = {"grad /= N in place": lambda: grad.copy_(grad_start), "accumulate 2 chunks": shard_grad.zero_}
    calls = {
        "cast fp32->bf16": (lambda b: b.pack([shard], gathered, [0]), numel * 6),
        "grad /= N in place": (lambda b: b.pack([grad], grad, [0], 0.5), numel * 8),
        "accumulate 2 chunks": (lambda b: b.accumulate(shard_grad, chunks, 1.0, 2), numel * 16),
    }
    # The best plain torch expressions of the same computations, in place where torch has it.
    plain = {
        "cast fp32->bf16": {"torch copy_": lambda: gathered.copy_(shard)},
        "grad /= N in place": {"torch mul_": lambda: grad.mul_(0.5), "torch div_": lambda: grad.div_(2.0)},
        "accumulate 2 chunks": {
            "torch add_ x2": lambda: shard_grad.add_(first).add_(second),
            "torch _foreach_add_": lambda: torch._foreach_add_([shard_grad], [first]) or
            torch._foreach_add_([shard_grad], [second]),
            "torch add_(sum(dim=0))": lambda: shard_grad.add_(chunks.view(2, numel).sum(0)),
        },
    }
    rows = []
    for op, (call, nbytes) in calls.items():
        candidates = _with_backends(_working(dict(plain[op])), call, device, backends)
        rows += _rows("runtime_shard", op, 1, numel, nbytes, timed(candidates, device, repeats, resets.get(op)))
    return rows


def print_table(rows: list[dict]) -> None:
    print(markdown_table(["case", "op", "impl", "tensors", "elements", "ms", "GB/s"],
                         [[r["case"], r["op"], r["impl"], r["tensors"], r["elements"], f"{r['ms']:.3f}",
                           f"{r['GB/s']:.2f}"] for r in rows]))


def summarise(rows: list[dict]) -> list[dict]:
    """Per case and op, each overlap backend against the plain copy and the best plain torch
    expression of the same computation (torch's ops and the reference backend)."""
    summary = []
    groups: dict[tuple[str, str], list[dict]] = {}
    for r in rows:
        groups.setdefault((r["case"], r["op"]), []).append(r)
    for (case, op), group in groups.items():
        copy = next((r["GB/s"] for r in group if r["impl"].startswith("copy")), None)
        torch_ops = [r["GB/s"] for r in group if r["impl"].startswith("torch") or r["impl"] == "overlap torch"]
        best_torch = max(torch_ops) if torch_ops else None
        for r in group:
            if r["impl"].startswith("overlap ") and r["impl"] != "overlap torch":
                summary.append({"case": case, "op": op, "backend": r["impl"].removeprefix("overlap "),
                                "GB/s": r["GB/s"], "of_copy": None if copy is None else r["GB/s"] / copy,
                                "vs_best_torch": None if best_torch is None else r["GB/s"] / best_torch})
    return summary


def print_summary(summary: list[dict]) -> None:
    print("\n" + markdown_table(["case", "op", "backend", "GB/s", "% of copy", "x best torch"], [
        [s["case"], s["op"], s["backend"], f"{s['GB/s']:.2f}", _or_dash(s["of_copy"], "{:.0%}"),
         _or_dash(s["vs_best_torch"], "{:.2f}")] for s in summary]))


def _or_dash(value: Optional[float], form: str, dash: str = "-") -> str:
    return dash if value is None else form.format(value)


# ---- Block-quantised communication kernels (kernels/quantized.py) ------------------------------

# The runtime_shard size rounded down to a multiple of 4096, so every block size tried divides it.
QUANT_NUMEL = 11_599_872


class Spread(NamedTuple):
    median_s: float
    iqr_s: float
    # The calling thread's median CPU time (CPU only): unlike wall time, it does not grow while
    # other jobs hold the core.
    cpu_median_s: Optional[float]


def timed(candidates: dict, device: torch.device, repeats: int, reset: Optional[Callable[[], None]] = None
          ) -> dict[str, Spread]:
    """A Spread per candidate, the candidates taking turns within every repeat. `reset`, untimed,
    runs before every call: halving a gradient over and over would reach slow subnormal floats."""
    reset = reset or (lambda: None)
    for fn in candidates.values():
        reset()
        fn()
    wall: dict = {label: [] for label in candidates}
    cpu: dict = {label: [] for label in candidates}
    for _ in range(repeats):
        for label, fn in candidates.items():
            reset()
            start = time.thread_time()
            wall[label].append(device_seconds(fn, device))
            cpu[label].append(time.thread_time() - start)
    return {label: Spread(statistics.median(t), _iqr(t), statistics.median(cpu[label]) if device.type == "cpu"
                          else None) for label, t in wall.items()}


def _iqr(values: list[float]) -> float:
    quartiles = statistics.quantiles(values, n=4)
    return quartiles[2] - quartiles[0]


def _ms(t: Spread) -> dict[str, Optional[float]]:
    return {"ms": t.median_s * 1e3, "iqr_ms": t.iqr_s * 1e3, "cpu_ms": None if t.cpu_median_s is None else t.cpu_median_s * 1e3}


def _rows(case: str, op: str, tensors: int, elements: int, nbytes: int, times: dict[str, Spread]) -> list[dict]:
    return [{"case": case, "op": op, "impl": label, "tensors": tensors, "elements": elements, **_ms(t),
             "GB/s": nbytes / t.median_s / 1e9} for label, t in times.items()]


def _with_backends(candidates: dict[str, Callable[[], None]], call: Callable, device: torch.device,
                   backends: list[str]) -> dict[str, Callable[[], None]]:
    """`candidates` and, for each of `backends`, `call(backend)` as "overlap <name>"."""
    return {**candidates, **{f"overlap {name}": (lambda b=get_backend(name, device): call(b)) for name in backends}}


class PlainTorchQuant:
    """The best plain torch expressions of the quantised kernels, on buffers allocated once (fresh
    temporaries cost torch on CPU 3-4x the time), without the kernels' zero-block and inf/NaN
    handling."""

    def __init__(self, numel: int, block: int, device: torch.device) -> None:
        self.block = block
        self.x_BK = torch.empty(numel // block, block, device=device)
        self.work_BK = torch.empty_like(self.x_BK)
        self.scale_B1 = torch.empty(numel // block, 1, device=device)
        self.q_BK = torch.empty(numel // block, block, dtype=torch.int8, device=device)
        self.nibble_BH = torch.empty(numel // block, block // 2, dtype=torch.int8, device=device)

    def quantize(self, x_BK: torch.Tensor, qmax: int) -> torch.Tensor:
        torch.amax(torch.abs(x_BK, out=self.work_BK), 1, keepdim=True, out=self.scale_B1).div_(qmax)
        return torch.div(x_BK, self.scale_B1, out=self.work_BK).round_().clamp_(-qmax, qmax)

    def quantize_int8(self, src: torch.Tensor, q: torch.Tensor, scales: torch.Tensor) -> None:
        x_BK = src.view(-1, self.block)
        if src.dtype != torch.float32:
            x_BK = self.x_BK.copy_(x_BK)
        q.view(-1, self.block).copy_(self.quantize(x_BK, 127))
        scales.copy_(self.scale_B1.view(-1))

    def quantize_int4_feedback(self, src: torch.Tensor, error: torch.Tensor, q: torch.Tensor,
                               scales: torch.Tensor) -> None:
        x_BK = torch.add(src.view(-1, self.block), error.view(-1, self.block), out=self.x_BK)
        self.q_BK.copy_(self.quantize(x_BK, 7))
        torch.sub(x_BK, self.work_BK.mul_(self.scale_B1), out=error.view(-1, self.block))
        low = torch.bitwise_and(self.q_BK[:, 0::2], 0xF, out=self.nibble_BH)
        torch.bitwise_or(low, self.q_BK[:, 1::2] << 4, out=q.view(torch.int8).view(-1, self.block // 2))
        scales.copy_(self.scale_B1.view(-1))

    def dequantize_accumulate(self, dst: torch.Tensor, q: torch.Tensor, scales: torch.Tensor, bits: int,
                              chunks: int) -> None:
        """dst += each chunk's q * scale: copy_, then addcmul_ (4x faster than mul, then add_)."""
        values_BK = self.work_BK.view(-1)[:dst.numel()].view(-1, self.block)
        for c in range(chunks):
            if bits == 8:
                values_BK.copy_(q.view(chunks, -1, self.block)[c])
            else:
                bytes_BH = q.view(torch.int8).view(chunks, -1, self.block // 2)[c]
                nibble_BH = self.nibble_BH[:len(bytes_BH)]
                pairs_BH2 = values_BK.view(-1, self.block // 2, 2)
                pairs_BH2[:, :, 0].copy_(torch.bitwise_left_shift(bytes_BH, 4, out=nibble_BH).bitwise_right_shift_(4))
                pairs_BH2[:, :, 1].copy_(torch.bitwise_right_shift(bytes_BH, 4, out=nibble_BH))
            dst.view(-1, self.block).addcmul_(values_BK, scales.view(chunks, -1, 1)[c])

    def dequantize_into(self, dst: torch.Tensor, q: torch.Tensor, scales: torch.Tensor) -> None:
        dst.view(-1, self.block).copy_(self.work_BK.copy_(q.view(-1, self.block)).mul_(scales[:, None]))


def quantized_cases(device: torch.device, block: int) -> dict[str, tuple[Callable, dict[str, Callable], int]]:
    """op -> (call(backend), plain torch candidates, bytes read + written), on QUANT_NUMEL elements."""
    n, nb = QUANT_NUMEL, QUANT_NUMEL // block
    plain = PlainTorchQuant(n, block, device)
    src = torch.randn(n, device=device)
    src_bf16 = src.to(torch.bfloat16)
    error = torch.randn(n, device=device) * 1e-3
    q8, q4 = torch.empty(n, dtype=torch.int8, device=device), torch.empty(n // 2, dtype=torch.uint8, device=device)
    scales = torch.empty(nb, device=device)
    dst = torch.zeros(n, device=device)
    gathered = torch.empty(n, dtype=torch.bfloat16, device=device)
    # What an all-to-all delivers: 2 chunks of n (2 ranks), or 8 chunks of n / 4 (8 ranks).
    q8_x2, scales_x2 = torch.randint(-127, 128, (2 * n,), dtype=torch.int8, device=device), \
        torch.rand(2 * nb, device=device)
    n8 = n // 4
    q4_x8, scales_x8 = torch.randint(0, 256, (8 * n8 // 2,), dtype=torch.uint8, device=device), \
        torch.rand(8 * n8 // block, device=device)
    dst8 = torch.zeros(n8, device=device)
    torch_ops = "torch (preallocated)"
    return {
        "quantize_int8 fp32": (lambda b: b.quantize_int8(src, q8, scales, block),
                               {torch_ops: lambda: plain.quantize_int8(src, q8, scales)}, n * 5 + nb * 4),
        "quantize_int8 bf16": (lambda b: b.quantize_int8(src_bf16, q8, scales, block),
                               {torch_ops: lambda: plain.quantize_int8(src_bf16, q8, scales)}, n * 3 + nb * 4),
        "quantize_int4 +feedback": (lambda b: b.quantize_int4(src, q4, scales, block, error),
                                    {torch_ops: lambda: plain.quantize_int4_feedback(src, error, q4, scales)},
                                    n * 12 + n // 2 + nb * 4),
        "dequant_acc int8 x2": (lambda b: b.dequantize_accumulate(dst, q8_x2, scales_x2, block, 8, 2),
                                {torch_ops: lambda: plain.dequantize_accumulate(dst, q8_x2, scales_x2, 8, 2)},
                                2 * n + 2 * nb * 4 + 8 * n),
        "dequant_acc int4 x8": (lambda b: b.dequantize_accumulate(dst8, q4_x8, scales_x8, block, 4, 8),
                                {torch_ops: lambda: plain.dequantize_accumulate(dst8, q4_x8, scales_x8, 4, 8)},
                                8 * n8 // 2 + 8 * (n8 // block) * 4 + 8 * n8),
        "dequant_into int8->bf16": (lambda b: b.dequantize_into(gathered, q8, scales, block, 8),
                                    {torch_ops: lambda: plain.dequantize_into(gathered, q8, scales)},
                                    n + nb * 4 + 2 * n),
    }


def measure_quantized(device: torch.device, backends: list[str], repeats: int, block: int) -> list[dict]:
    rows = []
    for op, (call, plain, nbytes) in quantized_cases(device, block).items():
        candidates = _with_backends(plain, call, device, backends)
        rows += _rows(f"quant_shard(block {block})", op, 1, QUANT_NUMEL, nbytes, timed(candidates, device, repeats))
    return rows


def print_quant_table(rows: list[dict]) -> None:
    """Each backend against the best plain torch candidate (the reference backend included), by
    wall and by CPU time."""
    table = []
    for r in rows:
        group = [g for g in rows if g["op"] == r["op"] and g["case"] == r["case"]
                 and (not g["impl"].startswith("overlap ") or g["impl"] == "overlap torch")]
        ours = r["impl"].startswith("overlap ") and r["impl"] != "overlap torch"
        speedup = f"{min(g['ms'] for g in group) / r['ms']:.2f}" if ours else ""
        cpu_speedup = f"{min(g['cpu_ms'] for g in group) / r['cpu_ms']:.2f}" if ours and r["cpu_ms"] else ""
        table.append([r["op"], r["impl"], f"{r['ms']:.3f}", f"{r['iqr_ms']:.3f}", _or_dash(r["cpu_ms"], "{:.3f}"),
                      f"{r['GB/s']:.2f}", speedup, cpu_speedup])
    print(markdown_table(["op", "impl", "ms", "IQR ms", "CPU ms", "GB/s", "x best torch", "x (CPU)"], table))


def sweep_quant_blocks(device: torch.device, blocks: list[int], repeats: int) -> list[dict]:
    """Per block size: the relative RMS error of int8 and int4 round trips on normal and Student-t
    (3 degrees of freedom) values, bytes per element, and the time of the fastest backend's
    quantize_int8 and 2-chunk dequantize_accumulate."""
    from overlap.kernels.quantized import empty_quantized

    gen = torch.Generator().manual_seed(0)
    chi2_3 = torch.randn(3, QUANT_NUMEL, generator=gen).square_().sum(0)
    data = {"normal": torch.randn(QUANT_NUMEL, generator=gen).to(device),
            "student_t3": (torch.randn(QUANT_NUMEL, generator=gen) / (chi2_3 / 3).sqrt_()).to(device)}
    backend = get_backend("auto", device)
    rows, candidates = [], {}
    x, dst = data["normal"], torch.zeros(QUANT_NUMEL // 2, device=device)
    for block in blocks:
        row = {"block": block, "bytes_int8": 1 + 4 / block, "bytes_int4": 0.5 + 4 / block}
        for bits in (8, 4):
            q, scales = empty_quantized(QUANT_NUMEL, block, bits, device)
            quantize = backend.quantize_int8 if bits == 8 else backend.quantize_int4
            for name, values in data.items():
                out = torch.empty_like(values)
                quantize(values, q, scales, block)
                backend.dequantize_into(out, q, scales, block, bits)
                row[f"rel_rms_int{bits}_{name}"] = ((out - values).norm() / values.norm()).item()
        rows.append(row)
        # Timed on the same number of elements: quantize n, and accumulate 2 chunks of n / 2.
        q, scales = empty_quantized(QUANT_NUMEL, block, 8, device)
        candidates[(block, "quantize")] = lambda q=q, s=scales, b=block: backend.quantize_int8(x, q, s, b)
        candidates[(block, "accumulate")] = lambda q=q, s=scales, b=block: backend.dequantize_accumulate(
            dst, q, s, b, 8, 2)
    times = timed(candidates, device, repeats)
    for row in rows:
        for op in ("quantize", "accumulate"):
            t = times[(row["block"], op)]
            row.update({f"{op}_{key}": value for key, value in _ms(t).items()})
    # One more bit per element halves the error: a block's cost in bits per element is its
    # scales' 32 / block plus log2(error). `excess_bits`: the most, over int8/int4 and both
    # distributions, by which a block's cost exceeds the best block's.
    errors = [key for key in rows[0] if key.startswith("rel_rms_")]
    best = {key: min(32 / r["block"] + math.log2(r[key]) for r in rows) for key in errors}
    for row in rows:
        row["excess_bits"] = max(32 / row["block"] + math.log2(row[key]) - best[key] for key in errors)
    print(f"{backend.name} backend, {QUANT_NUMEL} elements; errors: relative RMS of a round trip; "
          "times in ms: wall median (IQR) and CPU-time median")
    def times(r: dict, op: str) -> str:
        return f"{r[f'{op}_ms']:.2f} ({r[f'{op}_iqr_ms']:.2f})" + _or_dash(r[f"{op}_cpu_ms"], " {:.2f}", "")

    print(markdown_table(["block", "B/elem int8", "B/elem int4", "int8 err N", "int8 err t3", "int4 err N",
                          "int4 err t3", "excess bits", "quantize8 ms", "accumulate8x2 ms"], [
        [r["block"], f"{r['bytes_int8']:.4f}", f"{r['bytes_int4']:.4f}", f"{r['rel_rms_int8_normal']:.5f}",
         f"{r['rel_rms_int8_student_t3']:.5f}", f"{r['rel_rms_int4_normal']:.4f}", f"{r['rel_rms_int4_student_t3']:.4f}",
         f"{r['excess_bits']:.3f}", times(r, "quantize"), times(r, "accumulate")] for r in rows]))
    return rows


def main(argv: Optional[list[str]] = None) -> None:
    parser = arg_parser(__doc__)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--threads", type=int, default=None, help="CPU threads (default: torch's)")
    parser.add_argument("--repeats", type=int, default=None,
                        help="timed calls per candidate, at least 2 (a spread needs two); default 20 on CUDA, 11 on CPU")
    parser.add_argument("--out", default=None, help="JSON file (default bench_out/kernels_<device>.json)")
    parser.add_argument("--quant-only", action="store_true",
                        help="only the quantised kernels, with IQR (default out bench_out/quant_kernels_<device>.json)")
    parser.add_argument("--quant-blocks", default=None,
                        help="comma-separated block sizes: error and speed of each, instead of the tables "
                             "(default out bench_out/quant_blocks_<device>.json)")
    args = parser.parse_args(argv)
    if args.repeats is not None:
        require_min(parser, args, 2, "repeats")
    record = RunRecord("kernel_bandwidth.py", sys.argv[1:] if argv is None else argv)
    device = torch.device(args.device)
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    repeats = args.repeats or (20 if device.type == "cuda" else 11)
    backends = [b for b in available_backends(device) if not (device.type == "cpu" and b == "triton")]
    print(f"device {device}, threads {torch.get_num_threads()}, backends {backends}, median of {repeats}")
    if args.quant_blocks:
        name = "quant_blocks"
        result = {"block_sweep": sweep_quant_blocks(device, [int(b) for b in args.quant_blocks.split(",")], repeats)}
    elif args.quant_only:
        name, result = "quant_kernels", {"rows": measure_quantized(device, backends, repeats, DEFAULT_BLOCK)}
        print_quant_table(result["rows"])
    else:
        name, rows = "kernels", []
        for case, sizes in shapes(device).items():
            for src_dtype, dst_dtype in ((torch.float32, torch.float32), (torch.float32, torch.bfloat16)):
                rows += measure_case(case, sizes, src_dtype, dst_dtype, device, backends, repeats)
        rows += measure_runtime_calls(device, backends, repeats)
        rows += measure_quantized(device, backends, repeats, DEFAULT_BLOCK)
        print_table(rows)
        result = {"rows": rows, "summary": summarise(rows)}
        print_summary(result["summary"])
    meta = {"device": str(device), "threads": torch.get_num_threads(),
            "gpu": torch.cuda.get_device_name(device) if device.type == "cuda" else None,
            **({} if name == "kernels" else {"repeats": repeats}), **record.fields()}
    out = args.out or f"bench_out/{name}_{device.type}.json"
    write_json(out, {"meta": meta, **result})
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
