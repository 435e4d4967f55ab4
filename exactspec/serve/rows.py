"""A choice's output as it grows: incremental text for streams, and token strings for logprobs.

The text of a finished choice is exactly `es.generate`'s: the decoded tokens (special tokens
skipped), cut before a stop string. While it grows, the last characters that could still be
the start of a stop string are held back, as `es.stream` does.
"""

from __future__ import annotations


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
