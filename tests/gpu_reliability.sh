#!/usr/bin/env bash
# tests/gpu_reliability.sh: the GPU half of the reliability tests, in one command on a GPU machine.
#
#   bash tests/gpu_reliability.sh            (from the repository root or anywhere)
#
# Steps (each with its own time limit; the whole took 4 minutes on an H100, its limits add up to
# 9.5 minutes):
#   1 plain     the files of STEP1 below without a sanitizer: the CUDA bad-input matrix,
#               non-finite input, validation, two threads on two streams, and every backward
#               route at the 32-bit limits in NaN-filled memory (the `huge` tests: tens of GB of
#               GPU memory); also the C library's own argument checks.
#   2 memcheck  compute-sanitizer memcheck over the lying device-side shape tables
#               (-k "lying and cuda"): proves no read or write outside the tensors.
#   3 memcheck  over the CUDA test suite (-k "cuda"; tests/test_routes.py reaches every backward
#               route and dtype) minus the `huge` tests (too slow instrumented), the lying tests of
#               step 2, the `caching_allocator` tests (CUDA graph capture and the
#               no-synchronisation test, which need torch's caching allocator) and the
#               `own_library` test (it builds and loads an sm_80 library: step 4 does that), in
#               parallel shards (tests/sanitizer_shards.py; SHARDS, default half the CPU cores,
#               at most 8).
#   4 memcheck  the half-precision cases of tests/test_routes.py with a library of sm_80 code
#               (SM80_LIBRARY, else built into build-sm80/ first, about a minute): on a GPU of
#               sm_90 or newer the only way to run the routes older GPUs take (a half grad_value
#               summed in an f32 workspace, grad_value zeroed by cudaMemsetAsync).
#   5 racecheck over a small forward/backward workload reaching every CUDA kernel: every
#               backward route (asserted through pymsda.routes), every fast-path group size,
#               partial point chunks, every dtype, each combination of requested gradients.
#   6 synccheck over the same workload (barriers and warp shuffles under divergence).
# Sanitizer steps run with PYTORCH_NO_CUDA_MEMORY_CACHING=1, so every tensor is its own
# cudaMalloc and memcheck knows its exact bounds, and instrument only pymsda's kernels
# (--kernel-name kns=msda): torch's own kernels run at full speed and are not judged.
#
# Prints a summary table and exits non-zero if any step failed, timed out, or any sanitizer
# reported anything (errors, or racecheck hazards of any severity). Logs: $LOG_DIR (default
# $OUT/gpu_reliability when $OUT is set, else /tmp/gpu_reliability).
# Environment: PYTHON (python3), COMPUTE_SANITIZER (found on PATH or under the CUDA toolkit),
# STEP_LIMITS ("120 60 150 150 60 45" seconds), MEMCHECK_K / MEMCHECK_M (the -k and -m
# expressions of step 3), SHARDS (step 3's parallel processes), SM80_LIBRARY (step 4's library).
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"  # the workload scripts run from a temporary folder

PYTHON=${PYTHON:-python3}
LOG_DIR=${LOG_DIR:-${OUT:+$OUT/gpu_reliability}}
LOG_DIR=${LOG_DIR:-/tmp/gpu_reliability}
mkdir -p "$LOG_DIR"
read -r -a LIMITS <<< "${STEP_LIMITS:-120 60 150 150 60 45}"
MEMCHECK_K=${MEMCHECK_K:-"cuda and not lying"}
MEMCHECK_M=${MEMCHECK_M:-"not huge and not caching_allocator and not own_library"}
half=$(( $(nproc) / 2 ))
SHARDS=${SHARDS:-$(( half < 1 ? 1 : (half > 8 ? 8 : half) ))}
export PYTHONUNBUFFERED=1

say() { printf '%s\n' "$*" | tee -a "$LOG_DIR/summary.txt"; }
: > "$LOG_DIR/summary.txt"

# ---- preflight: a GPU, a CUDA build of the library, compute-sanitizer ---------------------------
if ! "$PYTHON" -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)"; then
    say "FAIL: torch sees no GPU ($PYTHON)"; exit 2
fi
if ! "$PYTHON" -c "import pymsda, sys; sys.exit(0 if pymsda.has_cuda() else 1)" 2>/dev/null; then
    arch=$(nvidia-smi --query-gpu=compute_cap --format=csv,noheader 2>/dev/null | head -n 1 | tr -d '. ')
    say "the loaded libpymsda has no CUDA kernels: building build-gpu/ for sm_${arch:-90}"
    make --no-print-directory BUILD=build-gpu MSDA_CUDA=1 CUDA_ARCHS="${arch:-90}" \
        >"$LOG_DIR/build.log" 2>&1 || { say "FAIL: make (see $LOG_DIR/build.log)"; exit 2; }
    export PYMSDA_LIBRARY="$PWD/build-gpu/libpymsda.so"
fi
CS=${COMPUTE_SANITIZER:-$(command -v compute-sanitizer || true)}
if [ -z "$CS" ]; then
    nvcc_dir=$(dirname "$(readlink -f "$(command -v nvcc || echo /usr/local/cuda/bin/nvcc)")")
    for c in "$nvcc_dir/compute-sanitizer" "$nvcc_dir/../compute-sanitizer/compute-sanitizer" \
             /usr/local/cuda/bin/compute-sanitizer /usr/local/cuda/compute-sanitizer/compute-sanitizer \
             /opt/nvidia/compute-sanitizer/compute-sanitizer; do
        [ -x "$c" ] && { CS=$c; break; }
    done
fi
[ -n "$CS" ] || { say "FAIL: compute-sanitizer not found (set COMPUTE_SANITIZER)"; exit 2; }
# (the whole help text is read before grep: grep -q would close the pipe early and, under
# pipefail, make the test fail)
if "$CS" --help 2>&1 | grep -- "--kernel-name" >/dev/null; then
    FILTER=(--kernel-name kns=msda)
else
    FILTER=(--filter kns=msda)
fi
SAN=("$CS" "${FILTER[@]}" --error-exitcode 1 --print-limit 50)
say "pymsda: $("$PYTHON" -c 'import pymsda, torch; print(pymsda.library_path(), "| torch", torch.__version__, "|", torch.cuda.get_device_name(), "| archs", " ".join(pymsda.cuda_archs()))')"
say "compute-sanitizer: $CS ($("$CS" --version 2>/dev/null | tail -n 1))"

# ---- the racecheck / synccheck workload ---------------------------------------------------------
WORKLOAD="$(mktemp -d)/workload.py"
cat > "$WORKLOAD" <<'EOF'
"""Every CUDA kernel of pymsda once, forward and backward, on small shapes; every backward route
(c/msda.h: msda_route) is asserted to be reached."""
import itertools
import torch
import pymsda
from pymsda.routes import backward_route

torch.manual_seed(0)
shapes = [(7, 9), (4, 5), (2, 3), (1, 1)]           # L = 4; S = 90
S = sum(h * w for h, w in shapes)
# (dtype, C, Q, P, options): C = 4*G for every fast-path group size G = 1..32 in f32 (the shared
# memory layout depends on G, not on the type), G = 1, 8, 32 in f16 and bf16; the generic
# kernels: C = 5, C = 256, f64. Q = S = 90 with P = 5 (20 points an item: two chunks) is an
# encoder (the aggregated route for G >= 4), Q = 3 a decoder whose points are sliced (bf16) or
# split over lane groups (the direct kernel in f32 and f16), P = 1 a decoder of 4 points (direct);
# Q = 1500 with P = 5, past 2^16 lanes at C = 32, takes the staged forward and, in bf16, the
# pipelined backward.
decoders = ((90, 5), (3, 5), (3, 1))
cases = [(torch.float32, c, q, p, {}) for c in (4, 8, 16, 32, 64, 128) for q, p in decoders] + \
        [(d, c, q, p, {}) for d in (torch.float16, torch.bfloat16) for c in (4, 32, 128)
         for q, p in decoders] + \
        [(torch.float32, 32, 37, 5, dict(sampling="nearest")),
         (torch.bfloat16, 32, 3, 1, dict(sampling="nearest")),
         (torch.float32, 5, 37, 5, {}), (torch.bfloat16, 256, 37, 5, {}),
         (torch.float64, 8, 37, 5, {}), (torch.float64, 3, 3, 1, {}),
         (torch.float32, 32, 0, 5, {}),
         (torch.float32, 32, 1500, 5, {}), (torch.bfloat16, 32, 1500, 5, {})]
seen, runs = set(), 0
# all gradients (the fast backward then runs its two passes: point gradients, then grad_value)
# and the weight gradient alone, each atomic and deterministic
for (dtype, C, Q, P, options), grads, det in itertools.product(
        cases, [(1, 1, 1), (0, 0, 1)], [False, True]):
    value = torch.randn(2, S, 3, C, device="cuda", dtype=dtype)
    loc = (torch.rand(2, Q, 3, 4, P, 2, device="cuda") * 1.4 - 0.2).to(dtype)
    attn = torch.rand(2, Q, 3, 4, P, device="cuda").to(dtype)
    leaves = [t.requires_grad_(bool(g)) for t, g in zip((value, loc, attn), grads)]
    names = [n for n, g in zip(("value", "sampling_locations", "attention_weights"), grads) if g]
    route = backward_route(2, S, 3, C, 4, Q, P, dtype, deterministic=det, grads=names, **options)
    seen.add((route.kernel, route.deterministic))
    out = pymsda.ms_deform_attn(leaves[0], shapes, None, leaves[1], leaves[2], deterministic=det,
                                **options)
    out.backward(torch.randn_like(out))
    runs += 1
torch.cuda.synchronize()
missing = set(pymsda._clib.ROUTE_KERNELS.values()) - {k for k, _ in seen}
assert not missing, f"routes not reached: {sorted(missing)}"
assert {k for k, d in seen if d} >= {"generic", "point", "aggregated"}, seen
print(f"workload: {runs} forward/backward runs over {len(cases)} kernel configurations; "
      f"routes reached: {sorted(seen)}")
EOF

# ---- steps ---------------------------------------------------------------------------------------
status=0
declare -a ROWS
run_step() {  # name limit kind(plain|memcheck|racecheck|synccheck) command...
    local name=$1 limit=$2 kind=$3; shift 3
    local log="$LOG_DIR/$name.log" start rc summary result
    start=$(date +%s)
    echo "== $name ($kind, limit ${limit}s): $*" | tee "$log"
    timeout --signal=INT --kill-after=20 "$limit" "$@" >>"$log" 2>&1
    rc=$?
    summary=""
    case $kind in
        memcheck|synccheck) summary=$(grep -Eo "ERROR SUMMARY: [0-9]+ errors?" "$log" | tail -n 1) ;;
        racecheck) summary=$(grep -Eo "RACECHECK SUMMARY: [0-9]+ hazards? displayed \([0-9]+ errors?, [0-9]+ warnings?\)" "$log" | tail -n 1) ;;
        plain) summary=$(grep -Eo "[0-9]+ passed.*in [0-9.]+s" "$log" | tail -n 1) ;;
    esac
    if [ $rc -eq 124 ] || [ $rc -eq 130 ] || [ $rc -eq 137 ]; then
        result="TIMEOUT"
    elif [ "$kind" != plain ] && [ -z "$summary" ]; then
        result="FAIL(no summary, rc=$rc)"
    elif [ "$kind" = racecheck ] && ! echo "$summary" | grep -q "SUMMARY: 0 hazard"; then
        result="FAIL(hazards)"
    elif [ "$kind" != plain ] && [ "$kind" != racecheck ] && ! echo "$summary" | grep -q "SUMMARY: 0 error"; then
        result="FAIL(errors)"
    elif [ $rc -ne 0 ]; then
        result="FAIL(tests, rc=$rc)"
    else
        result="PASS"
    fi
    [ "$result" = PASS ] || status=1
    ROWS+=("$(printf '%-15s %-9s %-16s %5ss  %s' "$name" "$kind" "$result" "$(( $(date +%s) - start ))" "$summary")")
    tail -n 5 "$log"
}

STEP1=(tests/test_inputs.py tests/test_unusual_tensors.py tests/test_non_finite.py
       tests/test_lying_tables.py tests/test_threads.py tests/test_large_problems.py
       tests/test_library.py::test_c_library_refuses_sizes_it_cannot_index
       tests/test_library.py::test_c_library_refuses_a_thread_count_openmp_would_abort_on
       tests/test_library.py::test_c_library_refuses_misaligned_pointers)
unset PYTORCH_NO_CUDA_MEMORY_CACHING  # torch disables caching when it is set at all
run_step plain "${LIMITS[0]}" plain \
    "$PYTHON" -m pytest "${STEP1[@]}" -q -p no:cacheprovider -rs

export PYTORCH_NO_CUDA_MEMORY_CACHING=1
run_step memcheck-lying "${LIMITS[1]}" memcheck \
    "${SAN[@]}" --tool memcheck "$PYTHON" -m pytest tests -q -p no:cacheprovider -k "lying and cuda"
run_step memcheck-suite "${LIMITS[2]}" memcheck \
    "$PYTHON" tests/sanitizer_shards.py --shards "$SHARDS" --log-dir "$LOG_DIR" \
    "${SAN[@]}" --tool memcheck -- tests -k "$MEMCHECK_K" -m "$MEMCHECK_M"
sm80_library() {  # step 4's library: SM80_LIBRARY, or build-sm80/ made now
    if [ -n "${SM80_LIBRARY:-}" ]; then echo "$SM80_LIBRARY"; return; fi
    make --no-print-directory BUILD=build-sm80 MSDA_CUDA=1 CUDA_ARCHS=80 -j "$(nproc)" \
        >"$LOG_DIR/build-sm80.log" 2>&1 && echo "$PWD/build-sm80/libpymsda.so"
}
SM80=$(sm80_library)
if [ -n "$SM80" ]; then
    run_step memcheck-sm80 "${LIMITS[3]}" memcheck env PYMSDA_LIBRARY="$SM80" \
        "${SAN[@]}" --tool memcheck "$PYTHON" -m pytest tests/test_routes.py -q -p no:cacheprovider \
        -k "cuda and (float16 or bfloat16)"
else
    say "FAIL: make of the sm_80 library (see $LOG_DIR/build-sm80.log)"
    status=1
    ROWS+=("$(printf '%-15s %-9s %-16s' memcheck-sm80 memcheck 'FAIL(build)')")
fi
run_step racecheck "${LIMITS[4]}" racecheck \
    "${SAN[@]}" --tool racecheck "$PYTHON" "$WORKLOAD"
run_step synccheck "${LIMITS[5]}" synccheck \
    "${SAN[@]}" --tool synccheck "$PYTHON" "$WORKLOAD"

say ""
say "step            tool      result            time  summary"
for row in "${ROWS[@]}"; do say "$row"; done
if [ $status -eq 0 ]; then
    say "gpu_reliability: PASS (all steps clean; logs in $LOG_DIR)"
else
    say "gpu_reliability: FAIL (see the logs in $LOG_DIR)"
fi
exit $status
