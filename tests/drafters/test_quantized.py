"""QuantizedDraft: arguments, targets it refuses, and its copy following the target's weights."""

from __future__ import annotations

import logging

import pytest
import torch

from exactspec import SamplingParams
from exactspec.drafters import quantized, quantized_auto
from exactspec.drafters.gguf_draft import llama_cpp_available, llama_cpp_why
from exactspec.drafters.quantized import QuantizedDraft
from exactspec.engine import generate
from exactspec.models.lean import lean_forward_for
from tests.engine.tiny import tiny_llama

GREEDY = SamplingParams(temperature=0)


@pytest.mark.parametrize(("kwargs", "error", "match"), [
    ({"bits": 3}, ValueError, "bits=3"),
    ({"bits": "8"}, TypeError, "bits must be an int"),
    ({"bits": True}, TypeError, "bits must be an int"),
    ({"layers": [2, 1]}, ValueError, "increasing"),
    ({"layers": [1, 1]}, ValueError, "increasing"),
    ({"layers": "0,1"}, TypeError, "layers must be a list"),
    ({"layers": [0.5]}, TypeError, "layers must hold ints"),
    ({"group_size": 48}, ValueError, "group_size=48"),
])
def test_bad_arguments_name_the_argument(kwargs, error, match):
    with pytest.raises(error, match=match):
        QuantizedDraft(**kwargs)


def test_layers_outside_the_target_are_refused_at_begin():
    target = tiny_llama(0)  # 2 layers
    with pytest.raises(ValueError, match=r"layers=\[0, 5\] must lie in 0..1"):
        generate(target, [[1, 2, 3]], drafter=QuantizedDraft(8, layers=[0, 5]), params=GREEDY,
                 max_new_tokens=4)


BACKENDS = ["torch", pytest.param("llama.cpp", marks=pytest.mark.skipif(
    not llama_cpp_available(), reason=llama_cpp_why()))]


def _built(drafter: QuantizedDraft):
    """What the drafter built from the target's weights (the lean copy or the GGUF draft)."""
    return drafter.forward if drafter.backend == "torch" else drafter.gguf


@pytest.mark.parametrize("backend", BACKENDS)
def test_the_copy_is_cached_and_rebuilt_after_a_weight_update(backend):
    target = tiny_llama(0)
    drafter = QuantizedDraft(8, backend=backend)
    generate(target, [[1, 2, 3]], drafter=drafter, params=GREEDY, max_new_tokens=4)
    first = _built(drafter)
    generate(target, [[4, 5]], drafter=drafter, params=GREEDY, max_new_tokens=4)
    assert _built(drafter) is first  # built once per target, not per call
    if backend == "torch":
        assert lean_forward_for(target, "int8") is first
    with torch.no_grad():  # an in-place policy update, as an RL step makes
        for p in target.parameters():
            p.mul_(-1.0)
    out = generate(target, [[1, 2, 3]], drafter=drafter, params=GREEDY, max_new_tokens=12)
    assert _built(drafter) is not first
    plain = generate(target, [[1, 2, 3]], params=GREEDY, max_new_tokens=12)
    assert out[0].token_ids == plain[0].token_ids
    # the rebuilt copy drafts the new weights: it agrees with the new target
    assert out[0].stats.accepted > out[0].stats.drafted // 2


def test_auto_backend_follows_what_is_installed():
    assert QuantizedDraft(8).backend == ("llama.cpp" if llama_cpp_available() else "torch")
    assert QuantizedDraft(8, layers=[0]).backend == "torch"  # llama.cpp keeps every layer
    assert QuantizedDraft(16).backend == "torch"
    with pytest.raises(ValueError, match=r"backend='llama\.cpp' takes bits 8 or 4"):
        QuantizedDraft(16, backend="llama.cpp")
    with pytest.raises(ValueError, match="backend='cuda'"):
        QuantizedDraft(8, backend="cuda")


@pytest.mark.skipif(not llama_cpp_available(), reason=llama_cpp_why())
def test_gguf_export_computes_the_model(tmp_path):
    """llama.cpp on the F32 export gives transformers' logits, up to its f16 KV cache (a
    relative rounding of 2^-11 per cached value; bound: 1% of the logits' range)."""
    from exactspec.drafters.gguf_draft import GgufDraft
    from exactspec.models.gguf_export import export_gguf

    model = tiny_llama(0, vocab=64, hidden=64)
    draft = GgufDraft(export_gguf(model, tmp_path / "tiny.gguf", "f32"))
    ids = [[1, 5, 9, 13, 7], [2, 4]]
    ctx = _context(ids, 64)
    draft.begin(ctx, _info(64))
    got = draft._decode([(0, r) for r in ids])  # [2, V] after each row's last token
    with torch.no_grad():
        want = torch.stack([model(torch.tensor([r])).logits[0, -1] for r in ids])
    assert float((got - want).abs().max()) <= 0.01 * float(want.abs().max())


def _context(rows, vocab):
    from exactspec.drafters.base import DraftContext
    from exactspec.sampling import RowStreams

    width = max(map(len, rows)) + 8
    tokens = torch.full((len(rows), width), -1, dtype=torch.long)
    for i, r in enumerate(rows):
        tokens[i, : len(r)] = torch.tensor(r)
    lengths = torch.tensor([len(r) for r in rows])
    return DraftContext(tokens, lengths, lengths.clone(), GREEDY, RowStreams.from_seed(0, len(rows)))


def _info(vocab):
    from exactspec.drafters.base import TargetInfo

    return TargetInfo(vocab, None)


@pytest.mark.parametrize("backend", BACKENDS)
def test_bfloat16_target_greedy_equals_plain(backend):
    target = tiny_llama(0).to(torch.bfloat16)
    prompts = [[1, 2, 3, 4], [9, 8]]
    plain = generate(target, prompts, params=GREEDY, max_new_tokens=16)
    out = generate(target, prompts, drafter=QuantizedDraft(8, backend=backend), params=GREEDY,
                   max_new_tokens=16, num_draft_tokens=4)
    assert [g.token_ids for g in out] == [g.token_ids for g in plain]
    assert sum(g.stats.accepted for g in out) > 0


NEEDS_LLAMA_CPP = pytest.mark.skipif(not llama_cpp_available(),
                                     reason=llama_cpp_why())


@pytest.mark.parametrize("forced", BACKENDS)
def test_auto_forced_by_the_environment_drafts_with_it_greedy_equals_plain(
        forced, monkeypatch, caplog):
    """EXACTSPEC_QUANTIZED_BACKEND picks auto's backend without a measurement (no log line)."""
    monkeypatch.setenv(quantized_auto.ENV, forced)
    target = tiny_llama(0)
    prompts = [[1, 2, 3, 4], [9, 8], [5, 6, 5, 6, 5]]
    drafter = QuantizedDraft(8)
    with caplog.at_level(logging.INFO, logger=quantized_auto.__name__):
        out = generate(target, prompts, drafter=drafter, params=GREEDY, max_new_tokens=24,
                       num_draft_tokens=4)
    assert drafter.backend == forced
    assert (drafter.gguf is not None) == (forced == "llama.cpp")
    assert not [r for r in caplog.records if r.name == quantized_auto.__name__]
    plain = generate(target, prompts, params=GREEDY, max_new_tokens=24)
    assert [g.token_ids for g in out] == [g.token_ids for g in plain]
    assert sum(g.stats.accepted for g in out) > 0


@NEEDS_LLAMA_CPP
@pytest.mark.parametrize("bits", [8, 4])
def test_auto_measures_once_per_target_logs_both_costs_and_uses_the_faster(
        bits, monkeypatch, caplog):
    """Where the torch draft would keep a cache of its own (the switch off; a layer subset),
    auto times both backends once."""
    monkeypatch.delenv(quantized_auto.ENV, raising=False)
    monkeypatch.setattr(quantized, "SHARE_TARGET_CACHE", False)
    target = tiny_llama(0)
    prompts = [[1, 2, 3, 4], [9, 8]]
    drafter = QuantizedDraft(bits)

    def run():
        with caplog.at_level(logging.INFO, logger=quantized_auto.__name__):
            return generate(target, prompts, drafter=drafter, params=GREEDY, max_new_tokens=16,
                            num_draft_tokens=4)

    out = run()
    lines = [r.getMessage() for r in caplog.records if r.name == quantized_auto.__name__]
    assert len(lines) == 1 and "llama.cpp" in lines[0] and "torch" in lines[0]
    costs = quantized_auto.COSTS[target][bits]
    assert set(costs) == {"llama.cpp", "torch"} and all(c > 0 for c in costs.values())
    assert drafter.backend == min(costs, key=costs.__getitem__)
    assert lines[0].endswith(f"picks {drafter.backend}")
    plain = generate(target, prompts, params=GREEDY, max_new_tokens=16)
    assert [g.token_ids for g in out] == [g.token_ids for g in plain]
    if drafter.backend == "torch":  # the slower llama.cpp copy is not kept loaded
        assert drafter.gguf is None
    caplog.clear()
    run()  # the cached pick, no second measurement
    with torch.no_grad():  # nor after an in-place policy update (the shapes set the costs)
        for p in target.parameters():
            p.mul_(-1.0)
    out = run()
    assert not [r for r in caplog.records if r.name == quantized_auto.__name__]
    plain = generate(target, prompts, params=GREEDY, max_new_tokens=16)
    assert [g.token_ids for g in out] == [g.token_ids for g in plain]


@NEEDS_LLAMA_CPP
def test_auto_takes_the_torch_draft_on_the_target_cache_unmeasured(monkeypatch, caplog):
    """The torch draft on the target's cache prefills and catches up nothing, which a per-token
    timing does not see: auto takes it without timing llama.cpp (unless the environment
    forces a backend, tested above)."""
    monkeypatch.delenv(quantized_auto.ENV, raising=False)
    target = tiny_llama(1)
    drafter = QuantizedDraft(8)
    with caplog.at_level(logging.INFO, logger=quantized_auto.__name__):
        out = generate(target, [[1, 2, 3, 4], [9, 8]], drafter=drafter, params=GREEDY,
                       max_new_tokens=16, num_draft_tokens=4)
    assert drafter.backend == "torch" and drafter._shared is not None
    assert not [r for r in caplog.records if r.name == quantized_auto.__name__]
    assert target not in quantized_auto.COSTS and drafter.gguf is None
    plain = generate(target, [[1, 2, 3, 4], [9, 8]], params=GREEDY, max_new_tokens=16)
    assert [g.token_ids for g in out] == [g.token_ids for g in plain]


def test_auto_env_value_is_checked(monkeypatch):
    monkeypatch.setenv(quantized_auto.ENV, "cuda")
    with pytest.raises(ValueError, match=r"EXACTSPEC_QUANTIZED_BACKEND='cuda'"):
        generate(tiny_llama(0), [[1, 2, 3]], drafter=QuantizedDraft(8), params=GREEDY,
                 max_new_tokens=4)


def test_auto_keeps_torch_where_llama_cpp_cannot_run(monkeypatch):
    """The environment decides only where both backends can run: a layer subset is torch's."""
    monkeypatch.setenv(quantized_auto.ENV, "llama.cpp")
    drafter = QuantizedDraft(8, layers=[0])
    generate(tiny_llama(0), [[1, 2, 3]], drafter=drafter, params=GREEDY, max_new_tokens=4)
    assert drafter.backend == "torch"


@NEEDS_LLAMA_CPP
@pytest.mark.parametrize("faster", ["llama.cpp", "torch"])
def test_auto_uses_the_backend_measured_faster(faster, monkeypatch, caplog):
    """Both outcomes of the measurement, made deterministic by a stand-in timer: the faster
    backend drafts (the other's llama.cpp copy is freed), the log line says so, greedy ==
    plain. (The torch draft with a cache of its own: on the target's it is taken unmeasured.)"""
    monkeypatch.delenv(quantized_auto.ENV, raising=False)
    monkeypatch.setattr(quantized, "SHARE_TARGET_CACHE", False)
    timed = []

    def cost(drafter, target):
        name = "torch" if isinstance(drafter, QuantizedDraft) else "llama.cpp"
        timed.append(name)
        return 1e-3 if name == faster else 2e-3

    monkeypatch.setattr(quantized_auto, "_cost", cost)
    target = tiny_llama(0)
    prompts = [[1, 2, 3, 4], [9, 8]]
    drafter = QuantizedDraft(8)
    with caplog.at_level(logging.INFO, logger=quantized_auto.__name__):
        out = generate(target, prompts, drafter=drafter, params=GREEDY, max_new_tokens=16)
    assert sorted(timed) == ["llama.cpp", "torch"]
    lines = [r.getMessage() for r in caplog.records if r.name == quantized_auto.__name__]
    assert len(lines) == 1 and lines[0].endswith(f"picks {faster}")
    assert "llama.cpp 1.00 ms" in lines[0] or "llama.cpp 2.00 ms" in lines[0]
    assert drafter.backend == faster
    assert (drafter.gguf is not None) == (faster == "llama.cpp")
    plain = generate(target, prompts, params=GREEDY, max_new_tokens=16)
    assert [g.token_ids for g in out] == [g.token_ids for g in plain]
    assert sum(g.stats.accepted for g in out) > 0
