#!/usr/bin/env bash
# The GPU acceptance run: one command on a machine with a CUDA GPU (an H100 or H200 in mind), no
# download, from the source tree, at most 8 minutes on one GPU. benchmarks/gpu_acceptance.py runs
# its stages (the CUDA tests; tokens/s and MFU of llama3-1b and qwen3-0.6b, bf16, eager and
# compiled, activation checkpointing none and full; the async checkpoint stall with pinned staging
# against the synchronous save; the planner's memory against torch.cuda.max_memory_allocated on
# the same rows; distrain's ranges in a profiler trace, and NVTX under nsys where installed),
# each within its own time budget, into one record: benchmarks/results/gpu-acceptance.json.
# A failing stage is recorded and the run goes on; the exit status is 1 if any failed.
# --dry-run: every stage on CPU with tiny sizes and no compiling (CI runs it), writing
# gpu-dry-run.json instead. PYTHON picks the interpreter (default python3), OUT_DIR the JSON's
# folder (default benchmarks/results).
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON="${PYTHON:-python3}"
OUT_DIR="${OUT_DIR:-benchmarks/results}"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"

if [ "${1-}" = "--dry-run" ]; then
    exec "$PYTHON" benchmarks/gpu_acceptance.py --dry-run --out-dir "$OUT_DIR"
elif [ $# -gt 0 ]; then
    echo "usage: benchmarks/gpu.sh [--dry-run]" >&2
    exit 2
fi
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader || true
exec "$PYTHON" benchmarks/gpu_acceptance.py --out-dir "$OUT_DIR"
