"""Rows with their own SamplingParams and seeds, and rows admitted between steps.

Exact (token ids, float32 on CPU): a row given its own params and seed decodes the same alone,
at any index of a batch, next to rows with other params, and when admitted into a running
batch as when the batch started with it.
"""

from __future__ import annotations

import pytest

from exactspec import SamplingParams
from exactspec.drafters import DraftModel, PromptLookup
from exactspec.drafters.eagle import EagleDrafter
from exactspec.drafters.eagle_head import EagleConfig, EagleHead
from exactspec.engine import generate
from exactspec.engine.api import _stream_seeds
from exactspec.engine.decoder import DecodeConfig, Decoder
from tests.engine.tiny import perturbed, tiny_llama

PROMPTS = [[5, 6, 7, 8, 5, 6, 7], [9], [1, 2, 3, 1, 2, 3, 1, 2, 3, 1, 2], [30, 31, 30, 31, 30]]
MIXED = [SamplingParams(temperature=0.6, seed=21),
         SamplingParams(temperature=1.3, top_k=12, seed=22),
         SamplingParams(temperature=0),
         SamplingParams(repetition_penalty=1.3, frequency_penalty=0.3, min_p=0.05, seed=24)]


@pytest.fixture(scope="module")
def target():
    return tiny_llama(0)


def _eagle(target):
    import torch

    torch.manual_seed(2)
    head = EagleHead(EagleConfig.for_target(target.config, (1, -1)))
    with torch.no_grad():
        for w in head.parameters():
            w.mul_(3.0)
    return EagleDrafter(head, target)


def _drafter(kind, target):
    return {"plain": lambda: None, "lookup": PromptLookup,
            "draft": lambda: DraftModel(perturbed(target, 0.3)),
            "eagle": lambda: _eagle(target)}[kind]()


def _ids(gens):
    return [g.token_ids for g in gens]


@pytest.mark.parametrize("kind", ["plain", "lookup", "draft"])
def test_per_row_seeds_give_the_same_row_alone_and_at_any_index(target, kind):
    """T=1: the same prompt and seed, alone or at index 0..3 of batches with other rows."""
    seeds = [101, 102, 103, 104]
    params = [SamplingParams(seed=s) for s in seeds]
    alone = [generate(target, [p], drafter=_drafter(kind, target), params=[pp],
                      max_new_tokens=24)[0].token_ids for p, pp in zip(PROMPTS, params, strict=True)]
    batch = _ids(generate(target, PROMPTS, drafter=_drafter(kind, target), params=params,
                          max_new_tokens=24))
    order = [2, 0, 3, 1]
    shuffled = _ids(generate(target, [PROMPTS[i] for i in order], drafter=_drafter(kind, target),
                             params=[params[i] for i in order], max_new_tokens=24))
    # the same prompt and seed twice in one batch, next to a row with another seed
    twice = _ids(generate(target, [PROMPTS[1], PROMPTS[0], PROMPTS[1]],
                          drafter=_drafter(kind, target),
                          params=[params[1], SamplingParams(seed=999), params[1]],
                          max_new_tokens=24))
    assert batch == alone
    assert shuffled == [alone[i] for i in order]
    assert twice[0] == twice[2] == alone[1] != twice[1]
    # a per-row seed is row 0 of a call sharing that seed
    shared = generate(target, [PROMPTS[3]], drafter=_drafter(kind, target),
                      params=SamplingParams(seed=104), max_new_tokens=24)
    assert shared[0].token_ids == alone[3]
    assert len({tuple(r) for r in alone}) == 4


def test_a_shared_seed_keeps_the_row_index_derivation(target):
    """One SamplingParams: row i's stream comes from (seed, i), as before (index-dependent)."""
    shared = SamplingParams(seed=7)
    batch = _ids(generate(target, [PROMPTS[0]] * 3, params=shared, max_new_tokens=20))
    assert len({tuple(r) for r in batch}) == 3  # identical prompts, three streams
    assert _stream_seeds([shared] * 3, False) != _stream_seeds([shared] * 3, True)
    alone = generate(target, [PROMPTS[0]], params=shared, max_new_tokens=20)[0].token_ids
    assert alone == batch[0]


@pytest.mark.parametrize("kind", ["plain", "lookup", "draft", "eagle"])
@pytest.mark.parametrize("verify", ["token", "block"])
def test_rows_with_different_params_in_one_batch_match_each_row_alone(target, kind, verify):
    if kind == "plain" and verify == "block":
        pytest.skip("plain decoding verifies nothing: the same run as token")
    batch = _ids(generate(target, PROMPTS, drafter=_drafter(kind, target), params=MIXED,
                          max_new_tokens=24, verify=verify, num_draft_tokens=3))
    for prompt, params, got in zip(PROMPTS, MIXED, batch, strict=True):
        alone = generate(target, [prompt], drafter=_drafter(kind, target), params=[params],
                         max_new_tokens=24, verify=verify, num_draft_tokens=3)
        assert alone[0].token_ids == got
    greedy = generate(target, [PROMPTS[2]], params=SamplingParams(temperature=0),
                      max_new_tokens=24)[0].token_ids
    assert batch[2] == greedy  # the greedy row stays greedy next to sampled ones
    assert len({tuple(r) for r in batch}) == 4


def _decoder(target, drafter, params, max_new_tokens=20):
    cfg = DecodeConfig(params=params, max_new_tokens=max_new_tokens, num_draft_tokens=3,
                       verify="token", return_logprobs=True, eos_token_ids=[], stop=[],
                       tokenizer=None)
    return Decoder(target, drafter, cfg)


@pytest.mark.parametrize("kind", ["plain", "lookup", "draft", "eagle"])
def test_rows_admitted_between_steps_equal_a_batch_started_with_them(target, kind):
    """Rows 2 and 3 join after two steps, row 1 after four: each gives the same tokens and
    logprobs as in one batch started with every row (per-row seeds; one row greedy)."""
    seeds = _stream_seeds(MIXED, True)
    full = generate(target, PROMPTS, drafter=_drafter(kind, target), params=MIXED,
                    max_new_tokens=20, num_draft_tokens=3, return_logprobs=True)
    dec = _decoder(target, _drafter(kind, target), MIXED)
    rows = [dec.make_row(i, PROMPTS[i], MIXED[i], seeds[i]) for i in range(4)]
    admit_staggered(dec, rows)
    assert [r.output.tokens for r in rows] == _ids(full)
    for r, g in zip(rows, full, strict=True):
        assert r.output.logprobs == pytest.approx(g.logprobs, abs=1e-5)
        assert r.output.stats.emitted == 20 and r.output.finish_reason == "length"


def test_rows_admitted_after_others_finished(target):
    """A decoder emptied by finished rows takes new ones (the server's idle case)."""
    seeds = _stream_seeds(MIXED, True)
    dec = _decoder(target, DraftModel(target), MIXED, max_new_tokens=3)
    first = dec.make_row(0, PROMPTS[0], MIXED[0], seeds[0])
    dec.admit([first])
    while dec.rows:
        dec.step()
    later = dec.make_row(3, PROMPTS[3], MIXED[3], seeds[3])
    dec.admit([later])
    while dec.rows:
        dec.step()
    alone = generate(target, [PROMPTS[3]], drafter=DraftModel(target), params=[MIXED[3]],
                     max_new_tokens=3, num_draft_tokens=3)
    assert later.output.tokens == alone[0].token_ids and len(first.output.tokens) == 3


def admit_staggered(dec: Decoder, rows: list) -> None:
    """Row 0 first, rows 2.. after two steps, row 1 after four; step until every row ends."""
    dec.admit([rows[0]])
    for step in range(1, 100):
        if not dec.rows:
            break
        dec.step()
        if step == 2:
            dec.admit(rows[2:])
        if step == 4:
            dec.admit([rows[1]])
