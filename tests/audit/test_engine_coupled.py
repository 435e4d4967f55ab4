"""End to end: `generate(..., verify="coupled")` emits exactly the target's distribution.

The same sequence-level chi-square as tests/audit/test_engine_lossless.py (alpha = 1e-6 per
check, ROWS copies of the prompt, each row its own seed, the exact law of the first N tokens
from the target's full forwards), on coupled verification with a sampled draft model, the
int8 self-draft and prompt lookup. A wrong coupled rule that emits the draft token at the
first mismatch (instead of the target's own draw) fails the same test. The exact enumeration
of the coupled law is in tests/sampling/test_coupled.py.
"""

from dataclasses import dataclass
from typing import ClassVar

import pytest
import torch

from exactspec.audit import target_law
from exactspec.audit.stats import chi_square
from exactspec.drafters import DraftModel, PromptLookup
from exactspec.drafters.quantized import QuantizedDraft
from exactspec.sampling import Verdict
from exactspec.sampling.methods import Coupled
from tests.audit.test_engine_lossless import FILTERED, PENALISED, ROWS, N, _counts, _world
from tests.audit.test_engine_lossless import models as models


@pytest.mark.parametrize(("drafter", "params"), [
    pytest.param("draft model", FILTERED, id="draft-filtered"),
    pytest.param("draft model", PENALISED, id="draft-penalised"),
    pytest.param("int8", FILTERED, id="quantized-int8-filtered"),
    pytest.param("prompt lookup", FILTERED, id="lookup-filtered"),
])
def test_coupled_generate_matches_the_target(models, drafter, params):
    make = {"draft model": lambda: DraftModel(models[1]), "prompt lookup": PromptLookup,
            "int8": lambda: QuantizedDraft(8, backend="torch")}[drafter]
    counts, accepted = _counts(models, make(), params, "coupled", seed=5)
    assert accepted > ROWS // 10  # drafts were really used, not only the target's draws
    result = chi_square(counts, target_law(_world(models, params), N))
    assert result.dof > 30 and not result.rejected, result


@dataclass(frozen=True)
class DraftAtMismatch(Coupled):
    """WRONG: at the first mismatch it emits the draft token, not the target's draw, so a
    rejected draft is kept anyway (the output follows q where they differ)."""

    name: ClassVar[str] = "coupled-draft-at-mismatch"

    def verdict(self, p, x, streams, positions, *, greedy=False):
        right = super().verdict(p, x, streams, positions, greedy=greedy)
        n, k = right.num_accepted, x.shape[1]
        rows = (n < k).nonzero().squeeze(-1)
        tokens = right.tokens.clone()
        drafted = x[rows, n[rows]]
        tokens[rows, n[rows]] = torch.where(drafted >= 0, drafted, tokens[rows, n[rows]])
        return Verdict(tokens=tokens, num_accepted=n)


def test_a_wrong_coupled_rule_is_caught(models):
    counts, _ = _counts(models, DraftModel(models[1]), FILTERED, DraftAtMismatch(), seed=6)
    assert chi_square(counts, target_law(_world(models, FILTERED), N)).rejected
