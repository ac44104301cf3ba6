"""The GPU code compiles for the architectures CI targets, on machines without a GPU.

Every `.cu` file is compiled by nvcc on its own with setup.py's architecture flags (sm_80,
sm_90, and PTX for GPUs newer than the last one; one nvcc call per file builds every
architecture, as the extension's build does); the Triton kernels are
compiled ahead of time for the same targets (Triton needs no GPU for that). Compiled
kernels must not fuse `a + b * s` into an FMA, which would round differently from torch.
"""
from __future__ import annotations

import ast
import pathlib
import shutil
import subprocess

import pytest

from triton_aot import compile_for_cuda

ROOT = pathlib.Path(__file__).resolve().parent.parent
CUDA_SOURCES = sorted([*ROOT.glob("kernels/*.cu"), *ROOT.glob("csrc/*.cu")])
ARCHS = (80, 90)


def test_cuda_sources_exist():
    assert {p.name for p in CUDA_SOURCES} >= {"flat_kernels.cu", "flat_launch.cu"}


def _setup_arch_flags() -> list[str]:
    tree = ast.parse((ROOT / "setup.py").read_text())
    (value,) = [node.value for node in tree.body if isinstance(node, ast.Assign)
                and any(getattr(t, "id", None) == "CUDA_ARCH_FLAGS" for t in node.targets)]
    return ast.literal_eval(value)


def test_build_embeds_ptx_for_newer_gpus():
    flags = _setup_arch_flags()
    sass = sorted(int(f.split("code=sm_")[1]) for f in flags if "code=sm_" in f)
    assert sass[:2] == list(ARCHS)
    assert f"-gencode=arch=compute_{sass[-1]},code=compute_{sass[-1]}" in flags


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc not found")
@pytest.mark.parametrize("source", CUDA_SOURCES, ids=lambda p: p.name)
def test_nvcc_compiles_with_the_build_flags(source, tmp_path):
    command = ["nvcc", "-c", "-O3", *_setup_arch_flags(), "-I", str(ROOT / "kernels"), "-I", str(ROOT / "csrc"),
               str(source), "-o", str(tmp_path / "out.o")]
    result = subprocess.run(command, capture_output=True, text=True, timeout=400)
    assert result.returncode == 0, f"{' '.join(command)}\n{result.stderr}"


# Runs in a fresh process: the kernels must be built by Triton's compiler, not for the
# interpreter that tests/test_kernels.py turns on in this one.
AOT_SCRIPT = """
import triton
import triton.language as tl
from triton.compiler import ASTSource
triton.knobs.runtime.interpret = False
from overlap.kernels import triton_backend as k

common = {"BLOCK": k.BLOCK, "APPLY_SCALE": True}
sources = {
    "copy_one": ASTSource(k._copy_one_kernel, constexprs=common, signature={
        "src": "*fp32", "dst": "*bf16", "n": "i64", "scale": "fp32", "BLOCK": "constexpr",
        "APPLY_SCALE": "constexpr"}),
    "pack_many": ASTSource(k._pack_many_kernel, constexprs={**common, "SRC_DTYPE": tl.float16},
        signature={"table": "*i64", "count": "i32", "flat": "*bf16", "scale": "fp32", "SRC_DTYPE": "constexpr",
                   "BLOCK": "constexpr", "APPLY_SCALE": "constexpr"}),
    "accumulate": ASTSource(k._accumulate_kernel, constexprs=common, signature={
        "dst": "*fp32", "src": "*bf16", "n": "i64", "chunks": "i32", "scale": "fp32", "BLOCK": "constexpr",
        "APPLY_SCALE": "constexpr"}),
    # n below 2**31 arrives as i32: chunk offsets past 2**31 must still be reached.
    "accumulate_i32": ASTSource(k._accumulate_kernel, constexprs=common, signature={
        "dst": "*fp32", "src": "*bf16", "n": "i32", "chunks": "i32", "scale": "fp32", "BLOCK": "constexpr",
        "APPLY_SCALE": "constexpr"}),
}


def check(name, ptx):
    pass
"""


def test_triton_kernels_compile_for_cuda():
    pytest.importorskip("triton")
    compile_for_cuda(AOT_SCRIPT, ("copy_one", "pack_many", "accumulate", "accumulate_i32"), ARCHS)
