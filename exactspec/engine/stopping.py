"""When a row ends: EOS, a stop string, or max_new_tokens. Tokens past the end are never emitted."""

from __future__ import annotations


class StopRule:
    """Decides, for one row, how many of a step's emitted tokens to keep and whether it ended.

    EOS: the EOS token is kept (it was emitted, with a logprob) and ends the row. Stop strings:
    the row ends with the token that completes the first stop string; the text is cut before
    it. max_new_tokens: the row ends when it has that many tokens.
    """

    def __init__(self, *, eos_token_ids: list[int], stop: list[str], tokenizer,
                 max_new_tokens: int) -> None:
        self.eos = set(eos_token_ids)  # token ids that end the row
        self.stop = stop  # strings that end the row
        self.tokenizer = tokenizer  # needed when stop strings are given
        self.max_new_tokens = max_new_tokens  # hard cap on generated tokens
        self.cut: int | None = None  # character index of the stop string in the decoded text
        self._scanned_chars = 0  # decoded characters already searched for stop strings

    def decode(self, tokens: list[int]) -> str:
        return self.tokenizer.decode(tokens, skip_special_tokens=True)

    def keep(self, generated: list[int], new: list[int]) -> tuple[int, str | None]:
        """How many of `new` to keep after `generated`, and the reason the row ended (or None)."""
        room = self.max_new_tokens - len(generated)
        new = new[:room]
        reason = None
        for i, tok in enumerate(new):
            if tok in self.eos:
                new, reason = new[: i + 1], "eos"
                break
        if self.stop and new:
            longest = max(map(len, self.stop))
            start = max(0, self._scanned_chars - longest + 1)
            if self._find(self.decode(generated + new), start) is not None:
                for i in range(len(new)):  # the first token that completes a stop string
                    at = self._find(self.decode(generated + new[: i + 1]), start)
                    if at is not None:
                        self.cut = at
                        return i + 1, "stop"
            self._scanned_chars = len(self.decode(generated + new))
        if reason is None and len(generated) + len(new) >= self.max_new_tokens:
            reason = "length"
        return len(new), reason

    def _find(self, text: str, start: int) -> int | None:
        hits = [at for s in self.stop if (at := text.find(s, start)) >= 0]
        return min(hits) if hits else None
