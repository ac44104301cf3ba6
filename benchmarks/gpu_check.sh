#!/usr/bin/env bash
# The check to run first on any machine with a GPU (written for one H200 with torch, triton,
# cupy-cuda13x and nvcc installed, and no internet), in under 10 minutes. It prints PASS,
# FAIL or SKIP per check, with its figures:
#   1. build overlap._C with its CUDA kernels (sm_80, sm_90, and PTX for newer GPUs);
#   2. the kernel tests on CUDA tensors (every backend against the torch reference) and the
#      CUDA source compile tests;
#   3. benchmarks/gpu_checks.py: device selection from init_process_group(), "cpu:gloo,cuda:nccl"
#      and "nccl"; stream-race parity by delay injection in five configurations; every kernel
#      backend past 2**31 elements; the step record's collective times against CUPTI's;
#      ShardedModule vs FSDP2 vs the plain model on a ~1B-parameter GPT in bf16;
#   4. benchmarks/kernels.py on CUDA: each backend's GB/s next to a device-to-device copy.
# Without a GPU every check says SKIP and why (a dry run of the script itself).
#
# One GPU is one rank: NCCL's collectives are then local copies. What this cannot show
# (it needs N > 1 ranks): transfers between GPUs and their overlap with compute, the link
# model the planner fits (NVLink or InfiniBand α and β), gradients summed across ranks by the
# reduce-scatter, the check that ranks run the same units, and races between ranks.
#
# Run from the repository root: bash benchmarks/gpu_check.sh
# Logs go to $OUT (if set) or bench_out/: build.log, tests.log, checks.log, kernels_cuda.json.
set -uo pipefail

OUT_DIR="${OUT:-bench_out}"
mkdir -p "$OUT_DIR"
PY="${PYTHON:-python}"
status=0
start_s=$SECONDS
# The whole script stays within 10 minutes: each step's limit is its own cap or what is left.
BUDGET_S=570

step() { echo; echo "=== $* ($(date +%T), $((SECONDS - start_s)) s)"; }
verdict() { echo "$1 $2: $3"; [ "$1" = FAIL ] && status=1; return 0; }
limit() { local left=$((BUDGET_S - (SECONDS - start_s))); left=$(( left < $1 ? left : $1 )); echo $(( left < 1 ? 1 : left )); }

step "machine"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>/dev/null || echo "no nvidia-smi"
"$PY" -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'GPU', torch.cuda.is_available())"
"$PY" -c "import triton; print('triton', triton.__version__)" 2>/dev/null || echo "triton not importable"
"$PY" -c "import cupy; print('cupy', cupy.__version__)" 2>/dev/null || echo "cupy not importable: the cupy backend is skipped"
command -v nvcc >/dev/null && nvcc --version | tail -1 || echo "no nvcc"
has_gpu=$("$PY" -c "import torch; print(int(torch.cuda.is_available()))")

step "build overlap._C (CUDA)"
if [ "$has_gpu" != 1 ]; then
    verdict SKIP build "no CUDA device: the CPU build in place is kept"
elif ! command -v nvcc >/dev/null; then
    verdict FAIL build "nvcc not found: the extension would be built without its CUDA kernels"
# --no-deps: the machine's torch is used as it is, nothing is fetched.
elif ! MAX_JOBS="$(nproc)" timeout "$(limit 240)" "$PY" -m pip install --no-build-isolation --no-deps -e . \
        >"$OUT_DIR/build.log" 2>&1; then
    verdict FAIL build "pip install failed; see $OUT_DIR/build.log"; tail -30 "$OUT_DIR/build.log"
else
    "$PY" - <<'EOF' && verdict PASS build "overlap._C has CUDA kernels" || verdict FAIL build "overlap._C lacks its CUDA kernels"
import torch
import overlap._C  # noqa: F401
from overlap.kernels import available_backends
print("backends on cuda, fastest first:", available_backends(torch.device("cuda")))
assert torch._C._dispatch_has_kernel_for_dispatch_key("overlap::pack", "CUDA")
EOF
fi

step "kernel tests on CUDA tensors"
if [ "$has_gpu" != 1 ]; then
    verdict SKIP kernel_tests "no CUDA device: tests/test_kernels.py's CUDA cases select nothing"
else
    # The CPU cases run in every test run; here only the CUDA ones and the compile tests.
    tests=(tests/test_kernels.py tests/test_cuda_sources.py)
    [ -f tests/test_quant_kernels.py ] && tests+=(tests/test_quant_kernels.py)
    if timeout "$(limit 150)" "$PY" -m pytest -q -p no:cacheprovider -k "cuda or nvcc or compile or ptx" \
            "${tests[@]}" >"$OUT_DIR/tests.log" 2>&1; then
        verdict PASS kernel_tests "$(tail -1 "$OUT_DIR/tests.log")"
    else
        verdict FAIL kernel_tests "$(tail -1 "$OUT_DIR/tests.log"); see $OUT_DIR/tests.log"; tail -15 "$OUT_DIR/tests.log"
    fi
fi

step "device selection, stream-race parity, large indices, report timing, overhead"
checks_s=$(limit 240)
timeout "$checks_s" "$PY" benchmarks/gpu_checks.py 2>&1 | tee "$OUT_DIR/checks.log"
checks_rc=${PIPESTATUS[0]}
if [ "$checks_rc" = 124 ]; then
    verdict FAIL gpu_checks "did not finish within $checks_s s; see $OUT_DIR/checks.log"
elif [ "$checks_rc" != 0 ]; then
    status=1
fi

step "kernel bandwidth"
if [ "$has_gpu" != 1 ]; then
    verdict SKIP kernel_bandwidth "no CUDA device (the CPU figures are in docs/kernels.md)"
elif [ "$(limit 120)" -lt 20 ]; then
    verdict SKIP kernel_bandwidth "the 10-minute budget is spent"
elif timeout "$(limit 120)" "$PY" benchmarks/kernels.py --device cuda --repeats 10 --out "$OUT_DIR/kernels_cuda.json"; then
    verdict PASS kernel_bandwidth "table above; $OUT_DIR/kernels_cuda.json"
else
    verdict FAIL kernel_bandwidth "benchmarks/kernels.py failed"
fi

step "summary"
echo "checks that need more than one GPU, not run here: transfers between GPUs and their overlap,"
echo "the planner's link fit, gradients summed across ranks, ranks running different units."
grep -hE "^(PASS|FAIL|SKIP) " "$OUT_DIR/checks.log" >/dev/null 2>&1 && \
    echo "gpu_checks.py: $(grep -cE '^PASS ' "$OUT_DIR/checks.log") passed, $(grep -cE '^FAIL ' "$OUT_DIR/checks.log") failed, $(grep -cE '^SKIP ' "$OUT_DIR/checks.log") skipped"
echo "status $status after $((SECONDS - start_s)) s"
exit $status
