"""Sampling from a run's latest checkpoint: rebuild the model from <run_dir>/config.toml, load only
the model weights (any layout's checkpoint loads into the plain module), and sample text with the
run's tokenizer (data.tokenizer)."""

from __future__ import annotations

import logging
import warnings
from pathlib import Path

import torch
from torch import nn

from distrain.checkpoint.checkpointer import Checkpointer, read_checkpoints_of
from distrain.config.io import load_config, run_config_file
from distrain.data.tokenizer import load_tokenizer
from distrain.errors import CheckpointError, ConfigError
from distrain.launch.rundir import run_id
from distrain.models.registry import build_model, model_shape
from distrain.observe.logs import LOGGER_NAME as LOGGER


def load_model(
    run_dir: Path, device: torch.device, *, checkpoint_dir: str | None = None
) -> tuple[nn.Module, int]:
    """The run's model at its newest complete checkpoint, and that checkpoint's step
    (`checkpoint_dir`: where the checkpoints are, when not in the run folder)."""
    config_path = run_config_file(run_dir)
    cfg = load_config(str(config_path))
    storage = read_checkpoints_of(cfg.checkpoint, run_dir, checkpoint_dir)
    checkpointer = Checkpointer(
        storage,
        run_id=run_id(run_dir, create=False),
        layout="",
        async_mode="off",
        keep_temporary=1,
        logger=logging.getLogger(LOGGER),
    )
    model = build_model(cfg.model)
    model.to_empty(device=device)
    state = {"model": model.state_dict()}
    with warnings.catch_warnings():  # DCP warns that it loads without a process group: intended
        warnings.simplefilter("ignore", UserWarning)
        step = checkpointer.restore_latest(state)
    if step is None:
        raise CheckpointError(
            f"--run-dir {run_dir}: no complete, intact checkpoint under {storage.url}"
        )
    model.load_state_dict(state["model"])
    return model.eval(), step


def check_sampling(*, max_new_tokens: int, temperature: float, top_k: int | None) -> None:
    """Refuse sampling options that would do nothing, or something else than asked, silently."""
    if max_new_tokens < 1:
        raise ConfigError(f"--max-new-tokens must be >= 1, got {max_new_tokens}")
    if not temperature >= 0 or temperature == float("inf"):
        raise ConfigError(
            f"--temperature must be a finite number >= 0 (0 = greedy), got {temperature}"
        )
    if top_k is not None and top_k < 0:
        raise ConfigError(f"--top-k must be >= 0 (0 = no top-k filtering), got {top_k}")


@torch.no_grad()
def sample(
    model: nn.Module,
    prompt: list[int],
    *,
    max_seq_len: int,
    max_new_tokens: int,
    temperature: float,
    top_k: int | None,
    generator: torch.Generator,
    num_tokens: int | None = None,
) -> list[int]:
    """`max_new_tokens` ids continuing `prompt` (each predicted from the last `max_seq_len`
    ids, the model's longest sequence); with `num_tokens`, only ids below it (a model's
    vocabulary padded past its tokenizer's has rows no text decodes to)."""
    device = next(model.parameters()).device
    tokens = torch.tensor([prompt], dtype=torch.long, device=device)
    for _ in range(max_new_tokens):
        context = tokens[:, -max_seq_len:]
        logits = model(context)[0, -1, :num_tokens].float()
        if temperature <= 0:
            next_token = logits.argmax().view(1)
        else:
            logits = logits / temperature
            if top_k:
                kth = torch.topk(logits, min(top_k, logits.numel())).values[-1]
                logits = logits.masked_fill(logits < kth, float("-inf"))
            probs = torch.softmax(logits, dim=-1)
            next_token = torch.multinomial(probs.cpu(), 1, generator=generator).to(device)
        tokens = torch.cat([tokens, next_token.view(1, 1)], dim=1)
    return tokens[0, len(prompt) :].tolist()


def generate_text(
    run_dir: Path,
    prompt: str,
    *,
    max_new_tokens: int,
    temperature: float,
    top_k: int | None,
    seed: int,
    checkpoint_dir: str | None = None,
) -> str:
    check_sampling(max_new_tokens=max_new_tokens, temperature=temperature, top_k=top_k)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    model, _ = load_model(run_dir, device, checkpoint_dir=checkpoint_dir)
    cfg = load_config(str(run_dir / "config.toml"))
    tokenizer = load_tokenizer(cfg.data.tokenizer)
    shape = model_shape(cfg.model)
    if shape.vocab_size < tokenizer.vocab_size:
        raise ConfigError(
            f"generate: the run's model has vocab_size {shape.vocab_size}, fewer than its "
            f"tokenizer {tokenizer.spec!r} ({tokenizer.vocab_size}); this run cannot be decoded"
        )
    start = tokenizer.encode(prompt) or tokenizer.encode("\n")
    generator = torch.Generator().manual_seed(seed)
    new = sample(
        model,
        start,
        max_seq_len=shape.max_seq_len,
        max_new_tokens=max_new_tokens,
        temperature=temperature,
        top_k=top_k,
        generator=generator,
        num_tokens=tokenizer.vocab_size,
    )
    return prompt + tokenizer.decode(new)
