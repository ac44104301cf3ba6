#!/usr/bin/env bash
# One prepared check of the flat-buffer kernels on a CUDA machine (written for one H200 with
# torch, triton, cupy-cuda13x and nvcc installed, and no internet), in under 10 minutes:
#   1. build overlap._C with its CUDA kernels (sm_80 + sm_90),
#   2. run the kernel tests (every backend on CUDA tensors against the torch reference) and
#      the CUDA source compile tests,
#   3. run benchmarks/kernels.py on CUDA and print its table and summary.
# Run from the repository root: bash benchmarks/gpu_check.sh
# Results go to $OUT (if set) or bench_out/: build.log, tests.log, kernels_cuda.json.
set -uo pipefail

OUT_DIR="${OUT:-bench_out}"
mkdir -p "$OUT_DIR"
status=0

step() { echo; echo "=== $* ($(date +%T))"; }

step "machine"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader || true
python -c "import torch, triton; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'triton', triton.__version__)"
python -c "import cupy; print('cupy', cupy.__version__)" || echo "cupy not importable: the cupy backend is skipped"
nvcc --version | tail -1

step "build overlap._C (CUDA)"
# --no-deps: the machine's torch is used as it is, nothing is fetched.
if ! MAX_JOBS="$(nproc)" timeout 300 pip install --no-build-isolation --no-deps -e . >"$OUT_DIR/build.log" 2>&1; then
    echo "build failed; see $OUT_DIR/build.log"; tail -30 "$OUT_DIR/build.log"; exit 1
fi
grep -i "warn.*overlap" "$OUT_DIR/build.log" || true
python - <<'EOF' || status=1
import torch
import overlap._C  # noqa: F401
from overlap.kernels import available_backends
has_cuda = torch._C._dispatch_has_kernel_for_dispatch_key("overlap::pack", "CUDA")
print("overlap._C CUDA kernels:", has_cuda)
print("backends on cuda, fastest first:", available_backends(torch.device("cuda")))
assert has_cuda, "overlap._C was built without its CUDA kernels"
EOF

step "kernel tests"
timeout 300 python -m pytest -q -p no:cacheprovider tests/test_kernels.py tests/test_cuda_sources.py \
    >"$OUT_DIR/tests.log" 2>&1 || status=1
tail -15 "$OUT_DIR/tests.log"

step "benchmark"
timeout 240 python benchmarks/kernels.py --device cuda --out "$OUT_DIR/kernels_cuda.json" || status=1

step "done: status $status"
exit $status
