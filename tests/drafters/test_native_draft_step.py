"""DraftModel's loop on the native draft step (kernels/draft_step.py) against its Python path.

Exact: `propose` gives the same drafts and the same q (torch.equal) with the native step and
without it (EXACTSPEC_DRAFT_STEP=0), for greedy and sampled laws, coupled draws, ragged
catch-ups; laws it does not take (penalties, several laws in a batch) fall back; greedy
speculative == plain greedy. Statistical: the engine's sequence-level chi-square at 1e-6
(tests/audit/test_engine_lossless.py's helpers) with the native step in use, and a wrong
native step (drawing without the temperature, reporting the standardized q) rejected by it.
"""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from exactspec import kernels
from exactspec.audit import Speculative, output_law, power, target_law
from exactspec.audit.stats import chi_square
from exactspec.audit.world import World, logits_table, model_world, standardize
from exactspec.drafters import DraftModel
from exactspec.drafters.base import DraftContext, TargetInfo
from exactspec.drafters.quantized import QuantizedDraft
from exactspec.engine import generate
from exactspec.kernels import draft_step
from exactspec.sampling import RowStreams, SamplingParams
from tests.audit.test_engine_lossless import (  # noqa: F401  (models: a fixture)
    FILTERED,
    PROMPT,
    ROWS,
    TEMPERATURE,
    K,
    N,
    V,
    _counts,
    _world,
    lean_logits,
    models,
)
from tests.engine.tiny import tiny_llama

if not kernels.enabled():
    pytest.skip("the native draft step needs the exactspec kernels", allow_module_level=True)

VOCAB = 300  # wider than top-p's first 256 candidates
LAWS = {
    "greedy": SamplingParams(temperature=0.0, seed=3),
    "t1": SamplingParams(temperature=1.0, seed=3),
    "filtered": SamplingParams(temperature=0.7, top_k=40, top_p=0.9, min_p=0.01, seed=3),
}


@pytest.fixture
def calls(monkeypatch):
    """Counts the native step's calls (the loop really took it)."""
    seen = []
    real = draft_step.draft_step

    def counted(*args, **kwargs):
        seen.append(1)
        return real(*args, **kwargs)

    monkeypatch.setattr(draft_step, "draft_step", counted)
    return seen


@pytest.fixture(scope="module")
def draft_lm():
    return tiny_llama(1, vocab=VOCAB, head_scale=3.0)


def context(params, coupled=False, grow: int = 0) -> DraftContext:
    """Three ragged rows; `grow` tokens more per row (catch-ups of several tokens)."""
    rows = [[5, 9, 2, 7, 7, 1], [4, 4], [8, 1, 3, 3]]
    rows = [r + [(11 * i + j) % VOCAB for j in range(grow + i)] for i, r in enumerate(rows)]
    width = max(map(len, rows))
    tokens = torch.full((3, width), -1, dtype=torch.long)
    for i, r in enumerate(rows):
        tokens[i, : len(r)] = torch.tensor(r)
    lengths = torch.tensor([len(r) for r in rows])
    streams = RowStreams.from_seed(params.seed or 0, 3)
    streams.steps += grow
    return DraftContext(tokens, lengths, torch.tensor([3, 1, 2]), params, streams,
                        coupled=coupled)


def both_paths(monkeypatch, draft_lm, params, coupled):
    """(drafts, q) of two proposes each (the second after ragged catch-ups), native and not."""
    out = {}
    for flag in ("1", "0"):
        monkeypatch.setenv("EXACTSPEC_DRAFT_STEP", flag)
        drafter = DraftModel(draft_lm)
        drafter.begin(context(params, coupled), TargetInfo(VOCAB, None))
        first = drafter.propose(context(params, coupled), torch.tensor([4, 3, 4]))
        second = drafter.propose(context(params, coupled, grow=3), torch.tensor([2, 4, 3]))
        out[flag] = (*first, *second)
    return out["1"], out["0"]


@pytest.mark.parametrize("coupled", [False, True, "mask"])
@pytest.mark.parametrize("law", list(LAWS))
def test_propose_is_the_python_path(monkeypatch, calls, draft_lm, law, coupled):
    if coupled == "mask":
        coupled = torch.tensor([True, False, True])
    native, python = both_paths(monkeypatch, draft_lm, LAWS[law], coupled)
    assert len(calls) == 4 + 4  # K = 4, then K = 4 (the first propose and the second)
    for a, b in zip(native, python, strict=True):
        assert torch.equal(a, b)


@pytest.mark.parametrize("params", [
    SamplingParams(temperature=0.8, repetition_penalty=1.3, seed=1),
    SamplingParams(temperature=0.8, logit_bias={4: 2.0}, seed=1),
], ids=["penalty", "logit-bias"])
def test_laws_it_does_not_take_fall_back(monkeypatch, calls, draft_lm, params):
    native, python = both_paths(monkeypatch, draft_lm, params, False)
    assert calls == []
    for a, b in zip(native, python, strict=True):
        assert torch.equal(a, b)


def test_rows_with_different_laws_fall_back(monkeypatch, calls, draft_lm):
    monkeypatch.setenv("EXACTSPEC_DRAFT_STEP", "1")
    ctx = replace(context(LAWS["t1"]), params=None,
                  row_params=(LAWS["t1"], LAWS["filtered"], LAWS["t1"]))
    drafter = DraftModel(draft_lm)
    drafter.begin(ctx, TargetInfo(VOCAB, None))
    drafter.propose(ctx, torch.tensor([2, 2, 2]))
    assert calls == []


@pytest.mark.parametrize("drafter", ["int8", "draft model"])
def test_greedy_equals_plain(calls, draft_lm, drafter):
    target = tiny_llama(0, vocab=VOCAB, head_scale=3.0)
    greedy = SamplingParams(temperature=0)
    prompts = [[1, 2, 3], [7, 8, 9, 10, 11]]
    plain = generate(target, prompts, params=greedy, max_new_tokens=24)
    make = QuantizedDraft(8, backend="torch") if drafter == "int8" else DraftModel(draft_lm)
    out = generate(target, prompts, drafter=make, params=greedy, max_new_tokens=24,
                   num_draft_tokens=4, return_logprobs=True)
    assert calls  # drafted on the native step
    assert [g.token_ids for g in out] == [g.token_ids for g in plain]


@pytest.mark.parametrize("bits", [8, 4])
@pytest.mark.parametrize("law", ["greedy", "t1", "filtered"])
def test_a_reduced_head_on_the_native_step_is_the_python_path(monkeypatch, calls, bits, law):
    """QuantizedDraft(vocab=ids): the native step places the reduced head's logits in the
    vocabulary as LeanLlama.full_logits does; generate's tokens and log p with the native
    step equal the Python path's, bit for bit."""
    target = tiny_llama(0, vocab=VOCAB, head_scale=3.0)
    params = LAWS[law] if law in LAWS else SamplingParams(temperature=0)
    prompts = [[1, 2, 3], [7, 8, 9, 10, 11]]
    keep = list(range(0, VOCAB, 3))  # a third of the vocabulary
    out = {}
    for flag in ("1", "0"):
        monkeypatch.setenv("EXACTSPEC_DRAFT_STEP", flag)
        gens = generate(target, prompts, drafter=QuantizedDraft(bits, backend="torch", vocab=keep),
                        params=params, max_new_tokens=24, num_draft_tokens=4,
                        return_logprobs=True)
        out[flag] = [(g.token_ids, g.logprobs) for g in gens]
        if flag == "1":
            assert calls  # drafted on the native step
    assert out["1"] == out["0"]


def test_generate_matches_the_target(models, calls):  # noqa: F811
    counts, accepted = _counts(models, QuantizedDraft(8, backend="torch"), FILTERED, "token",
                               seed=5)
    assert calls
    assert accepted > ROWS // 10  # drafts were really used, not only bonus tokens
    result = chi_square(counts, target_law(_world(models, FILTERED), N))
    assert result.dof > 30 and not result.rejected, result


def test_a_native_step_that_skips_the_temperature_is_caught(models, monkeypatch):  # noqa: F811
    """Wrong: the native step draws at temperature 1 and reports q at the target's 0.5 (what
    a step skipping the standardization before its draw would do); its exact wrong law, from
    the quantized forward's own logits, is rejected end to end and followed by the draws."""
    real = draft_step.draft_step
    seen = []

    def hot(x, norm, head, params, u, *reduced):
        seen.append(1)
        tokens, q1 = real(x, norm, head, replace(params, temperature=1.0), u, *reduced)
        claimed = q1.double() ** (1.0 / params.temperature)
        return tokens, (claimed / claimed.sum(-1, keepdim=True)).float()

    monkeypatch.setattr(draft_step, "draft_step", hot)
    drafter = QuantizedDraft(8, backend="torch")
    q_logits = logits_table(lean_logits(models[0], drafter.fmt), PROMPT, V, N + K)
    depth = N + K
    good = model_world(models[2], q_logits, V, depth, TEMPERATURE, PROMPT)
    drawn = standardize(q_logits, V, depth, SamplingParams(), tuple(PROMPT))
    bad = World("temperature skipped", V, depth, good.target, drawn, good.claimed)
    target = target_law(good, N)
    wrong = output_law(bad, Speculative("token", K), N)
    assert power(target, wrong, ROWS) > 1 - 1e-6
    counts, accepted = _counts(models, drafter, TEMPERATURE, "token", seed=8)
    assert seen and accepted > ROWS // 10
    assert chi_square(counts, target).rejected
    assert not chi_square(counts, wrong).rejected
