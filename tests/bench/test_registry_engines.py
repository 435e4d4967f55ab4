"""The bench names its engines through the drafter registry (drafters/registry.py) and its words
(bench/engine_names.py's BenchUse): a drafter added there with a bench word gets its default
engines, its names and its runs, with no other bench edit; the runs equal `es.generate` with
the drafter the registry builds."""

from __future__ import annotations

import pytest

import exactspec as es
from exactspec.bench import BenchConfig, default_engines, engine_names
from exactspec.bench.engine_names import BenchUse
from exactspec.bench.engines import Engines, EngineSpec
from exactspec.bench.harness import Bench, Workload
from exactspec.bench.specs import MODES
from exactspec.bench.trees import engine_from_name
from exactspec.cli import build_parser
from exactspec.cli.bench import model_drafters
from exactspec.drafters import registry
from exactspec.drafters.registry import Entry
from exactspec.errors import InvalidValue
from tests.engine.tiny import tiny_model

WORKLOADS = [Workload("copy", "copying", True, 8, ["copy: abc abc abc abd abc"])]


@pytest.fixture(scope="module")
def model():
    return tiny_model(0, layers=2, eos=0)


@pytest.fixture
def echo(monkeypatch):
    """A new drafter, added as one registry line and one line of bench words: prompt lookup
    under the word 'echo'."""
    entry = Entry(None, registry.DRAFTERS["prompt-lookup"].build, lambda s, d: "echo", "fixed")
    monkeypatch.setitem(registry.DRAFTERS, "echo", entry)
    monkeypatch.setitem(engine_names.BENCH_USES, "echo", (BenchUse("echo"),))
    return entry


def _decode(model, spec, drafter, mode: str, seed: int = 4):
    ids = [model.encode("copy: abc abc abc abd abc abd abc", chat=True)]
    run = Engines(model).run(spec, ids, MODES[mode], 12, seed=seed)
    k = spec.k if isinstance(spec.k, int) else 4
    gen = es.generate(model, ids, drafter=drafter, params=MODES[mode].params(seed),
                      max_new_tokens=12, num_draft_tokens=k)[0]
    return run, gen


def test_a_registry_line_and_its_words_are_all_a_drafter_needs_to_be_benched(model, echo):
    names = [s.name for s in default_engines()]
    assert "exactspec echo K=4" in names and "exactspec echo auto" in names
    chain = engine_from_name("echo K=3")
    tree = engine_from_name("echo tree 2x3")  # a point-mass drafter: M matches of depth D
    assert (chain.drafter, chain.k) == ("echo", 3) and tree.tree == (2, 1, 1)
    for spec, drafter in ((chain, es.PromptLookup()),
                          (tree, es.PromptLookup(branches=2, depth=3))):
        for mode in ("greedy", "t1"):
            run, gen = _decode(model, spec, drafter, mode)
            assert run.texts == [gen.token_ids] and run.steps == gen.stats.steps, (spec, mode)
            assert run.drafted == gen.stats.drafted, (spec, mode)
    bench = Bench(model, BenchConfig(rounds=1, modes=["greedy"], engines=["echo"]),
                  workloads=WORKLOADS, progress=False)
    assert [s.name for s in bench.specs] == ["exactspec echo K=4",
                                             "exactspec echo auto"]  # only those asked for


def test_without_the_registry_line_the_word_is_unknown(model):
    assert engine_from_name("echo K=3") is None
    with pytest.raises(InvalidValue, match="unknown drafter 'echo'"):
        Engines(model).run(EngineSpec("exactspec echo K=3", "exactspec", "echo", 3),
                           [[1, 2, 3]], MODES["greedy"], 4, seed=0)


def test_cross_vocab_engines_run_the_registrys_drafter_on_the_benchs_model(model):
    """'cross-vocab': CrossVocabDraft over the model the bench is given (here the target
    itself, another tokenizer's stand-in); without one its engines are not available."""
    spec = engine_from_name("cross-vocab K=3")
    assert not Engines(model).available(spec)
    runner = Engines(model, sources={"cross-vocab-draft": model})
    assert runner.available(spec)
    ids = [model.encode("copy: abc abc abc abd abc", chat=True)]
    for mode, seed in (("greedy", 0), ("t1", 5), ("t1", 6)):  # the drafter is reused
        run = runner.run(spec, ids, MODES[mode], 12, seed=seed)
        gen = es.generate(model, ids, drafter=es.CrossVocabDraft(model), num_draft_tokens=3,
                          params=MODES[mode].params(seed), max_new_tokens=12)[0]
        assert run.texts == [gen.token_ids] and run.steps == gen.stats.steps, (mode, seed)
        assert run.accepted == gen.stats.accepted, (mode, seed)
    assert engine_from_name("cross-vocab tree 2,1") is None  # it drafts chains only


def test_model_flags_of_the_bench_come_from_the_registry():
    flags = {flag: use.word for _, flag, use in model_drafters()}
    assert flags == {"--draft": "draft", "--cross-vocab-draft": "cross-vocab"}
    args = build_parser().parse_args(["bench", "--cross-vocab-draft", "smollm2-135m"])
    assert args.cross_vocab_draft == "smollm2-135m" and args.draft is None
