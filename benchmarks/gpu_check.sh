#!/usr/bin/env bash
# The first check on a GPU machine (one GPU with torch, triton and cupy, perhaps nvcc, no internet)
# within 8 minutes: the plan of capped steps first, then PASS, FAIL or SKIP per check with its figures
# or why. Steps: install (no compiling, so later steps import it whatever happens), extension, the
# kernel tests' CUDA cases, benchmarks/gpu_checks.py (one process per step, CHECKS below),
# compute-sanitizer over the extension's and CuPy's cases, kernel_bandwidth.py on CUDA. One GPU is
# one rank: transfers between GPUs, gradients summed and races across ranks are not checked.
#   bash benchmarks/gpu_check.sh [--rehearse]   (--rehearse: the Python checks on CPU with gloo)
# Logs go to $OUT (if set) or bench_out/, one per step.
set -uo pipefail

rehearse=""         # the flag passed on to gpu_checks.py
case "${1:-}" in
    "") ;;
    --rehearse) rehearse=--rehearse ;;
    *) echo "usage: bash benchmarks/gpu_check.sh [--rehearse]" >&2; exit 2 ;;
esac

OUT_DIR="${OUT:-bench_out}"
mkdir -p "$OUT_DIR"
PY="${PYTHON:-$(command -v python3 || command -v python)}"
start_s=$SECONDS

# The steps in order with their caps in seconds, adding up to at most BUDGET_S. [Note: the caps]
# quant_kernels compiles the Triton kernels (100+ compiles cold) into TRITON_CACHE_DIR, kept
# between calls: the largest cap of the test steps. The extension's cap assumes ninja; without
# it the build may stop at its cap (a FAIL), and later steps still run on the other backends.
BUDGET_S=480
STEPS=(machine:15 install:20 extension:80 quant_kernels:55 offload:25 compressed:20 report_timing:20 sync_free:20
       two_level:15 slow_link:30 parity:45 sanitized:25 large_index:20 overhead:20 kernel_tests:30 kernel_memcheck:20
       kernel_racecheck:10 kernel_bandwidth:10)
declare -A CAP
for entry in "${STEPS[@]}"; do CAP[${entry%:*}]=${entry#*:}; done
STEPS=("${STEPS[@]%:*}")
# The checks of benchmarks/gpu_checks.py that each step runs.
declare -A CHECKS=([offload]=offload [compressed]=compressed [report_timing]=report_timing [sync_free]=sync_free [two_level]=hybrid,hpz
                   [slow_link]=slow_link [parity]=device,parity [sanitized]=sanitized [large_index]=large_index
                   [overhead]=overhead)
# What NCCL warns of goes to the logs; the Triton cache outlives this run (see the note).
export NCCL_DEBUG="${NCCL_DEBUG:-WARN}"
export TRITON_CACHE_DIR="${TRITON_CACHE_DIR:-$PWD/bench_out/triton_cache}"

echo "plan: step, cap (budget $BUDGET_S s)"
total=0
for name in "${STEPS[@]}"; do
    printf '  %-18s %4d s\n' "$name" "${CAP[$name]}"
    total=$((total + CAP[$name]))
done
echo "  total              $total s"
if (( total > BUDGET_S )); then
    echo "FAIL plan: the caps add up to $total s, more than the $BUDGET_S s budget"
    exit 2
fi

SCALE=1
status=0
declare -A COUNT=([PASS]=0 [FAIL]=0 [SKIP]=0)
step() { echo; echo "=== $1 (cap $((CAP[$1] * SCALE)) s; at $((SECONDS - start_s)) s)"; }
verdict() { echo "$1 $2: $3"; COUNT[$1]=$((COUNT[$1] + 1)); [ "$1" = FAIL ] && status=1; return 0; }
# The seconds step $1 may run: its cap or what is left of the budget, times SCALE.
limit() {
    local cap=$((CAP[$1] * SCALE)) left=$((BUDGET_S * SCALE - (SECONDS - start_s)))
    echo $(( left < cap ? (left > 0 ? left : 0) : cap ))
}
# Run "$@" under step $1's limit, teed to $OUT_DIR/$1.log; its status (124: stopped at the limit).
capped() {
    local name=$1; shift
    local seconds; seconds=$(limit "$name")
    if (( seconds < 5 )); then echo "budget spent" >"$OUT_DIR/$name.log"; return 124; fi
    # --kill-after: a collective stuck in NCCL may not answer SIGTERM.
    timeout --kill-after=5 "$seconds" "$@" 2>&1 | tee "$OUT_DIR/$name.log"
    local rc=${PIPESTATUS[0]}
    [ "$rc" = 137 ] && rc=124
    return "$rc"
}
# How a step that ran under `capped` ended, when it printed no verdict of its own.
ended() {
    local name=$1 rc=$2
    local left=$((BUDGET_S * SCALE - (SECONDS - start_s)))
    if [ "$rc" = 124 ]; then
        verdict FAIL "$name" "stopped at its limit (cap $((CAP[$name] * SCALE)) s, $left s of the budget left); see\
 $OUT_DIR/$name.log"
    elif [ "$rc" != 0 ] && ! grep -q '^FAIL ' "$OUT_DIR/$name.log"; then
        verdict FAIL "$name" "exited with status $rc and no verdict; see $OUT_DIR/$name.log"
    elif [ "$rc" != 0 ]; then
        status=1
    fi
}

has_gpu=$("$PY" -c "import torch; print(int(torch.cuda.is_available()))" 2>/dev/null || echo 0)
has_pytest=$("$PY" -c "import pytest" 2>/dev/null && echo 1 || echo 0)
# torch's build finds nvcc in CUDA_HOME or /usr/local/cuda when PATH lacks it; so do we.
nvcc_path=$(command -v nvcc || ls "${CUDA_HOME:-/usr/local/cuda}/bin/nvcc" 2>/dev/null || true)
[ -n "$nvcc_path" ] && export PATH="$(dirname "$nvcc_path"):$PATH"
# gpu: everything runs; rehearse: the Python checks on CPU; none: every step SKIPs.
if [ -n "$rehearse" ]; then mode=rehearse
    # A CPU shared with other work is slower than the GPU the caps are set for.
    SCALE=4; echo "rehearsal: caps and budget x$SCALE"
elif [ "$has_gpu" = 1 ]; then mode=gpu
else mode=none
fi
installed=1

step machine
capped machine "$PY" - <<'EOF'
import importlib.metadata, shutil, subprocess, torch
print("torch", torch.__version__, "cuda", torch.version.cuda, "GPU", torch.cuda.is_available())
driver = None
if torch.cuda.is_available():
    p = torch.cuda.get_device_properties(0)
    print(f"device {p.name}, {p.total_memory / 2**30:.0f} GiB, sm_{p.major}{p.minor}")
    print("nccl", ".".join(map(str, torch.cuda.nccl.version())))
    smi = shutil.which("nvidia-smi")
    if smi:
        out = subprocess.run([smi, "--query-gpu=driver_version", "--format=csv,noheader"], capture_output=True,
                             text=True).stdout.strip().splitlines()
        driver = out[0] if out else None
    print("driver", driver or "unknown (no nvidia-smi)")
versions = {}
for name in ("triton", "cupy-cuda13x", "cupy-cuda12x", "pytest", "setuptools"):
    try:
        versions[name] = importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        versions[name] = None
    print(name, versions[name] or "not installed")
# cupy-cuda13x needs driver 580 or later; otherwise the CuPy backend drops out (cupy-cuda12x serves).
if versions["cupy-cuda13x"] and driver and int(driver.split(".")[0]) < 580:
    print(f"cupy: cupy-cuda13x needs driver >= 580, this one is {driver}: the CuPy backend is unavailable; "
          "install cupy-cuda12x for it to be checked")
setuptools = versions["setuptools"]
if setuptools and int(setuptools.split(".")[0]) < 77:
    print(f"setuptools {setuptools}: the install needs >= 77 (pyproject.toml's SPDX license, read with "
          "--no-build-isolation): the install step will fail")
nvcc = shutil.which("nvcc")
print("nvcc", subprocess.run([nvcc, "--version"], capture_output=True, text=True).stdout.strip().splitlines()[-1]
      if nvcc else "not found")
print("ninja", "found" if shutil.which("ninja") else "not found: the extension would compile one file at a time")
print("compute-sanitizer", shutil.which("compute-sanitizer") or "not found")
EOF
ended machine $?

step install
if [ "$mode" != gpu ]; then
    verdict SKIP install "no CUDA device, or a rehearsal: the install in place is kept"
else
    # CXX names no compiler: setup.py installs without the extension in seconds; --no-deps: the
    # machine's torch as it is.
    CXX=overlap-no-compiler capped install "$PY" -m pip install --no-build-isolation --no-deps -e .
    rc=$?
    if [ "$rc" = 0 ] && "$PY" -c "import overlap, overlap.kernels"; then
        verdict PASS install "overlap importable from this tree"
    else
        installed=0
        ended install "$rc"
        [ "$rc" = 0 ] && verdict FAIL install "installed, but overlap does not import; see $OUT_DIR/install.log"
        tail -20 "$OUT_DIR/install.log"
    fi
fi
# Every later Python step needs the package.
ready() { [ "$mode" = gpu ] && [ "$installed" = 1 ]; }
not_ready_reason() {
    [ "$mode" = gpu ] && echo "the package did not install" || echo "no CUDA device, or a rehearsal"
}

step extension
if ! ready; then
    verdict SKIP extension "$(not_ready_reason)"
elif [ -z "$nvcc_path" ]; then
    verdict SKIP extension "nvcc not found: overlap._C would have no CUDA kernels, so the ext backend's\
 CUDA cases are skipped (its CPU half is checked by the CPU test suite)"
else
    # The install that builds the extension in place; -v shows setup.py's warning if it skips it.
    MAX_JOBS="$(nproc)" capped extension "$PY" -m pip install -v --no-build-isolation --no-deps -e . >/dev/null
    rc=$?
    if [ "$rc" != 0 ]; then
        ended extension "$rc"
        tail -20 "$OUT_DIR/extension.log"
    elif "$PY" - <<'EOF'; then
import torch
from overlap.kernels.backends import available_backends
import overlap._C  # noqa: F401
print("kernel backends on cuda, in auto's order:", available_backends(torch.device("cuda")))
for op in ("overlap::pack", "overlap::quantize"):
    assert torch._C._dispatch_has_kernel_for_dispatch_key(op, "CUDA"), op
EOF
        verdict PASS extension "overlap._C has its CUDA kernels"
    else
        skipped=$(grep -o 'installing without the overlap._C extension: [^.]*' "$OUT_DIR/extension.log" | head -1)
        verdict FAIL extension "overlap._C lacks its CUDA kernels${skipped:+: $skipped}; see $OUT_DIR/extension.log"
    fi
fi

# pytest_step NAME TEST_FILE: the file's CUDA cases (the compile-only cases run in the CPU suite).
pytest_step() {
    local name=$1 file=$2
    if ! ready; then
        verdict SKIP "$name" "$(not_ready_reason) (the CPU cases run in the test suite)"
    elif [ "$has_pytest" != 1 ]; then
        verdict SKIP "$name" "pytest is not importable here"
    else
        # Not the nvcc PTX test (its name says cuda too): it runs in the CPU suite.
        capped "$name" "$PY" -m pytest -q -p no:cacheprovider -k "cuda and not compile and not fuse_no_fma" "$file" \
            >/dev/null
        local rc=$?
        if [ "$rc" = 0 ]; then
            verdict PASS "$name" "$(tail -1 "$OUT_DIR/$name.log")"
        elif [ "$rc" = 5 ]; then
            verdict SKIP "$name" "no CUDA case selected: $(tail -1 "$OUT_DIR/$name.log")"
        else
            tail -15 "$OUT_DIR/$name.log"
            if [ "$rc" = 124 ]; then ended "$name" "$rc"
            else verdict FAIL "$name" "$(tail -1 "$OUT_DIR/$name.log"); see $OUT_DIR/$name.log"
            fi
        fi
    fi
}

step quant_kernels
pytest_step quant_kernels tests/test_quant_kernels.py

checks_logs=()      # the logs of gpu_checks.py written by this run, counted in the summary
# checks_step NAME: its checks of benchmarks/gpu_checks.py, in a process of their own.
checks_step() {
    local name=$1
    step "$name"
    if [ "$mode" = none ] || [ "$installed" != 1 ]; then
        local why="the package did not install"
        [ "$mode" = none ] && why="no CUDA device (torch.cuda.is_available() is False)"
        for check in ${CHECKS[$name]//,/ }; do verdict SKIP "$check" "$why"; done
    else
        if [ "$name" = sanitized ] && [ "$mode" = gpu ]; then
            # Read when torch is imported: the sanitizer wraps every CUDA op of the process.
            TORCH_CUDA_SANITIZER=1 capped "$name" "$PY" benchmarks/gpu_checks.py --only "${CHECKS[$name]}"
        else
            capped "$name" "$PY" benchmarks/gpu_checks.py --only "${CHECKS[$name]}" $rehearse
        fi
        ended "$name" $?
        checks_logs+=("$OUT_DIR/$name.log")
    fi
}
for name in "${STEPS[@]}"; do [ -n "${CHECKS[$name]:-}" ] && checks_step "$name"; done

step kernel_tests
pytest_step kernel_tests tests/test_kernels.py

sanitizer=$(command -v compute-sanitizer || ls "${CUDA_HOME:-/usr/local/cuda}/bin/compute-sanitizer" 2>/dev/null || true)
# sanitizer_step NAME TOOL: compute-sanitizer's TOOL over the extension's and CuPy's CUDA cases
# at their small sizes (the tools slow kernels 10-100x).
sanitizer_step() {
    local name=$1 tool=$2
    step "$name"
    if ! ready; then
        verdict SKIP "$name" "$(not_ready_reason)"
    elif [ -z "$sanitizer" ]; then
        verdict SKIP "$name" "compute-sanitizer not found (it ships with the CUDA toolkit)"
    elif [ "$has_pytest" != 1 ]; then
        verdict SKIP "$name" "pytest is not importable here"
    else
        capped "$name" "$sanitizer" --tool "$tool" --error-exitcode 3 "$PY" -m pytest -q -x -p no:cacheprovider \
            -k "cuda and (ext or cupy) and not compile and not fuse_no_fma" tests/test_kernels.py \
            tests/test_quant_kernels.py >/dev/null
        local rc=$?
        if [ "$rc" = 0 ]; then verdict PASS "$name" "$tool reports no error: $(tail -1 "$OUT_DIR/$name.log")"
        else ended "$name" "$rc"
        fi
    fi
}
# memcheck: out-of-bounds and misaligned accesses; racecheck: shared-memory races.
sanitizer_step kernel_memcheck memcheck
sanitizer_step kernel_racecheck racecheck

step kernel_bandwidth
if ! ready; then
    verdict SKIP kernel_bandwidth "$(not_ready_reason) (the CPU figures are in docs/kernels.md)"
else
    capped kernel_bandwidth "$PY" benchmarks/kernel_bandwidth.py --device cuda --repeats 10 \
        --out "$OUT_DIR/kernels_cuda.json"
    rc=$?
    if [ "$rc" = 0 ]; then verdict PASS kernel_bandwidth "table above; $OUT_DIR/kernels_cuda.json"
    else ended kernel_bandwidth "$rc"
    fi
fi

echo
echo "=== summary"
echo "not checked here, it needs more than one GPU: transfers between GPUs and their overlap, the"
echo "planner's link fit, gradients summed across ranks, ranks running different units."
for kind in PASS FAIL SKIP; do
    found=0
    (( ${#checks_logs[@]} )) && found=$(cat "${checks_logs[@]}" | grep -cE "^$kind ")
    COUNT[$kind]=$((COUNT[$kind] + found))
done
echo "${COUNT[PASS]} passed, ${COUNT[FAIL]} failed, ${COUNT[SKIP]} skipped; status $status after $((SECONDS - start_s)) s"
exit $status
