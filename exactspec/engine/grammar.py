"""The rows' grammars in the engine: one llguidance matcher per row, and the masks it gives.

A row with a `Grammar` (exactspec.sampling.grammar) carries a matcher advanced by the tokens
the row emits. At each step the masks are computed along the draft: the matcher consumes the
draft tokens one by one, the mask after each prefix is taken, then it rolls back to the row's
committed state. The same masks restrict q when a drafter standardizes (DraftContext.standardize
asks `allowed` for the drafts it has drawn) and p at the K + 1 verify positions, so a draft the
grammar forbids is never drawn, and the output is the target's law restricted to the grammar.
Masks are cached per committed state and draft prefix, so the verifier reuses the drafter's.

Past a draft token the matcher cannot take (EOS, a token the grammar forbids from a drafter
that does not standardize through the context) the mask of that position is repeated: p there
has p(x) = 0 at the forbidden token, so nothing after it is ever kept, and after EOS the row
ends; the law of the output does not read those positions.
"""

from __future__ import annotations

import contextlib
import weakref

import numpy as np
import torch

from exactspec.errors import InvalidValue
from exactspec.sampling.grammar import Grammar

__all__ = ["GrammarRows", "llg_tokenizer"]

_TOKENIZERS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # tokenizer -> LLTokenizer


def llg_tokenizer(tokenizer, eos_ids: list[int]):
    """llguidance's view of a transformers tokenizer (built once per tokenizer, ~1 s for a
    49k vocabulary): from its tokenizers JSON, or, for a decoder llguidance does not read
    (Fuse, as the test tokenizers use), from each token's own decoded bytes."""
    key = (tuple(eos_ids),)
    try:
        cached = _TOKENIZERS.get(tokenizer, {})
    except TypeError:  # not weak-referenceable: no cache
        cached = {}
    if key in cached:
        return cached[key]
    import llguidance
    import llguidance.hf

    if not eos_ids:
        raise InvalidValue("a grammar needs the model's EOS token (the text ends where the "
                           "grammar accepts it), and this model declares none; set "
                           "generation_config.eos_token_id")
    try:
        out = llguidance.hf.from_tokenizer(tokenizer, eos_token=list(eos_ids))
    except ValueError:
        out = llguidance.LLTokenizer(llguidance.TokenizerWrapper(_Bytes(tokenizer, eos_ids)),
                                     eos_token=list(eos_ids))
    with contextlib.suppress(TypeError):  # not weak-referenceable: no cache
        _TOKENIZERS.setdefault(tokenizer, {})[key] = out
    return out


class _Bytes:
    """A tokenizer as llguidance's TokenizerWrapper reads it: each token's bytes."""

    def __init__(self, tokenizer, eos_ids: list[int]) -> None:
        special = set(getattr(tokenizer, "all_special_ids", [])) | set(eos_ids)
        self.eos_token_id = eos_ids[0]
        self.bos_token_id = None
        self.special_token_ids = sorted(special)
        self.tokens = [b"\xff[" + str(tokenizer.convert_ids_to_tokens(i)).encode() + b"]"
                       if i in special else tokenizer.decode([i]).encode()
                       for i in range(len(tokenizer))]
        self._tok = tokenizer

    def __call__(self, text: str) -> list[int]:
        return self._tok.encode(text, add_special_tokens=False)


class _RowMatcher:
    """One row's matcher and its masks cache (prefix of drafts -> mask [V] bool)."""

    def __init__(self, matcher, eos: set[int]) -> None:
        self.m = matcher  # llguidance.LLMatcher at the row's committed tokens
        self.eos = eos  # ids that end the row
        self.cache: dict[tuple[int, ...], torch.Tensor] = {}  # draft prefix -> [V] bool

    def masks(self, prefix: list[int], rows: GrammarRows) -> list[torch.Tensor]:
        """The masks after prefix[:0], ..., prefix[:J] ([V] bool each)."""
        have = [self.cache.get(tuple(prefix[:j])) for j in range(len(prefix) + 1)]
        if all(h is not None for h in have):
            return have
        took, going = 0, True  # tokens the matcher consumed (rolled back), still taking them
        last = None
        try:
            for j in range(len(prefix) + 1):
                if j > 0 and going:
                    t = prefix[j - 1]
                    if t in self.eos or self.m.is_stopped() or self.m.validate_tokens([t]) != 1:
                        going = False  # the matcher stops here; later positions repeat `last`
                    else:
                        if not self.m.consume_token(t):
                            raise AssertionError(f"llguidance refused a validated token: "
                                                 f"{self.m.get_error()}")
                        took += 1
                if have[j] is None:
                    have[j] = rows.mask_of(self.m) if going else last
                    self.cache[tuple(prefix[:j])] = have[j]
                last = have[j]
        finally:
            if took:
                self.m.rollback(took)
        return have

    def advance(self, tokens: list[int]) -> None:
        """Commit the row's new tokens (EOS ends the row: not fed)."""
        self.cache.clear()
        keep = [t for t in tokens if t not in self.eos]
        if keep and not self.m.consume_tokens(keep):
            raise AssertionError(f"llguidance refused emitted tokens {keep}: "
                                 f"{self.m.get_error()}")


class GrammarRows:
    """The grammar state of every row of a batch (None for a row without one)."""

    def __init__(self, tokenizer, eos_ids: list[int], vocab: int) -> None:
        if tokenizer is None:
            raise InvalidValue("a grammar needs the target's tokenizer (to know each token's "
                               "text); pass an exactspec Model or es.as_model(model, tokenizer)")
        self.tokenizer = tokenizer  # the target's transformers tokenizer
        self.eos = set(eos_ids)  # ids that end a row
        self.llg = llg_tokenizer(tokenizer, sorted(self.eos))
        self.vocab = vocab  # width of the target's logits (ids past the tokenizer are masked)
        if self.llg.vocab_size > vocab:
            raise InvalidValue(f"the tokenizer has {self.llg.vocab_size} tokens, more than the "
                               f"model's {vocab} logits; a grammar cannot be served")
        self.rows: list[_RowMatcher | None] = []  # [B]

    def matcher(self, grammar: Grammar | None) -> _RowMatcher | None:
        if grammar is None:
            return None
        import llguidance

        m = llguidance.LLMatcher(self.llg, grammar.spec, log_level=0)
        if m.is_error():
            raise InvalidValue(f"{grammar!r} cannot be served with this tokenizer: "
                               f"{m.get_error()}")
        return _RowMatcher(m, self.eos)

    def admit(self, grammars: list[Grammar | None]) -> None:
        self.rows += [self.matcher(g) for g in grammars]

    def select(self, keep: list[int]) -> None:
        self.rows = [self.rows[j] for j in keep]

    def subset(self, rows: torch.Tensor) -> GrammarRows:  # rows [R] long
        """The same matchers for the rows at these indices (DraftContext of a few rows)."""
        out = object.__new__(GrammarRows)
        out.__dict__.update(self.__dict__)
        out.rows = [self.rows[i] for i in rows.tolist()]
        return out

    @property
    def active(self) -> bool:
        return any(r is not None for r in self.rows)

    def mask_of(self, m) -> torch.Tensor:  # [V] bool
        """The matcher's mask now, padded with False to the model's vocabulary."""
        import llguidance.torch as lt

        words = lt.allocate_token_bitmask(1, self.llg.vocab_size)  # [1, ceil(Vt / 32)] int32
        lt.fill_next_token_bitmask(m, words)
        # bit j of word i is token 32 i + j (little-endian words: byte b holds bits 8b..8b+7)
        little = words[0].numpy().astype("<i4").view(np.uint8)  # [4 W]
        bits = np.unpackbits(little, bitorder="little")  # [32 W]
        out = torch.zeros(self.vocab, dtype=torch.bool)
        out[: self.llg.vocab_size] = torch.from_numpy(bits[: self.llg.vocab_size].astype(bool))
        if m.is_error() or (not m.is_accepting() and not self._continues(out)):
            # llguidance allows EOS where it cannot go on: text the grammar does not accept
            raise InvalidValue("the grammar cannot continue the text with this tokenizer and is "
                               f"not complete (text so far rejected or no token fits): "
                               f"{m.get_error() or 'only EOS would be allowed'}")
        return out

    def _continues(self, mask: torch.Tensor) -> bool:  # mask [V] bool
        """Whether `mask` allows some token other than EOS."""
        others = mask.clone()
        others[sorted(self.eos)] = False
        return bool(others.any())

    def along(self, drafts: torch.Tensor  # [B, J] long, -1 padded
              ) -> torch.Tensor:  # [B, J+1, V] bool
        """Each row's allowed tokens after each prefix of its drafts (all True without a
        grammar); the drafts past a row's -1 pad repeat its last mask."""
        b, j = drafts.shape
        out = torch.ones(b, j + 1, self.vocab, dtype=torch.bool)
        for i, (row, toks) in enumerate(zip(self.rows, drafts.tolist(), strict=True)):
            if row is None:
                continue
            real = toks[: toks.index(-1)] if -1 in toks else toks
            masks = row.masks(real, self)
            out[i, : len(masks)] = torch.stack(masks)
            out[i, len(masks):] = masks[-1]
        return out.to(drafts.device)

    def allowed(self, drafted: torch.Tensor | None  # [B, J] long, -1 padded, or None
                ) -> torch.Tensor:  # [B, V] bool
        """The tokens each row may take after its drafts so far (DraftContext.standardize)."""
        if drafted is None:
            drafted = torch.zeros(len(self.rows), 0, dtype=torch.long)
        return self.along(drafted)[:, -1]

    def forbidden_cut(self, drafts: torch.Tensor  # [B, K] long, -1 padded
                      ) -> torch.Tensor:  # [B, K]
        """Point-mass drafts cut (-1) from the first token the grammar forbids: such a draft
        is rejected with certainty (p = 0 there), and its residual is p itself, so cutting it
        is exact and saves the rest of the row's draft."""
        out = drafts.clone()
        for i, (row, toks) in enumerate(zip(self.rows, drafts.tolist(), strict=True)):
            if row is None:
                continue
            real = toks[: toks.index(-1)] if -1 in toks else toks
            masks = row.masks(real, self)
            for j, t in enumerate(real):
                if not bool(masks[j][t]):
                    out[i, j:] = -1
                    break
        return out

    def advance(self, emitted: torch.Tensor,  # [B, K+1] long, -1 padded
                counts: torch.Tensor) -> None:  # [B] tokens each row keeps
        for row, toks, c in zip(self.rows, emitted.tolist(), counts.tolist(), strict=True):
            if row is not None and c:
                row.advance(toks[:c])
