"""Triton kernels compiled ahead of time for CUDA targets on a machine without a GPU, in a fresh
process (the test session runs Triton's interpreter): a script's `sources` (name -> ASTSource)
compiled for each architecture, each PTX checked to hold its entry point and no fused
multiply-add (which rounds differently from torch), plus the script's own `check(name, ptx)`."""
from __future__ import annotations

import os
import subprocess
import sys
from typing import Sequence

# Runs after the script that defines `sources` and `check`.
COMPILE_LOOP = """
import sys
from triton.backends.compiler import GPUTarget
for arch in map(int, sys.argv[1:]):
    for name, source in sources.items():
        ptx = triton.compile(source, target=GPUTarget("cuda", arch, 32), options={"enable_fp_fusion": False}).asm["ptx"]
        assert ".entry" in ptx, name
        assert "fma" not in ptx, f"{name} fuses a multiply and an add for sm_{arch}"
        check(name, ptx)
        print(f"{name}@{arch}", "ok")
"""


def compile_for_cuda(script: str, names: Sequence[str], archs: Sequence[int]) -> None:
    """Run `script` and the loop for `archs` in one process (the imports cost as much as the
    compiles); every kernel of `names` must compile and pass for every architecture."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    result = subprocess.run([sys.executable, "-c", script + COMPILE_LOOP, *map(str, archs)], capture_output=True,
                            text=True, timeout=240, env=env)
    assert result.returncode == 0, result.stdout + result.stderr
    assert result.stdout.split() == [word for arch in archs for name in names for word in (f"{name}@{arch}", "ok")]
