"""Every available compiled kernel backend against the torch reference, element for element.

Inputs are fresh random values each run (the seed is in every failure message); outputs
start as NaN so a skipped element, a write into padding or a write past a region shows.
Triton runs on CPU tensors through its interpreter, which is switched on here through
Triton's own knob before its kernels are first built.
"""
from __future__ import annotations

import os
import random
import shutil
import subprocess
import sys

import pytest
import torch

try:
    import triton
except ImportError:
    triton = None

if triton is not None and not torch.cuda.is_available():
    triton.knobs.runtime.interpret = True

from overlap.kernels.backends import BACKEND_NAMES, BackendUnavailable, available_backends, get_backend  # noqa: E402
from overlap.kernels.reference import TorchKernels  # noqa: E402

# Triton's interpreter warns where numpy overflows to fp16 infinity or adds opposite
# infinities, as the kernels must.
pytestmark = [pytest.mark.filterwarnings("ignore:overflow encountered:RuntimeWarning"),
              pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")]

DTYPES = (torch.float32, torch.bfloat16, torch.float16)
SIZES = (0, 1, 3, 7, 1023, 1025, 4097)  # empty, tiny, one below and above the block, non-multiples
REFERENCE = TorchKernels()
# Every backend but the reference itself (and "auto", which picks one of them).
COMPILED = tuple(name for name in BACKEND_NAMES if name not in ("auto", REFERENCE.name))


def _cases() -> list:
    devices = [torch.device("cpu")] + ([torch.device("cuda")] if torch.cuda.is_available() else [])
    cases = []
    for name in COMPILED:
        for device in devices:
            if name in available_backends(device):
                cases.append(pytest.param(name, device, id=f"{name}-{device.type}"))
    return cases


EVERY_BACKEND = pytest.mark.parametrize("name,device", _cases())
EVERY_DTYPE_PAIR = pytest.mark.parametrize("src_dtype,dst_dtype", [(s, d) for s in DTYPES for d in DTYPES],
                                           ids=lambda dtype: str(dtype).removeprefix("torch."))


@pytest.fixture
def rng() -> tuple[torch.Generator, int]:
    seed = random.randrange(2**31)
    return torch.Generator().manual_seed(seed), seed


def _random(numel: int, dtype: torch.dtype, gen: torch.Generator, device: torch.device) -> torch.Tensor:
    # Values over a wide range, so casts round and overflow (fp16) differently if done wrong.
    values = torch.randn(numel, generator=gen) * torch.exp2(torch.randint(-20, 20, (numel,), generator=gen).float())
    return values.to(dtype).to(device)


def _poisoned(numel: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    return torch.full((numel,), float("nan"), dtype=dtype, device=device)


def _layout(sizes, gen: torch.Generator) -> tuple[list[int], int]:
    """Offsets with random gaps between regions (padding the kernels must leave alone)."""
    offsets, end = [], int(torch.randint(0, 5, (), generator=gen))
    for size in sizes:
        offsets.append(end)
        end += size + int(torch.randint(0, 5, (), generator=gen))
    return offsets, end + 3


def _assert_same(actual: torch.Tensor, expected: torch.Tensor, seed: int, what: str) -> None:
    """Bit-for-bit equal values (signed zeros and infinities included), NaN in the same places."""
    bits = {torch.float64: torch.int64, torch.float32: torch.int32}.get(actual.dtype, torch.int16)
    numbers = ~expected.isnan()
    same = torch.equal(actual.isnan(), expected.isnan()) and \
        torch.equal(actual[numbers].view(bits), expected[numbers].view(bits))
    assert same, f"{what} differs from the reference (seed {seed}): " \
                 f"{(actual.double() - expected.double()).abs().nan_to_num(float('inf')).max().item()}"


def _assert_sum_close(actual: torch.Tensor, expected: torch.Tensor, dst: torch.Tensor, src: torch.Tensor,
                      num_chunks: int, scale: float, seed: int, what: str) -> None:
    """For 3+ chunks torch.sum picks its own order of additions, so backends may differ from it
    by rounding: each result is within (chunks * eps32 + 2 * eps(dst)) * sum of |terms| of the
    exact value, so two results are within twice that."""
    magnitude = dst.double().abs() + abs(scale) * src.double().abs().view(num_chunks, -1).sum(0)
    eps = num_chunks * torch.finfo(torch.float32).eps + 2 * torch.finfo(dst.dtype).eps
    tolerance = 2 * eps * magnitude + torch.finfo(dst.dtype).tiny
    error = (actual.double() - expected.double()).abs()
    assert bool((error <= tolerance).all()), f"{what} differs from the reference beyond rounding (seed {seed}): " \
                                             f"{error.max().item()}"


@EVERY_BACKEND
@EVERY_DTYPE_PAIR
def test_pack_many_sizes(name, device, src_dtype, dst_dtype, rng):
    gen, seed = rng
    backend = get_backend(name, device)
    srcs = [_random(n, src_dtype, gen, device) for n in SIZES]
    offsets, total = _layout(SIZES, gen)
    for scale in (1.0, 0.37):
        expected, actual = _poisoned(total, dst_dtype, device), _poisoned(total, dst_dtype, device)
        REFERENCE.pack(srcs, expected, offsets, scale)
        backend.pack(srcs, actual, offsets, scale)
        _assert_same(actual, expected, seed, f"pack scale={scale}")


@EVERY_BACKEND
@EVERY_DTYPE_PAIR
def test_pack_one_tensor_as_the_runtime_does(name, device, src_dtype, dst_dtype, rng):
    """The per-step calls: a shard cast to the gather dtype, a gradient divided by the world size."""
    gen, seed = rng
    backend = get_backend(name, device)
    for numel in SIZES:
        src = _random(numel, src_dtype, gen, device)
        for offset, scale in ((0, 1.0), (0, 1 / 3), (5, 0.125)):
            expected = _poisoned(numel + offset + 2, dst_dtype, device)
            actual = expected.clone()
            REFERENCE.pack([src], expected, [offset], scale)
            backend.pack([src], actual, [offset], scale)
            _assert_same(actual, expected, seed, f"pack one numel={numel} offset={offset} scale={scale}")
    if src_dtype == dst_dtype:
        grad = _random(4097, src_dtype, gen, device)
        expected = grad.clone()
        REFERENCE.pack([expected], expected, [0], 0.25)
        backend.pack([grad], grad, [0], 0.25)
        _assert_same(grad, expected, seed, "in-place pre-division")


@EVERY_BACKEND
@EVERY_DTYPE_PAIR
def test_accumulate_chunks(name, device, src_dtype, dst_dtype, rng):
    gen, seed = rng
    backend = get_backend(name, device)
    for num_chunks in range(1, 9):
        for numel in SIZES:
            scale = 1.0 if num_chunks % 2 else 0.5
            what = f"accumulate chunks={num_chunks} numel={numel} scale={scale}"
            if num_chunks <= 2:  # the runtime's cases (reduce-scatter output, 2-rank all-to-all): exact
                src = _random(num_chunks * numel, src_dtype, gen, device)
                expected = _random(numel, dst_dtype, gen, device)
            else:
                src = torch.randn(num_chunks * numel, generator=gen).to(src_dtype).to(device)
                expected = torch.randn(numel, generator=gen).to(dst_dtype).to(device)
            start = expected.clone()
            actual = expected.clone()
            REFERENCE.accumulate(expected, src, scale, num_chunks)
            backend.accumulate(actual, src, scale, num_chunks)
            if num_chunks <= 2:
                _assert_same(actual, expected, seed, what)
            else:
                _assert_sum_close(actual, expected, start, src, num_chunks, scale, seed, what)


@EVERY_BACKEND
def test_hundreds_of_tiny_tensors_mixed_dtypes(name, device, rng):
    gen, seed = rng
    backend = get_backend(name, device)
    sizes = [int(n) for n in torch.randint(0, 40, (300,), generator=gen)]
    srcs = [_random(n, DTYPES[i % 3], gen, device) for i, n in enumerate(sizes)]
    offsets, total = _layout(sizes, gen)
    expected, actual = _poisoned(total, torch.float32, device), _poisoned(total, torch.float32, device)
    REFERENCE.pack(srcs, expected, offsets, 0.5)
    backend.pack(srcs, actual, offsets, 0.5)
    _assert_same(actual, expected, seed, "pack of 300 tensors")


@EVERY_BACKEND
def test_strided_and_uncovered_dtypes_match_reference(name, device, rng):
    """Strided sources and float64 (left to the reference), in one call."""
    gen, seed = rng
    backend = get_backend(name, device)
    srcs = [_random(35, torch.float32, gen, device).view(5, 7).t(), _random(9, torch.float64, gen, device),
            _random(12, torch.bfloat16, gen, device)]
    offsets, total = _layout([35, 9, 12], gen)
    expected, actual = _poisoned(total, torch.float16, device), _poisoned(total, torch.float16, device)
    REFERENCE.pack(srcs, expected, offsets, 2.0)
    backend.pack(srcs, actual, offsets, 2.0)
    _assert_same(actual, expected, seed, "pack of strided/float64 sources")


@EVERY_BACKEND
def test_bad_arguments_raise_clear_errors(name, device):
    backend = get_backend(name, device)
    flat = torch.zeros(10, device=device)
    src = torch.ones(4, device=device)
    with pytest.raises(ValueError, match="2 tensors but 1 offsets"):
        backend.pack([src, src], flat, [0])
    with pytest.raises(ValueError, match="does not fit"):
        backend.pack([src], flat, [7])
    with pytest.raises(ValueError, match="does not fit"):
        backend.pack([src], flat, [-1])
    with pytest.raises(ValueError, match="contiguous 1-D"):
        backend.pack([src], flat.view(2, 5), [0])
    with pytest.raises(ValueError, match="num_chunks"):
        backend.accumulate(flat, torch.ones(30, device=device), 1.0, 2)
    with pytest.raises(ValueError, match="num_chunks"):
        backend.accumulate(flat, flat, 1.0, 0)


def test_unknown_and_unavailable_backends_are_errors():
    with pytest.raises(ValueError, match="unknown kernel backend 'fast'"):
        get_backend("fast", torch.device("cpu"))
    for name in COMPILED:
        if name not in available_backends(torch.device("cpu")):
            with pytest.raises(BackendUnavailable, match=name):
                get_backend(name, torch.device("cpu"))
    if not torch.cuda.is_available():
        with pytest.raises(BackendUnavailable, match="'ext'"):
            get_backend("ext", torch.device("cuda"))


@pytest.mark.skipif(shutil.which("c++") is None, reason="no C++ compiler: the extension is not built")
def test_extension_was_built_and_auto_prefers_it_on_cpu():
    assert "ext" in available_backends(torch.device("cpu")), "overlap._C is missing although a compiler exists"
    assert get_backend("auto", torch.device("cpu")).name == "ext"


@pytest.mark.skipif(triton is None or torch.cuda.is_available(), reason="Triton's interpreter is a CPU-only check")
def test_triton_runs_on_cpu_through_its_interpreter():
    assert "triton" in available_backends(torch.device("cpu"))


# One program of the accumulate kernel over 2049 chunks of 2**20 elements: the last chunk
# starts at element 2**31, where a 32-bit `c * n` wraps. The 4 GiB source is allocated but
# only each chunk's first block is touched. A wrapped offset reads unmapped memory and kills
# the process, hence a process of its own.
LARGE_INDEX_SCRIPT = """
import torch
import triton
triton.knobs.runtime.interpret = True
from overlap.kernels import triton_backend as k

n, chunks = 2**20, 2**11 + 1
dst = torch.zeros(n, dtype=torch.bfloat16)
src = torch.empty(chunks * n, dtype=torch.bfloat16)
for c in range(chunks):
    src[c * n:c * n + k.BLOCK] = {0: 1.0, chunks - 1: 2.0}.get(c, 0.0)
k._accumulate_kernel[(1,)](dst, src, n, chunks, 1.0, BLOCK=k.BLOCK, APPLY_SCALE=False)
print(dst[:k.BLOCK].unique().tolist(), dst[k.BLOCK:].abs().max().item())
"""


@pytest.mark.skipif(triton is None, reason="Triton is not installed")
def test_triton_accumulate_indexes_past_2_31_elements():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    result = subprocess.run([sys.executable, "-c", LARGE_INDEX_SCRIPT], capture_output=True, text=True,
                            timeout=240, env=env)
    assert result.returncode == 0, result.stdout + result.stderr
    assert result.stdout.split() == ["[3.0]", "0.0"]


@pytest.mark.skipif("ext" not in available_backends(torch.device("cpu")), reason="overlap._C was not built")
def test_ext_relaunches_refused_calls_only():
    """A call the C++ checks refuse takes the checked path; any other error (a CUDA fault)
    is raised as it is, not launched a second time."""
    backend = get_backend("ext", torch.device("cpu"))
    calls = []

    class Faulting:
        def __getattr__(self, op):
            def run(*args):
                calls.append(op)
                raise RuntimeError("CUDA error: an illegal memory access was encountered")
            return run

    original = backend._ops
    backend._ops = Faulting()
    try:
        with pytest.raises(RuntimeError, match="illegal memory access"):
            backend.accumulate(torch.zeros(4), torch.ones(8), 1.0, 2)
    finally:
        backend._ops = original
    assert calls == ["accumulate"]
    dst = torch.zeros(4)
    backend.pack([torch.ones(2, dtype=torch.float64)], dst, [1])       # refused dtype: the reference
    assert dst.tolist() == [0.0, 1.0, 1.0, 0.0]
    with pytest.raises(ValueError, match="does not fit"):
        backend.pack([torch.ones(3)], torch.zeros(2), [0])
