"""Grammars in the engine: greedy speculative == greedy plain bit for bit under a grammar, every
output matches it, per-row grammars in one batch, and the refused combinations."""

from __future__ import annotations

import json
import re

import pytest

from exactspec.drafters import DraftModel, PromptLookup
from exactspec.drafters.quantized import QuantizedDraft
from exactspec.engine import generate
from exactspec.errors import InvalidType, InvalidValue
from exactspec.models.loading import Model
from exactspec.sampling import SamplingParams
from exactspec.sampling.grammar import Grammar
from tests.engine.tiny import GREEDY, char_tokenizer, perturbed, tiny_llama

EOS = 0
WORDS = r"[a-z]{2,6}( [a-z]{2,6}){2,5}\."  # a sentence of lowercase words
PROMPTS = ["hello world", "a", "abc abc abc ab", "the cat. the"]


@pytest.fixture(scope="module")
def target() -> Model:
    return Model(model=tiny_llama(0, eos=EOS), tokenizer=char_tokenizer(), name="tiny-eos")


@pytest.fixture(scope="module")
def plain(target) -> list[list[int]]:
    return [g.token_ids for g in generate(target, PROMPTS, params=GREEDY, max_new_tokens=48,
                                          grammar=Grammar.regex(WORDS))]


def test_plain_greedy_output_matches_the_grammar(target, plain):
    tok = target.tokenizer
    for ids in plain:
        assert ids[-1] == EOS
        assert re.fullmatch(WORDS, tok.decode(ids[:-1]))


@pytest.mark.parametrize("name", ["draft model", "contrarian draft", "int8", "prompt lookup"])
@pytest.mark.parametrize("k", [1, 4])
def test_greedy_speculative_equals_plain_under_a_grammar(target, plain, name, k):
    drafter = {"draft model": lambda: DraftModel(Model(model=perturbed(target.model, 0.3),
                                                       tokenizer=char_tokenizer(), name="d")),
               "contrarian draft": lambda: DraftModel(Model(model=tiny_llama(3, eos=EOS),
                                                            tokenizer=char_tokenizer(), name="c")),
               "int8": lambda: QuantizedDraft(8, backend="torch"),
               "prompt lookup": PromptLookup}[name]()
    gens = generate(target, PROMPTS, drafter=drafter, params=GREEDY, max_new_tokens=48,
                    num_draft_tokens=k, grammar=Grammar.regex(WORDS))
    assert [g.token_ids for g in gens] == plain


def test_rows_carry_their_own_grammar(target):
    grammars = [Grammar.regex("[0-9]{3}"), None, Grammar.choice(["yes", "no"]),
                Grammar.regex("[0-9]{3}")]
    gens = generate(target, PROMPTS, params=SamplingParams(temperature=1.0, seed=3),
                    drafter=PromptLookup(), max_new_tokens=12, grammar=grammars)
    assert re.fullmatch("[0-9]{3}", gens[0].text) and re.fullmatch("[0-9]{3}", gens[3].text)
    assert gens[2].text in ("yes", "no")
    assert all(g.finish_reason == "eos" for g in gens[::2] + gens[3:])


def test_a_json_schema_over_a_tokenizer_without_braces_is_an_empty_language(target):
    """The char tokenizer has no '{': no JSON object can be written. llguidance then allows EOS
    alone, which would end the row with text the grammar rejects; the engine raises instead."""
    with pytest.raises(InvalidValue, match="cannot continue"):
        generate(target, ["x"], params=GREEDY, max_new_tokens=4, grammar=Grammar.json_object())


def test_refused_combinations(target):
    g = Grammar.regex("ab")
    draft = Model(model=perturbed(target.model, 0.3), tokenizer=char_tokenizer(), name="d")
    with pytest.raises(InvalidValue, match="token-tree"):
        generate(target, ["x"], drafter=DraftModel(draft, tree=(2, 1)), grammar=g)
    with pytest.raises(InvalidValue, match="lossy"):
        generate(target, ["x"], drafter=DraftModel(draft), verify="lenient:0.5", grammar=g)
    with pytest.raises(InvalidType, match="grammar"):
        generate(target, ["x"], grammar="ab")
    with pytest.raises(InvalidValue, match="2 entries for 1 prompts"):
        generate(target, ["x"], grammar=[g, g])
    with pytest.raises(InvalidValue, match="needs the target's tokenizer"):
        generate(Model(model=tiny_llama(0), tokenizer=None, name="no-tok"), [[1, 2]],
                 grammar=g)


def test_grammar_reprs_and_hashes():
    assert Grammar.regex("a+") == Grammar.regex("a+")
    assert len({Grammar.json_schema({"type": "integer"}),
                Grammar.json_schema('{"type": "integer"}')}) == 1
    assert "json_schema" in repr(Grammar.json_schema({"type": "integer"}))
    assert json.loads(Grammar.choice(["a", "b"]).source) == ["a", "b"]
