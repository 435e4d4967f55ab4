"""A choice's output as it grows: incremental text for streams, and top log-probabilities.

The text of a finished choice is exactly `es.generate`'s: the decoded tokens (special tokens
skipped), cut before a stop string. While it grows, the last characters that could still be
the start of a stop string are held back, as `es.stream` does.
"""

from __future__ import annotations

import torch

from exactspec.models.loading import Model
from exactspec.sampling import SamplingParams, probs_from_logits


class RowText:
    """Turns a choice's tokens into text deltas; `text` is the full text so far."""

    def __init__(self, tokenizer, stop: list[str]) -> None:
        self.tokenizer = tokenizer  # decodes the tokens
        self.hold = max(map(len, stop), default=1) - 1  # characters held back while growing
        self.tokens: list[int] = []  # every token so far
        self.text = ""  # text sent so far

    def push(self, new: list[int], *, finished: bool, cut: int | None) -> str:
        """Add `new` tokens; the text that can be sent now (possibly empty)."""
        self.tokens += new
        text = self.tokenizer.decode(self.tokens, skip_special_tokens=True)
        if not finished:
            text = text.rstrip("\ufffd")  # a character split across tokens
            text = text[: len(text) - self.hold] if self.hold else text
        elif cut is not None:
            text = text[:cut]
        if len(text) > len(self.text) and text.startswith(self.text):
            delta, self.text = text[len(self.text):], text
            return delta
        return ""


def token_strings(tokenizer, ids: list[int]) -> list[str]:
    """Each token on its own, as logprobs report them (special tokens shown)."""
    return [tokenizer.decode([t]) for t in ids]


@torch.inference_mode()
def top_logprobs(model: Model, prompt: list[int], tokens: list[int], start: int,
                 params: SamplingParams, k: int) -> list[list[tuple[int, float]]]:
    """The k most likely tokens and their log p at positions start.. of `tokens`.

    p is the target's standardized distribution (same `probs_from_logits`, parameters and
    history as the engine's), from one teacher-forced forward over prompt + tokens. Only
    tokens with p > 0 are listed, so filters (top-k, top-p, greedy) can leave fewer than k.
    The forward is the transformers one, so the last digits may differ from the engine's.
    """
    seq = prompt + tokens
    first = len(prompt) + start  # index in seq of the first token to report
    if first >= len(seq):
        return []
    dev = model.device
    ids = torch.tensor([seq[:-1]], dtype=torch.long, device=dev)  # [1, L-1]
    logits = model.model(ids).logits[:, first - 1:]  # [1, T, V]
    t = logits.shape[1]
    prev = None
    if params.uses_history:
        hist = torch.tensor([seq], dtype=torch.long, device=dev)  # [1, L]
        ends = torch.arange(first, first + t, device=dev)  # [T]: history before each position
        pos = torch.arange(len(seq), device=dev)
        prev = hist[:, None, :].masked_fill(pos >= ends[None, :, None], -1)  # [1, T, L]
    plen = torch.full((1, t), len(prompt), dtype=torch.long, device=dev)  # [1, T]
    p = probs_from_logits(logits.float(), params, prev, plen)[0]  # [T, V]
    vals, idx = p.topk(min(k, p.shape[-1]), dim=-1)  # [T, k]
    out = []
    for v_row, i_row in zip(vals.tolist(), idx.tolist(), strict=True):
        out.append([(i, _log(v)) for v, i in zip(v_row, i_row, strict=True) if v > 0])
    return out


def _log(x: float) -> float:
    return float(torch.tensor(x, dtype=torch.float64).log())
