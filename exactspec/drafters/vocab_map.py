"""Which draft tokens are target tokens: tokens compared by the bytes they stand for.

Two tokenizers spell the same text differently in their vocabularies (byte-level BPE writes a
space as "Ġ", SentencePiece as "▁", byte-fallback tokens as "<0x20>"), so tokens are matched by
their bytes, read through the tokenizer's decoder. Special tokens never match. A target byte
string held by several target ids maps to one of them (regular tokens before byte fallbacks,
then the lowest id); several draft ids may map to one target id (their probabilities add up).
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from functools import lru_cache

import torch

_BYTE_FALLBACK = re.compile(r"^<0x([0-9A-Fa-f]{2})>$")


@lru_cache(maxsize=1)
def byte_decoder() -> dict[str, int]:
    """GPT-2's printable-character alphabet for bytes, inverted (char -> byte)."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + \
        list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return {chr(c): b for b, c in zip(bs, cs, strict=True)}


def _decoder_kinds(tokenizer) -> set[str]:
    """The decoder steps of a fast tokenizer ("ByteLevel", "Replace", "ByteFallback", ...)."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    decoder = getattr(backend, "decoder", None)
    if decoder is None:
        return set()
    # the decoder's own JSON (its pickled state), not the whole tokenizer's (to_str() writes
    # and json parses every token and merge, for a few hundred bytes)
    spec = json.loads(decoder.__getstate__())
    steps = spec.get("decoders", [spec]) if spec.get("type") == "Sequence" else [spec]
    return {s.get("type", "") for s in steps}


def token_bytes(tokenizer) -> list[bytes | None]:
    """The bytes each token id stands for; None for special tokens and unreadable pieces."""
    return _read_vocab(tokenizer)[0]


def _read_vocab(tokenizer) -> tuple[list[bytes | None], set[int]]:
    """token_bytes, and the ids of the byte-fallback tokens ("<0x20>": a target's last choice
    for a byte string), in one pass over the vocabulary."""
    vocab = tokenizer.get_vocab()  # piece -> id
    special = set(getattr(tokenizer, "all_special_ids", []) or [])
    special |= set(getattr(tokenizer, "added_tokens_decoder", {}) or {})
    kinds = _decoder_kinds(tokenizer)
    byte_level = "ByteLevel" in kinds
    metaspace = "Metaspace" in kinds or "Replace" in kinds
    fallback = "ByteFallback" in kinds
    table = byte_decoder()
    out: list[bytes | None] = [None] * (max(vocab.values(), default=-1) + 1)
    fallbacks: set[int] = set()
    for piece, i in vocab.items():
        m = _BYTE_FALLBACK.match(piece) if fallback else None
        if m:
            fallbacks.add(i)
        if i in special:
            continue
        if byte_level:
            if all(c in table for c in piece):
                out[i] = bytes(table[c] for c in piece)
            continue
        if m:
            out[i] = bytes([int(m.group(1), 16)])
            continue
        out[i] = (piece.replace("▁", " ") if metaspace else piece).encode("utf-8")
    return out, fallbacks


@dataclass(frozen=True)
class VocabMap:
    """Draft ids whose bytes are a target token, and that token's id."""

    draft_ids: torch.Tensor  # [M] long: draft ids in the intersection (sorted)
    target_ids: torch.Tensor  # [M] long: the target id each stands for
    draft_for_target: torch.Tensor  # [Vt] long: one draft id per target id, -1 if none
    duplicates: bool  # several draft ids map to one target id
    draft_size: int  # draft tokens with readable bytes (the overlap's denominator)
    target_size: int  # target tokens with readable bytes

    @property
    def overlap(self) -> int:
        """Target tokens reachable from the draft."""
        return int((self.draft_for_target >= 0).sum())


def vocab_map(draft_tokenizer, target_tokenizer, target_width: int) -> VocabMap:
    """Match the two vocabularies by bytes; target_width = the target's logits width."""
    target, fallbacks = _read_vocab(target_tokenizer)
    by_bytes: dict[bytes, int] = {}
    order = sorted(range(len(target)), key=lambda i: (i in fallbacks, i))
    for i in order:
        b = target[i]
        if b is not None and i < target_width:
            by_bytes.setdefault(b, i)
    draft = token_bytes(draft_tokenizer)
    pairs = [(d, by_bytes[b]) for d, b in enumerate(draft) if b is not None and b in by_bytes]
    d_ids = torch.tensor([d for d, _ in pairs], dtype=torch.long)
    t_ids = torch.tensor([t for _, t in pairs], dtype=torch.long)
    lowest: dict[int, int] = {}
    for d, t in pairs:  # the lowest draft id wins (pairs run in draft id order)
        lowest.setdefault(t, d)
    back = torch.full((target_width,), -1, dtype=torch.long)
    back[torch.tensor(list(lowest), dtype=torch.long)] = torch.tensor(list(lowest.values()),
                                                                       dtype=torch.long)
    return VocabMap(d_ids, t_ids, back, len(lowest) < len(pairs),
                    sum(b is not None for b in draft), sum(b is not None for b in target))
