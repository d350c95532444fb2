#!/bin/bash
# A weighted mixture of three local folders, each prepared as a sharded dataset; trained on 2
# processes, stopped by a signal (a checkpoint, exit 75), resumed on 3: every source continues at
# its own next sample, so the run sees the batches an uninterrupted run sees, on any world size.
#   bash examples/mixture-resume.sh [WORK_DIR]     (default: a new temporary folder)
set -euo pipefail
work=${1:-$(mktemp -d)}
mkdir -p "$work"
repo=$(cd "$(dirname "$0")/.." && pwd)
distrain=${DISTRAIN:-distrain}

# 1. Three sources, each a folder of shards of at most 64 Ki tokens with an index.json.
$distrain prepare --out "$work/code" --shard-tokens 65536 --glob '**/*.py' --workers 1 \
    "$repo/distrain"
$distrain prepare --out "$work/docs" --shard-tokens 65536 --glob '**/*.md' --workers 1 "$repo/docs"
$distrain prepare --out "$work/tests" --shard-tokens 65536 --glob '*.py' --workers 1 "$repo/tests"

# 2. The mixture: [[data.sources]] with a path, a weight and a name (metrics data/tokens/NAME).
cat > "$work/mixture.toml" <<EOF
[data]
shuffle_window_shards = 2

[[data.sources]]
path = "$work/code"
weight = 0.5
name = "code"

[[data.sources]]
path = "$work/docs"
weight = 0.3
name = "docs"

[[data.sources]]
path = "$work/tests"
weight = 0.2
name = "tests"

[model]
family = "llama"
preset = "llama-tiny"

[training]
steps = 12
global_batch_size = 12
micro_batch_size = 2
seq_len = 64
log_interval_steps = 1
eval_interval_steps = 0
compile = false

[checkpoint]
interval_steps = 4

[metrics]
progress_bar = false
tensorboard = false
EOF

# 3. Train on 2 processes; after step 3, SIGTERM to the launcher: the run finishes its step,
#    commits a checkpoint and exits 75.
$distrain train --nproc 2 --config "$work/mixture.toml" --run-dir "$work/run" &
launcher=$!
until grep -qs '"step": 3, "loss"' "$work/run/metrics.jsonl"; do
    kill -0 "$launcher" 2>/dev/null || break
    sleep 0.2
done
kill -TERM "$launcher"
status=0
wait "$launcher" || status=$?
echo "stopped with exit status $status"

# 4. Resume on 3 processes: the same global batches, from the sample after the checkpoint's.
$distrain train --nproc 3 --config "$work/mixture.toml" --run-dir "$work/run"
grep -o '"step": 12, "loss[^}]*' "$work/run/metrics.jsonl" | tail -1
