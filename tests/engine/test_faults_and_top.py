"""A drafter that raises inside a step (on_fault="plain": the server's setting) and top-k
logprobs taken from the step's own p.

Exact: greedy rows whose drafter broke mid-way equal plain greedy bit for bit (they continue
plain), and the drafter is restarted once the rows that saw the fault have left. A sampled
token's logprob equals its own top_logprobs entry exactly; the top lists are the p the engine
verified with (compared with a teacher-forced forward of the same target).
"""

from __future__ import annotations

import math

import pytest
import torch

import exactspec as es
from exactspec import SamplingParams
from exactspec.drafters import DraftModel
from exactspec.engine import generate
from exactspec.engine.decoder import DecodeConfig, Decoder
from exactspec.sampling import probs_from_logits
from tests.engine.test_rows import PROMPTS
from tests.engine.tiny import perturbed, tiny_llama

GREEDY = SamplingParams(temperature=0)


@pytest.fixture(scope="module")
def target():
    return tiny_llama(0)


class Breaks:
    """A draft model that raises at its `at`-th propose (counting from 1), then works."""

    hidden_layers = None

    def __init__(self, target, at: int, where: str = "propose") -> None:
        self.inner = DraftModel(perturbed(target, 0.3))
        self.at, self.where, self.calls, self.begins, self.drafted = at, where, 0, 0, 0

    def begin(self, context, info):
        self.begins += 1
        self.inner.begin(context, info)

    def admit(self, context, info, start):
        self.inner.admit(context, info, start)

    def select(self, rows):
        self.inner.select(rows)

    def propose(self, context, num_tokens):
        self.calls += 1
        if self.calls == self.at:
            raise RuntimeError("the drafter broke")
        drafts, q = self.inner.propose(context, num_tokens)
        self.drafted += int((drafts >= 0).sum())
        return drafts, q


def _decoder(target, drafter, on_fault="plain", max_new_tokens=24):
    cfg = DecodeConfig(params=GREEDY, max_new_tokens=max_new_tokens, num_draft_tokens=3,
                       verify="token", return_logprobs=True, eos_token_ids=[], stop=[],
                       tokenizer=None)
    return Decoder(target, drafter, cfg, on_fault=on_fault)


def test_a_raising_drafter_leaves_its_rows_plain_and_exact(target):
    drafter = Breaks(target, at=3)
    dec = _decoder(target, drafter)
    rows = [dec.make_row(i, p, GREEDY, 0) for i, p in enumerate(PROMPTS[:3])]
    dec.admit(rows)
    while dec.rows:
        dec.step()
    assert dec.drafter_faults == 1
    for r in rows:
        plain = generate(target, [r.prompt], params=GREEDY, max_new_tokens=24)[0].token_ids
        assert r.output.tokens == plain and r.output.finish_reason == "length"
    drafted_before = rows[0].output.stats.drafted
    assert drafter.calls == 3  # no more proposals for the rows that saw the fault
    # the batch emptied: the next rows draft again, with a fresh begin
    later = dec.make_row(9, PROMPTS[3], GREEDY, 0)
    dec.admit([later])
    while dec.rows:
        dec.step()
    assert later.output.stats.drafted > 0 and drafter.begins == 2
    assert drafted_before > 0  # the first two steps did draft
    plain = generate(target, [PROMPTS[3]], params=GREEDY, max_new_tokens=24)[0].token_ids
    assert later.output.tokens == plain


def test_rows_admitted_during_a_fault_draft_once_the_faulted_rows_left(target):
    drafter = Breaks(target, at=2)
    dec = _decoder(target, drafter)
    first = dec.make_row(0, PROMPTS[0], GREEDY, 0, max_new_tokens=6)
    dec.admit([first])
    dec.step()
    dec.step()  # the fault: `first` continues plain
    second = dec.make_row(1, PROMPTS[2], GREEDY, 0, max_new_tokens=24)
    dec.admit([second])
    while dec.rows:
        dec.step()
    assert drafter.begins == 2  # restarted over `second` once `first` had left
    assert second.output.stats.drafted > 0
    for r, n in ((first, 6), (second, 24)):
        plain = generate(target, [r.prompt], params=GREEDY, max_new_tokens=n)[0].token_ids
        assert r.output.tokens == plain


def test_by_default_a_drafter_error_propagates(target):
    dec = _decoder(target, Breaks(target, at=1), on_fault="raise")
    dec.admit([dec.make_row(0, PROMPTS[0], GREEDY, 0)])
    with pytest.raises(RuntimeError, match="the drafter broke"):
        dec.step()


def test_bad_user_q_continues_plain_under_the_server_setting(target):
    """A user drafter whose q is not a distribution: the step keeps only the token after the
    context (plain), so greedy output is still plain greedy."""

    class BadQ(Breaks):
        def propose(self, context, num_tokens):
            drafts, q = self.inner.propose(context, num_tokens)
            return drafts, q * 2.0  # sums to 2

    dec = _decoder(target, BadQ(target, at=0))
    rows = [dec.make_row(i, p, GREEDY, 0) for i, p in enumerate(PROMPTS[:2])]
    dec.admit(rows)
    while dec.rows:
        dec.step()
    assert dec.drafter_faults == 1
    for r in rows:
        assert r.output.tokens == generate(target, [r.prompt], params=GREEDY,
                                           max_new_tokens=24)[0].token_ids


@pytest.mark.parametrize("kind", ["plain", "draft"])
def test_top_logprobs_come_from_the_steps_p(target, kind):
    params = SamplingParams(temperature=0.9, top_k=20, seed=5)
    drafter = None if kind == "plain" else DraftModel(perturbed(target, 0.3))
    cfg = DecodeConfig(params=params, max_new_tokens=16, num_draft_tokens=3, verify="token",
                       return_logprobs=True, eos_token_ids=[], stop=[], tokenizer=None)
    dec = Decoder(target, drafter, cfg)
    row = dec.make_row(0, PROMPTS[2], params, 123, top_logprobs=5)
    other = dec.make_row(1, PROMPTS[0], params, 7)  # asks none: gets none
    dec.admit([row, other])
    while dec.rows:
        dec.step()
    out = row.output
    assert len(out.top) == len(out.tokens) == 16 and other.output.top == []
    hits = 0
    for tok, lp, top in zip(out.tokens, out.logprobs, out.top, strict=True):
        assert 1 <= len(top) <= 5
        values = [v for _, v in top]
        assert values == sorted(values, reverse=True)
        own = dict(top).get(tok)
        if own is not None:
            hits += 1
            assert own == lp  # the very same float, not merely close
    assert hits >= 8  # at T=0.9 most tokens are among the five likeliest
    # the lists are p: a teacher-forced forward over prompt + output gives the same top tokens
    seq = torch.tensor([PROMPTS[2] + out.tokens])
    with torch.no_grad():
        logits = target(seq[:, :-1]).logits[0, len(PROMPTS[2]) - 1:]  # [16, V]
    p = probs_from_logits(logits.float(), params)
    for j, top in enumerate(out.top):
        ref_val, ref_idx = p[j].topk(len(top))
        assert [i for i, _ in top] == ref_idx.tolist()
        assert [math.exp(v) for _, v in top] == pytest.approx(ref_val.tolist(), abs=1e-5)


def test_greedy_top_logprobs_list_only_the_chosen_token(target):
    cfg = DecodeConfig(params=GREEDY, max_new_tokens=6, num_draft_tokens=3, verify="token",
                       return_logprobs=True, eos_token_ids=[], stop=[], tokenizer=None)
    dec = Decoder(target, es.PromptLookup(), cfg)
    row = dec.make_row(0, PROMPTS[0], GREEDY, 0, top_logprobs=3)
    dec.admit([row])
    while dec.rows:
        dec.step()
    assert row.output.top == [[(t, 0.0)] for t in row.output.tokens]


def test_a_tree_drafter_that_raises_leaves_its_rows_plain(target):
    class BreaksTree(DraftModel):
        calls = 0

        def propose_tree(self, context, max_depth):
            BreaksTree.calls += 1
            if BreaksTree.calls == 2:
                raise RuntimeError("the tree broke")
            return super().propose_tree(context, max_depth)

    dec = _decoder(target, BreaksTree(perturbed(target, 0.3), tree=(2, 1)))
    rows = [dec.make_row(i, p, GREEDY, 0) for i, p in enumerate(PROMPTS[:2])]
    dec.admit(rows)
    while dec.rows:
        dec.step()
    assert dec.drafter_faults == 1 and BreaksTree.calls == 2
    for r in rows:
        assert r.output.tokens == generate(target, [r.prompt], params=GREEDY,
                                           max_new_tokens=24)[0].token_ids
