"""verify="coupled" end to end: the same seed gives the same text, bit for bit, whatever the
drafter, the draft length ("auto" included) and with no drafter at all (exact tests on tiny
random Llamas, float32, one thread). A wrong variant, whose target draws fresh uniforms each
step instead of the position's (independent draws for draft and target), fails the equality.

The chi-square of the coupled engine's output law is in tests/audit/test_engine_coupled.py.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import pytest

from exactspec import SamplingParams as SP
from exactspec.drafters import DraftModel, PromptLookup, SuffixDrafter
from exactspec.drafters.quantized import QuantizedDraft
from exactspec.engine import generate
from exactspec.errors import InvalidValue
from exactspec.sampling import DOMAIN_RESAMPLE, uniforms
from exactspec.sampling.methods import Coupled
from tests.engine.tiny import GREEDY, GREEDY_PROMPTS, perturbed, tiny_llama

PROMPTS = [[5, 6, 7, 8, 5, 6, 7], [9, 12, 3], [1, 2, 3, 1, 2, 3, 1, 2]]
NEW = 24  # tokens per row
KS = [*range(1, 9), "auto"]


@pytest.fixture(scope="module")
def target():
    return tiny_llama(0, head_scale=10.0)  # a spread of probabilities, not one-hots


DRAFTERS = {
    "draft_model": lambda t: DraftModel(perturbed(t, 0.2)),
    "int8": lambda t: QuantizedDraft(8, backend="torch"),
    "prompt_lookup": lambda t: PromptLookup(),
    "suffix": lambda t: SuffixDrafter(),
}


def _texts(target, drafter, params, k=4, verify="coupled", prompts=PROMPTS):
    gens = generate(target, prompts, drafter=drafter, params=params, max_new_tokens=NEW,
                    num_draft_tokens=k, verify=verify)
    return [g.token_ids for g in gens], sum(g.stats.accepted for g in gens)


@pytest.mark.parametrize("temperature", [0.7, 1.0])
@pytest.mark.parametrize("name", list(DRAFTERS))
def test_the_same_seed_gives_the_same_text_with_and_without_speculation(target, name,
                                                                        temperature):
    params = SP(temperature=temperature, top_p=0.95, seed=11)
    plain, _ = _texts(target, None, params)
    assert len({tuple(t) for t in plain}) == len(PROMPTS)  # rows differ: not a degenerate law
    accepted = 0
    for k in KS:
        texts, n = _texts(target, DRAFTERS[name](target), params, k=k)
        assert texts == plain, (name, k)
        accepted += n
    assert accepted > 0  # drafts were kept, not only the target's own tokens emitted


def test_plain_coupled_is_not_plain_token_but_keeps_its_seed(target):
    """Plain decoding under "coupled" draws with the positions' uniforms (another stream than
    the default's, which is pinned in test_seeded_pins); a row's text does not depend on the
    rows beside it."""
    params = SP(temperature=1.0, seed=3)
    coupled, _ = _texts(target, None, params)
    token, _ = _texts(target, None, params, verify="token")
    assert coupled != token
    alone, _ = _texts(target, None, params, prompts=PROMPTS[:1])
    assert alone[0] == coupled[0]


def test_greedy_coupled_equals_plain_greedy(target):
    plain, _ = _texts(target, None, GREEDY, verify="token", prompts=GREEDY_PROMPTS)
    for name, make in DRAFTERS.items():
        for k in (1, 3, "auto"):
            texts, _ = _texts(target, make(target), GREEDY, k=k, prompts=GREEDY_PROMPTS)
            assert texts == plain, (name, k)


@dataclass(frozen=True)
class StepDraws(Coupled):
    """WRONG for reproducibility (still exact in law): the target draws a fresh uniform per
    step and slot, independent of the position uniform the draft drew with."""

    name: ClassVar[str] = "coupled-step-draws"

    def target_uniforms(self, streams, positions):
        return uniforms(streams, positions.shape[0], positions.shape[1], DOMAIN_RESAMPLE,
                        positions.device)


def test_independent_draws_fail_the_equality(target):
    params = SP(temperature=1.0, seed=11)
    plain, _ = _texts(target, None, params, verify=StepDraws())
    differ = [k for k in (1, 2, 4, 8)
              if _texts(target, DRAFTERS["int8"](target), params, k=k,
                        verify=StepDraws())[0] != plain]
    assert differ == [1, 2, 4, 8]


def test_coupled_refuses_trees(target):
    with pytest.raises(InvalidValue, match=r"'coupled' cannot verify token trees.*tree=None"):
        generate(target, PROMPTS[:1], drafter=DraftModel(perturbed(target, 0.2), tree=(2, 1)),
                 params=SP(seed=1), max_new_tokens=4, verify="coupled")


def test_mixed_rows_keep_their_text(target):
    """Rows with different laws (greedy, T=0.7 with a penalty) in one batch: each row's text
    is its plain text."""
    params = [SP(temperature=0, seed=1), SP(temperature=0.7, presence_penalty=0.5, seed=2),
              SP(temperature=1.0, seed=3)]
    plain, _ = _texts(target, None, params)
    for k in (2, "auto"):
        texts, _ = _texts(target, DRAFTERS["draft_model"](target), params, k=k)
        assert texts == plain
