"""`DistrainLM`: lm-evaluation-harness's `LM` interface over a distrain model and tokenizer.

loglikelihood scores each (context, continuation) request as the sum of the continuation
tokens' log-probabilities after the context (the context cut on the left to the model's
max_seq_len), in padded batches sorted by length; loglikelihood_rolling scores a whole text in
windows of max_seq_len predictions, each with as much preceding context as fits;
generate_until decodes greedily up to the first stop string. Tokens are split as the harness's
own Hugging Face model does: context and continuation encoded together, the context's trailing
whitespace moved to the continuation. `lm_eval` is imported by the caller (downstream.py)
before this module, which subclasses its `LM`.
"""

from __future__ import annotations

from typing import Any

import torch
from lm_eval.api.model import LM
from torch import nn

from distrain.data.tokenizer import Tokenizer
from distrain.inference.generate import sample

DEFAULT_GEN_TOKENS = 256


class DistrainLM(LM):
    def __init__(
        self, model: nn.Module, tokenizer: Tokenizer, *, max_length: int, batch_size: int = 16
    ):
        """`max_length`: the model's longest sequence (its max_seq_len)."""
        super().__init__()
        self.model = model.eval()
        self.tokenizer = tokenizer
        self.batch_size_per_call = batch_size
        self.max_length = max_length
        self._device = next(model.parameters()).device
        # What an empty context is conditioned on (the byte tokenizer has no end-of-text).
        self.prefix = tokenizer.encode("\n")

    # --- tokens ----------------------------------------------------------------------------

    def _split(self, context: str, continuation: str) -> tuple[list[int], list[int]]:
        spaces = len(context) - len(context.rstrip())
        if spaces:
            context, continuation = context[:-spaces], context[-spaces:] + continuation
        if not context:
            return self.prefix, self.tokenizer.encode(continuation)
        whole = self.tokenizer.encode(context + continuation)
        head = self.tokenizer.encode(context)
        return whole[: len(head)], whole[len(head) :]

    # --- scoring ---------------------------------------------------------------------------

    @torch.no_grad()
    def _score(self, windows: list[tuple[list[int], int]]) -> list[tuple[float, bool]]:
        """For each (tokens, n): the summed log-probability of tokens' last n given the ones
        before them, and whether each was the greedy choice. len(tokens) <= max_length + 1."""
        order = sorted(range(len(windows)), key=lambda i: -len(windows[i][0]))
        out: list[tuple[float, bool]] = [(0.0, False)] * len(windows)
        vocab = self.tokenizer.vocab_size
        for start in range(0, len(order), self.batch_size_per_call):
            chunk = order[start : start + self.batch_size_per_call]
            width = len(windows[chunk[0]][0]) - 1
            inputs = torch.zeros(len(chunk), width, dtype=torch.long)
            for row, i in enumerate(chunk):
                tokens = windows[i][0]
                inputs[row, : len(tokens) - 1] = torch.tensor(tokens[:-1])
            logits = self.model(inputs.to(self._device))[..., :vocab].float()
            logprobs = torch.log_softmax(logits, dim=-1).cpu()
            for row, i in enumerate(chunk):
                tokens, n = windows[i]
                end = len(tokens) - 1
                targets = torch.tensor(tokens[len(tokens) - n :], dtype=torch.long)
                picked = logprobs[row, end - n : end]
                total = picked.gather(1, targets[:, None]).sum().item()
                greedy = bool((picked.argmax(dim=-1) == targets).all())
                out[i] = (total, greedy)
        return out

    def _window(self, context: list[int], continuation: list[int]) -> tuple[list[int], int]:
        tokens = (context + continuation)[-(self.max_length + 1) :]
        return tokens, min(len(continuation), len(tokens) - 1)

    def loglikelihood(self, requests: list[Any], disable_tqdm: bool = False) -> list:
        windows = [self._window(*self._split(*r.args)) for r in requests]
        return self._score(windows)

    def loglikelihood_rolling(self, requests: list[Any], disable_tqdm: bool = False) -> list:
        results = []
        for request in requests:
            tokens = self.prefix + self.tokenizer.encode(request.args[0])
            windows = []
            # Predict tokens[1:] in chunks of max_length, each after what context fits.
            for end in range(len(tokens), 1, -self.max_length):
                first = max(1, end - self.max_length)
                left = max(0, end - self.max_length - 1)
                windows.append((tokens[left:end], end - first))
            results.append(sum(score for score, _ in self._score(windows)))
        return results

    def generate_until(self, requests: list[Any], disable_tqdm: bool = False) -> list[str]:
        outputs = []
        for request in requests:
            context, options = request.args
            until = options.get("until", [])
            until = [until] if isinstance(until, str) else list(until)
            max_new = int(options.get("max_gen_toks", DEFAULT_GEN_TOKENS))
            prompt = (self.tokenizer.encode(context) or self.prefix)[-self.max_length :]
            new = sample(
                self.model,
                prompt,
                max_seq_len=self.max_length,
                max_new_tokens=max_new,
                temperature=0.0,
                top_k=None,
                generator=torch.Generator(),
                num_tokens=self.tokenizer.vocab_size,
            )
            text = self.tokenizer.decode(new)
            cuts = [text.find(stop) for stop in until if stop and stop in text]
            outputs.append(text[: min(cuts)] if cuts else text)
        return outputs
