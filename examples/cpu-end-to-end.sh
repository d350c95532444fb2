#!/bin/bash
# The whole path on a CPU in well under a minute: prepare a token file, train a tiny Llama-shaped
# model for a few steps on 2 processes, sample from it, export it as a Hugging Face folder.
#   bash examples/cpu-end-to-end.sh [WORK_DIR]     (default: a new temporary folder)
set -euo pipefail
work=${1:-$(mktemp -d)}
mkdir -p "$work"
distrain=${DISTRAIN:-distrain}

# 1. Some text (here: this script's folder, any .md/.sh/.toml file), tokenized byte-level.
$distrain prepare --out "$work/train.bin" --glob '**/*.*' --workers 1 "$(dirname "$0")"

# 2. Train: 2 worker processes, data-parallel, a checkpoint at the end.
$distrain train --nproc 2 --run-dir "$work/run" \
    --model.family llama --model.preset llama-tiny --data.path "$work/train.bin" \
    --training.steps 4 --training.global_batch_size 4 --training.micro_batch_size 2 \
    --training.seq_len 64 --training.eval_interval_steps 0 --training.compile false

# 3. Where it stands, and a sample from its checkpoint.
$distrain status "$work/run"
$distrain generate --run-dir "$work/run" --prompt "distrain" --max-new-tokens 32

# 4. A Hugging Face folder transformers can load: config.json, generation_config.json, the
#    safetensors shards and their index (a byte-level run has no tokenizer files to ship).
$distrain export "$work/run" --out "$work/hf"
ls "$work/hf"
