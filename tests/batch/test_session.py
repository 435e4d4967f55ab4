"""es.Engine: n samples per prompt, the policy's log-probabilities, update_weights in place.

Statistical (alpha = 1e-6 per check, fixed seeds): after `update_weights` the samples follow the
*new* weights' exact law and are rejected against the old law (and before it, the other way
round), with a draft model that keeps the old weights, so the draft stays exact while stale.
The exact law of the first N tokens comes from full forward passes of each model over every
continuation (as in tests/audit/test_engine_lossless.py); the test's power against the other
law (and against 5% of old-law samples mixed in) at this sample size is computed. Exact: logprobs equal a plain transformers forward of
the target; greedy speculative equals greedy plain, bit for bit.
"""

from dataclasses import replace

import pytest
import torch

from exactspec.audit import power, target_law
from exactspec.audit.samplers import sequence_ids
from exactspec.audit.stats import bincount, chi_square
from exactspec.audit.world import logits_table, model_world
from exactspec.drafters import DraftModel, QuantizedDraft
from exactspec.drafters.gguf_draft import llama_cpp_available, llama_cpp_why
from exactspec.engine.engine import Engine
from exactspec.errors import InvalidType, InvalidValue
from exactspec.sampling import SamplingParams, probs_from_logits
from tests.batch.helpers import PARAMS, PROMPT, V, policy
from tests.engine.tiny import perturbed

N, K = 3, 2  # tokens compared (512 outcomes), drafts per step
ROWS = 2000  # samples per law: enough to see even 5% of old-law samples (power asserted)
@pytest.fixture(scope="module")
def laws():
    """Exact laws [V**N] of the first N tokens under the old (seed 0) and new (seed 1) weights."""
    out = []
    for seed in (0, 1):
        model = policy(seed)
        table = logits_table(lambda ids, m=model: m(ids).logits, PROMPT, V, N + K)
        out.append(target_law(model_world(table, table, V, N + K, PARAMS, PROMPT), N))
    return out


def _counts(engine: Engine, seed: int) -> tuple[torch.Tensor, int]:
    gens = engine.generate([PROMPT], n=ROWS, params=replace(PARAMS, seed=seed))[0]
    seqs = torch.tensor([g.token_ids[:N] for g in gens])  # [ROWS, N]
    return bincount(sequence_ids(seqs, V), V**N), sum(g.stats.accepted for g in gens)


@pytest.mark.parametrize("draft", ["stale draft model", "quantized self-draft"])
def test_update_weights_moves_the_samples_to_the_new_law(laws, draft):
    old_law, new_law = laws
    assert power(old_law, new_law, ROWS) > 1 - 1e-6  # ROWS suffices to tell the laws apart
    assert power(new_law, old_law, ROWS) > 1 - 1e-6
    assert power(new_law, 0.95 * new_law + 0.05 * old_law, ROWS) > 1 - 1e-6  # a partial update
    target = policy(0)
    params_before = [p for p in target.parameters()]
    drafter = DraftModel(policy(0)) if draft == "stale draft model" else QuantizedDraft(8)
    engine = Engine(target, drafter, PARAMS, max_new_tokens=N + K, num_draft_tokens=K,
                    batch_size=ROWS)  # a draft model keeps the old weights; QuantizedDraft not
    before, _ = _counts(engine, seed=1)
    assert not chi_square(before, old_law).rejected
    assert chi_square(before, new_law).rejected  # the old policy's samples fail the new law
    assert engine.update_weights(policy(1).state_dict()) == len(target.state_dict())
    assert engine.policy_version == 1
    assert all(a is b for a, b in zip(params_before, target.parameters(), strict=True))
    after, accepted = _counts(engine, seed=2)
    assert accepted > ROWS // 10  # the stale draft still proposes and is still verified
    assert not chi_square(after, new_law).rejected, chi_square(after, new_law)
    assert chi_square(after, old_law).rejected


def test_a_draft_built_on_the_target_follows_the_update():
    """A draft sharing the target's weights has q = p: every draft is accepted, before and after."""
    target = policy(0)
    engine = Engine(target, DraftModel(target), PARAMS, max_new_tokens=8, num_draft_tokens=K)
    engine.update_weights(policy(1).state_dict())
    gens = engine.generate([PROMPT], n=50, params=replace(PARAMS, seed=3))[0]
    drafted = sum(g.stats.drafted for g in gens)
    assert drafted > 0 and sum(g.stats.accepted for g in gens) == drafted
    stale = Engine(policy(1), DraftModel(policy(0)), PARAMS, max_new_tokens=8,
                   num_draft_tokens=K)  # the same new target with the old weights as draft
    gens = stale.generate([PROMPT], n=50, params=replace(PARAMS, seed=3))[0]
    assert sum(g.stats.accepted for g in gens) < sum(g.stats.drafted for g in gens)


@pytest.mark.parametrize("backend", [
    "torch", pytest.param("llama.cpp", marks=pytest.mark.skipif(
        not llama_cpp_available(), reason=llama_cpp_why()))])
def test_the_quantized_self_draft_is_rebuilt_from_the_new_weights(backend):
    """After an update, the engine draws exactly what a fresh engine on the new weights draws
    (same seed), and its int8 draft agrees with the new target as well as a fresh one does.
    Each backend named: "auto" measures each new target, so the fresh engine could time the
    other backend faster and draft other numbers (same law, other tokens)."""
    engine = Engine(policy(0), QuantizedDraft(8, backend=backend), PARAMS,
                    max_new_tokens=N + K, num_draft_tokens=K)
    engine.generate([PROMPT], n=100, params=replace(PARAMS, seed=3))  # builds the int8 copy
    engine.update_weights(policy(1).state_dict())
    got = engine.generate([PROMPT], n=200, params=replace(PARAMS, seed=4))[0]
    fresh = Engine(policy(1), QuantizedDraft(8, backend=backend), PARAMS, max_new_tokens=N + K,
                   num_draft_tokens=K).generate([PROMPT], n=200, params=replace(PARAMS, seed=4))[0]
    assert [g.token_ids for g in got] == [g.token_ids for g in fresh]
    assert [g.stats.accepted for g in got] == [g.stats.accepted for g in fresh]
    accepted, drafted = (sum(g.stats.accepted for g in got), sum(g.stats.drafted for g in got))
    assert accepted > 0.9 * drafted  # the old weights as draft: 0.38 of drafts accepted


def test_logprobs_equal_a_plain_forward_of_the_target():
    target = policy(0)
    params = SamplingParams(temperature=0.7, top_p=0.95, seed=4)
    engine = Engine(target, DraftModel(perturbed(target, 0.3)), params, max_new_tokens=12)
    gens = engine.generate([PROMPT, [5, 6]], n=3)
    for prompt, samples in zip([PROMPT, [5, 6]], gens, strict=True):
        for g in samples:
            ids = torch.tensor([prompt + g.token_ids])  # [1, T]
            with torch.no_grad():
                logits = target(ids).logits[0, len(prompt) - 1:-1]  # [n, V]
            tokens = torch.tensor(g.token_ids)[:, None]
            want = probs_from_logits(logits, params).gather(1, tokens)[:, 0].log()
            hot = probs_from_logits(logits, replace(params, temperature=1.0))
            wrong = hot.gather(1, tokens)[:, 0].log()  # another temperature's log p
            got = torch.tensor(g.logprobs)
            # float32 rounding of two forward implementations: ~1e-6; the wrong law: > 1e-2
            assert (got - want).abs().max() < 1e-4
            assert (got - wrong).abs().max() > 1e-2


def test_greedy_speculative_equals_greedy_plain():
    target = policy(0)
    greedy = SamplingParams(temperature=0)
    plain = Engine(target, None, greedy, max_new_tokens=20).generate([PROMPT, [7]], n=2)
    fast = Engine(target, DraftModel(perturbed(target, 0.3)), greedy,
                  max_new_tokens=20).generate([PROMPT, [7]], n=2)
    assert [[g.token_ids for g in r] for r in fast] == [[g.token_ids for g in r] for r in plain]
    assert sum(g.stats.accepted for r in fast for g in r) > 0


def test_generate_groups_n_samples_per_prompt():
    engine = Engine(policy(0), None, replace(PARAMS, seed=5), max_new_tokens=4)
    out = engine.generate([PROMPT, [4, 5]], n=3)
    assert [len(r) for r in out] == [3, 3]
    again = engine.generate([PROMPT, [4, 5]], n=3)  # same seed, same samples
    assert [[g.token_ids for g in r] for r in out] == [[g.token_ids for g in r] for r in again]
    with pytest.raises(InvalidValue, match="n=0"):
        engine.generate([PROMPT], n=0)


def test_update_weights_refuses_what_does_not_fit():
    target = policy(0)
    engine = Engine(target, None, PARAMS)
    sd = policy(1).state_dict()
    name = "model.layers.0.mlp.up_proj.weight"
    cases = [
        ({**sd, "extra.weight": torch.zeros(1)}, "unknown names \\['extra.weight'\\]"),
        ({k: v for k, v in sd.items() if k != name}, "missing names"),
        ({**sd, name: sd[name][:1]}, f"{name} has shape"),
        ({**sd, name: sd[name] * float("nan")}, f"{name} holds NaN"),
    ]
    before = {k: v.clone() for k, v in target.state_dict().items()}
    for bad, message in cases:
        with pytest.raises(InvalidValue, match=message):
            engine.update_weights(bad)
    with pytest.raises(InvalidType, match="mapping"):
        engine.update_weights([1, 2])
    assert all(torch.equal(before[k], v) for k, v in target.state_dict().items())  # untouched
    assert engine.policy_version == 0
    assert engine.update_weights({name: sd[name]}, strict=False) == 1  # a subset, on request
    assert torch.equal(target.state_dict()[name], sd[name])


def test_one_row_steps_after_an_update_use_the_new_weights():
    """Caches built from the weights (the lean forward's one-row copies) are rebuilt."""
    greedy = SamplingParams(temperature=0)
    engine = Engine(policy(0), None, greedy, max_new_tokens=16)
    old = engine.generate([PROMPT])[0][0].token_ids  # one row: builds the one-row copies
    engine.update_weights(policy(1).state_dict())
    got = engine.generate([PROMPT])[0][0].token_ids
    fresh = Engine(policy(1), None, greedy, max_new_tokens=16).generate([PROMPT])[0][0].token_ids
    assert got == fresh != old
