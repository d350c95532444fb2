#!/usr/bin/env bash
# The GPU check, one script for a machine with one or more CUDA GPUs (an H200 in mind):
#   1. the tests that exercise CUDA code paths on one GPU (CUDA-event comm timing, NVTX ranges
#      and the profiler, training.precision auto -> bf16);
#   2. benchmarks/mfu.py on the 1b preset, bf16, eager and torch.compile, seq 2048, the largest
#      micro-batch of MICRO_BATCHES that fits (an out-of-memory run falls through to the next);
#      it prints tokens/s and MFU against the GPU's dense bf16 peak (989 TFLOP/s on an H200).
# --dry-run: the same steps on CPU with a tiny model and a few steps, so CI keeps the script
# working where no GPU is (eager only: compiling on CI's 2 cores would cost more than the run;
# MFU against the H200 figure, since measuring a CPU's bf16 matmul peak takes minutes without AMX).
# Run from anywhere; PYTHON picks the interpreter (default python3), OUT_DIR the JSON's folder.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON="${PYTHON:-python3}"
OUT_DIR="${OUT_DIR:-benchmarks/results}"
TESTS=(
    "tests/test_compress.py::test_comm_clock_on_cuda_measures_the_stream_not_the_launch"
    tests/test_profiling.py
    tests/test_precision.py
)

if [ "${1-}" = "--dry-run" ]; then
    echo "== dry run on CPU: CUDA test subset (collected only), then mfu.py on a tiny model"
    "$PYTHON" -m pytest -q --collect-only "${TESTS[@]}" >/dev/null
    "$PYTHON" benchmarks/mfu.py --preset gpt2-tiny --seq-len 32 --micro-batch-size 2 \
        --ranks 1 --warmup 1 --steps 2 --no-compile-variant --peak-tflops 989 --out "$OUT_DIR/gpu-dry-run.json"
    exit 0
elif [ $# -gt 0 ]; then
    echo "usage: benchmarks/gpu.sh [--dry-run]" >&2
    exit 2
fi

"$PYTHON" -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 'no CUDA device here; use --dry-run')"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader || true
echo "== CUDA test subset"
"$PYTHON" -m pytest -q -rs "${TESTS[@]}"
echo "== mfu.py: 1b, bf16, seq 2048, eager and compiled, on one GPU"
for mb in ${MICRO_BATCHES:-16 8 4 2 1}; do
    if "$PYTHON" benchmarks/mfu.py --preset 1b --seq-len 2048 --micro-batch-size "$mb" \
        --ranks 1 --out "$OUT_DIR/gpu-mfu.json"; then
        exit 0
    fi
    echo "micro-batch $mb failed (out of memory?); trying a smaller one"
done
echo "no micro-batch size ran" >&2
exit 1
