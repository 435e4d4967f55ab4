"""End-to-end behaviour of generate / stream on tiny random models: randomness, logprobs, stopping."""

from __future__ import annotations

import math

import pytest
import torch

from exactspec import SamplingParams, probs_from_logits
from exactspec.drafters import DraftModel, PromptLookup
from exactspec.engine import generate, stream
from exactspec.models.loading import Model
from exactspec.sampling import verify as exact_verify
from tests.engine.tiny import VOCAB, char_tokenizer, perturbed, tiny_llama, tiny_model

SAMPLED = SamplingParams(temperature=0.9, top_k=20, top_p=0.95, seed=7)
PENALISED = SamplingParams(temperature=1.0, repetition_penalty=1.3, presence_penalty=0.5,
                           frequency_penalty=0.2, seed=11)
PROMPTS = [[5, 6, 7, 8, 5, 6, 7], [9], [1, 2, 3, 1, 2, 3, 1, 2, 3, 1, 2], [30, 31, 30, 31, 30]]


@pytest.fixture(scope="module")
def target():
    return tiny_llama(0)


@pytest.fixture(scope="module")
def draft(target):
    return perturbed(target, 0.3)


@pytest.mark.parametrize("params", [SAMPLED, PENALISED])
@pytest.mark.parametrize("kind", ["plain", "draft", "lookup"])
def test_seeded_rows_identical_alone_and_in_a_larger_batch(target, draft, params, kind):
    make = {"plain": lambda: None, "draft": lambda: DraftModel(draft), "lookup": PromptLookup}[kind]
    big = generate(target, PROMPTS, drafter=make(), params=params, max_new_tokens=30)
    small = generate(target, PROMPTS[:2], drafter=make(), params=params, max_new_tokens=30)
    alone = generate(target, PROMPTS[:1], drafter=make(), params=params, max_new_tokens=30)
    chunked = generate(target, PROMPTS, drafter=make(), params=params, max_new_tokens=30,
                       batch_size=3)
    assert [g.token_ids for g in small] == [g.token_ids for g in big[:2]]
    assert alone[0].token_ids == big[0].token_ids
    assert [g.token_ids for g in chunked] == [g.token_ids for g in big]
    again = generate(target, PROMPTS, drafter=make(), params=params, max_new_tokens=30)
    assert [g.token_ids for g in again] == [g.token_ids for g in big]


def test_seed_none_draws_a_fresh_seed(target):
    a = generate(target, [[1, 2]] * 4, params=SamplingParams(), max_new_tokens=20)
    b = generate(target, [[1, 2]] * 4, params=SamplingParams(), max_new_tokens=20)
    assert [g.token_ids for g in a] != [g.token_ids for g in b]


def _full_forward_logprobs(model, prompt, tokens, params):
    """log p of each generated token from one uncached forward over prompt + tokens."""
    ids = torch.tensor([prompt + tokens])
    with torch.no_grad():
        logits = model(ids).logits[0, len(prompt) - 1 : -1]  # [N, V]
    n = len(tokens)
    hist = torch.full((n, len(prompt) + n), -1, dtype=torch.long)
    for i in range(n):
        hist[i, : len(prompt) + i] = ids[0, : len(prompt) + i]
    p = probs_from_logits(logits, params, hist, len(prompt))
    return p[torch.arange(n), torch.tensor(tokens)].log().tolist()


@pytest.mark.parametrize("params", [SAMPLED, PENALISED, SamplingParams(temperature=0)])
@pytest.mark.parametrize("kind", ["plain", "draft", "lookup"])
def test_logprobs_equal_a_full_forward(target, draft, params, kind):
    drafter = {"plain": None, "draft": DraftModel(draft), "lookup": PromptLookup()}[kind]
    out = generate(target, PROMPTS, drafter=drafter, params=params, max_new_tokens=25,
                   return_logprobs=True)
    for prompt, g in zip(PROMPTS, out, strict=True):
        assert len(g.logprobs) == len(g.token_ids) == 25
        expect = _full_forward_logprobs(target, prompt, g.token_ids, params)
        assert g.logprobs == pytest.approx(expect, abs=1e-4)
        assert all(math.isfinite(x) for x in g.logprobs)


def test_stop_strings_cut_text_and_tokens():
    model = tiny_model(0)
    params = SamplingParams(seed=5)
    for make in (lambda: None, lambda: DraftModel(model), PromptLookup):
        full = generate(model, "hello world", drafter=make(), params=params,
                        max_new_tokens=40)[0]
        stop = _late_stop(full.text)
        first = full.text.find(stop)
        out = generate(model, "hello world", drafter=make(), params=params, max_new_tokens=40,
                       stop=["zzzz-not-there", stop])[0]
        assert out.finish_reason == "stop"
        assert out.text == full.text[:first]
        # tokens end with the one completing the stop string; nothing proposed past it
        assert out.token_ids == full.token_ids[: first + len(stop)]


def _late_stop(text: str) -> str:
    """A two-character substring of `text` whose first occurrence starts at index >= 10."""
    return next(text[i : i + 2] for i in range(10, len(text) - 1)
                if text.find(text[i : i + 2]) >= 10)


def test_stream_pieces_concatenate_to_the_text():
    model = tiny_model(0)
    params = SamplingParams(seed=3)
    full = generate(model, "hello world", drafter=DraftModel(model), params=params,
                    max_new_tokens=40)[0]
    stop = _late_stop(full.text)
    s = stream(model, "hello world", drafter=DraftModel(model), params=params,
               max_new_tokens=40, stop=stop)
    pieces = list(s)
    assert len(pieces) > 1
    assert "".join(pieces) == s.generation.text == full.text[: full.text.find(stop)]


def test_stream_takes_exactly_one_prompt():
    model = tiny_model(0)
    params = SamplingParams(seed=1)
    one = "".join(stream(model, "hi", params=params, max_new_tokens=5))
    assert "".join(stream(model, ["hi"], params=params, max_new_tokens=5)) == one
    assert "".join(stream(model, model.encode("hi"), params=params, max_new_tokens=5)) == one
    with pytest.raises(ValueError, match="one prompt"):
        list(stream(model, ["a", "b"], max_new_tokens=5))


def test_max_new_tokens_is_exact(target):
    for drafter in (None, DraftModel(target), PromptLookup()):
        for m in (1, 2, 7):
            out = generate(target, PROMPTS, drafter=drafter, params=SAMPLED, max_new_tokens=m,
                           num_draft_tokens=5)
            assert [len(g.token_ids) for g in out] == [m] * len(PROMPTS)
            assert all(g.finish_reason == "length" for g in out)


def test_stats_are_consistent(target, draft):
    out = generate(target, PROMPTS, drafter=DraftModel(draft), params=SAMPLED, max_new_tokens=30,
                   num_draft_tokens=3)
    for g in out:
        s = g.stats
        assert s.emitted == len(g.token_ids) == 30
        assert s.accepted == sum(s.accepted_per_position)
        assert len(s.accepted_per_position) <= 3
        assert list(s.accepted_per_position) == sorted(s.accepted_per_position, reverse=True)
        assert s.acceptance_rate == s.accepted / s.drafted
        assert s.mean_acceptance_length == pytest.approx(30 / s.steps)
        assert s.seconds > 0 and s.tokens_per_second > 0
    plain = generate(target, PROMPTS, params=SAMPLED, max_new_tokens=30)
    assert all(g.stats.steps == 30 and g.stats.drafted == 0 for g in plain)
    assert all(g.stats.mean_acceptance_length == 1.0 for g in plain)


def test_custom_verify_callable_is_used(target, draft):
    calls = []

    def spy(target_probs, draft_tokens, draft_probs=None, *, generator=None):
        calls.append(draft_tokens.shape)
        return exact_verify(target_probs, draft_tokens, draft_probs, generator=generator)

    a = generate(target, PROMPTS, drafter=DraftModel(draft), params=SAMPLED, max_new_tokens=20,
                 verify=spy)
    b = generate(target, PROMPTS, drafter=DraftModel(draft), params=SAMPLED, max_new_tokens=20)
    assert calls and [g.token_ids for g in a] == [g.token_ids for g in b]


def test_auto_draft_length_runs_per_row(target):
    out = generate(target, PROMPTS, drafter=PromptLookup(), params=SAMPLED, max_new_tokens=30,
                   num_draft_tokens="auto")
    assert all(len(g.token_ids) == 30 for g in out)


def test_many_identical_prompts(target):
    n = 30_000
    out = generate(target, [[3, 4, 5]] * n, params=SamplingParams(seed=1), max_new_tokens=2,
                   batch_size=10_000)
    assert len(out) == n and all(len(g.token_ids) == 2 for g in out)
    assert len({tuple(g.token_ids) for g in out}) > 1  # each row has its own stream


def test_text_prompts_and_text_output():
    model = tiny_model(0)
    out = generate(model, ["ab", "hello"], params=SamplingParams(seed=0), max_new_tokens=5)
    tok = char_tokenizer()
    for g in out:
        assert g.text == tok.decode(g.token_ids, skip_special_tokens=True)


@pytest.mark.parametrize(
    ("prompts", "kwargs", "error"),
    [
        ([], {}, ValueError),
        ([[]], {}, ValueError),
        ([1, 2, 3], {}, TypeError),
        ([[1, VOCAB]], {}, ValueError),
        ([[1, -1]], {}, ValueError),
        ([[1]], {"max_new_tokens": 0}, ValueError),
        ([[1]], {"num_draft_tokens": -1}, ValueError),
        ([[1]], {"num_draft_tokens": "many"}, ValueError),
        ([[1]], {"verify": "exact"}, ValueError),
        ([[1]], {"drafter": "lookup"}, TypeError),
        ([[1]], {"params": {"temperature": 0}}, TypeError),
        ([[1]], {"stop": ""}, ValueError),
        ([[1]], {"stop": "x"}, ValueError),  # no tokenizer to find text
        (["text"], {}, ValueError),  # no tokenizer to encode
        ([[1] * 500], {"max_new_tokens": 20}, ValueError),  # beyond the 512-token context
    ],
)
def test_bad_input_is_a_clear_error(target, prompts, kwargs, error):
    with pytest.raises(error):
        generate(target, prompts, **kwargs)


def test_empty_text_prompt_is_an_error():
    with pytest.raises(ValueError, match="empty"):
        generate(tiny_model(0), [""], max_new_tokens=3)


def test_vocab_mismatch_is_an_error(target):
    other = tiny_llama(0, vocab=VOCAB + 3)
    with pytest.raises(ValueError, match="vocabulary"):
        generate(target, PROMPTS, drafter=DraftModel(other), max_new_tokens=3)


def test_tokenizer_mismatch_is_an_error():
    target = tiny_model(0)
    tok = char_tokenizer()
    tok.add_tokens(["<extra>"])
    with pytest.raises(ValueError, match="vocabulary"):
        generate(target, "hi", drafter=DraftModel(Model(tiny_llama(1), tok, "other")),
                 max_new_tokens=3)


def test_lossless_flag_is_false_only_under_a_lossy_or_uncertified_rule(target, draft):
    def run(verify, drafter=True, params=SAMPLED):
        out = generate(target, PROMPTS, drafter=DraftModel(draft) if drafter else None,
                       params=params, max_new_tokens=6, verify=verify)
        return {g.lossless for g in out}

    assert run("token") == run("block") == {True}
    assert run("greedy", params=SamplingParams(temperature=0)) == {True}
    assert run("lenient:0.5") == {False}
    assert run(exact_verify) == {False}  # a callable is not known to be exact
    assert run("lenient:0.5", drafter=False) == {True}  # plain decoding verifies nothing
