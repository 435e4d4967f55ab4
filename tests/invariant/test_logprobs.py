"""es.token_logprobs in the trainer's forward equals the rollouts' Generation.logprobs bit for
bit under es.batch_invariant() (torch.equal), for every verification path, sampling law and
batch shape; without the mode the same comparison fails (so these tests have power)."""

from __future__ import annotations

import contextlib

import pytest
import torch

import exactspec as es
from exactspec.drafters import DraftModel, PromptLookup, QuantizedDraft
from tests.engine.tiny import perturbed, tiny_llama

PROMPTS = [[1, 2, 3, 4, 5, 1, 2, 3], [7, 8, 9], [10, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21]]
T1 = es.SamplingParams(temperature=1.0)
LAWS = {
    "T=1": T1,
    "filtered": es.SamplingParams(temperature=0.7, top_k=20, top_p=0.9, min_p=0.02),
    "penalised": es.SamplingParams(temperature=0.9, top_p=0.95, repetition_penalty=1.3,
                                   presence_penalty=0.4, frequency_penalty=0.2),
}


@pytest.fixture(scope="module")
def target():
    return tiny_llama(0, hidden=64, head_scale=5.0)


@pytest.fixture(scope="module")
def draft(target):
    return perturbed(target, 0.3)


def rollouts(target, prompts, drafter, params, verify="token", seed=11, invariant=True,
             max_new_tokens=14):
    """Generations and their sequences (prompt + generated), decoded together."""
    mode = es.batch_invariant() if invariant else contextlib.nullcontext()
    with mode:
        gens = es.generate(target, prompts, drafter=drafter,
                           params=params.__class__(**{**params.__dict__, "seed": seed}),
                           max_new_tokens=max_new_tokens, num_draft_tokens=3, verify=verify,
                           return_logprobs=True)
    return gens, [list(p) + g.token_ids for p, g in zip(prompts, gens, strict=True)]


def scored(model, seqs, prompts, params, invariant=True) -> torch.Tensor:  # [B, C]
    mode = es.batch_invariant() if invariant else contextlib.nullcontext()
    with mode:
        return es.token_logprobs(model, seqs, [len(p) for p in prompts], params).detach()


def equal_rows(gens, lp) -> list[bool]:
    out = []
    for i, g in enumerate(gens):
        ref = torch.tensor(g.logprobs, dtype=torch.float32)  # the engine's floats, exactly
        out.append(torch.equal(lp[i, : len(ref)], ref) and bool((lp[i, len(ref):] == 0).all()))
    return out


DRAFTERS = {
    "plain": lambda d: None,
    "int8-chain": lambda d: QuantizedDraft(8, backend="torch"),
    "draft-chain": lambda d: DraftModel(d),
    "draft-tree": lambda d: DraftModel(d, tree=(2, 2, 1)),
}
CASES = [("plain", "token"), ("int8-chain", "token"), ("int8-chain", "block"),
         ("draft-chain", "token"), ("draft-chain", "block"),
         ("draft-tree", "token"), ("draft-tree", "traversal")]


@pytest.mark.parametrize("law", list(LAWS))
@pytest.mark.parametrize(("drafter", "verify"), CASES, ids=[f"{d}-{v}" for d, v in CASES])
def test_trainer_logprobs_equal_the_rollouts_bit_for_bit(target, draft, drafter, verify, law):
    params = LAWS[law]
    gens, seqs = rollouts(target, PROMPTS, DRAFTERS[drafter](draft), params, verify)
    assert sum(len(g.token_ids) for g in gens) >= 30
    if drafter != "plain":
        assert sum(g.stats.accepted for g in gens) > 0  # speculation really ran
    together = scored(target, seqs, PROMPTS, params)  # ragged rows padded into one forward
    assert all(equal_rows(gens, together))
    for i in range(len(PROMPTS)):  # each row alone
        alone = scored(target, seqs[i:i + 1], PROMPTS[i:i + 1], params)
        assert torch.equal(alone[0, : together.shape[1]], together[i, : alone.shape[1]])


def test_without_the_mode_the_trainer_disagrees(target, draft):
    """The power of the tests above: the same rollouts scored by transformers' ordinary
    forward differ from the engine's logprobs (by float rounding, ~1e-6)."""
    gens, seqs = rollouts(target, PROMPTS, QuantizedDraft(8, backend="torch"), T1)
    plain = scored(target, seqs, PROMPTS, T1, invariant=False)
    assert not any(equal_rows(gens, plain))
    close = [torch.allclose(plain[i, : len(g.logprobs)], torch.tensor(g.logprobs), atol=1e-4)
             for i, g in enumerate(gens)]
    assert all(close)  # the same numbers up to rounding: the comparison is of like with like


def test_rows_are_their_own_whatever_the_batch(target):
    """A row's trainer logprobs do not depend on what else is in the batch (a longer row
    changes the padding, another prompt the neighbours)."""
    _gens, seqs = rollouts(target, PROMPTS, None, T1, max_new_tokens=20)
    ref = scored(target, seqs, PROMPTS, T1)
    other = [[5, 4, 3, 2, 1] * 9]  # a longer neighbour: more padding for every row
    both = scored(target, seqs + other, [*PROMPTS, other[0][:3]], T1)
    assert torch.equal(both[:3, : ref.shape[1]], ref)


def test_per_row_params(target):
    """Rows drawn with different laws in one batch: each scored with its own."""
    laws = [es.SamplingParams(temperature=t, top_p=tp, seed=s)
            for t, tp, s in ((1.0, 1.0, 1), (0.6, 0.9, 2), (1.3, 0.8, 3))]
    with es.batch_invariant():
        gens = es.generate(target, PROMPTS, params=laws, max_new_tokens=12, return_logprobs=True)
    seqs = [p + g.token_ids for p, g in zip(PROMPTS, gens, strict=True)]
    assert all(equal_rows(gens, scored(target, seqs, PROMPTS, laws)))


def test_after_update_weights_and_with_the_engine_flag(target):
    """Engine(batch_invariant=True) rollouts after update_weights equal the trainer's
    logprobs under the new weights (and not under the old ones)."""
    policy = tiny_llama(0, hidden=64, head_scale=5.0)
    engine = es.Engine(policy, QuantizedDraft(8, backend="torch"), T1, max_new_tokens=12,
                       batch_invariant=True)
    new = perturbed(policy, 0.2, seed=5)
    engine.update_weights(new.state_dict())
    out = engine.generate(PROMPTS, n=2, params=es.SamplingParams(seed=4))
    gens = [g for row in out for g in row]
    prompts = [p for p in PROMPTS for _ in range(2)]
    seqs = [p + g.token_ids for p, g in zip(prompts, gens, strict=True)]
    assert all(equal_rows(gens, scored(new, seqs, prompts, T1)))
    assert not any(equal_rows(gens, scored(target, seqs, prompts, T1)))
    assert not es.is_batch_invariant()  # the engine's calls leave the mode as they found it


def test_greedy_rollouts_score_zero(target):
    params = es.SamplingParams(temperature=0.0)
    gens, seqs = rollouts(target, PROMPTS, QuantizedDraft(8, backend="torch"), params)
    lp = scored(target, seqs, PROMPTS, params)
    assert all(equal_rows(gens, lp)) and bool((lp == 0).all())


def test_tensor_input_and_errors(target):
    _gens, seqs = rollouts(target, PROMPTS, None, T1, max_new_tokens=6)
    padded = torch.full((3, max(map(len, seqs))), -1)
    for i, s in enumerate(seqs):
        padded[i, : len(s)] = torch.tensor(s)
    plen = torch.tensor([len(p) for p in PROMPTS])
    with es.batch_invariant():
        assert torch.equal(es.token_logprobs(target, padded, plen, T1).detach(),
                           scored(target, seqs, PROMPTS, T1))
    with pytest.raises(ValueError, match="prompt_lengths"):
        es.token_logprobs(target, seqs, [1, 2], T1)
    with pytest.raises(ValueError, match=r"prompt_lengths\[0\]=0"):
        es.token_logprobs(target, seqs, [0, 1, 1], T1)
    with pytest.raises(ValueError, match=r"prompt_lengths\[1\]=\d+ must be in 1\.\.\d+ \(the "
                                         r"length of sequence 1\)"):
        es.token_logprobs(target, seqs, [1, len(seqs[1]) + 1, 1], T1)
    with pytest.raises(TypeError, match="SamplingParams"):
        es.token_logprobs(target, seqs, plen, [T1])


def test_the_engine_already_computes_these_numbers_outside_the_mode(target):
    """The lean forward always runs on the kernels, so a Llama target's rollouts are the same
    tokens and logprobs with the mode on or off: the mode is for the trainer's forward (and
    the engine flag checks the target is one the guarantee covers)."""
    params = LAWS["filtered"]
    # prompt lookup: its drafts depend on the tokens only (a draft model's forward would run
    # under the mode too, so its q, and which drafts a seed draws, could move)
    inside, _ = rollouts(target, PROMPTS, PromptLookup(), params, "block")
    outside, _ = rollouts(target, PROMPTS, PromptLookup(), params, "block", invariant=False)
    assert [g.token_ids for g in inside] == [g.token_ids for g in outside]
    assert [g.logprobs for g in inside] == [g.logprobs for g in outside]


def test_the_thread_count_does_not_matter(target):
    gens, seqs = rollouts(target, PROMPTS, None, T1, max_new_tokens=20)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = scored(target, seqs, PROMPTS, T1)
        torch.set_num_threads(max(2, threads))
        more = scored(target, seqs, PROMPTS, T1)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(one, more) and all(equal_rows(gens, one))


def test_a_rollout_row_is_the_same_alone_and_in_a_batch(target, draft):
    """The engine's side: a row with its own seed gives the same tokens and logprobs alone as
    in a ragged batch (speculative, a tree), so the trainer has one set of numbers to match."""
    laws = [es.SamplingParams(temperature=0.9, top_p=0.95, seed=20 + i) for i in range(3)]
    with es.batch_invariant():
        together = es.generate(target, PROMPTS, drafter=DraftModel(draft, tree=(2, 1)),
                               params=laws, max_new_tokens=12, return_logprobs=True)
        alone = [es.generate(target, [p], drafter=DraftModel(draft, tree=(2, 1)), params=[law],
                             max_new_tokens=12, return_logprobs=True)[0]
                 for p, law in zip(PROMPTS, laws, strict=True)]
    assert [g.token_ids for g in together] == [g.token_ids for g in alone]
    assert [g.logprobs for g in together] == [g.logprobs for g in alone]
