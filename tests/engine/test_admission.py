"""Admission without re-prefill: a row admitted into a running batch is prefilled alone, in the
target and in the drafter (its admission hook); the running rows keep their draft state.

Counted forwards: every TargetAdapter.extend call (the target's, a DraftModel's, a
QuantizedDraft's cache) is recorded with its rows and width, so the test sees exactly which
tokens an admission ran. Exact: admitted rows give the same tokens as in a batch started with
them, for every drafter (the suffix drafter and the quantized self-draft here; plain, lookup,
draft model and EAGLE in test_rows.py), and greedy rows equal plain greedy.
"""

from __future__ import annotations

import pytest
import torch

from exactspec import SamplingParams
from exactspec.drafters import DraftModel, PromptLookup, quantized
from exactspec.drafters.base import AdmitsRows
from exactspec.drafters.gguf_draft import llama_cpp_available, llama_cpp_why
from exactspec.engine import generate
from exactspec.engine.api import _stream_seeds
from exactspec.engine.decoder import DecodeConfig, Decoder
from exactspec.models import adapter as adapter_module
from tests.engine.test_rows import MIXED, PROMPTS, _eagle, admit_staggered
from tests.engine.tiny import perturbed, tiny_llama

K = 3


@pytest.fixture(scope="module")
def target():
    return tiny_llama(0)


class Counter:
    """Records (adapter, rows, width) for every TargetAdapter.extend while installed."""

    def __init__(self, monkeypatch) -> None:
        self.calls: list[tuple[object, int, int]] = []
        real = adapter_module.TargetAdapter.extend

        def counted(adapter, tokens, **kw):
            self.calls.append((adapter, int(tokens.shape[0]), int(tokens.shape[1])))
            return real(adapter, tokens, **kw)

        monkeypatch.setattr(adapter_module.TargetAdapter, "extend", counted)

    def of(self, adapter) -> list[tuple[int, int]]:
        """(rows, width) of every call on `adapter` so far."""
        return [(b, w) for a, b, w in self.calls if a is adapter]

    def mark(self) -> int:
        return len(self.calls)

    def since(self, mark: int, adapter) -> list[tuple[int, int]]:
        return [(b, w) for a, b, w in self.calls[mark:] if a is adapter]


def _decoder(target, drafter, max_new_tokens=20, k=K):
    cfg = DecodeConfig(params=SamplingParams(), max_new_tokens=max_new_tokens,
                       num_draft_tokens=k, verify="token", return_logprobs=True,
                       eos_token_ids=[], stop=[], tokenizer=None)
    return Decoder(target, drafter, cfg)


def _drafter(kind, target):
    import exactspec as es

    return {"draft": lambda: DraftModel(perturbed(target, 0.3)),
            "quantized": lambda: es.QuantizedDraft(8, backend="torch"),
            "suffix": lambda: es.SuffixDrafter(),
            "lookup": PromptLookup,
            "eagle": lambda: _eagle(target)}[kind]()


@pytest.mark.parametrize("kind", ["draft", "quantized"])
def test_admission_prefills_only_the_new_row_in_the_draft_cache(target, kind, monkeypatch):
    """Two rows run three steps; a third is admitted: the drafter's cache runs its prompt alone
    (one call of 1 row x its prompt but the last token), not the running rows again; the next
    step's draft catches each running row up by what it emitted only. (The quantized
    self-draft with a cache of its own: on the target's cache it runs nothing, next test.)"""
    monkeypatch.setattr(quantized, "SHARE_TARGET_CACHE", False)
    count = Counter(monkeypatch)
    seeds = _stream_seeds(MIXED, True)
    drafter = _drafter(kind, target)
    dec = _decoder(target, drafter)
    rows = [dec.make_row(i, PROMPTS[i], MIXED[i], seeds[i]) for i in range(3)]
    dec.admit(rows[:2])
    for _ in range(3):
        dec.step()
    ad = drafter._adapter
    before_fed = drafter._fed[:2].clone()
    mark = count.mark()
    dec.admit([rows[2]])
    new_prompt = len(PROMPTS[2]) - 1
    assert count.since(mark, ad) == [(1, new_prompt)]  # the new row alone, in the draft
    assert count.since(mark, dec.target) == [(1, new_prompt)]  # ... and in the target
    assert torch.equal(drafter._fed[:2, : before_fed.shape[1]], before_fed)  # kept as it was
    mark = count.mark()
    dec.step()
    first = count.since(mark, ad)[0]  # the draft's catch-up: at most one step's tokens wide
    assert first[0] == 3 and first[1] <= K + 1
    # a begin over the whole batch (what every admission did before the hook) re-runs all
    # three rows' contexts: at least the longest context wide
    mark = count.mark()
    drafter.begin(dec.batch.context(), dec.draft.info)
    longest = int(dec.batch.lengths.max()) - 1
    assert count.since(mark, drafter._adapter) == [(3, longest)]


def test_a_self_draft_on_the_target_cache_runs_nothing_at_admission(target, monkeypatch):
    """The quantized self-draft reading the target's cache: an admission prefills the new row
    in the target alone and runs no draft forward; the next step drafts every row one token
    wide (no catch-up), and even a begin over the whole batch runs nothing."""
    count = Counter(monkeypatch)
    seeds = _stream_seeds(MIXED, True)
    drafter = _drafter("quantized", target)
    dec = _decoder(target, drafter)
    rows = [dec.make_row(i, PROMPTS[i], MIXED[i], seeds[i]) for i in range(3)]
    dec.admit(rows[:2])
    assert drafter._shared is dec.target
    for _ in range(3):
        dec.step()
    ad = drafter._adapter
    mark = count.mark()
    dec.admit([rows[2]])
    assert count.since(mark, ad) == []
    assert count.since(mark, dec.target) == [(1, len(PROMPTS[2]) - 1)]
    mark = count.mark()
    dec.step()
    assert count.since(mark, ad) == [(3, 1)] * K  # K draft positions, one token each
    mark = count.mark()
    drafter.begin(dec.batch.context(), dec.draft.info)
    assert count.calls[mark:] == []  # no forward anywhere


def test_a_drafter_without_the_hook_is_restarted_over_the_batch(target, monkeypatch):
    """A user's drafter written before the hook still works: `begin` over every row."""

    class Legacy:
        hidden_layers = None

        def __init__(self):
            self.inner, self.begins = DraftModel(perturbed(target, 0.3)), []

        def begin(self, context, info):
            self.begins.append(int(context.tokens.shape[0]))
            self.inner.begin(context, info)

        def select(self, rows):
            self.inner.select(rows)

        def propose(self, context, num_tokens):
            return self.inner.propose(context, num_tokens)

    legacy = Legacy()
    assert not isinstance(legacy, AdmitsRows)
    seeds = _stream_seeds(MIXED, True)
    dec = _decoder(target, legacy)
    rows = [dec.make_row(i, PROMPTS[i], MIXED[i], seeds[i]) for i in range(3)]
    dec.admit(rows[:2])
    dec.step()
    dec.admit([rows[2]])
    assert legacy.begins == [2, 3]


def test_suffix_and_eagle_keep_the_running_rows_state(target):
    import exactspec as es

    seeds = _stream_seeds(MIXED, True)
    suffix = es.SuffixDrafter()
    dec = _decoder(target, suffix)
    rows = [dec.make_row(i, PROMPTS[i], MIXED[i], seeds[i]) for i in range(3)]
    dec.admit(rows[:2])
    dec.step()
    dec.step()
    tries = list(suffix._rows)
    dec.admit([rows[2]])
    assert suffix._rows[:2] == tries and all(a is b for a, b in zip(suffix._rows, tries,
                                                                      strict=False))
    assert len(suffix._rows) == 3

    eagle = _eagle(target)
    dec = _decoder(target, eagle)
    rows = [dec.make_row(i, PROMPTS[i], MIXED[i], seeds[i]) for i in range(3)]
    dec.admit(rows[:2])
    dec.step()
    dec.step()
    k, committed = eagle._k.clone(), eagle._committed.clone()
    dec.admit([rows[2]])
    assert torch.equal(eagle._k[:2], k) and torch.equal(eagle._committed[:2], committed)
    assert int(eagle._committed[2]) == 0  # the new row's head cache fills at its next draft


@pytest.mark.parametrize("kind", ["suffix", "quantized", "lookup"])
def test_rows_admitted_between_steps_equal_a_batch_started_with_them(target, kind):
    """As test_rows.py's test of the same name, for the drafters it does not cover."""
    seeds = _stream_seeds(MIXED, True)
    full = generate(target, PROMPTS, drafter=_drafter(kind, target), params=MIXED,
                    max_new_tokens=20, num_draft_tokens=K, return_logprobs=True)
    dec = _decoder(target, _drafter(kind, target))
    rows = [dec.make_row(i, PROMPTS[i], MIXED[i], seeds[i]) for i in range(4)]
    admit_staggered(dec, rows)
    assert [r.output.tokens for r in rows] == [g.token_ids for g in full]


def test_each_row_keeps_its_own_budget_and_stop(target):
    """Budgets and stop rules live on the rows: one decoder, rows of 3, 9 and 20 tokens."""
    dec = _decoder(target, DraftModel(perturbed(target, 0.3)), max_new_tokens=20)
    greedy = SamplingParams(temperature=0)
    rows = [dec.make_row(i, PROMPTS[i], greedy, 0, max_new_tokens=n)
            for i, n in enumerate((3, 9, 20))]
    dec.admit(rows)
    while dec.rows:
        dec.step()
    assert [len(r.output.tokens) for r in rows] == [3, 9, 20]
    for r, n in zip(rows, (3, 9, 20), strict=True):
        plain = generate(target, [r.prompt], params=greedy, max_new_tokens=n)[0].token_ids
        assert r.output.tokens == plain


def test_a_row_past_the_context_is_refused_naming_both_numbers(target):
    dec = _decoder(target, None)
    ctx = dec.target.max_context
    row = dec.make_row(0, [1, 2, 3], SamplingParams(), 0, max_new_tokens=ctx)
    with pytest.raises(ValueError, match=rf"prompt of 3 tokens plus max_new_tokens={ctx}.*{ctx}"):
        dec.admit([row])
    assert dec.rows == []


def test_drop_removes_rows_before_the_next_step(target):
    seeds = _stream_seeds(MIXED, True)
    drafter = DraftModel(perturbed(target, 0.3))
    dec = _decoder(target, drafter)
    rows = [dec.make_row(i, PROMPTS[i], MIXED[i], seeds[i]) for i in range(3)]
    dec.admit(rows)
    dec.step()
    gone = dec.drop([1])
    assert gone == [rows[1]] and [r.id for r in dec.rows] == [0, 2]
    assert dec.target.batch_size == 2 and drafter._fed.shape[0] == 2
    n = len(rows[1].output.tokens)
    while dec.rows:
        dec.step()
    assert len(rows[1].output.tokens) == n and rows[1].output.finish_reason is None


@pytest.mark.skipif(not llama_cpp_available(), reason=llama_cpp_why())
def test_llama_cpp_draft_admission_keeps_sequences_and_reuses_freed_ones(target):
    """The llama.cpp backend: running rows keep their sequences and cached tokens; a new row
    takes a sequence a dropped row left; greedy rows admitted at any step equal plain greedy."""
    import exactspec as es

    drafter = es.QuantizedDraft(8, backend="llama.cpp")
    greedy = SamplingParams(temperature=0)
    dec = _decoder(target, drafter, max_new_tokens=16)
    rows = [dec.make_row(i, p, greedy, 0) for i, p in enumerate(PROMPTS)]
    dec.admit(rows[:3])
    dec.step()
    dec.step()
    gguf = drafter._gguf
    dec.drop([1])
    where, fed = list(gguf._where), gguf._fed.clone()
    contexts = len(gguf._ctxs)
    dec.admit([rows[3]])
    assert gguf._where[:2] == where and torch.equal(gguf._fed[:2, : fed.shape[1]], fed)
    assert len(gguf._ctxs) == contexts  # the dropped row's sequence was free
    assert gguf._where[2] not in where
    while dec.rows:
        dec.step()
    for r in (rows[0], rows[2], rows[3]):
        plain = generate(target, [r.prompt], params=greedy, max_new_tokens=16)[0].token_ids
        assert r.output.tokens == plain


def test_calibrate_measures_every_verify_width_at_one_row_then_leaves(target, monkeypatch):
    """Decoder.calibrate (what a server runs before its first request, with auto K): one row
    drafts K = 0..AUTO_MAX_DRAFT in turn, twice (a width's first measurement is dropped), so
    every verify width has its cost at one row; then the batch is empty again and a request
    decodes exactly as without it (greedy equals plain)."""
    from exactspec.engine.policy import AUTO_MAX_DRAFT

    counter = Counter(monkeypatch)
    dec = _decoder(target, _drafter("quantized", target), k="auto")
    seconds = dec.calibrate(list(PROMPTS[0]))
    assert seconds > 0 and dec.rows == [] and not dec.policy.forced
    verifies = [w for b, w in counter.of(dec.target) if b == 1][1:]  # after the prefill
    assert verifies == list(range(1, AUTO_MAX_DRAFT + 2)) * 2
    measured = {w for (b, w) in dec.policy.target_cost if b == 1}
    assert measured == set(range(1, AUTO_MAX_DRAFT + 2))
    greedy = SamplingParams(temperature=0.0)
    row = dec.make_row(0, list(PROMPTS[1]), greedy, 0, max_new_tokens=12)
    dec.admit([row])
    while dec.rows:
        dec.step()
    (plain,) = generate(target, [list(PROMPTS[1])], max_new_tokens=12, params=greedy)
    assert row.output.tokens == plain.token_ids
    # fixed K: nothing to calibrate
    assert _decoder(target, PromptLookup(), k=K).calibrate(list(PROMPTS[0])) == 0.0
