"""Every architecture the engine accepts decodes from its own law (models/architectures.py).

Statistical test (alpha = 1e-6 per check, fixed seeds): for each model type in the declared
table, a tiny random model (tests/models/architectures.py; windows of 4 positions wherever the
architecture has them) and a 10-token prompt, so every generated token is past the window. The
exact law of the first N generated tokens comes from transformers' own full forward (no cache,
its own masks) over every continuation, standardized by probs_from_logits; one batched
`es.generate` call over ROWS copies of the prompt is tested against it, plainly and with prompt
lookup, a draft model, a token tree and the int8 self-draft. The wrong variant is the engine's old mask (a
windowed model decoded as if it had no window): its exact law is that of transformers' forward
given a plain causal mask, and the same test rejects it (with the rows its power needs).
Greedy decoding equals transformers' greedy `generate` token for token, ragged batches included.
"""

from __future__ import annotations

import copy
from dataclasses import replace

import pytest
import torch

from exactspec.audit import target_law
from exactspec.audit.samplers import sequence_ids
from exactspec.audit.stats import bincount, chi_square, power
from exactspec.audit.world import logits_table, model_world
from exactspec.drafters import DraftModel, PromptLookup, QuantizedDraft
from exactspec.engine import generate
from exactspec.models import architectures
from exactspec.sampling import SamplingParams
from tests.models.architectures import CONFIGS, REQUIRED, tiny, windowed

V, N, K = 8, 3, 2  # vocabulary, generated tokens compared (512 outcomes), drafts per step
ROWS = 4000  # copies of the prompt in one generate call
PROMPT = [1, 2, 3, 4, 5, 6, 1, 2, 3, 4]  # 10 tokens (past windows of 4), repeats for lookup
PARAMS = SamplingParams(temperature=1.0)
PATHS = ("plain", "prompt lookup", "draft model", "token tree", "int8 self-draft")


def _law(model) -> torch.Tensor:
    """Exact law [V**N] of the first N tokens under transformers' own full forward."""
    table = logits_table(lambda ids: model(ids).logits, PROMPT, V, N)
    return target_law(model_world(table, table, V, N, PARAMS, PROMPT), N)


def _counts(model, drafter, seed: int, rows: int = ROWS) -> tuple[torch.Tensor, int]:
    gens = generate(model, [PROMPT] * rows, drafter=drafter, params=replace(PARAMS, seed=seed),
                    max_new_tokens=N + K, num_draft_tokens=K, batch_size=rows)
    seqs = torch.tensor([g.token_ids[:N] for g in gens])  # [ROWS, N]
    return bincount(sequence_ids(seqs, V), V**N), sum(g.stats.accepted for g in gens)


def _drafter(path: str, model_type: str):
    if path == "plain":
        return None
    if path == "prompt lookup":
        return PromptLookup()
    if path == "int8 self-draft":  # a quantized copy of the target: its masks are the target's
        return QuantizedDraft(8, backend="torch")
    draft = tiny(model_type, seed=1)  # the same architecture, other weights
    return DraftModel(draft, tree=(2, 1) if path == "token tree" else None)


@pytest.fixture(scope="module")
def laws() -> dict:
    return {}


def _model_and_law(laws: dict, model_type: str):
    if model_type not in laws:
        model = tiny(model_type)
        laws[model_type] = (model, _law(model))
    return laws[model_type]


def test_every_declared_architecture_is_tested():
    assert set(CONFIGS) == set(architectures.LAYOUTS)
    assert set(REQUIRED) <= set(CONFIGS)


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("model_type", sorted(CONFIGS))
def test_generate_samples_from_the_models_own_law(laws, model_type, path):
    if path not in ("plain", "prompt lookup") and model_type not in REQUIRED:
        pytest.skip("drafters are checked on the required families; plain + lookup on the rest")
    torch.set_num_threads(1)
    model, law = _model_and_law(laws, model_type)
    counts, accepted = _counts(model, _drafter(path, model_type), seed=11)
    if path != "plain":
        assert accepted > ROWS // 20  # drafts were really used, not only bonus tokens
    result = chi_square(counts, law)
    assert result.dof > 100 and not result.rejected, (model_type, path, result)


def _blind_law(model) -> torch.Tensor:
    """Exact law [V**N] of `model` read through a plain causal mask on every layer: the
    window ignored, as the engine's old mask did for Mistral and Phi-3."""
    def forward(ids: torch.Tensor) -> torch.Tensor:  # [n, T] -> [n, T, V]
        t = ids.shape[1]
        causal = torch.ones(t, t, dtype=torch.bool).tril()
        mask = torch.zeros(ids.shape[0], 1, t, t).masked_fill(~causal, torch.finfo().min)
        if getattr(model.config, "layer_types", None):
            mask = {"full_attention": mask, "sliding_attention": mask}
        return model(ids, attention_mask=mask).logits

    table = logits_table(forward, PROMPT, V, N)
    return target_law(model_world(table, table, V, N, PARAMS, PROMPT), N)


@pytest.mark.parametrize("model_type", ["mistral", "phi3", "qwen2", "gemma2"])
def test_the_old_window_blind_mask_is_caught(laws, model_type, monkeypatch):
    """The wrong variant: decoding as if the model had no window (what the engine did for
    Mistral and Phi-3), run with as many rows as the test needs to see it at 1e-6."""
    model, law = _model_and_law(laws, model_type)
    wrong = _blind_law(model)
    rows = next((r for r in (ROWS, 2 * ROWS, 4 * ROWS) if power(law, wrong, r) > 1 - 1e-6), None)
    assert rows is not None, "the windowless law is too close to the model's to test here"
    monkeypatch.setitem(architectures.LAYOUTS, model_type, "causal")  # the window ignored
    counts, _ = _counts(model, None, seed=12, rows=rows)
    assert chi_square(counts, law).rejected
    assert not chi_square(counts, wrong).rejected  # it did run the windowless law


GREEDY_PROMPTS = [[3, 1, 4, 1, 5, 9, 2, 6, 5], [2, 7, 1, 8, 2, 8, 1, 8, 2, 8, 4, 5, 9],
                  [1, 6, 1, 8, 0, 3, 3]]  # ragged, all past the window


@pytest.mark.parametrize("model_type", sorted(CONFIGS))
def test_greedy_equals_transformers_greedy_generate(model_type):
    """Plain and speculative greedy ids equal transformers' own greedy `generate`, each prompt
    alone there and all of them as one ragged batch here."""
    torch.set_num_threads(1)
    model = tiny(model_type, vocab=16, head_scale=3.0)
    new = 20
    expected = []
    for p in GREEDY_PROMPTS:
        out = model.generate(torch.tensor([p]), do_sample=False, max_new_tokens=new,
                             attention_mask=torch.ones(1, len(p), dtype=torch.long))
        expected.append(out[0, len(p):].tolist())
    greedy = SamplingParams(temperature=0)
    plain = generate(model, GREEDY_PROMPTS, params=greedy, max_new_tokens=new)
    assert [g.token_ids for g in plain] == expected
    if windowed(model_type) or model_type in REQUIRED:
        draft = tiny(model_type, seed=1, vocab=16, head_scale=3.0)
        for drafter in (DraftModel(draft), DraftModel(draft, tree=(2, 1)), PromptLookup()):
            spec = generate(model, GREEDY_PROMPTS, drafter=drafter, params=greedy,
                            max_new_tokens=new, num_draft_tokens=3)
            assert [g.token_ids for g in spec] == expected, drafter


def test_unknown_and_unsupported_architectures_are_refused():
    from transformers import AutoConfig, AutoModelForCausalLM, LlamaConfig

    from exactspec.errors import InvalidValue

    cfg = AutoConfig.for_model("bloom", vocab_size=V, hidden_size=16, n_layer=1, n_head=2)
    with pytest.raises(InvalidValue, match="model type 'bloom' is not among"):
        generate(AutoModelForCausalLM.from_config(cfg).eval(), [PROMPT], max_new_tokens=2)
    longrope = tiny("phi3", rope_parameters={
        "rope_type": "longrope", "rope_theta": 10000.0, "short_factor": [1.0] * 4,
        "long_factor": [2.0] * 4}, original_max_position_embeddings=16)
    with pytest.raises(InvalidValue, match=r"rope_type='longrope'.* passes 16 of the 64"):
        generate(longrope, [PROMPT], max_new_tokens=2)
    dynamic = LlamaConfig(vocab_size=V, hidden_size=16, intermediate_size=32,
                          num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1,
                          max_position_embeddings=64,
                          rope_parameters={"rope_type": "dynamic", "factor": 2.0,
                                           "rope_theta": 10000.0})
    dynamic_model = AutoModelForCausalLM.from_config(dynamic).eval()
    # NTK scaling acts only past max_position_embeddings, which the engine refuses: accepted
    ids = torch.tensor([PROMPT])
    greedy = generate(dynamic_model, [PROMPT], params=SamplingParams(temperature=0),
                      max_new_tokens=8)[0].token_ids
    expected = dynamic_model.generate(ids, do_sample=False, max_new_tokens=8,
                                      attention_mask=torch.ones_like(ids))[0, len(PROMPT):]
    assert greedy == expected.tolist()
    chunked = copy.deepcopy(tiny("qwen2").config)
    chunked.layer_types = ["chunked_attention", "full_attention"]
    with pytest.raises(InvalidValue, match=r"layer_types \['chunked_attention'\] on layer 0"):
        architectures.check_target(type("M", (), {"config": chunked})())
