"""End to end: `generate` with dynamic token trees (EAGLE-2 growth) emits the target's law.

Statistical test (alpha = 1e-6 per check, fixed seeds) on the tiny models and exact laws of
tests/audit/test_tree_engine.py: the first N tokens of ROWS generations counted against the
target's exact law. Dynamic trees are grown from the draft's confidence, deterministic (top-k,
point masses) or sampled (without replacement, shape fixed before each draw); the same test
rejects two deliberately wrong variants: sampled children cut afterwards by their own q
(EAGLE-2's final re-rank applied to drawn nodes) and sampled children verified as point masses.
"""

from dataclasses import replace

import pytest
import torch

from exactspec.audit import target_law
from exactspec.audit.samplers import sequence_ids
from exactspec.audit.stats import bincount, chi_square
from exactspec.audit.world import logits_table, model_world
from exactspec.drafters import DraftModel, QuantizedDraft
from exactspec.drafters.dynamic_tree import DynamicTree
from exactspec.engine import generate
from exactspec.sampling import DraftTree, SamplingParams
from tests.audit.test_engine_lossless import FILTERED, PENALISED, PROMPT, N, V, eagle, tiny_llama

ROWS = 6000
T1 = SamplingParams(temperature=1.0)
SMALL = DynamicTree(node_budget=6, top_k=3, max_depth=3)  # 3 root children, 3 per depth


@pytest.fixture(scope="module")
def models():
    """The target, its draft, and the target's logits table after every context."""
    target, draft = tiny_llama(0), tiny_llama(1)
    return target, draft, logits_table(lambda ids: target(ids).logits, PROMPT, V, N)


def _law(models, params):
    return target_law(model_world(models[2], models[2], V, N, params, PROMPT), N)


def _counts(models, drafter, params, verify, seed):
    """Counts [V**N] of the first N tokens of ROWS generations, and the accepted drafts."""
    gens = generate(models[0], [PROMPT] * ROWS, drafter=drafter, params=replace(params, seed=seed),
                    max_new_tokens=N, verify=verify, batch_size=ROWS)
    seqs = torch.tensor([g.token_ids[:N] for g in gens])  # [ROWS, N]
    return bincount(sequence_ids(seqs, V), V**N), sum(g.stats.accepted for g in gens)


@pytest.mark.parametrize(("drafter", "siblings", "params", "verify"), [
    pytest.param("draft", "deterministic", FILTERED, "token", id="draft-topk-filtered-token"),
    pytest.param("eagle", "deterministic", PENALISED, "traversal", id="eagle-topk-penalised-trav"),
    pytest.param("eagle", "without_replacement", T1, "token", id="eagle-wor-t1-token"),
    pytest.param("draft", "without_replacement", PENALISED, "token", id="draft-wor-penalised-token"),
    pytest.param("int8", "without_replacement", FILTERED, "token", id="int8-wor-filtered-token"),
    pytest.param("int8-fixed", "iid", PENALISED, "traversal", id="int8-fixed22-penalised-trav"),
])
def test_dynamic_tree_generate_matches_the_target(models, drafter, siblings, params, verify):
    if drafter == "eagle":
        d = eagle(models[0])
        d.tree, d.siblings = SMALL, siblings
    elif drafter == "int8":
        d = QuantizedDraft(8, backend="torch", tree=SMALL, siblings=siblings)
    elif drafter == "int8-fixed":  # QuantizedDraft's fixed trees, through DraftModel's code
        d = QuantizedDraft(8, backend="torch", tree=(2, 2), siblings=siblings)
    else:
        d = DraftModel(models[1], tree=SMALL, siblings=siblings)
    counts, accepted = _counts(models, d, params, verify, seed=7)
    assert accepted > ROWS // 10  # trees were really used, not only bonus tokens
    result = chi_square(counts, _law(models, params))
    assert result.dof > 30 and not result.rejected, result


class CutByOwnQ(DraftModel):
    """Wrong: four children drawn without replacement, the two with the lowest q(x) dropped
    afterwards (what EAGLE-2's final re-rank would do to sampled nodes)."""

    def propose_tree(self, context, max_depth):
        tree = super().propose_tree(context, max_depth)  # DynamicTree(4, 4, 1): 4 root children
        own = tree.draft_probs.gather(2, tree.tokens.clamp(min=0)[..., None])[..., 0]  # [B, 4]
        low = own.argsort(1)[:, :2]  # [B, 2]
        tokens = tree.tokens.scatter(1, low, -1)
        return DraftTree(tokens, tree.parents, tree.draft_probs, tree.siblings)


class ArgmaxAsSampled(DraftModel):
    """Wrong: the root's argmax (what a deterministic dynamic tree drafts) handed to verify as
    if drawn without replacement from q."""

    def propose_tree(self, context, max_depth):
        tree = super().propose_tree(context, max_depth)  # DynamicTree(1, 1, 1), sampled
        q = tree.draft_probs  # [B, 1, V]: the root's q
        top = q[:, 0].topk(1, dim=-1)
        tokens = torch.where((tree.tokens >= 0) & (top.values > 0), top.indices, -1)
        return DraftTree(tokens, tree.parents, q, "without_replacement")


class SampledAsPointMasses(DraftModel):
    """Not wrong: sampled children verified as point masses. The point-mass rule (accept x
    with P(x), else remove x) is exact for any x drawn independently of the verifier, so this
    only wastes acceptance (P(x) instead of min(1, P(x) / q(x)))."""

    def propose_tree(self, context, max_depth):
        tree = super().propose_tree(context, max_depth)
        return DraftTree(tree.tokens, tree.parents, None, "deterministic")


@pytest.mark.parametrize("wrong", [CutByOwnQ, ArgmaxAsSampled])
def test_wrong_dynamic_trees_are_caught(models, wrong):
    tree = DynamicTree(4, 4, 1) if wrong is CutByOwnQ else DynamicTree(1, 1, 1)
    drafter = wrong(models[1], tree=tree, siblings="without_replacement")
    counts, _ = _counts(models, drafter, FILTERED, "token", seed=8)
    assert chi_square(counts, _law(models, FILTERED)).rejected


def test_sampled_children_verified_as_point_masses_stay_exact(models):
    drafter = SampledAsPointMasses(models[1], tree=SMALL, siblings="without_replacement")
    counts, _ = _counts(models, drafter, FILTERED, "token", seed=9)
    assert not chi_square(counts, _law(models, FILTERED)).rejected
