"""Exactness under load: the server's outputs are the target's law, and greedy is plain greedy.

Statistical test (alpha = 1e-6 per check, fixed seeds), as tests/audit/test_engine_lossless.py:
125 concurrent seeded requests of n=64 choices each (8000 samples) with filtering parameters,
and 62 with penalties sent among them, for one prompt on a tiny random Llama with an 8-token
vocabulary, speculating with a draft model; each law's first N tokens are compared by
chi-square with the exact law from full forward passes of the target. The
same test fails on two deliberately wrong servers: a wrong residual in verification (power
computed from its exact law), and a server that gives every choice of a request the same
random stream (its counts come in multiples of 64, so the statistic is about 64 times a
chi-square(dof) variable and exceeds the threshold, about dof + 5 sqrt(2 dof), with certainty).
"""

from __future__ import annotations

import asyncio
import threading
from dataclasses import replace

import pytest
import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

import exactspec as es
from exactspec.audit import output_law, power, target_law
from exactspec.audit.pitfalls import ResidualFromTarget, WrongResidual, wrong_verify
from exactspec.audit.samplers import sequence_ids
from exactspec.audit.stats import bincount, chi_square
from exactspec.audit.world import logits_table, model_world
from exactspec.models.loading import Model
from exactspec.serve import DrafterChoice, build_drafter
from tests.audit.test_engine_lossless import FILTERED, PENALISED, PROMPT, K, N, V, tiny_llama
from tests.engine.tiny import char_tokenizer, perturbed
from tests.engine.tiny import tiny_llama as char_llama
from tests.serve.conftest import NAME, client, openai, start

REQUESTS, PER_REQUEST = 125, 64  # 8000 samples, as the engine's own test
SYMBOLS = "abcdefgh"  # one character per token id of the V = 8 vocabulary


def symbol_tokenizer() -> PreTrainedTokenizerFast:
    tok = Tokenizer(models.WordLevel({c: i for i, c in enumerate(SYMBOLS)}, unk_token="a"))
    tok.pre_tokenizer = pre_tokenizers.Split("", "isolated")
    tok.decoder = decoders.Fuse()
    return PreTrainedTokenizerFast(tokenizer_object=tok)


@pytest.fixture(scope="module")
def world():
    target, draft = tiny_llama(0), tiny_llama(1)

    def table(model):
        return logits_table(lambda ids: model(ids).logits, PROMPT, V, N + K)

    law_world = model_world(table(target), table(draft), V, N + K, FILTERED, PROMPT)
    other = model_world(table(target), table(draft), V, N + K, PENALISED, PROMPT)
    return Model(target, symbol_tokenizer(), "tiny-8"), draft, law_world, target_law(other, N)


@pytest.fixture(scope="module")
def penalised_law(world):
    return world[3]


def _body(params) -> dict:
    """A request's sampling fields for `params` (top-level extensions as vLLM takes them)."""
    return dict(temperature=params.temperature, top_p=params.top_p,
                presence_penalty=params.presence_penalty,
                frequency_penalty=params.frequency_penalty,
                extra_body={"top_k": params.top_k, "min_p": params.min_p,
                            "repetition_penalty": params.repetition_penalty})


def _counts(srv, requests: int = REQUESTS, other: int = 0) -> list[torch.Tensor]:
    """Counts [V**N] of the first N tokens of every choice of `requests` concurrent FILTERED
    requests, and of `other` PENALISED ones sent among them (every third until used up)."""
    async def ask(c, seed, params):
        r = await c.completions.create(model=NAME, prompt=PROMPT, max_tokens=N + K,
                                       n=PER_REQUEST, seed=seed, **_body(params))
        return [ch.text for ch in r.choices]

    kinds = [PENALISED if i % 3 == 2 and i // 3 < other else FILTERED
             for i in range(requests + other)]

    async def main():
        async with openai.AsyncOpenAI(base_url=srv.url + "/v1", api_key="x", max_retries=0,
                                      timeout=120) as c:
            return await asyncio.gather(*(ask(c, 1000 + i, p) for i, p in enumerate(kinds)))

    answers = asyncio.run(main())
    out = []
    for params, n in ((FILTERED, requests), (PENALISED, other)):
        texts = [t for p, ts in zip(kinds, answers, strict=True) if p is params for t in ts]
        assert len(texts) == n * PER_REQUEST
        seqs = torch.tensor([[SYMBOLS.index(ch) for ch in t[:N]] for t in texts],
                            dtype=torch.long)  # [ROWS, N]
        out.append(bincount(sequence_ids(seqs.reshape(-1, N), V), V**N))
    return out


def _server(world, **engine):
    model, draft = world[:2]
    return start(model, es.DraftModel(draft),
                 engine={"max_batch": 2048, "max_queue": 2 * REQUESTS, "num_draft_tokens": K,
                         **engine})


@pytest.mark.parametrize(("k", "seeded"), [(K, "method"), ("auto", "method"), (K, "coupled")])
def test_concurrent_requests_follow_the_target_law(world, penalised_law, k, seeded):
    """FILTERED and PENALISED requests interleaved: rows of both laws share decode steps, each
    standardized with its own parameters, and each law passes on its own; with a fixed K and
    with the serving default, the draft length chosen per step from measured costs (K = 0
    included), rows admitted into running batches without re-prefilling the others. The
    requests are seeded (reproducible counts): verified by the server's method (token), and
    coupled, the default for seeded requests (at a fixed K: coupled accepts fewer drafts, and
    under auto K the policy may then draft none)."""
    with _server(world, num_draft_tokens=k, seeded_verify=seeded) as srv:
        filtered, penalised = _counts(srv, REQUESTS, REQUESTS // 2)
        accepted = srv.app.state.metrics.accepted_tokens
        peak = srv.app.state.metrics.peak_batch_rows
    # drafts were really used (auto starts at K = 4 until costs are measured)
    assert accepted > (REQUESTS * PER_REQUEST // 10 if k == K else 0)
    assert peak > 2 * PER_REQUEST  # several requests (of both laws, interleaved) shared a step
    for counts, law in ((filtered, target_law(world[2], N)), (penalised, penalised_law)):
        result = chi_square(counts, law)
        assert result.dof > 30 and not result.rejected, result


def test_a_server_with_a_wrong_verify_is_caught(world):
    target = target_law(world[2], N)
    wrong = output_law(world[2], WrongResidual("token", K, ResidualFromTarget, "from p"), N)
    few = REQUESTS // 4  # 1984 samples already see it:
    assert power(target, wrong, few * PER_REQUEST) > 1 - 1e-6
    with _server(world, verify=wrong_verify(ResidualFromTarget)) as srv:
        counts, _ = _counts(srv, few)
    assert chi_square(counts, target).rejected
    assert not chi_square(counts, wrong).rejected  # the server did run the modelled sampler


def test_a_server_reusing_one_stream_per_request_is_caught(world):
    with _server(world) as srv:
        engine, submit = srv.engine, srv.engine.submit

        def one_stream(spec, loop):  # the bug: every choice gets choice 0's stream
            sub = submit(spec, loop)
            for c in sub.choices:
                c.seed = sub.choices[0].seed
            return sub

        engine.submit = one_stream
        counts, _ = _counts(srv, REQUESTS // 4)  # 31 draws, 64 copies of each
    assert chi_square(counts, target_law(world[2], N)).rejected


@pytest.fixture(scope="module")
def char_model():
    return Model(char_llama(3, eos=0), char_tokenizer(), "tiny-char")


@pytest.mark.parametrize("drafter", ["plain", "prompt lookup", "lookup auto", "draft model",
                                     "quantized 8"])
def test_greedy_through_the_server_is_plain_greedy(char_model, drafter):
    k = "auto" if drafter == "lookup auto" else 4
    make = {"plain": lambda: None, "prompt lookup": es.PromptLookup,
            "lookup auto": es.PromptLookup,
            "draft model": lambda: es.DraftModel(perturbed(char_model.model, 0.3)),
            "quantized 8": lambda: build_drafter(DrafterChoice(quantized_draft=8),
                                                 char_model)[0]}[drafter]
    asks = [("abcabcabc", 30), ("hello hello", 17), ("zz", 30), ("the cat sat on the", 9),
            ("a", 25), ("abcabcabc", 17)]
    out: dict[int, object] = {}
    with start(char_model, make(), engine={"max_batch": 8, "num_draft_tokens": k}) as srv:
        c = client(srv)

        def ask(i, prompt, m):
            out[i] = c.completions.create(model=NAME, prompt=prompt, max_tokens=m, temperature=0)

        threads = [threading.Thread(target=ask, args=(i, *a)) for i, a in enumerate(asks)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
    greedy = es.SamplingParams(temperature=0)
    for i, (prompt, m) in enumerate(asks):
        (g,) = es.generate(char_model, [prompt], params=greedy, max_new_tokens=m)
        r = out[i]
        assert r.choices[0].text == g.text, (prompt, drafter)
        assert r.usage.completion_tokens == len(g.token_ids)  # the same tokens, EOS included
        assert r.choices[0].finish_reason == ("length" if g.finish_reason == "length" else "stop")


def test_seeded_request_alone_equals_generate_with_a_drafter(char_model):
    params = replace(FILTERED, seed=77)
    with start(char_model, es.PromptLookup()) as srv:
        r = client(srv).completions.create(model=NAME, prompt="abcabcab", max_tokens=20, n=3,
                                           seed=77, temperature=params.temperature,
                                           top_p=params.top_p, extra_body={"top_k": params.top_k})
    gens = es.generate(char_model, ["abcabcab"] * 3, drafter=es.PromptLookup(), params=params,
                       max_new_tokens=20, verify="coupled")  # seeded: coupled (issue 38)
    assert [ch.text for ch in r.choices] == [g.text for g in gens]
