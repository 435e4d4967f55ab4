"""Exact: greedy speculative decoding emits the same tokens as greedy plain decoding, in float32."""

from __future__ import annotations

import pytest

from exactspec.drafters import DraftModel, PromptLookup
from exactspec.drafters.gguf_draft import llama_cpp_available, llama_cpp_why
from exactspec.drafters.quantized import QuantizedDraft
from exactspec.engine import generate
from tests.engine.tiny import (
    GREEDY,
    GREEDY_PROMPTS,
    contrarian,
    greedy_plain,
    greedy_target,
    perturbed,
    tiny_llama,
)

PROMPTS = GREEDY_PROMPTS
target, plain = greedy_target, greedy_plain  # the module fixtures of tests/engine/tiny.py


def _drafters(target):
    return {
        "self": DraftModel(target),  # always agrees
        "contrarian": DraftModel(contrarian(target)),  # never agrees
        "perturbed": DraftModel(perturbed(target, 0.3)),  # agrees partly
        "prompt-lookup": PromptLookup(1, 3),
        "int8": QuantizedDraft(8, backend="torch"),  # the target itself, quantized
        "int4": QuantizedDraft(4, backend="torch"),
        "int8-one-layer": QuantizedDraft(8, layers=[1], backend="torch"),  # agrees partly
        **({"q8_0": QuantizedDraft(8, backend="llama.cpp"),  # the same through llama.cpp
            "q4_0": QuantizedDraft(4, backend="llama.cpp")} if llama_cpp_available() else {}),
    }


NEEDS_LLAMA_CPP = pytest.mark.skipif(not llama_cpp_available(),
                                     reason=llama_cpp_why())


@pytest.mark.parametrize("name", ["self", "contrarian", "perturbed", "prompt-lookup", "int8",
                                  "int4", "int8-one-layer",
                                  pytest.param("q8_0", marks=NEEDS_LLAMA_CPP),
                                  pytest.param("q4_0", marks=NEEDS_LLAMA_CPP)])
@pytest.mark.parametrize("k", [1, 4, "auto"])
def test_greedy_speculative_equals_plain(target, plain, name, k):
    drafter = _drafters(target)[name]
    out = generate(target, PROMPTS, drafter=drafter, params=GREEDY, max_new_tokens=40,
                   num_draft_tokens=k)
    assert [g.token_ids for g in out] == plain
    drafted = sum(g.stats.drafted for g in out)
    accepted = sum(g.stats.accepted for g in out)
    if name == "self":
        assert accepted == drafted > 0
    if name == "contrarian":
        assert accepted == 0 and drafted > 0
    if name in ("perturbed", "int8-one-layer"):
        assert 0 < accepted < drafted
    if name in ("int8", "int4", "q8_0", "q4_0"):
        assert accepted > drafted // 2


@pytest.mark.parametrize("verify", ["token", "block", "greedy"])
def test_every_verify_method_is_exact_when_greedy(target, plain, verify):
    drafter = DraftModel(perturbed(target, 0.3))
    out = generate(target, PROMPTS, drafter=drafter, params=GREEDY, max_new_tokens=40,
                   verify=verify)
    assert [g.token_ids for g in out] == plain


def test_eos_inside_a_draft(target, plain):
    # an EOS id that greedy decoding emits mid-generation, while the draft keeps proposing past it
    row = plain[2]
    eos = row[len(row) // 2]
    model = tiny_llama(0, eos=eos)
    expect = [r[: r.index(eos) + 1] if eos in r else r for r in plain]
    for drafter in (None, DraftModel(model), PromptLookup()):
        out = generate(model, PROMPTS, drafter=drafter, params=GREEDY, max_new_tokens=40,
                       num_draft_tokens=6)
        assert [g.token_ids for g in out] == expect
        assert [g.finish_reason for g in out] == ["eos" if eos in r else "length" for r in plain]


def test_batch_equals_each_row_alone(target, plain):
    for drafter in (None, DraftModel(perturbed(target, 0.3)), PromptLookup()):
        for prompt, expect in zip(PROMPTS, plain, strict=True):
            out = generate(target, [prompt], drafter=drafter, params=GREEDY, max_new_tokens=40)
            assert out[0].token_ids == expect


def test_eager_attention_gives_the_same_tokens(plain):
    model = tiny_llama(0, attn="eager")
    out = generate(model, PROMPTS, drafter=DraftModel(model), params=GREEDY, max_new_tokens=40)
    assert [g.token_ids for g in out] == plain
