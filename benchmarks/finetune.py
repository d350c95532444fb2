"""Fine-tuning a Hugging Face folder: LoRA against full fine-tuning, side by side in one run.

The script makes a small random Llama with transformers (`save_pretrained`, with a byte-level BPE
and a ChatML chat template), writes chat conversations and prepares them with the folder's
template, then runs `distrain train --model.init_from hf:FOLDER` as a user types it, once per
mode (full: every weight trains; LoRA: rank 16, alpha 32 on q/k/v/o_proj, as
docs/guides/fine-tuning.md) and layout (1 process and 2 processes: dp2). Each repetition runs
every layout, the two modes back to back (the first of the pair alternating between
repetitions), so machine noise hits both modes alike. Per run:

- tokens/s: the global batch's tokens over the median step time (metrics.jsonl's step_time_s,
  the slowest rank's) of the steps after --warmup;
- peak RSS: the largest resident-set high-water mark of the run's processes (the launcher and
  its workers: `os.wait4`'s ru_maxrss, which covers the waited-for descendants);
- time to first step: from the `distrain train` process's start to the first metrics row
  (step 1; log_interval_steps = 1).

And, in this process: the import of the folder (its config read, the model built on the meta
device, materialized and filled from the safetensors: what each rank does at its start) against
the seeded init of the same model, median of 3 after one untimed.

    python3 benchmarks/finetune.py                 # 1 and 2 processes, 3 repetitions
    python3 benchmarks/finetune.py --nprocs 1 --repeats 1

Prints a table and writes JSON to --out (default benchmarks/results/finetune.json). On CPU the
ratios (LoRA / full) are the figures to read.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch
from harness import write_json

ROOT = Path(__file__).resolve().parent.parent
# ChatML, the assistant's answer inside generation markers (tests/test_chat.py's template).
TEMPLATE = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' }}"
    "{%- if message['role'] == 'assistant' %}"
    "{% generation %}{{- message['content'] + '<|im_end|>' }}{% endgeneration %}{{- '\\n' }}"
    "{%- else %}{{- message['content'] + '<|im_end|>\\n' }}{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)
WORDS = "the cat sat on a mat and saw one red fox run over two big logs by the old river".split()
LORA = ["--lora.rank", "16", "--lora.alpha", "32", "--lora.target_modules",
        "q_proj,k_proj,v_proj,o_proj"]  # fmt: skip
MODEL = {
    "vocab_size": 8192,
    "hidden_size": 256,
    "intermediate_size": 1024,
    "num_hidden_layers": 4,
    "num_attention_heads": 8,
    "num_key_value_heads": 4,
    "max_position_embeddings": 1024,
    "tie_word_embeddings": False,
}


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--nprocs", default="1,2", help="comma-separated process counts (dp)")
    parser.add_argument("--repeats", type=int, default=3, help="runs of each mode and layout")
    parser.add_argument("--steps", type=int, default=8, help="training steps per run")
    parser.add_argument("--warmup", type=int, default=2, help="first steps left out of tokens/s")
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--global-batch", type=int, default=4)
    parser.add_argument("--micro-batch", type=int, default=2)
    parser.add_argument("--out", default="benchmarks/results/finetune.json", help="JSON output")
    return parser.parse_args(argv)


def make_folder(folder: Path) -> None:
    """A random transformers Llama (MODEL) saved with a ChatML byte-level BPE."""
    import transformers
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=320,
        special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator([" ".join(WORDS)] * 50 + ["user assistant system"] * 20, trainer)
    fast = transformers.PreTrainedTokenizerFast(
        tokenizer_object=tok, eos_token="<|im_end|>", pad_token="<|endoftext|>"
    )
    fast.chat_template = TEMPLATE
    fast.save_pretrained(folder)
    torch.manual_seed(0)
    config = transformers.LlamaConfig(**MODEL)
    transformers.AutoModelForCausalLM.from_config(config).save_pretrained(folder)


def write_chat(path: Path, count: int) -> None:
    rng = np.random.default_rng(0)

    def text(n: int) -> str:
        return " ".join(rng.choice(WORDS, size=n))

    with path.open("w") as f:
        for i in range(count):
            messages = []
            for _ in range(1 + i % 3):
                messages += [
                    {"role": "user", "content": text(int(rng.integers(3, 12)))},
                    {"role": "assistant", "content": text(int(rng.integers(5, 30)))},
                ]
            f.write(json.dumps({"messages": messages}) + "\n")


def time_import(folder: Path) -> dict[str, list[float]]:
    """Seconds to build the model from the folder's safetensors, and from the seed (what a rank
    does at its start), each 3 times after an untimed one."""
    from distrain.config.schema import ModelConfig
    from distrain.models.decoder.model import Decoder, init_weights
    from distrain.models.registry import model_args, model_family

    spec = f"hf:{folder}"
    args = model_args(ModelConfig(family="llama", init_from=spec))

    def build(from_folder: bool) -> float:
        start = time.perf_counter()
        with torch.device("meta"):
            model = Decoder(args)
        model.to_empty(device="cpu")
        source = model_family("llama").hf.source(spec, args) if from_folder else None
        init_weights(model, args, 0, source=source)
        return time.perf_counter() - start

    out: dict[str, list[float]] = {}
    for key, from_folder in (("import_s", True), ("seeded_init_s", False)):
        build(from_folder)
        out[key] = [build(from_folder) for _ in range(3)]
    return out


def train_once(
    args: argparse.Namespace, work: Path, nproc: int, mode: str, index: int
) -> dict[str, Any]:
    """One `distrain train` run: its tokens/s, peak RSS and time to first step."""
    run_dir = work / "runs" / f"{mode}-{nproc}-{index}"
    folder = "hf:models/llama"
    argv = [
        sys.executable, "-m", "distrain", "train", "--nproc", str(nproc),
        "--model.family", "llama", "--model.init_from", folder,
        "--data.path", "data/chat.bin", "--data.tokenizer", folder,
        "--data.document_masking", "true",
        "--training.seq_len", str(args.seq_len),
        "--training.global_batch_size", str(args.global_batch),
        "--training.micro_batch_size", str(args.micro_batch),
        "--training.steps", str(args.steps),
        "--training.log_interval_steps", "1", "--training.eval_interval_steps", "0",
        "--checkpoint.interval_steps", "0", "--checkpoint.at_end", "false",
        "--metrics.progress_bar", "false", "--metrics.tensorboard", "false",
        "--run.dir", str(run_dir),
        *(LORA if mode == "lora" else []),
    ]  # fmt: skip
    env = dict(
        os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])
    )
    metrics = run_dir / "metrics.jsonl"
    log = work / f"{run_dir.name}.log"
    with log.open("w") as out:
        start = time.perf_counter()
        proc = subprocess.Popen(argv, cwd=work, env=env, stdout=out, stderr=subprocess.STDOUT)
        first = None
        while True:
            pid, status, usage = os.wait4(proc.pid, os.WNOHANG)
            if first is None and metrics.is_file() and metrics.stat().st_size > 0:
                first = time.perf_counter() - start
            if pid:
                break
            time.sleep(0.02)
    proc.returncode = os.waitstatus_to_exitcode(status)
    if proc.returncode != 0:
        raise RuntimeError(f"{mode} on {nproc}: exit {proc.returncode}\n{log.read_text()[-3000:]}")
    rows = [r for r in map(json.loads, metrics.read_text().splitlines()) if "step_time_s" in r]
    assert len(rows) == args.steps, rows
    step_s = statistics.median(r["step_time_s"] for r in rows[args.warmup :])
    return {
        "nproc": nproc,
        "mode": mode,
        "tokens_per_s": args.global_batch * args.seq_len / step_s,
        "step_s": step_s,
        "peak_rss_mib": usage.ru_maxrss / 1024,  # KiB on Linux
        "first_step_s": first,
        "final_loss": rows[-1]["loss"],
    }


def param_counts() -> dict[str, int]:
    """The model's parameters, and the LoRA run's trainable ones (rank x (in + out) per adapted
    linear)."""
    m = MODEL
    d, layers, f = m["hidden_size"], m["num_hidden_layers"], m["intermediate_size"]
    head = d // m["num_attention_heads"]
    kv = m["num_key_value_heads"] * head
    per_layer = 2 * d * d + 2 * d * kv + 3 * d * f + 2 * d
    total = layers * per_layer + 2 * m["vocab_size"] * d + d
    lora = layers * 16 * ((d + d) + (d + kv) + (d + kv) + (d + d))
    return {"params": total, "lora_trainable": lora}


def main() -> None:
    args = parse_args(sys.argv[1:])
    nprocs = [int(n) for n in args.nprocs.split(",")]
    with tempfile.TemporaryDirectory(prefix="distrain-finetune-") as tmp:
        work = Path(tmp)
        make_folder(work / "models" / "llama")
        (work / "data").mkdir()
        write_chat(work / "data" / "chat.jsonl", 1500)
        from distrain.data.prepare import prepare

        prepare([str(work / "data" / "chat.jsonl")], out=str(work / "data" / "chat.bin"),
                tokenizer=f"hf:{work / 'models' / 'llama'}", workers=1)  # fmt: skip
        imported = time_import(work / "models" / "llama")
        runs = []
        for rep in range(args.repeats):
            for nproc in nprocs:
                order = ("full", "lora") if rep % 2 == 0 else ("lora", "full")
                for mode in order:
                    runs.append(train_once(args, work, nproc, mode, rep))
                    r = runs[-1]
                    print(
                        f"{mode:>4} x{nproc}: {r['tokens_per_s']:,.0f} tok/s, "
                        f"peak RSS {r['peak_rss_mib']:.0f} MiB, first step "
                        f"{r['first_step_s']:.1f} s",
                        flush=True,
                    )
    rows = []
    for nproc in nprocs:
        row: dict[str, Any] = {"nproc": nproc}
        for mode in ("full", "lora"):
            mine = [r for r in runs if r["nproc"] == nproc and r["mode"] == mode]
            for key in ("tokens_per_s", "peak_rss_mib", "first_step_s"):
                row[f"{mode}_{key}"] = [r[key] for r in mine]
        for key in ("tokens_per_s", "peak_rss_mib", "first_step_s"):
            row[f"ratio_{key}"] = statistics.median(row[f"lora_{key}"]) / statistics.median(
                row[f"full_{key}"]
            )
        rows.append(row)
    print("\nLoRA (rank 16, q/k/v/o) against full fine-tuning; median of", args.repeats, "runs")
    print("| processes | figure | full | LoRA | LoRA / full |")
    print("|---|---|---|---|---|")
    for row in rows:
        for key, spec in (
            ("tokens_per_s", ",.0f"),
            ("peak_rss_mib", ".0f"),
            ("first_step_s", ".1f"),
        ):
            full = statistics.median(row[f"full_{key}"])
            lora = statistics.median(row[f"lora_{key}"])
            print(f"| {row['nproc']} | {key} | {full:{spec}} | {lora:{spec}} | "
                  f"{row[f'ratio_{key}']:.2f} |")  # fmt: skip
    print(
        f"import of the folder {statistics.median(imported['import_s']):.2f} s, seeded init "
        f"{statistics.median(imported['seeded_init_s']):.2f} s"
    )
    config = {
        "model": MODEL,
        **param_counts(),
        "lora": " ".join(LORA),
        "seq_len": args.seq_len,
        "global_batch": args.global_batch,
        "micro_batch": args.micro_batch,
        "steps": args.steps,
        "warmup": args.warmup,
        "repeats": args.repeats,
        "device": "cpu",
    }
    write_json(args.out, {"config": config, "import": imported, "rows": rows, "runs": runs})


if __name__ == "__main__":
    main()
