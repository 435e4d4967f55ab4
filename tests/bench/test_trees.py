"""The bench's tree engines on a tiny random Llama: wired to the drafter they name, scoring the
width they report, and the tree table's figures consistent with the rows. Never timings."""

from __future__ import annotations

import pytest
import torch

import exactspec as es
from exactspec.bench import (
    MODES,
    Bench,
    BenchConfig,
    Engines,
    EngineSpec,
    Workload,
    format_report,
    write_plots,
)
from exactspec.bench.trees import (
    chain_spec,
    engine_from_name,
    tree_engines,
    tree_spec,
    width_cost_at,
)
from exactspec.cli.bench import split_engines
from exactspec.drafters import PromptLookup
from exactspec.drafters.dynamic_tree import DynamicTree
from exactspec.drafters.eagle import EagleDrafter
from exactspec.drafters.eagle_head import EagleConfig, EagleHead
from exactspec.errors import InvalidValue
from exactspec.models import adapter as adapter_mod
from exactspec.models import tree_attention
from tests.engine.tiny import tiny_model

WORKLOADS = [
    Workload("chat", "questions", False, 12, ["why is the sky blue?"]),
    Workload("copy", "copy a list", True, 14,
             ["copy: abc abc abc abd abc abc abc abd abc abc"]),
]
# 4 and 6 nodes: the chains K=4 and K=6 pair them
SETS = {"eagle": ((2, 1), DynamicTree(4, top_k=2, max_depth=3)), "lookup": ((2, 1, 1),)}


@pytest.fixture(scope="module")
def model():
    return tiny_model(0, layers=2, eos=0)


@pytest.fixture(scope="module")
def head(model):
    torch.manual_seed(2)
    head = EagleHead(EagleConfig.for_target(model.model.config, (1, -1)))
    with torch.no_grad():  # random but sharp, so drafts are sometimes accepted
        for w in head.parameters():
            w.mul_(3.0)
    return head


@pytest.fixture(scope="module")
def result(model, head):
    cfg = BenchConfig(rounds=1, modes=["greedy", "t1"], trees=True, width_cost_repeats=1)
    bench = Bench(model, cfg, engines=tree_engines(SETS), workloads=WORKLOADS, progress=False,
                  eagle_factory=lambda: EagleDrafter(head, model))
    return bench.run()


def _drafter(spec, model, head):
    """The drafter a user would build for `spec` with the public API, independently."""
    if spec.drafter == "lookup":
        if spec.tree is None:
            return PromptLookup(1, 3)
        return PromptLookup(1, 3, branches=spec.tree[0], depth=len(spec.tree))
    return EagleDrafter(head, model, tree=spec.tree)


def test_tree_rows_equal_what_generate_gives_with_that_drafter(result, model, head):
    """Acceptance length and tokens of every compared engine == es.generate with the drafter
    it names, the same prompt, seed and budget (seed 1000 * round + prompt index)."""
    specs = {s.name: s for s in tree_engines(SETS)}
    rows = [r for r in result["results"] if r["drafter"] != "none"]
    assert {r["engine"] for r in rows} == set(specs) - {"exactspec plain"}
    for r in rows:
        s = specs[r["engine"]]
        w = next(w for w in WORKLOADS if w.name == r["workload"])
        ids = model.encode(w.prompts[0], chat=True)
        gen = es.generate(model, [ids], drafter=_drafter(s, model, head),
                          params=MODES[r["mode"]].params(0), max_new_tokens=w.max_new_tokens,
                          num_draft_tokens=s.k or 0)[0]
        assert r["tokens"] == len(gen.token_ids) and r["steps"] == gen.stats.steps, r["engine"]
        assert r["mean_acceptance_length"] == pytest.approx(gen.stats.mean_acceptance_length)
        assert r["drafted"] == gen.stats.drafted
    trees = [r for r in rows if r["tree"]]
    assert len({r["engine"] for r in trees}) == 3
    for r in trees:
        nodes = (r["tree"]["node_budget"] if isinstance(r["tree"], dict)
                 else len(es.sampling.branching_parents(r["tree"])))
        assert r["verify_width"] == nodes + 1, r["engine"]
    # the random head's trees keep something at T=1 (else this test could not tell them apart)
    assert any(r["mean_acceptance_length"] > 1 for r in rows if r["drafter"] == "eagle")


def test_engines_score_the_width_they_report(model, head):
    """The target's verify forward is exactly N + 1 wide for a tree of N nodes, and K + 1 for
    the chain of K at equal width (the EAGLE head always drafts K within the budget)."""
    runner = Engines(model, eagle_factory=lambda: EagleDrafter(head, model))
    ids = [model.encode("copy: abc abc abc abd abc abc", chat=True)]
    seen: list[int] = []
    real_at, real_extend = tree_attention.extend_at, adapter_mod.TargetAdapter.extend

    def at(ad, tokens, *a, **kw):  # the target's tree forward (extend_tree's only call)
        seen.append(tokens.shape[1])
        return real_at(ad, tokens, *a, **kw)

    def extend(self, tokens, *a, **kw):  # the target's chain forward (EAGLE and lookup
        seen.append(tokens.shape[1])  # draft without TargetAdapter)
        return real_extend(self, tokens, *a, **kw)

    mp = pytest.MonkeyPatch()
    mp.setattr(tree_attention, "extend_at", at)
    mp.setattr(adapter_mod.TargetAdapter, "extend", extend)
    try:
        for spec in (tree_spec("eagle", (2, 1, 1)), tree_spec("lookup", (3, 1)),
                     tree_spec("eagle", DynamicTree(6, top_k=2, max_depth=4)),
                     chain_spec("eagle", 6)):
            seen.clear()
            run = runner.run(spec, ids, MODES["t1"], 30, seed=0)
            assert spec.verify_width == 7
            steps = seen[-run.steps:]  # the decode's forwards (prefill before them)
            assert max(steps) == spec.verify_width, (spec.name, steps)
            if isinstance(spec.tree, tuple):  # every fixed tree step scores the whole tree
                assert set(steps) == {spec.verify_width}, (spec.name, steps)
            elif spec.tree is not None:  # a dynamic tree shrinks only with the budget's end
                assert steps.count(spec.verify_width) > len(steps) / 2, steps
            else:  # the chain drafts K = 6 until the budget's end narrows it
                assert steps == sorted(steps, reverse=True) and steps.count(7) > len(steps) / 2
                assert len(run.drafted_per_position) == 6
    finally:
        mp.undo()


def test_tree_table_pools_the_rows_and_pairs_equal_widths(result, tmp_path):
    trees = result["trees"]
    w = trees["width_cost"]
    assert sorted(w["ms"]) == list(range(1, 8)) and w["w"][1] == 1.0  # up to K=6's width 7
    rows = trees["rows"]
    by = {(r["engine"], r["mode"], r["group"]): r for r in rows}
    assert {r["group"] for r in rows} == {"open-ended", "grounded"}
    for r in rows:
        src = [x for x in result["results"] if x["engine"] == r["engine"]
               and x["mode"] == r["mode"] and x["workload"] in r["workloads"]]
        assert r["mean_acceptance_length"] == pytest.approx(
            sum(x["tokens"] for x in src) / sum(x["steps"] for x in src))
        # a tree scores all its slots; a chain (one row) 1 + what it drafted
        scored = r["verify_width"] if r["shape"] == "tree" else 1 + r["nodes_per_step"]
        assert r["scored_width"] == pytest.approx(scored) and scored <= r["verify_width"]
        assert r["width_cost"] == pytest.approx(width_cost_at(w["ms"], scored))
        assert r["predicted"] == pytest.approx(
            r["mean_acceptance_length"] / (r["width_cost"] + r["draft_cost"]))
        if r["shape"] == "tree":  # paired with the chain of as many draft tokens
            chain = by[(r["equal_width_chain"], r["mode"], r["group"])]
            assert chain["k"] == r["draft_nodes"] and chain["verify_width"] == r["verify_width"]
            assert r["acc_over_chain"] == pytest.approx(
                r["mean_acceptance_length"] / chain["mean_acceptance_length"])
    assert {r["equal_width_chain"] for r in rows if r["shape"] == "tree"} == {
        "exactspec eagle K=4", "exactspec lookup K=6"}
    dyn = by[("exactspec eagle tree dynamic:4:2:3", "t1", "grounded")]
    assert dyn["equal_width_chain"] == "exactspec eagle K=4" and dyn["draft_forwards"] == 3
    assert by[("exactspec eagle tree 2,1", "t1", "grounded")]["draft_forwards"] == 2
    assert by[("exactspec lookup K=6", "t1", "grounded")]["draft_forwards"] == 0
    assert not result["sweep"] and not result["batch"]  # the comparison sweeps the width
    text = format_report(result, markdown=True)
    assert "trees against chains at equal verify width" in text
    assert "| exactspec eagle tree 2,1 | t1 | grounded | 5 | 5.0 | 2 |" in text
    names = [p.name for p in write_plots(result, tmp_path)]
    assert names == ["tokens_per_second.png", "acceptance_by_position.png", "trees.png"]
    assert (tmp_path / "trees.png").stat().st_size > 1000


def test_width_cost_is_interpolated_between_probed_widths():
    ms = {1: 10.0, 2: 14.0, 4: 20.0}
    assert width_cost_at(ms, 1) == 1.0 and width_cost_at(ms, 2) == pytest.approx(1.4)
    assert width_cost_at(ms, 3) == pytest.approx(1.7) and width_cost_at(ms, 3.5) == pytest.approx(1.85)
    assert width_cost_at(ms, 5) is None and width_cost_at({2: 1.0}, 2) is None


def test_engine_names_round_trip_and_split():
    for text, tree, k in (("eagle tree 4,1,1,1", (4, 1, 1, 1), 0),
                          ("lookup tree 3x4", (3, 1, 1, 1), 0),
                          ("exactspec eagle K=16", None, 16),
                          ("qdraft int8 torch K=12", None, 12),
                          ("qdraft int8 torch tree 2,1,1", (2, 1, 1), 0),
                          ("eagle tree dynamic:16", DynamicTree(16), 0),
                          ("eagle tree dynamic:24:4:8 deterministic", DynamicTree(24, 4, 8), 0)):
        spec = engine_from_name(text)
        assert spec.tree == tree and spec.k == k, text
        assert engine_from_name(spec.name) == spec and spec.name.endswith(text.split(" ", 1)[-1])
    assert engine_from_name("eagle tree 2,2 iid traversal").siblings == "iid"
    assert engine_from_name("eagle tree dynamic:16 deterministic").sampling_only  # greedy: same
    assert not engine_from_name("eagle tree dynamic:16").sampling_only
    assert engine_from_name("eagle tree dynamic:16").verify_width == 17
    assert engine_from_name("eagle tree 2,2 traversal").sampling_only
    assert engine_from_name("lookup tree 3x4").name == "exactspec lookup tree 3x4"
    for bad in ("eagle tree 3x4", "suffix tree dynamic:8", "plain", "eagle tree", "eagle K=4 iid",
                "lookup tree dynamic:8"):
        assert engine_from_name(bad) is None, bad
    assert split_engines("plain, eagle tree 4,1,1,1,lookup tree 3x4,eagle K=16") == [
        "plain", "eagle tree 4,1,1,1", "lookup tree 3x4", "eagle K=16"]
    # every compared chain and tree is spelled so that --engines finds it again
    for s in tree_engines():
        assert s.drafter == "none" or engine_from_name(s.name) == s


@pytest.mark.parametrize("name, backend", [("qdraft int8 torch tree 2,1", "torch"),
                                           ("qdraft int8 tree 2,1", "auto")])
def test_quantized_tree_engine_equals_generate_with_that_drafter(model, name, backend):
    """The 8-bit self-draft's tree engine: the drafter es.generate gets for that tree (the
    registry's BenchUse options: "torch" fixes the backend; auto picks torch for trees)."""
    spec = engine_from_name(name)
    ids = [model.encode("copy: abc abc abc abd abc", chat=True)]
    run = Engines(model).run(spec, ids, MODES["t1"], 12, seed=3)
    gen = es.generate(model, ids, drafter=es.QuantizedDraft(8, backend=backend, tree=(2, 1)),
                      params=MODES["t1"].params(3), max_new_tokens=12)[0]
    assert run.texts == [gen.token_ids] and run.steps == gen.stats.steps
    assert run.drafted == gen.stats.drafted and spec.verify_width == 5


def test_named_engines_are_added_and_unknown_names_refused(model):
    cfg = BenchConfig(rounds=1, modes=["greedy"], engines=["plain", "lookup tree 2x5"])
    bench = Bench(model, cfg, workloads=WORKLOADS, progress=False)
    assert [s.name for s in bench.specs] == ["exactspec plain", "transformers plain",
                                             "exactspec lookup tree 2x5"]
    assert bench.specs[2].verify_width == 11
    with pytest.raises(InvalidValue, match="no engine is named"):
        Bench(model, BenchConfig(engines=["plain", "eagel tree 2,1"]), workloads=WORKLOADS)
    runner = Engines(model)
    ids = [model.encode("abc abc", chat=True)]
    chain_only = EngineSpec("exactspec cross-vocab tree 2,1", "exactspec", "cross-vocab", 0,
                            tree=(2, 1))
    unknown = EngineSpec("exactspec int8 K=4", "exactspec", "int8", 4)
    for bad, match in ((tree_spec("lookup", (2, 2)), "M branches of depth D"),
                       (tree_spec("suffix", (2, 2)), "M branches of depth D"),
                       (chain_only, "drafts chains only"),
                       (unknown, "unknown drafter 'int8'; the bench's are draft, ")):
        with pytest.raises(InvalidValue, match=match):
            runner.run(bad, ids, MODES["greedy"], 4, seed=0)


def test_suffix_tree_engine_equals_generate_with_that_drafter(model):
    """'suffix tree 2x3': SuffixDrafter(branches=2, depth=3, tree_nodes=6), as es.generate."""
    spec = engine_from_name("suffix tree 2x3")
    assert spec.name == "exactspec suffix tree 2x3" and spec.verify_width == 7
    ids = [model.encode("copy: abc abc abc abd abc abd abc", chat=True)]
    for mode in ("greedy", "t1"):
        run = Engines(model).run(spec, ids, MODES[mode], 12, seed=5)
        gen = es.generate(model, ids, drafter=es.SuffixDrafter(branches=2, depth=3, tree_nodes=6),
                          params=MODES[mode].params(5), max_new_tokens=12)[0]
        assert run.texts == [gen.token_ids] and run.steps == gen.stats.steps, mode
        assert run.drafted == gen.stats.drafted, mode
