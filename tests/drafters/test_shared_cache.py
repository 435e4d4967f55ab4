"""The lean self-draft on the target's own KV cache (QuantizedDraft with the target's layers:
DraftModel._shared). It prefills nothing and catches nothing up: every draft forward is one
token wide. The target's law is untouched, on the kernels bit for bit: greedy token ids and log
p equal plain's, and at T=1 the log p on each row's common prefix with plain's text are the
same floats, in one batch and with rows admitted mid-run (batch_size below the prompt count).
A deliberately wrong variant, a draft that writes one slot inside the target's committed
prefix, fails that comparison, so it can fail."""

from __future__ import annotations

import pytest
import torch

import exactspec as es
from exactspec import kernels
from exactspec.drafters import quantized
from exactspec.drafters.draft_model import DraftModel
from exactspec.models.lean import lean_forward_for
from tests.kernels.test_generate_invariance import (
    GREEDY,
    MIN_MEAN_PREFIX,
    ROWS,
    T1,
    K,
    _assert_greedy_equal,
    _assert_t1_prefix_equal,
    _prompts,
    _run,
    _target,
)

pytestmark = pytest.mark.skipif(not kernels.enabled(),
                                reason="bit-equality needs the kernels (python -m exactspec.kernels)")


def _widths(monkeypatch, lean) -> list[int]:
    """Record the token width of every forward of `lean` (a LeanLlama)."""
    widths: list[int] = []
    forward = lean.forward

    def recording(tokens, *args, **kwargs):
        widths.append(int(tokens.shape[1]))
        return forward(tokens, *args, **kwargs)

    monkeypatch.setattr(lean, "forward", recording)
    return widths


def test_the_self_draft_shares_the_cache_and_runs_only_one_token_forwards(monkeypatch):
    target = _target()
    widths = _widths(monkeypatch, lean_forward_for(target, "int8"))
    prompts = _prompts()[:6]  # 1-24 tokens each
    drafter = es.QuantizedDraft(8, backend="torch")
    out = es.generate(target, prompts, drafter=drafter, params=GREEDY, max_new_tokens=24,
                      num_draft_tokens=K)
    assert drafter._shared is not None and not drafter.lags_behind
    assert sum(g.stats.accepted for g in out) > 0
    assert widths and set(widths) == {1}, sorted(set(widths))  # no prefill, no catch-up
    # its own cache (the switch off): the prompts are prefilled into it
    monkeypatch.setattr(quantized, "SHARE_TARGET_CACHE", False)
    widths.clear()
    drafter = es.QuantizedDraft(8, backend="torch")
    es.generate(target, prompts, drafter=drafter, params=GREEDY, max_new_tokens=24,
                num_draft_tokens=K)
    assert drafter._shared is None and drafter.lags_behind
    assert max(widths) == max(len(p) for p in prompts) - 1


def test_a_subset_of_layers_keeps_its_own_cache():
    target = _target()
    drafter = es.QuantizedDraft(8, backend="torch", layers=[0])
    es.generate(target, [[1, 2, 3]], drafter=drafter, params=GREEDY, max_new_tokens=8)
    assert drafter._shared is None


@pytest.fixture(scope="module")
def model():
    return _target()


@pytest.mark.parametrize("batch_size", [ROWS, 7])  # one batch; rows admitted mid-run
def test_the_target_law_is_bit_for_bit_plain(model, batch_size):
    def run(params, drafter=None):
        new = 32 if isinstance(params, list) else 64
        return es.generate(model, _prompts(), drafter=drafter, params=params,
                           max_new_tokens=new, num_draft_tokens=K, return_logprobs=True,
                           batch_size=batch_size)

    plain = _run(model, GREEDY)
    spec = run(GREEDY, es.QuantizedDraft(8, backend="torch"))
    for a, b in zip(plain, spec, strict=True):  # greedy: 64 of plain's 128 tokens
        assert a.token_ids[:64] == b.token_ids
        assert torch.equal(torch.tensor(a.logprobs[:64]), torch.tensor(b.logprobs))
    checked = _assert_t1_prefix_equal(_run(model, T1),
                                      run(T1, es.QuantizedDraft(8, backend="torch")))
    assert checked >= MIN_MEAN_PREFIX * ROWS, f"mean common prefix {checked / ROWS:.1f}"


def test_a_draft_writing_inside_the_target_prefix_is_caught(model, monkeypatch):
    """The wrong variant: the draft feeds each row's last token one slot early, overwriting
    the target's keys and values of the token before it."""
    catch_up = DraftModel._catch_up

    def early(self, context, on=None):
        feed, last = catch_up(self, context, on)
        if self._shared is not None:
            self._adapter.lengths = (self._adapter.lengths - 1).clamp(min=0)
        return feed, last

    plain = _run(model, T1)
    monkeypatch.setattr(DraftModel, "_catch_up", early)
    spec = _run(model, T1, es.QuantizedDraft(8, backend="torch"))
    with pytest.raises(AssertionError):
        _assert_t1_prefix_equal(plain, spec)
    greedy = _run(model, GREEDY, es.QuantizedDraft(8, backend="torch"))
    with pytest.raises(AssertionError):
        _assert_greedy_equal(_run(model, GREEDY), greedy, logprobs=True)


def test_few_rows_draft_alone_on_a_copy_of_their_cache_rows(monkeypatch):
    """A probe under load (1 of 4 rows drafts): the draft forwards run over that row alone
    (not the batch fed a token each), the target's cache is left as it was, and the row's
    drafts and q are the bits it gets drafting with every row (the kernels' invariance)."""
    from exactspec.engine.decoder import DecodeConfig, Decoder
    from tests.engine.test_admission import Counter

    target = _target()
    drafter = es.QuantizedDraft(8, backend="torch")
    cfg = DecodeConfig(params=T1[0], max_new_tokens=16, num_draft_tokens=K, verify="token",
                       return_logprobs=False, eos_token_ids=[], stop=[], tokenizer=None)
    dec = Decoder(target, drafter, cfg)
    dec.admit([dec.make_row(i, p, T1[i], 100 + i) for i, p in enumerate(_prompts()[1:5])])
    dec.step()
    cache = dec.target.cache
    before = [t.clone() for t in cache.keys + cache.values]
    count = Counter(monkeypatch)
    ctx = dec.batch.context()
    drafts, q = drafter.propose(ctx, torch.tensor([0, 3, 0, 0]))
    assert [(b, w) for _, b, w in count.calls] == [(1, 1)] * 3  # the one row, one token wide
    assert all(torch.equal(a, b) for a, b in zip(before, cache.keys + cache.values,
                                                 strict=True))
    assert (drafts[[0, 2, 3]] == -1).all() and not q[[0, 2, 3]].any()
    every_drafts, every_q = drafter.propose(ctx, torch.tensor([3, 3, 3, 3]))
    assert torch.equal(drafts[1], every_drafts[1]) and torch.equal(q[1], every_q[1])
