"""Under load the "auto" policy decodes plain, and plain must cost the llama.cpp self-draft
nothing: a step at K = 0 feeds it no token, and a probe (one row, one draft token) feeds that
row alone. Counted: every token handed to llama_decode, per row. Exact all along: greedy rows
equal plain greedy."""

from __future__ import annotations

import pytest
import torch

from exactspec import SamplingParams
from exactspec.drafters.gguf_draft import llama_cpp_available, llama_cpp_why
from exactspec.engine import generate
from exactspec.engine.decoder import DecodeConfig, Decoder
from exactspec.engine.policy import AUTO_PROBE_EVERY, PROBE_SHARE, DraftLengthPolicy
from tests.engine.test_rows import PROMPTS
from tests.engine.tiny import tiny_llama

pytestmark = pytest.mark.skipif(not llama_cpp_available(), reason=llama_cpp_why())

STEPS = 3 * AUTO_PROBE_EVERY + 4  # at least two probes


@pytest.fixture(scope="module")
def target():
    return tiny_llama(0)


def _plain_costs(policy, rows: int) -> None:
    """Costs at which plain decoding wins at this load, held fixed (no timing in the test),
    and rows that have accepted nothing in 1,000 drafts; drafting could win only were every
    draft accepted (so probes are taken: none where even that would lose)."""
    policy.draft_cost = {1: 0.01, rows: 0.04}
    policy.target_cost = {(rows, 1): 0.1, (rows, 2): 0.15}
    policy.observe_costs = lambda *args, **kwargs: None
    policy.accepted = torch.zeros_like(policy.accepted)
    policy.rejections = torch.full_like(policy.rejections, 1000.0)
    policy.pool = [0.0, 1000.0]


def test_plain_steps_feed_the_llama_cpp_draft_nothing_and_probes_one_row(target):
    import exactspec as es

    drafter = es.QuantizedDraft(8, backend="llama.cpp")
    greedy = SamplingParams(temperature=0)
    cfg = DecodeConfig(params=greedy, max_new_tokens=STEPS + 2, num_draft_tokens="auto",
                       verify="token", return_logprobs=False, eos_token_ids=[], stop=[],
                       tokenizer=None)
    dec = Decoder(target, drafter, cfg, on_fault="raise")
    rows = [dec.make_row(i, p, greedy, 0) for i, p in enumerate(PROMPTS)]
    dec.admit(rows)
    _plain_costs(dec.policy, len(rows))
    gguf = drafter._gguf
    fed: list[set[int]] = []  # per llama_decode call: the rows it fed
    real = gguf._decode_chunk

    def counted(c, chunk, out):
        fed.append({i for i, _, _, _ in chunk})
        return real(c, chunk, out)

    gguf._decode_chunk = counted
    drafting_steps = 0
    for _ in range(STEPS):
        before = len(fed)
        want = sum(r.output.stats.drafted for r in rows)
        dec.step()
        drafted = sum(r.output.stats.drafted for r in rows) - want
        assert drafted in (0, 1)  # plain, or a probe's one token
        assert (len(fed) > before) == (drafted == 1)  # a plain step feeds llama.cpp nothing
        drafting_steps += drafted
    assert drafting_steps >= 2  # a probe of two steps (the next waits on its catch-up cost)
    assert fed and all(len(rows_fed) == 1 for rows_fed in fed)  # a probe feeds one row
    for r in rows:
        plain = generate(target, [r.prompt], params=greedy, max_new_tokens=STEPS + 2)[0]
        assert r.output.tokens[:STEPS] == plain.token_ids[:STEPS]


def test_plain_steps_leave_a_torch_draft_idle_and_rows_admitted_then_unfed(target, monkeypatch):
    """The torch self-draft (DraftModel's cache) under load: a step at K = 0 runs no draft
    forward; rows admitted while the batch decodes plain are not prefilled in the draft (the
    target's prefill is the only one); a probe catches its row up over that row alone
    (`feed_rows`), then drafts one token (the others get one padding token, not kept). Counted: every draft-cache extend and each
    row's draft-cache length. Greedy rows equal plain greedy."""
    import exactspec as es
    from exactspec.drafters import quantized
    from exactspec.drafters.draft_model import LONG_CATCH_UP
    from exactspec.models import adapter as adapter_module
    from tests.engine.test_admission import Counter

    monkeypatch.setattr(quantized, "SHARE_TARGET_CACHE", False)  # its own cache, to feed
    count = Counter(monkeypatch)
    keep: list[tuple[object, int]] = []  # (adapter, logits_to_keep) of every extend
    counted = adapter_module.TargetAdapter.extend
    monkeypatch.setattr(adapter_module.TargetAdapter, "extend", lambda a, tokens, **kw: (
        keep.append((a, kw.get("logits_to_keep", 0))), counted(a, tokens, **kw))[1])
    drafter = es.QuantizedDraft(8, backend="torch")
    greedy = SamplingParams(temperature=0)
    cfg = DecodeConfig(params=greedy, max_new_tokens=2 * STEPS, num_draft_tokens="auto",
                       verify="token", return_logprobs=False, eos_token_ids=[], stop=[],
                       tokenizer=None)
    dec = Decoder(target, drafter, cfg, on_fault="raise")
    rows = [dec.make_row(i, p, greedy, 0) for i, p in enumerate(PROMPTS)]
    dec.admit(rows[:2])
    _plain_costs(dec.policy, len(PROMPTS))
    dec.step()  # plain: the drafter has drafted nothing since
    ad = drafter._adapter
    mark = count.mark()
    dec.admit(rows[2:])
    assert count.since(mark, ad) == []  # no draft prefill while the batch decodes plain
    assert ad.lengths[2:].tolist() == [0, 0]
    probes = catch_ups = long_catch_ups = 0
    for _ in range(STEPS):
        mark = count.mark()
        keep.clear()
        before = [r.output.stats.drafted for r in rows]
        dec.step()
        drafted = [r.output.stats.drafted - b for r, b in zip(rows, before, strict=True)]
        calls = count.since(mark, ad)
        if sum(drafted) == 0:
            assert calls == []  # a plain step: no draft forward at all
            continue
        probes += 1
        j = drafted.index(1)
        assert sum(drafted) == 1  # one row, one token
        # the draft step feeds one token a row; where the probed row lagged by more, it first
        # caught up over its own row alone (feed_rows: its context but the last token,
        # keeping one position's logits), not the batch padded to its context
        assert calls[-1] == (len(rows), 1)
        if len(calls) == 2:
            catch_ups += 1
            long_catch_ups += calls[0][1] >= LONG_CATCH_UP
            assert calls[0][0] == 1 and [k for a, k in keep if a is ad] == [1, 0]
        assert len(calls) <= 2
        assert sum(w for _, w in calls) <= len(rows[j].prompt) + len(rows[j].output.tokens)
    assert probes >= 4 and catch_ups >= 1 and long_catch_ups >= 1
    probed = [r.output.stats.drafted > 0 for r in rows]
    for j in (2, 3):  # admitted while plain: cached in the draft only if a probe fed them
        assert (int(ad.lengths[j]) > 0) == probed[j]
    for r in rows:
        plain = generate(target, [r.prompt], params=greedy, max_new_tokens=STEPS)[0]
        assert r.output.tokens[:STEPS] == plain.token_ids[:STEPS]


def test_probes_cost_at_most_their_share_of_the_time_and_cheap_ones_keep_coming():
    """At a row count where drafting loses, a probe is due only once the plain steps since the
    last one cost 1 / PROBE_SHARE times what that probe cost beyond plain: a dear probe (a
    torch draft catching its row up in a forward padded to sixteen rows: 0.5 s against 0.1 s
    plain steps) runs at most a few times in 400 steps and costs at most its share of the
    time (plus the first, which nothing had priced); a cheap one keeps the step-count back-off
    (every 8, 16, 32, 64 steps). Costs are the policy's own measurements on a stand-in step."""
    def run(draft_s, steps=400):
        pol = DraftLengthPolicy("auto", 16)
        pol.accepted, pol.rejections = torch.zeros(16), torch.full((16,), 200.0)
        # drafting loses at this acceptance, and could win were every draft accepted (else no
        # probe at all: test_policy.py)
        pol.draft_cost = {16: 0.02}
        pol.target_cost = {(16, 1): 0.100, (16, 2): 0.120}
        probe_steps, excess = 0, 0.0
        for _ in range(steps):
            want = pol.choose(torch.full((16,), 30))
            k = int(want.max())
            pol.observe(want, torch.zeros(16))
            pol.observe_costs(draft_s * k, k, 0.100 + 0.020 * k, 1 + k, 16)
            probe_steps += k
            excess += (draft_s + 0.020) * k
        return probe_steps // 2, excess

    probes, excess = run(draft_s=0.5)
    plain_time = 400 * 0.100
    first = 2 * (0.5 + 0.020)
    assert 1 <= probes <= 2  # the step-count back-off alone ran 7 here
    assert excess <= PROBE_SHARE * plain_time + first
    probes, _ = run(draft_s=0.001)
    assert probes >= 6


@pytest.mark.parametrize("method", ["token", "block", "traversal"])
def test_a_step_where_no_row_drafts_draws_the_chain_laws_token_at_plains_cost(method):
    """At K = 0 the exact chain rules skip building their law (plain decoding's cost, measured
    2-5 ms a step at 16 rows) and draw the very token the law draws: the same uniform on the
    same p. Checked bit for bit against the law over many rows and temperatures; a draw with
    plain decoding's uniform (another domain) differs."""
    from exactspec.engine.verifier import bonus_rule, chain_rule
    from exactspec.sampling import DOMAIN_SAMPLE, RowStreams, parse_method, sample

    torch.manual_seed(0)
    rows, vocab = 64, 50
    p = torch.softmax(torch.randn(rows, 1, vocab) * 3, -1)  # [B, 1, V]
    drafts, q = torch.zeros(rows, 0, dtype=torch.long), torch.zeros(rows, 0, vocab)
    streams = RowStreams.from_seed(7, rows)
    law = parse_method(method).chain_law(p, drafts, q, check=False).draw(streams)
    fast = chain_rule(object(), parse_method(method))(p, drafts, q, streams)
    assert torch.equal(fast.tokens, law.tokens)
    assert torch.equal(fast.num_accepted, law.num_accepted)
    assert torch.equal(bonus_rule(p, streams).tokens, law.tokens)
    other = sample(p[:, 0], streams, domain=DOMAIN_SAMPLE)
    assert not torch.equal(other, law.tokens[:, 0])


def test_admitted_rows_lag_by_their_prompts_unless_the_batch_drafts_for_half_its_rows(
        target, monkeypatch):
    """The drafter and the policy share one rule (`prefills_at_once`): a begin or admission
    prefills the new prompts in the draft only if the latest step drafted for at least half the
    rows the batch then has. One stream drafting keeps its prefill at admission; load arriving
    after one stream (16 rows after a step drafting for one), plain steps and one-row probes
    leave the prompts to be fed when the rows first draft, and the policy counts them as lag.
    (The quantized self-draft with a cache of its own; on the target's cache it never lags.)"""
    import exactspec as es
    from exactspec.drafters import quantized
    from exactspec.drafters.draft_model import prefills_at_once

    monkeypatch.setattr(quantized, "SHARE_TARGET_CACHE", False)

    assert prefills_at_once(1, 1) and prefills_at_once(2, 4) and prefills_at_once(1 << 30, 64)
    assert not prefills_at_once(1, 16) and not prefills_at_once(0, 1)
    assert not prefills_at_once(None, 1)
    pol = DraftLengthPolicy("auto", 0)
    pol.admit(1, [5])  # no step yet: the policy cannot know, and counts the prompt
    assert pol.lag.tolist() == [5]
    pol.observe(torch.tensor([4.0]), torch.tensor([4.0]))  # drafted for its one row
    pol.admit(1, [7])  # 2 rows, 1 drafting: prefilled
    assert pol.lag.tolist() == [0, 0]
    pol.observe(torch.tensor([1.0, 0.0]), torch.tensor([0.0, 0.0]))
    pol.admit(2, [3, 4])  # 4 rows, 1 drafting: not prefilled
    assert pol.lag.tolist() == [0, 1, 3, 4]
    # the torch draft: after a step drafting for one row, a begin over four rows caches nothing
    drafter = es.QuantizedDraft(8, backend="torch")
    cfg = DecodeConfig(params=SamplingParams(temperature=0), max_new_tokens=8,
                       num_draft_tokens=3, verify="token", return_logprobs=False,
                       eos_token_ids=[], stop=[], tokenizer=None)
    dec = Decoder(target, drafter, cfg)
    dec.admit([dec.make_row(0, PROMPTS[0], SamplingParams(temperature=0), 0)])
    assert drafter._adapter.lengths.tolist() == [len(PROMPTS[0]) - 1]  # a fresh drafter: eager
    dec.step()
    dec.admit([dec.make_row(i, p, SamplingParams(temperature=0), 0)
               for i, p in enumerate(PROMPTS[1:], 1)])
    assert drafter._adapter.lengths[1:].tolist() == [0, 0, 0]
    drafter.begin(dec.batch.context(), dec.draft.info)
    assert drafter._adapter.lengths.tolist() == [0, 0, 0, 0]
    assert dec.policy.lagging and dec.policy.lag.sum() > 0
    # on the target's cache: nothing lags, so the policy charges no catch-up
    monkeypatch.setattr(quantized, "SHARE_TARGET_CACHE", True)
    dec = Decoder(target, es.QuantizedDraft(8, backend="torch"), cfg)
    dec.admit([dec.make_row(0, PROMPTS[0], SamplingParams(temperature=0), 0)])
    dec.step()
    dec.admit([dec.make_row(i, p, SamplingParams(temperature=0), 0)
               for i, p in enumerate(PROMPTS[1:], 1)])
    assert not dec.policy.lagging and dec.policy.lag.tolist() == [0.0] * 4
