#!/usr/bin/env bash
# GPU qualification of the CUDA path, in one run on a fresh GPU machine: at most 8.75 minutes (the phase
# limits add up to 525 s; about 5 minutes expected).
#
#   bench/gpu_qualify.sh              # on the GPU machine, from the repository root (or anywhere)
#   bench/gpu_qualify.sh --dry-run    # rehearsal on CPU: every phase, tiny shapes, kernels interpreted
#   (HYBRIDSERVE_GPU_QUALIFY_DRY=1 is the same as --dry-run)
#
# Needs: python3 with torch (CUDA build), triton, transformers, safetensors, tokenizers, numpy, pytest and
# pytest-timeout. Nothing is installed and no network is used: the project runs from this tree through
# PYTHONPATH, and nothing the model, the runner, the GPU tests or the benchmark import needs redis,
# opentelemetry or prometheus-client, so no wheels have to be carried. PYTHON=... picks another interpreter.
#
# Phases (each under `timeout`; a failed or timed-out phase is recorded and the next one runs):
#   env       device, versions, imports
#   kernels   tests/model/test_triton_kernels.py: every Triton kernel compiled on the GPU vs its torch contract
#   gpu-tests tests/model/test_gpu*.py: the CUDA backend (graphs on/off) vs transformers and the CPU path,
#             float32 and bf16; verify graphs vs the eager kernels
#   bench     bench/bench_gpu.py: prefill/decode throughput at batch 1, 8, 32, 128, 256 on a random
#             hidden-2048, 32-layer Bamba, torch path vs Triton eager vs CUDA graphs, vs the HBM floor
#   verify    bench/bench_gpu_verify.py: speculative decoding's verify steps (1, 4, 8 rows of 1 + 4 tokens)
#             from their CUDA graphs vs the eager kernels, and against a plain decode step, same model
# Output: $OUT/gpu_report.md (plus the phase logs next to it) when OUT is set, else bench/results/.
set -o pipefail
set -u

cd "$(dirname "$0")/.." || exit 1
ROOT=$PWD
DRY=${HYBRIDSERVE_GPU_QUALIFY_DRY:-0}
for arg in "$@"; do
    case "$arg" in
        --dry-run) DRY=1 ;;
        *) echo "unknown argument: $arg (only --dry-run)" >&2; exit 2 ;;
    esac
done
PY=${PYTHON:-python3}
export PY
DEST=${OUT:-$ROOT/bench/results}
mkdir -p "$DEST"
REPORT=$DEST/gpu_report.md
export PYTHONUNBUFFERED=1 PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}"
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 TOKENIZERS_PARALLELISM=false
export TRITON_CACHE_DIR=${TRITON_CACHE_DIR:-/tmp/hybridserve-triton-cache}
if [ "$DRY" = 1 ]; then
    BENCH_ARGS=(--dry-run --time-budget-s 150)
    SCALE=2  # the CPU interpreter is slow: longer limits, still bounded
else
    BENCH_ARGS=(--time-budget-s 110)
    SCALE=1
fi
STARTED=$SECONDS
PHASES=()

log() { echo "[$(date -u +%H:%M:%S)] $*"; }

# run_phase NAME LIMIT_S CMD...: runs CMD under timeout, output to $DEST/NAME.log (and the console)
run_phase() {
    local name=$1 limit=$(($2 * SCALE)) t0=$SECONDS rc status
    shift 2
    log "phase $name: start (limit ${limit}s)"
    timeout -k 10 "$limit" "$@" 2>&1 | tee "$DEST/$name.log"
    rc=$?
    case $rc in
        0) status=ok ;;
        124 | 137) status="TIMED OUT after ${limit}s" ;;
        *) status="FAILED (exit $rc)" ;;
    esac
    log "phase $name: $status in $((SECONDS - t0))s"
    PHASES+=("| $name | $status | $((SECONDS - t0)) |")
}

env_phase() {
    command -v nvidia-smi >/dev/null && nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.max.mem \
        --format=csv || echo "nvidia-smi: not available"
    "$PY" - <<'EOF'
import platform, sys
import torch
print("python", sys.version.split()[0], platform.machine())
print("torch", torch.__version__, "cuda", torch.version.cuda, "available", torch.cuda.is_available())
if torch.cuda.is_available():
    p = torch.cuda.get_device_properties(0)
    print("device", p.name, f"{p.total_memory / 2**30:.0f} GiB", f"sm_{p.major}{p.minor}", p.multi_processor_count, "SMs")
import triton, transformers
print("triton", triton.__version__, "transformers", transformers.__version__)
import gpu_worker.runner.runner, gpu_worker.model.backends.cuda.ops, gpu_worker.runner.cuda_graphs  # the CUDA path imports
print("imports ok")
EOF
}

log "gpu_qualify: dry run=$DRY, python=$PY, output in $DEST"
run_phase env 40 bash -c "$(declare -f env_phase); env_phase"
run_phase kernels 75 "$PY" -m pytest -p no:cacheprovider -v --timeout 60 tests/model/test_triton_kernels.py
run_phase gpu-tests 165 "$PY" -m pytest -p no:cacheprovider -v --timeout 90 tests/model/test_gpu.py \
    tests/model/test_gpu_backend.py
run_phase bench 170 "$PY" bench/bench_gpu.py --out "$DEST/bench.md" "${BENCH_ARGS[@]}"
VERIFY_ARGS=()
[ "$DRY" = 1 ] && VERIFY_ARGS=(--dry-run)
run_phase verify 75 "$PY" bench/bench_gpu_verify.py --out "$DEST/verify.md" ${VERIFY_ARGS[@]+"${VERIFY_ARGS[@]}"}

{
    echo "# GPU qualification report"
    echo
    echo "- $(date -u '+%Y-%m-%d %H:%M UTC'); commit $(git rev-parse --short HEAD 2>/dev/null || echo unknown);" \
        "dry run: $DRY; total $((SECONDS - STARTED)) s"
    echo
    echo "| phase | result | seconds |"
    echo "|---|---|---|"
    printf '%s\n' "${PHASES[@]}"
    echo
    echo "## Environment"
    echo
    echo '```'
    cat "$DEST/env.log" 2>/dev/null
    echo '```'
    for name in kernels gpu-tests; do
        echo
        echo "## Tests: $name"
        echo
        echo '```'
        grep -E "PASSED|FAILED|ERROR|SKIPPED|passed|failed|error" "$DEST/$name.log" 2>/dev/null | tail -n 60
        echo '```'
    done
    echo
    echo "## Benchmark"
    for name in bench verify; do  # each phase's markdown, else the end of its log
        echo
        if [ -s "$DEST/$name.md" ]; then
            sed 's/^# /### /' "$DEST/$name.md"
        else
            echo "No output from phase $name; the last lines of its log:"
            echo '```'
            tail -n 40 "$DEST/$name.log" 2>/dev/null
            echo '```'
        fi
    done
} >"$REPORT"
log "report written to $REPORT ($((SECONDS - STARTED))s in all)"
