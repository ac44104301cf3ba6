"""Block-quantised communication kernels: every available backend against the torch reference,
and the reference's own promises (error bounds, error feedback, the inf/NaN rule).

Inputs are fresh random values each run (the seed is in every failure message); outputs
start poisoned (NaN scales and errors, q bytes no quantisation produces) so a skipped element
shows. Triton runs on CPU tensors through its interpreter, as in test_kernels.py; on a CUDA
machine every backend runs on CUDA tensors. The CUDA source is compiled by
test_cuda_sources.py; here its PTX is checked for the entry points the launchers name.
"""
from __future__ import annotations

import pathlib
import random
import shutil
import subprocess

import pytest
import torch

try:
    import triton
except ImportError:
    triton = None

if triton is not None and not torch.cuda.is_available():
    triton.knobs.runtime.interpret = True

from test_kernels import _assert_same  # noqa: E402
from triton_aot import compile_for_cuda  # noqa: E402

from overlap.kernels.backends import available_backends, get_backend  # noqa: E402
from overlap.kernels.quantized import DEFAULT_BLOCK, MAX_BLOCK, Q_DTYPES, num_blocks, quantized_bytes  # noqa: E402
from overlap.kernels.reference import TorchKernels  # noqa: E402

# Triton's interpreter warns where numpy divides by a zero or NaN scale, as the kernels do
# before they select q = 0 for such blocks.
pytestmark = [pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning"),
              pytest.mark.filterwarnings("ignore:divide by zero encountered:RuntimeWarning"),
              pytest.mark.filterwarnings("ignore:overflow encountered:RuntimeWarning")]

ROOT = pathlib.Path(__file__).resolve().parent.parent
REFERENCE = TorchKernels()
SRC_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
# n = 1, odd, below / at / above a block, several blocks with a short last one.
SIZES = (1, 2, 3, 7, 64, 255, 256, 257, 1000, 4097)
# The smallest block, a block that is no power of two, the default, the largest.
BLOCKS = (2, 6, 64, DEFAULT_BLOCK, MAX_BLOCK)
# Bytes quantisation never writes: -128 (int8) and two -8 nibbles (int4).
POISON = {8: -128, 4: 0x88}


def _devices() -> list[torch.device]:
    return [torch.device("cpu")] + ([torch.device("cuda")] if torch.cuda.is_available() else [])


def _cases(with_reference: bool) -> list:
    names = ("torch", "ext", "triton", "cupy") if with_reference else ("ext", "triton", "cupy")
    return [pytest.param(name, device, id=f"{name}-{device.type}")
            for device in _devices() for name in names if name in available_backends(device) or name == "torch"]


EVERY_BACKEND = pytest.mark.parametrize("name,device", _cases(with_reference=False))
EVERY_BACKEND_AND_REFERENCE = pytest.mark.parametrize("name,device", _cases(with_reference=True))
BITS = pytest.mark.parametrize("bits", (8, 4))


@pytest.fixture
def rng() -> tuple[torch.Generator, int]:
    seed = random.randrange(2**31)
    return torch.Generator().manual_seed(seed), seed


def _random(numel: int, dtype: torch.dtype, gen: torch.Generator, device: torch.device) -> torch.Tensor:
    """Normal values with a magnitude that varies by up to 2**12 between neighbours, so a block
    holds both values that round to 0 and values near its absmax."""
    values = torch.randn(numel, generator=gen) * torch.exp2(torch.randint(-6, 6, (numel,), generator=gen).float())
    return values.to(dtype).to(device)


def _outputs(numel: int, block: int, bits: int, device: torch.device, chunks: int = 1
             ) -> tuple[torch.Tensor, torch.Tensor]:
    q = torch.full((chunks * quantized_bytes(numel, bits),), POISON[bits], dtype=torch.int16)
    scales = torch.full((chunks * num_blocks(numel, block),), float("nan"))
    return q.to(Q_DTYPES[bits]).to(device), scales.to(device)


def _quantize(backend, bits: int, src: torch.Tensor, block: int, error=None) -> tuple[torch.Tensor, torch.Tensor]:
    q, scales = _outputs(src.numel(), block, bits, src.device)
    (backend.quantize_int8 if bits == 8 else backend.quantize_int4)(src, q, scales, block, error)
    return q, scales


def _dequantized(q: torch.Tensor, scales: torch.Tensor, numel: int, block: int, bits: int) -> torch.Tensor:
    out = torch.full((numel,), float("nan"), device=q.device)
    REFERENCE.dequantize_into(out, q, scales, block, bits)
    return out


def _block_absmax(x: torch.Tensor, block: int) -> torch.Tensor:
    """Each element's block absmax, per element."""
    padded = torch.nn.functional.pad(x.float().abs(), (0, num_blocks(x.numel(), block) * block - x.numel()))
    return padded.view(-1, block).amax(1).repeat_interleave(block)[:x.numel()]


@EVERY_BACKEND
@BITS
@pytest.mark.parametrize("src_dtype", SRC_DTYPES, ids=lambda d: str(d).removeprefix("torch."))
def test_quantize_matches_reference(name, device, bits, src_dtype, rng):
    gen, seed = rng
    backend = get_backend(name, device)
    for numel in SIZES:
        src = _random(numel, src_dtype, gen, device)
        for block in BLOCKS:
            what = f"quantize bits={bits} numel={numel} block={block}"
            q, scales = _quantize(backend, bits, src, block)
            q_ref, scales_ref = _quantize(REFERENCE, bits, src, block)
            assert torch.equal(q, q_ref), f"{what}: q differs from the reference (seed {seed})"
            _assert_same(scales, scales_ref, seed, f"{what}: scales")
            error = torch.randn(numel, generator=gen).to(device) * scales_ref.nan_to_num().max()
            error_ref = error.clone()
            q, scales = _quantize(backend, bits, src, block, error)
            q_ref, scales_ref = _quantize(REFERENCE, bits, src, block, error_ref)
            assert torch.equal(q, q_ref), f"{what} with error feedback: q differs from the reference (seed {seed})"
            _assert_same(scales, scales_ref, seed, f"{what} with error feedback: scales")
            _assert_same(error, error_ref, seed, f"{what} with error feedback: error")


def _random_quantized(numel: int, block: int, bits: int, chunks: int, gen: torch.Generator,
                      device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """Any bytes (4 bits: -8 nibbles included) and positive scales with some 0 and NaN."""
    low = -127 if bits == 8 else 0
    high = 128 if bits == 8 else 256
    q = torch.randint(low, high, (chunks * quantized_bytes(numel, bits),), generator=gen, dtype=torch.int16)
    scales = torch.rand(chunks * num_blocks(numel, block), generator=gen) * 10
    special = torch.rand(scales.shape, generator=gen)
    scales[special < 0.05] = 0.0
    scales[special > 0.95] = float("nan")
    return q.to(Q_DTYPES[bits]).to(device), scales.to(device)


@EVERY_BACKEND
@BITS
def test_dequantize_accumulate_matches_reference(name, device, bits, rng):
    """The sum of chunks has one defined order, so every chunk count matches exactly."""
    gen, seed = rng
    backend = get_backend(name, device)
    for chunks in (1, 2, 3, 8):
        for numel in SIZES:
            for block in (2, 6, DEFAULT_BLOCK):
                q, scales = _random_quantized(numel, block, bits, chunks, gen, device)
                expected = (torch.randn(numel, generator=gen) * 100).to(device)
                actual = expected.clone()
                REFERENCE.dequantize_accumulate(expected, q, scales, block, bits, chunks)
                backend.dequantize_accumulate(actual, q, scales, block, bits, chunks)
                _assert_same(actual, expected, seed,
                             f"dequantize_accumulate bits={bits} chunks={chunks} numel={numel} block={block}")


@EVERY_BACKEND
@BITS
@pytest.mark.parametrize("dst_dtype", (*SRC_DTYPES, torch.float64), ids=lambda d: str(d).removeprefix("torch."))
def test_dequantize_into_matches_reference(name, device, bits, dst_dtype, rng):
    gen, seed = rng
    backend = get_backend(name, device)
    for numel in SIZES:
        for block in (2, 6, DEFAULT_BLOCK):
            q, scales = _random_quantized(numel, block, bits, 1, gen, device)
            expected = torch.full((numel,), float("nan"), dtype=dst_dtype, device=device)
            actual = expected.clone()
            REFERENCE.dequantize_into(expected, q, scales, block, bits)
            backend.dequantize_into(actual, q, scales, block, bits)
            _assert_same(actual, expected, seed, f"dequantize_into bits={bits} numel={numel} block={block}")


@EVERY_BACKEND_AND_REFERENCE
@BITS
def test_chunks_quantised_apart_accumulate_as_one_call(name, device, bits, rng):
    """The layout an all-to-all delivers: chunk c quantised on its own into the c-th slices of
    q and scales; one dequantize_accumulate adds them all, in chunk order."""
    gen, seed = rng
    backend = get_backend(name, device)
    numel, block, chunks = 1001, 64, 4
    q, scales = _outputs(numel, block, bits, device, chunks)
    srcs = [_random(numel, torch.float32, gen, device) for _ in range(chunks)]
    per_q, per_scales = quantized_bytes(numel, bits), num_blocks(numel, block)
    quantize = backend.quantize_int8 if bits == 8 else backend.quantize_int4
    for c, src in enumerate(srcs):
        quantize(src, q[c * per_q:(c + 1) * per_q], scales[c * per_scales:(c + 1) * per_scales], block)
    dst = _random(numel, torch.float32, gen, device)
    expected = dst.clone()
    total = None
    for c in range(chunks):
        part = _dequantized(q[c * per_q:(c + 1) * per_q], scales[c * per_scales:(c + 1) * per_scales], numel, block,
                            bits)
        total = part if total is None else total + part
    expected += total
    backend.dequantize_accumulate(dst, q, scales, block, bits, chunks)
    _assert_same(dst, expected, seed, "accumulate of chunks quantised apart")


@EVERY_BACKEND_AND_REFERENCE
@BITS
@pytest.mark.parametrize("src_dtype", SRC_DTYPES, ids=lambda d: str(d).removeprefix("torch."))
def test_zero_inf_and_nan_blocks_stay_in_their_block(name, device, bits, src_dtype, rng):
    """A zero block: scale 0, q 0, dequantised 0. A block with inf, -inf or NaN: NaN scale, q 0,
    dequantised NaN, error NaN; every other block as if those blocks had been finite."""
    gen, seed = rng
    backend = get_backend(name, device)
    block, numel = 64, 64 * 7 + 5
    src = _random(numel, src_dtype, gen, device)
    src[64:128] = 0  # block 1: zeros
    clean = src.clone()
    src[2 * 64 + 3] = float("inf")  # block 2
    src[3 * 64 + 63] = float("-inf")  # block 3, last element
    src[5 * 64] = float("nan")  # block 5, first element
    src[7 * 64 + 4] = float("nan")  # block 7, the short last block
    bad = [2, 3, 5, 7]
    error = torch.zeros(numel, device=device)
    q, scales = _quantize(backend, bits, src, block, error)
    q_clean, scales_clean = _quantize(REFERENCE, bits, clean, block)
    assert scales[1].item() == 0.0 and scales[bad].isnan().all(), f"scales {scales.tolist()} (seed {seed})"
    good = [b for b in range(num_blocks(numel, block)) if b not in bad]
    _assert_same(scales[good], scales_clean[good], seed, "scales of the finite blocks")
    deq = _dequantized(q, scales, numel, block, bits)
    deq_clean = _dequantized(q_clean, scales_clean, numel, block, bits)
    for b in range(num_blocks(numel, block)):
        region = slice(b * block, min((b + 1) * block, numel))
        if b in bad:
            assert deq[region].isnan().all(), f"block {b} does not dequantise to NaN (seed {seed})"
            assert error[region].isnan().all(), f"block {b}'s error is not NaN (seed {seed})"
        else:
            _assert_same(deq[region], deq_clean[region], seed, f"finite block {b}")
            assert error[region].isfinite().all(), f"finite block {b}'s error is not finite (seed {seed})"
    assert (deq[64:128] == 0).all() and (error[64:128] == 0).all()
    q_bytes = q.view(torch.int8) if bits == 4 else q
    for b in bad:
        lo, hi = b * block, min((b + 1) * block, numel)
        span = slice(lo, hi) if bits == 8 else slice(lo // 2, (hi + 1) // 2)
        assert (q_bytes[span] == 0).all(), f"block {b}: q of a non-finite block is not 0 (seed {seed})"
    dst = torch.zeros(numel, device=device)
    backend.dequantize_accumulate(dst, torch.cat([q, q]), torch.cat([scales, scales]), block, bits, 2)
    assert dst.isnan().sum().item() == sum(min((b + 1) * block, numel) - b * block for b in bad)


@EVERY_BACKEND_AND_REFERENCE
@pytest.mark.parametrize("src_dtype", SRC_DTYPES, ids=lambda d: str(d).removeprefix("torch."))
def test_int8_round_trip_within_1_254_of_block_absmax(name, device, src_dtype, rng):
    """|x - dequantised| <= absmax / 254 (half a step) up to fp32 rounding, for every element;
    and the largest error reaches most of that bound (an over-generous rounding would not)."""
    gen, seed = rng
    backend = get_backend(name, device)
    for block in (64, DEFAULT_BLOCK):
        src = _random(block * 64 + 17, src_dtype, gen, device)
        q, scales = _quantize(backend, 8, src, block)
        x = src.float()
        absmax = _block_absmax(x, block)
        error = (x - _dequantized(q, scales, x.numel(), block, 8)).abs()
        bound = absmax / 254 * (1 + 2**-20) + 4 * torch.finfo(torch.float32).eps * absmax
        assert bool((error <= bound).all()), f"int8 error above absmax / 254 (seed {seed}): " \
                                             f"{(error / absmax).max().item() * 254:.6f} x the bound"
        assert (error / absmax).max().item() > 0.45 / 254, f"int8 error suspiciously small (seed {seed})"


@EVERY_BACKEND_AND_REFERENCE
@BITS
def test_error_feedback_bounds_the_error_and_tracks_the_running_sum(name, device, bits, rng):
    """Each step's error is at most half a step (scale / 2) per element, and with feedback the
    running sum of dequantised values stays within one step's error of the running sum of the
    inputs (it equals sum of inputs - final error), while without it the gap grows."""
    gen, seed = rng
    backend = get_backend(name, device)
    numel, block, steps = 2048 + 6, 64, 40
    error = torch.zeros(numel, device=device)
    sent, sent_plain, target = (torch.zeros(numel, dtype=torch.float64, device=device) for _ in range(3))
    for step in range(steps):
        grad = _random(numel, torch.float32, gen, device)
        # The quantised input x = grad + error; its error is bounded by its own scale.
        x = grad + error
        q, scales = _quantize(backend, bits, grad, block, error)
        half_step = scales.repeat_interleave(block)[:numel] / 2
        slack = 4 * torch.finfo(torch.float32).eps * _block_absmax(x, block)
        assert bool((error.abs() <= half_step + slack).all()), f"step {step}: error above scale / 2 (seed {seed})"
        sent += _dequantized(q, scales, numel, block, bits).double()
        q_plain, scales_plain = _quantize(backend, bits, grad, block)
        sent_plain += _dequantized(q_plain, scales_plain, numel, block, bits).double()
        target += grad.double()
    gap = (target - sent).abs()
    assert bool((gap <= error.double().abs() + 1e-4 * target.abs().max()).all()), \
        f"running sum does not track the inputs (seed {seed}): {gap.max().item()}"
    gap_plain = (target - sent_plain).abs()
    assert gap.mean().item() < 0.5 * gap_plain.mean().item(), \
        f"feedback does not help (seed {seed}): {gap.mean().item()} vs {gap_plain.mean().item()}"


@EVERY_BACKEND_AND_REFERENCE
def test_int4_packs_two_values_per_byte_low_nibble_first(name, device):
    backend = get_backend(name, device)
    src = torch.tensor([7.0, -7.0, 1.0, -1.0, 0.0, 3.0, 7.0], device=device)  # one block, scale 1, odd n
    q, scales = _quantize(backend, 4, src, 8)
    assert scales.tolist() == [1.0]
    assert q.tolist() == [0x97, 0xF1, 0x30, 0x07]
    q8, _ = _quantize(backend, 8, src * (127 / 7), 8)
    assert q8.tolist() == [127, -127, 18, -18, 0, 54, 127]  # 1 * 127 / 7 = 18.14, 3 * 127 / 7 = 54.43


@EVERY_BACKEND_AND_REFERENCE
@BITS
def test_subnormal_scales_clamp_to_the_range(name, device, bits):
    """absmax / qmax rounded to a subnormal can be far below absmax / qmax, so x / scale
    exceeds qmax: q is clamped, and a scale that underflows to 0 gives q = 0."""
    backend = get_backend(name, device)
    qmax = 127 if bits == 8 else 7
    tiny = torch.finfo(torch.float32).smallest_normal * 2.0**-23  # the smallest subnormal
    units = torch.tensor([190.0, -190.0, 95.0, 1.0] + [3.0] * 4)  # block 0: scale rounds to 1 or 2 units
    src = torch.cat([units, torch.tensor([1.0, -1.0] + [0.0] * 6)]).mul(tiny).to(device)  # block 1: scale 0
    q, scales = _quantize(backend, bits, src, 8)
    q_ref, scales_ref = _quantize(REFERENCE, bits, src, 8)
    assert scales[0].item() > 0 and scales[1].item() == 0.0
    assert torch.equal(q, q_ref) and torch.equal(scales, scales_ref)
    values = _dequantized(q, scales, 16, 8, bits) / scales[0]
    assert values[:2].tolist() == [qmax, -qmax] and (values[8:] == 0).all()


@EVERY_BACKEND_AND_REFERENCE
@BITS
def test_rounds_half_to_even(name, device, bits):
    backend = get_backend(name, device)
    qmax = 127 if bits == 8 else 7
    # scale = 1 exactly: the absmax qmax sits in the block; halves round to the even neighbour.
    src = torch.tensor([qmax, 0.5, 1.5, 2.5, -0.5, -1.5, -2.5, 3.5], device=device)
    q, scales = _quantize(backend, bits, src, 8)
    values = _dequantized(q, scales, 8, 8, bits)
    assert scales.tolist() == [1.0] and values.tolist() == [qmax, 0, 2, 2, 0, -2, -2, 4]


@EVERY_BACKEND_AND_REFERENCE
def test_empty_and_single_element(name, device):
    backend = get_backend(name, device)
    for bits in (8, 4):
        q, scales = _quantize(backend, bits, torch.empty(0, device=device), 64)
        assert q.numel() == 0 and scales.numel() == 0
        backend.dequantize_accumulate(torch.empty(0, device=device), q, scales, 64, bits, 3)
        q, scales = _quantize(backend, bits, torch.tensor([-2.5], device=device), 64)
        out = torch.empty(1, dtype=torch.bfloat16, device=device)
        backend.dequantize_into(out, q, scales, 64, bits)
        assert out.tolist() == [-2.5]


@EVERY_BACKEND_AND_REFERENCE
def test_bad_arguments_raise_errors_naming_them(name, device):
    backend = get_backend(name, device)
    src = torch.randn(10, device=device)
    q8, q4 = torch.empty(10, dtype=torch.int8, device=device), torch.empty(5, dtype=torch.uint8, device=device)
    scales = torch.empty(5, device=device)
    dst = torch.zeros(10, device=device)
    cases = [
        (ValueError, "block=3", lambda: backend.quantize_int8(src, q8, torch.empty(4, device=device), 3)),
        (ValueError, "block=0", lambda: backend.quantize_int8(src, q8, scales, 0)),
        (ValueError, "block=2.0", lambda: backend.quantize_int8(src, q8, scales, 2.0)),
        (ValueError, f"from 2 to {MAX_BLOCK}", lambda: backend.quantize_int8(src, q8, torch.empty(1), 2 * MAX_BLOCK)),
        (TypeError, "out_q has dtype torch.uint8", lambda: backend.quantize_int8(src, q4, scales, 2)),
        (ValueError, "out_q has 5 elements", lambda: backend.quantize_int8(src, q8[:5], scales, 2)),
        (ValueError, r"out_scales has 5 elements; expected ceil\(n / block\)",
         lambda: backend.quantize_int4(src, q4, scales, 4)),
        (TypeError, "out_scales has dtype torch.float16", lambda: backend.quantize_int4(src, q4, scales.half(), 2)),
        (ValueError, "src must be a contiguous 1-D", lambda: backend.quantize_int4(src.view(2, 5), q4, scales, 2)),
        (TypeError, "src has dtype torch.int32", lambda: backend.quantize_int8(src.int(), q8, scales, 2)),
        (TypeError, "error has dtype torch.float16", lambda: backend.quantize_int4(src, q4, scales, 2, src.half())),
        (ValueError, "error has 9 elements", lambda: backend.quantize_int4(src, q4, scales, 2, src[:9])),
        (ValueError, "bits=3", lambda: backend.dequantize_accumulate(dst, q8, scales, 2, 3)),
        (ValueError, "chunks=0", lambda: backend.dequantize_accumulate(dst, q8, scales, 2, 8, 0)),
        (ValueError, r"q has 10 elements; expected chunks \(2\)",
         lambda: backend.dequantize_accumulate(dst, q8, scales, 2, 8, 2)),
        (ValueError, "scales has 5 elements", lambda: backend.dequantize_accumulate(dst, q8, scales, 4, 8)),
        (TypeError, "dst has dtype torch.bfloat16",
         lambda: backend.dequantize_accumulate(dst.bfloat16(), q8, scales, 2, 8)),
        (TypeError, "q has dtype torch.int8", lambda: backend.dequantize_into(dst, q8, scales, 2, 4)),
        (TypeError, "dst has dtype torch.int64", lambda: backend.dequantize_into(dst.long(), q8, scales, 2, 8)),
    ]
    for error_type, message, call in cases:
        with pytest.raises(error_type, match=message):
            call()


# Compiled for a GPU by Triton's compiler (no GPU needed), in a fresh process: this one runs
# the interpreter. The PTX must divide with IEEE rounding (div.rn, as torch) and fuse no FMA.
AOT_SCRIPT = """
import triton
from triton.compiler import ASTSource
triton.knobs.runtime.interpret = False
from overlap.kernels import triton_backend as k

quantize = {"src": "*bf16", "error": "*fp32", "q": "*u8", "scales": "*fp32", "n": "i64", "block": "i32",
            "num_blocks": "i32", "QMAX": "constexpr", "MAGIC": "constexpr", "BITS": "constexpr",
            "HAS_ERROR": "constexpr", "ROWS": "constexpr", "HALF": "constexpr"}
dequantize = {"dst": "*bf16", "q": "*i8", "scales": "*fp32", "n": "i64", "block": "i32", "chunks": "i32",
              "chunk_bytes": "i64", "num_blocks": "i32", "BITS": "constexpr", "ACCUMULATE": "constexpr",
              "PAIRS": "constexpr"}
sources = {
    "quantize_int4_feedback": ASTSource(k._quantize_kernel, signature=quantize, constexprs={
        "QMAX": 7.0, "MAGIC": k.ROUNDING_MAGIC, "BITS": 4, "HAS_ERROR": True, "ROWS": 8, "HALF": 128}),
    "quantize_int8": ASTSource(k._quantize_kernel, signature={**quantize, "q": "*i8"}, constexprs={
        "QMAX": 127.0, "MAGIC": k.ROUNDING_MAGIC, "BITS": 8, "HAS_ERROR": False, "ROWS": 1, "HALF": 2048}),
    "dequantize_into_int4": ASTSource(k._dequantize_kernel, signature={**dequantize, "q": "*u8"}, constexprs={
        "BITS": 4, "ACCUMULATE": False, "PAIRS": k.DEQUANT_PAIRS}),
    "dequantize_accumulate_int8": ASTSource(k._dequantize_kernel, signature={**dequantize, "dst": "*fp32"},
        constexprs={"BITS": 8, "ACCUMULATE": True, "PAIRS": k.DEQUANT_PAIRS}),
}


def check(name, ptx):
    if name.startswith("quantize"):
        assert "div.rn.f32" in ptx and "div.full" not in ptx and "div.approx" not in ptx, name + ": inexact division"
"""


def test_triton_quant_kernels_compile_for_cuda():
    """For sm_80 and sm_90."""
    pytest.importorskip("triton")
    compile_for_cuda(AOT_SCRIPT, ("quantize_int4_feedback", "quantize_int8", "dequantize_into_int4",
                                  "dequantize_accumulate_int8"), (80, 90))


QUANT_ENTRY_POINTS = [f"{op}_{dtype}_b{bits}" for op in ("quantize", "dequantize_into")
                      for dtype in ("f32", "f16", "bf16") for bits in (8, 4)] + \
                     [f"dequantize_accumulate_b{bits}" for bits in (8, 4)]


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc not found")
def test_cuda_quant_kernels_exist_divide_exactly_and_fuse_no_fma(tmp_path):
    """The entry points the extension's launchers and the CuPy backend name are in the PTX, with
    IEEE division and no FMA (which would round differently from the reference)."""
    ptx_file = tmp_path / "flat_kernels.ptx"
    command = ["nvcc", "--ptx", "-O3", "-arch=sm_90", str(ROOT / "kernels" / "flat_kernels.cu"), "-o", str(ptx_file)]
    result = subprocess.run(command, capture_output=True, text=True, timeout=240)
    assert result.returncode == 0, f"{' '.join(command)}\n{result.stderr}"
    ptx = ptx_file.read_text()
    for name in QUANT_ENTRY_POINTS:
        assert f".entry {name}(" in ptx, f"{name} is missing from flat_kernels.cu"
    entries = ptx.split(".entry ")[1:]
    for entry in entries:
        name = entry.split("(")[0]
        if name in QUANT_ENTRY_POINTS:
            assert "fma." not in entry, f"{name} fuses a multiply and an add"
            assert "div.approx" not in entry and "div.full" not in entry, f"{name} divides inexactly"
    source = (ROOT / "kernels" / "cupy_backend.py").read_text() + (ROOT / "csrc" / "flat_launch.cu").read_text()
    assert "quantize_" in source and "dequantize_accumulate_b" in source and "dequantize_into" in source
