"""End to end: `exactspec.generate` under a grammar emits exactly p restricted to the grammar.

Statistical test (alpha = 1e-6 per check, fixed seeds). A tiny random Llama over the character
tokenizer (tests/engine/tiny.py, EOS id 0) and a finite regular language: the exact law of the
whole output (up to EOS) is enumerated here without the engine's grammar code. At a prefix s
the allowed tokens are the characters c with s + c a prefix of a word of the language, and EOS
when s is a word (Python's own enumeration of the language); p there is probs_from_logits of
the target's logits over prompt + s with that mask, and a word's probability is the product
along it. One batched generate call over many copies of the prompt is tested against it, with
each drafter. The same test rejects a wrong drafter that draws under the mask but reports q
without it (the bug class of a q that is not the law the draft was drawn from).
"""

from __future__ import annotations

import dataclasses
import itertools
from dataclasses import replace

import pytest
import torch

from exactspec.audit.stats import chi_square
from exactspec.drafters import DraftModel, PromptLookup
from exactspec.drafters.quantized import QuantizedDraft
from exactspec.engine import generate
from exactspec.models.loading import Model
from exactspec.sampling import SamplingParams, probs_from_logits
from exactspec.sampling.grammar import Grammar
from tests.engine.tiny import ALPHABET, char_tokenizer, perturbed, tiny_llama

PATTERN = "(ab|ba)c{1,3}|[abc]{1,3}"  # 6 + 39 words, 41 distinct (ab, ba, abc, bac overlap)
PROMPT = "abcabcab"  # repeats of the grammar's letters, so prompt lookup finds copies
ROWS = 2000  # the wrong drafter reads ~6700 against a threshold of 96 at 3000 rows
K = 3
PARAMS = SamplingParams(temperature=0.8)
EOS = 0


def language() -> list[str]:
    words = {a + "c" * n for a in ("ab", "ba") for n in (1, 2, 3)}
    words |= {"".join(w) for n in (1, 2, 3) for w in itertools.product("abc", repeat=n)}
    return sorted(words)


def ids(text: str) -> list[int]:
    return [ALPHABET.index(c) + 1 for c in text]


@pytest.fixture(scope="module")
def target() -> Model:
    return Model(model=tiny_llama(0, eos=EOS, head_scale=5.0), tokenizer=char_tokenizer(),
                 name="tiny-grammar")


@pytest.fixture(scope="module")
def law(target) -> tuple[list[str], torch.Tensor]:
    """The words and their exact probabilities under p restricted to the language."""
    words = language()
    prefixes = {w[:i] for w in words for i in range(len(w) + 1)}
    vocab = target.model.config.vocab_size
    step: dict[str, torch.Tensor] = {}  # prefix -> p restricted, [V]
    with torch.no_grad():
        for s in sorted(prefixes):
            allowed = torch.zeros(vocab, dtype=torch.bool)
            for c in "abc":
                if s + c in prefixes:
                    allowed[ids(c)[0]] = True
            allowed[EOS] = s in words
            logits = target.model(torch.tensor([ids(PROMPT + s)])).logits[0, -1]  # [V]
            step[s] = probs_from_logits(logits, PARAMS, allowed=allowed).double()
    probs = []
    for w in words:
        pr = step[w][EOS]
        for i, c in enumerate(w):
            pr = pr * step[w[:i]][ids(c)[0]]
        probs.append(float(pr))
    probs = torch.tensor(probs, dtype=torch.float64)
    assert abs(float(probs.sum()) - 1) < 1e-5  # float32 steps
    return words, probs


def counts_of(target, drafter, words, seed, verify="token") -> tuple[torch.Tensor, int]:
    gens = generate(target, [PROMPT] * ROWS, drafter=drafter,
                    params=replace(PARAMS, seed=seed), max_new_tokens=8, num_draft_tokens=K,
                    verify=verify, batch_size=ROWS, grammar=Grammar.regex(PATTERN))
    assert all(g.finish_reason == "eos" and g.token_ids[-1] == EOS for g in gens)
    index = {w: i for i, w in enumerate(words)}
    counts = torch.zeros(len(words), dtype=torch.float64)
    for g in gens:
        counts[index[g.text]] += 1  # a word outside the language fails here
    return counts, sum(g.stats.accepted for g in gens)


class Unmasked(DraftModel):
    """A drafter blind to the grammar: draws from its q without the mask and reports that q
    (exact: p is 0 at a forbidden draft, which is rejected with certainty)."""

    standardized_q = True

    def propose(self, context, num_tokens):
        return super().propose(dataclasses.replace(context, grammar=None), num_tokens)


class MaskedDrawUnmaskedQ(DraftModel):
    """WRONG: draws under the grammar's mask but reports q without it (the mask applied to the
    draw and to p, not to the q verification reads)."""

    standardized_q = True

    def propose(self, context, num_tokens):
        seen = []
        blind = dataclasses.replace(context, grammar=None)
        masked = context.standardize

        def standardize(logits, drafted=None):
            seen.append(blind.standardize(logits, drafted))
            return masked(logits, drafted)

        ctx = dataclasses.replace(context)
        ctx.standardize = standardize  # the instance's, read by DraftModel.propose
        drafts, q = super().propose(ctx, num_tokens)
        return drafts, torch.stack(seen, 1).float()[:, : q.shape[1]]


def draft_of(target, scale=0.5) -> Model:
    return Model(model=perturbed(target.model, scale), tokenizer=char_tokenizer(), name="d")


@pytest.mark.parametrize(("name", "verify"), [
    ("plain", "token"), ("draft model", "token"), ("draft model", "block"),
    ("int8", "token"), ("prompt lookup", "token"), ("blind draft", "token"),
])
def test_generate_under_a_grammar_is_p_restricted(target, law, name, verify):
    words, probs = law
    drafter = {"plain": lambda: None,
               "draft model": lambda: DraftModel(draft_of(target)),
               "int8": lambda: QuantizedDraft(8, backend="torch"),
               "prompt lookup": PromptLookup,
               "blind draft": lambda: Unmasked(draft_of(target))}[name]()
    counts, accepted = counts_of(target, drafter, words, seed=11, verify=verify)
    if drafter is not None:
        assert accepted > ROWS // 10  # drafts were really used, not only bonus tokens
    result = chi_square(counts, probs)
    assert result.dof >= 15 and not result.rejected, result


def test_q_without_the_mask_is_caught(target, law):
    words, probs = law
    counts, _ = counts_of(target, MaskedDrawUnmaskedQ(draft_of(target, 1.0)), words, seed=12)
    assert chi_square(counts, probs).rejected
