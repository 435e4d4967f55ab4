"""A choice's output as it grows: incremental text for streams, and token strings and bytes for
logprobs.

The text of a finished choice is `es.generate`'s (the decoded tokens, special tokens skipped,
cut before a stop string), except that a reply never ends in half a character: while it grows,
an incomplete UTF-8 tail (a character split across tokens) is held back until its last byte
arrives, and at the end of a reply such a tail is dropped (`drop_partial`). The last characters
that could still be the start of a stop string are held back too, as `es.stream` does.
"""

from __future__ import annotations

import re

from exactspec.drafters.vocab_map import byte_decoder

_HEX_BYTE = re.compile(r"<0x([0-9A-Fa-f]{2})>")  # sentencepiece's byte-fallback tokens
_BYTE_LEVEL: dict[int, tuple[object, bool]] = {}  # id(tokenizer) -> (it, byte-level or not)


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
        if cut is not None:
            text = text[:cut]
        else:
            text = drop_partial(self.tokenizer, self.tokens, text)
            if not finished:
                text = text.rstrip("\ufffd")  # any tokenizer: a split character waits
                text = text[: len(text) - self.hold] if self.hold else text
        if len(text) > len(self.text) and text.startswith(self.text):
            delta, self.text = text[len(self.text):], text
            return delta
        return ""


def drop_partial(tokenizer, tokens: list[int], text: str) -> str:
    """`text` (the decode of `tokens`) without the replacement characters its incomplete UTF-8
    tail decoded to, if the tokens' bytes end inside a character."""
    tail = b"".join(token_bytes(tokenizer, t) for t in tokens[-4:])  # a character: 4 bytes
    missing = incomplete_tail(tail)
    while missing and text.endswith("\ufffd"):
        text, missing = text[:-1], missing - 1
    return text


def incomplete_tail(data: bytes) -> int:
    """How many bytes at the end of `data` start a UTF-8 character that is not complete."""
    for back in range(1, min(4, len(data)) + 1):
        b = data[-back]
        if b & 0xC0 == 0x80:  # a continuation byte: look further back
            continue
        need = 2 if b & 0xE0 == 0xC0 else 3 if b & 0xF0 == 0xE0 else 4 if b & 0xF8 == 0xF0 else 1
        return back if need > back else 0
    return 0


def token_strings(tokenizer, ids: list[int]) -> list[str]:
    """Each token on its own, as logprobs report them (special tokens shown)."""
    return [tokenizer.decode([t]) for t in ids]


def token_bytes(tokenizer, tid: int) -> bytes:
    """The token's own bytes: a byte-level BPE token's bytes (a token that is part of a UTF-8
    character gives its raw bytes, not U+FFFD's), a byte-fallback token <0xNN> its byte, any
    other token its decoded text's UTF-8."""
    piece = tokenizer.convert_ids_to_tokens(tid)
    if isinstance(piece, str):
        if _byte_level(tokenizer) and all(c in byte_decoder() for c in piece):
            return bytes(byte_decoder()[c] for c in piece)
        m = _HEX_BYTE.fullmatch(piece)
        if m:
            return bytes([int(m.group(1), 16)])
    return tokenizer.decode([tid]).encode("utf-8")


def _byte_level(tokenizer) -> bool:
    """Whether the tokenizer decodes with byte-level BPE's byte alphabet (GPT-2, Llama 3,
    SmolLM2); cached on the tokenizer object."""
    known = _BYTE_LEVEL.get(id(tokenizer))
    if known is None or known[0] is not tokenizer:
        backend = getattr(tokenizer, "backend_tokenizer", None)
        decoder = getattr(backend, "decoder", None)
        known = _BYTE_LEVEL[id(tokenizer)] = (tokenizer, decoder is not None
                                              and "ByteLevel" in repr(decoder))
    return known[1]

