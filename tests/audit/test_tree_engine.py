"""End to end: `generate` with token-tree drafters emits exactly the target's distribution.

Statistical test (alpha = 1e-6 per check, fixed seeds), on the tiny models and exact laws of
tests/audit/test_engine_lossless.py: one batched generate call over many copies of the prompt,
the first N tokens counted against the target's exact law. The same test fails on a tree drafter
that draws its siblings without replacement but tells verify they were i.i.d.; the power at
this sample size comes from that sampler's exact law on the same models (exactspec.audit.trees).
"""

from dataclasses import replace

import pytest
import torch

from exactspec.audit import output_law, power, target_law
from exactspec.audit.samplers import sequence_ids
from exactspec.audit.stats import bincount, chi_square
from exactspec.audit.trees import TreeScheme
from exactspec.audit.world import logits_table, model_world
from exactspec.drafters import DraftModel, PromptLookup
from exactspec.engine import generate
from exactspec.sampling import DraftTree, branching_parents
from tests.audit.test_engine_lossless import FILTERED, PENALISED, PROMPT, N, V, eagle, tiny_llama

TREE = (2, 2)
DEPTH = len(TREE)
ROWS = 8000


@pytest.fixture(scope="module")
def models():
    """The chain test's target and draft, and their logits tables after every context."""
    target, draft = tiny_llama(0), tiny_llama(1)
    depth = N + DEPTH  # contexts up to N - 1 + the deepest tree below

    def table(model):
        return logits_table(lambda ids: model(ids).logits, PROMPT, V, depth)

    return target, draft, table(target), table(draft)


def _world(models, params):
    return model_world(models[2], models[3], V, N + DEPTH, params, PROMPT)


def _counts(models, drafter, params, verify, seed):
    """Counts [V**N] of the first N tokens of ROWS generations, and the accepted drafts."""
    gens = generate(models[0], [PROMPT] * ROWS, drafter=drafter, params=replace(params, seed=seed),
                    max_new_tokens=N + DEPTH, verify=verify, batch_size=ROWS)
    seqs = torch.tensor([g.token_ids[:N] for g in gens])  # [ROWS, N]
    return bincount(sequence_ids(seqs, V), V**N), sum(g.stats.accepted for g in gens)


@pytest.mark.parametrize(("siblings", "params", "verify"), [
    pytest.param("without_replacement", FILTERED, "token", id="wor-filtered-token"),
    pytest.param("without_replacement", PENALISED, "traversal", id="wor-penalised-traversal"),
    pytest.param("iid", PENALISED, "token", id="iid-penalised-token"),
    pytest.param("lookup", FILTERED, "token", id="lookup-filtered-token"),
    pytest.param("lookup", PENALISED, "traversal", id="lookup-penalised-traversal"),
    pytest.param("eagle", FILTERED, "traversal", id="eagle-filtered-traversal"),
    pytest.param("eagle", PENALISED, "token", id="eagle-penalised-token"),
])
def test_tree_generate_matches_the_target(models, siblings, params, verify):
    if siblings == "lookup":
        drafter = PromptLookup(1, 2, branches=2, depth=DEPTH)
    elif siblings == "eagle":
        drafter = eagle(models[0])
        drafter.tree = TREE  # the head drafting a (2, 2) tree, siblings without replacement
    else:
        drafter = DraftModel(models[1], tree=TREE, siblings=siblings)
    counts, accepted = _counts(models, drafter, params, verify, seed=5)
    assert accepted > ROWS // 10  # trees were really used, not only bonus tokens
    result = chi_square(counts, target_law(_world(models, params), N))
    assert result.dof > 30 and not result.rejected, result


class IidLabelled(DraftModel):
    """Wrong: siblings drawn without replacement, handed to verify as if i.i.d."""

    def propose_tree(self, context, max_depth):
        tree = super().propose_tree(context, max_depth)
        return DraftTree(tree.tokens, tree.parents, tree.draft_probs, "iid")


def test_a_wrong_tree_drafter_in_the_engine_is_caught(models):
    world = _world(models, FILTERED)
    target = target_law(world, N)
    small = (4,)  # every V**N tree is enumerated (8**4 here); four siblings show the bug well
    parents = tuple(branching_parents(small))
    wrong = output_law(world, TreeScheme("token", parents, "without_replacement", claimed="iid"), N)
    assert power(target, wrong, ROWS) > 1 - 1e-6  # ROWS suffices to see it
    counts, _ = _counts(models, IidLabelled(models[1], tree=small), FILTERED, "token", seed=6)
    assert chi_square(counts, target).rejected
    assert not chi_square(counts, wrong).rejected  # the engine did run the modelled sampler
