"""QuantizedDraft(vocab=...): the lean self-draft with its LM head over a subset of the
vocabulary (FR-Spec / VocabTrim).

Exact: the reduced head is the full quantized head's rows; its logits are the full head's at
those tokens and OFF_HEAD elsewhere, so q is exactly 0 there; greedy speculative decoding
through es.generate equals plain decoding bit for bit (ids and log p) for int8, int4, bf16 and
a tree. Statistical: the engine's sequence-level chi-square at 1e-6 (tests/audit/
test_engine_lossless.py's helpers) with a kept set that leaves out the two tokens the target
likes most, and a wrong verifier (the residual norm(max(p - q, 0)) taken over the kept tokens
only) rejected by the same test, its power computed from its exact law.
"""

from __future__ import annotations

import json

import pytest
import torch

import exactspec as es
from exactspec import kernels
from exactspec.audit import output_law, power, target_law
from exactspec.audit.pitfalls import WrongResidual, wrong_verify
from exactspec.audit.stats import chi_square
from exactspec.audit.world import logits_table, model_world
from exactspec.drafters.quantized import QuantizedDraft
from exactspec.engine import generate
from exactspec.models.lean import OFF_HEAD, lean_forward_for
from exactspec.sampling import AcceptanceLaw
from tests.audit.test_engine_lossless import (
    FILTERED,
    PENALISED,
    PROMPT,
    ROWS,
    K,
    N,
    V,
    _counts,
    lean_logits,
    tiny_llama,
)
from tests.drafters.test_quantized_generic import tiny_gemma
from tests.engine.tiny import VOCAB
from tests.engine.tiny import tiny_llama as tiny
from tests.kernels.test_generate_invariance import (
    GREEDY,
    _assert_greedy_equal,
    _run,
    _target,
)

needs_kernels = pytest.mark.skipif(not kernels.enabled(), reason="bit-equality needs the kernels "
                                   "(python -m exactspec.kernels)")


@pytest.fixture(scope="module")
def world_models():
    """(target, -, its logits table, the same) as the chi-square helpers take them, and the
    kept tokens: every token but the two the target likes most after the prompt."""
    target = tiny_llama(0)
    table = logits_table(lambda ids: target(ids).logits, PROMPT, V, N + K)
    with torch.no_grad():
        first = torch.softmax(target(torch.tensor([PROMPT])).logits[0, -1], -1)  # [V]
    liked = first.topk(2).indices
    assert float(first[liked].sum()) > 2 / V  # more than their share of p: the favourites
    kept = torch.tensor([i for i in range(V) if i not in liked.tolist()])
    return (target, None, table, table), kept


@pytest.mark.parametrize(("bits", "params", "method"), [
    (8, FILTERED, "token"), (8, PENALISED, "block"), (4, FILTERED, "block")])
def test_generate_matches_the_target(world_models, bits, params, method):
    models, kept = world_models
    drafter = QuantizedDraft(bits, backend="torch", vocab=kept)
    counts, accepted = _counts(models, drafter, params, method, seed=11)
    assert torch.equal(drafter.forward.head_rows, kept)
    assert accepted > ROWS // 10  # drafts were really used, not only bonus tokens
    result = chi_square(counts, target_law(_world(models, params), N))
    assert result.dof > 30 and not result.rejected, result


def _world(models, params, draft_logits=None):
    return model_world(models[2], models[2] if draft_logits is None else draft_logits, V,
                       N + K, params, PROMPT)


def residual_over(kept: torch.Tensor) -> type[AcceptanceLaw]:
    """The wrong residual: after a rejection, norm(max(p - q, 0)) over the kept tokens only
    (p over them where that is empty, as the real law falls back to p), so a token the draft
    never proposes comes only as a bonus token."""
    inside = torch.zeros(V, dtype=torch.bool)
    inside[kept] = True

    class ResidualOverSubset(AcceptanceLaw):
        def residual(self, n: torch.Tensor) -> torch.Tensor:  # [B] -> [B, V]
            out = super().residual(n)  # the real one
            if self.draft_tokens.shape[1] == 0:  # a step without drafts: p
                return out
            b = torch.arange(n.shape[0], device=n.device)
            p = self.target_probs[b, n].to(out.dtype)  # [B, V]
            q = self.draft_probs[b, n.clamp(max=self.draft_tokens.shape[1] - 1)].to(out.dtype)
            off = ~inside.to(out.device)
            cut = (p - q).clamp(min=0.0).masked_fill(off, 0.0)
            cut = torch.where(cut.sum(-1, keepdim=True) > 0, cut, p.masked_fill(off, 0.0))
            use = (n < self.lengths)[:, None] & (cut.sum(-1, keepdim=True) > 0)
            return torch.where(use, cut, out)

    return ResidualOverSubset


def test_a_residual_over_the_kept_tokens_only_is_caught(world_models):
    models, kept = world_models
    q_logits = logits_table(lean_logits(models[0], "int8", rows=kept), PROMPT, V, N + K)
    off = torch.tensor(OFF_HEAD, dtype=torch.float32).double()  # the table is float64
    assert bool((q_logits[:, [i for i in range(V) if i not in kept.tolist()]] == off).all())
    world = _world(models, FILTERED, q_logits)
    target = target_law(world, N)
    law = residual_over(kept)
    wrong = output_law(world, WrongResidual("token", K, law, "residual over the subset"), N)
    assert power(target, wrong, ROWS) > 1 - 1e-6  # ROWS suffices to see it
    counts, accepted = _counts(models, QuantizedDraft(8, backend="torch", vocab=kept),
                               FILTERED, wrong_verify(law), seed=12)
    assert accepted > ROWS // 10
    assert chi_square(counts, target).rejected
    assert not chi_square(counts, wrong).rejected  # the engine ran the modelled sampler


@pytest.mark.parametrize("fmt", ["int8", "int4", "bfloat16"])
def test_the_reduced_head_is_the_full_heads_rows(fmt):
    target = tiny_llama(3)
    kept = torch.tensor([0, 2, 3, 6])
    full, part = lean_forward_for(target, fmt), lean_forward_for(target, fmt, head_rows=kept)
    assert torch.equal(part.head.dequantized(), full.head.dequantized()[kept])
    assert part.head.nbytes < full.head.nbytes and part.weight_bytes < full.weight_bytes
    ids = torch.tensor([PROMPT, PROMPT[::-1]])
    a, b = lean_logits(target, fmt)(ids), lean_logits(target, fmt, rows=kept)(ids)  # [2, T, V]
    out = torch.ones(V, dtype=torch.bool)
    out[kept] = False
    assert bool((b[..., out] == OFF_HEAD).all())
    if kernels.enabled():  # each logit reduced in its own fixed order: the same bits
        assert torch.equal(b[..., kept], a[..., kept])
    q = es.probs_from_logits(b, es.SamplingParams(temperature=3.0, repetition_penalty=1.5),
                             ids[:, None, :].expand(-1, ids.shape[1], -1))
    assert bool((q[..., out] == 0).all()) and bool((q[..., kept] > 0).all())


def test_the_forward_cache_is_keyed_by_the_rows():
    target = tiny_llama(4)
    a = lean_forward_for(target, "int8", head_rows=[5, 1, 3, 1])
    assert a is lean_forward_for(target, "int8", head_rows=torch.tensor([1, 3, 5]))
    assert torch.equal(a.head_rows, torch.tensor([1, 3, 5]))
    assert a is not lean_forward_for(target, "int8", head_rows=[1, 3])
    assert lean_forward_for(target, "int8").head_rows is None


# greedy == plain, bit for bit: on the kernels' tiny target (58 tokens, no EOS), 50 prompts
KEPT = torch.arange(0, VOCAB, 2)  # every other token: the target's argmax is often outside


@needs_kernels
@pytest.mark.parametrize("kind", ["int8", "int4", "bf16", "int8-tree"])
def test_greedy_ids_and_logprobs_equal_plain(kind):
    target = _target()
    drafter = {"int8": lambda: QuantizedDraft(8, backend="torch", vocab=KEPT),
               "int4": lambda: QuantizedDraft(4, backend="torch", vocab=KEPT),
               "bf16": lambda: QuantizedDraft(16, backend="torch", vocab=KEPT),
               "int8-tree": lambda: QuantizedDraft(8, backend="torch", vocab=KEPT,
                                                   tree=(2, 1, 1))}[kind]()
    spec = _run(target, GREEDY, drafter)
    _assert_greedy_equal(_run(target, GREEDY), spec, logprobs=True)
    assert torch.equal(drafter.forward.head_rows, KEPT) and drafter._shared is not None
    drafted = [t for g in spec for t in g.token_ids]
    assert sum(g.stats.accepted for g in spec) > 0
    assert any(t % 2 for t in drafted)  # tokens outside the head were emitted (recovered)


def test_greedy_equals_plain_with_the_kept_tokens_from_a_file(tmp_path):
    target = tiny(0, vocab=16, max_pos=64, head_scale=5.0)
    prompts = [[1, 2, 3, 4, 5, 6], [9, 8]]
    path = tmp_path / "kept.json"
    path.write_text(json.dumps([3, 1, 4, 5, 9, 2, 6]))
    plain = generate(target, prompts, params=GREEDY, max_new_tokens=16, return_logprobs=True)
    drafter = QuantizedDraft(8, backend="torch", vocab=str(path))
    out = generate(target, prompts, drafter=drafter, params=GREEDY, max_new_tokens=16,
                   num_draft_tokens=3, return_logprobs=True)
    assert drafter.forward.head_rows.tolist() == [1, 2, 3, 4, 5, 6, 9]
    assert [(g.token_ids, g.logprobs) for g in out] == [(g.token_ids, g.logprobs)
                                                        for g in plain]


def test_bad_vocab_values_are_refused(tmp_path):
    with pytest.raises(ValueError, match=r"vocab=0 must be a number of tokens >= 1"):
        QuantizedDraft(8, vocab=0)
    with pytest.raises(TypeError, match=r"not a bool"):
        QuantizedDraft(8, vocab=True)
    with pytest.raises(ValueError, match=r"vocab: head rows must be token ids >= 0, got -1"):
        QuantizedDraft(8, vocab=[3, -1])
    with pytest.raises(ValueError, match=r"vocab: head rows must be integer token ids"):
        QuantizedDraft(8, vocab=torch.tensor([0.5]))
    with pytest.raises(ValueError, match=r"backend='llama\.cpp' runs the whole head; "
                                         r"vocab=4096 needs backend='torch'"):
        QuantizedDraft(8, backend="llama.cpp", vocab=4096)
    target = tiny_llama(0)
    for vocab, why in ((V, r"vocab=8 keeps the whole vocabulary of 8 tokens"),
                       ([2, 8], r"token ids in \[0, 8\).*from 2 to 8"),
                       (str(tmp_path / "none.json"), r"cannot read a JSON list of token ids"),
                       (3, r"needs its tokenizer; pass the kept token ids")):
        with pytest.raises(ValueError, match=why):
            generate(target, [[1, 2]], drafter=QuantizedDraft(8, vocab=vocab), params=GREEDY,
                     max_new_tokens=2)
    with pytest.raises(ValueError, match=r"vocab=\[1, 2\] needs the lean forward .* drop vocab="):
        generate(tiny_gemma(0), [[1, 2]], drafter=QuantizedDraft(8, vocab=[1, 2]),
                 params=GREEDY, max_new_tokens=2)


def test_auto_drafts_a_reduced_head_with_torch():
    drafter = QuantizedDraft(8, vocab=[1, 2, 3])
    assert drafter.backend == "torch" and "vocab=<3 ids>" in repr(drafter)


# the option on the command line, in batch jobs and in the bench

def _spec(*argv: str):
    import argparse

    from exactspec.cli.drafter_flags import add_drafter_flags, drafter_spec

    parser = argparse.ArgumentParser()
    add_drafter_flags(parser)
    return drafter_spec(parser.parse_args(list(argv)))


def test_the_flag_becomes_the_spec_and_the_drafter(tmp_path):
    from exactspec.drafters.registry import build

    spec = _spec("--quantized-draft", "4", "--draft-vocab", "16384")
    assert spec.vocab == 16384 and spec.label() == "quantized draft 4-bit (auto), vocab 16384"
    drafter = build(spec, None)
    assert (drafter.vocab, drafter.backend, drafter.bits) == (16384, "torch", 4)
    path = tmp_path / "kept.json"
    path.write_text("[1, 2, 3]")
    assert _spec("--quantized-draft", "--draft-vocab", str(path)).vocab == str(path)


@pytest.mark.parametrize(("argv", "message"), [
    (["--draft-vocab", "100"], "--draft-vocab only applies with --quantized-draft"),
    (["--prompt-lookup", "--draft-vocab", "100"], "--draft-vocab only applies with"),
    (["--quantized-draft", "--draft-backend", "llama.cpp", "--draft-vocab", "100"],
     "--draft-backend llama.cpp runs the whole head; --draft-vocab needs --draft-backend torch"),
])
def test_the_flag_is_refused_where_it_would_be_ignored(argv, message):
    with pytest.raises(ValueError, match=message):
        _spec(*argv)


def test_a_bad_count_is_an_argument_error(capsys):
    from exactspec.cli import main

    assert main(["generate", "hi", "--quantized-draft", "--draft-vocab", "0"]) == 2
    assert "--draft-vocab 0: give a number of tokens >= 1" in capsys.readouterr().err


def test_a_batch_job_carries_the_option():
    from exactspec.batch.work import drafter_spec, job_drafter

    spec = _spec("--quantized-draft", "8", "--draft-vocab", "8192")
    assert drafter_spec(*job_drafter(spec)) == spec


def test_the_bench_names_the_reduced_head_engines():
    from exactspec.bench.engines import Engines, default_engines
    from exactspec.bench.trees import engine_from_name
    from exactspec.models.loading import Model

    spec = engine_from_name("qdraft int8 torch vocab=16384 K=6")
    assert (spec.drafter, spec.k) == ("qdraft int8 torch vocab=16384", 6)
    assert not any("vocab=" in s.name for s in default_engines())  # named, not by default
    target = Model(model=tiny_llama(0), tokenizer=None, name="tiny")
    drafter = Engines(target)._drafter(spec)
    assert (drafter.vocab, drafter.backend, drafter.bits) == (16384, "torch", 8)
