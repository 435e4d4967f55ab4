"""On the embedded real model (slow: converts the GGUF on first use)."""

from __future__ import annotations

import pytest

from exactspec import SamplingParams
from exactspec.drafters import PromptLookup
from exactspec.engine import generate

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def smollm():
    from exactspec.models import load

    return load("smollm2-135m")


def test_greedy_prompt_lookup_equals_plain_on_smollm2(smollm):
    text = ("The Eiffel Tower is a wrought-iron lattice tower on the Champ de Mars in Paris. "
            "It is named after the engineer Gustave Eiffel.")
    prompts = [smollm.encode("Repeat exactly:\n" + text, chat=True),
               smollm.encode("Name three colours.", chat=True)]
    greedy = SamplingParams(temperature=0)
    plain = generate(smollm, prompts, params=greedy, max_new_tokens=24)
    spec = generate(smollm, prompts, drafter=PromptLookup(), params=greedy, max_new_tokens=24,
                    num_draft_tokens="auto")
    assert [g.token_ids for g in spec] == [g.token_ids for g in plain]
    assert spec[0].stats.mean_acceptance_length > 1.5  # copying text is what lookup is for


def test_seeded_sampling_is_reproducible_on_smollm2(smollm):
    prompt = smollm.encode("Write one sentence about tea.", chat=True)
    params = SamplingParams(temperature=0.8, top_p=0.95, seed=4)
    a = generate(smollm, [prompt, prompt], params=params, max_new_tokens=16,
                 drafter=PromptLookup(), return_logprobs=True)
    b = generate(smollm, [prompt], params=params, max_new_tokens=16, drafter=PromptLookup())
    assert a[0].token_ids == b[0].token_ids
    assert a[0].text and len(a[0].logprobs) == 16
