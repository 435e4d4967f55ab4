"""What the lean forward does differently per architecture: one declared table, no forked code.

Every entry is the Llama decoder (pre-norm RMSNorm, RoPE, GQA attention, gated MLP) with a
few declared differences; `lean.py` and `lean_kernels.py` read them. A model type joins the
table only with the tests of tests/models/test_lean_architectures.py (logits against
transformers' forward, the kernels' invariance, greedy == plain and the chi-square through
`es.generate`); anything else, or a configuration with a feature the table does not implement
(soft-capping, biases beyond q / k / v, another activation), keeps transformers' forward
(`refusal` says why, one log line at load).

Gemma (1) and 3 scale their embeddings by sqrt(hidden) inside their embedding module, which the
lean forward calls. Llama 3 is `llama` (its rope scaling lives in the model's rotary module, which fills our RoPE
tables); Qwen 2.5 is `qwen2`. Sliding windows (Mistral, Qwen's windowed layers, Gemma 3's
local layers) come from `architectures.attention_layout`, one mask per layer kind.
"""

from __future__ import annotations

from dataclasses import dataclass

from exactspec.errors import InvalidValue
from exactspec.models.architectures import attention_layout


@dataclass(frozen=True)
class LeanArch:
    """How one model type's decoder differs from Llama's in the lean forward."""

    act: str = "silu"  # the MLP's gate activation: "silu" or "gelu_tanh"
    act_attr: str = "hidden_act"  # the config attribute naming it
    qkv_bias: bool = False  # q / k / v products carry biases (added after the product)
    qk_norm: bool = False  # RMSNorm over each q / k head, before RoPE (Qwen 3, Gemma 3)
    sandwich: bool = False  # norms after attention and after the MLP too (Gemma 3: four a layer)
    unit_offset: bool = False  # RMSNorm scales by (1 + w) (Gemma)
    rope_per_kind: bool = False  # the rotary module takes the layer kind (Gemma 3: own bases)
    scale_attr: str | None = None  # config attribute s: scores scaled by s^-0.5 (else head_dim)


# model_type -> its declared differences from Llama
ARCHS: dict[str, LeanArch] = {
    "llama": LeanArch(),
    "mistral": LeanArch(),
    "ministral": LeanArch(),  # Mistral with per-layer windows (layer_types)
    "qwen2": LeanArch(qkv_bias=True),
    "qwen3": LeanArch(qk_norm=True),
    "gemma": LeanArch(act="gelu_tanh", unit_offset=True),  # its embedding module scales
    "gemma3_text": LeanArch(act="gelu_tanh", act_attr="hidden_activation", qk_norm=True,
                            sandwich=True, unit_offset=True, rope_per_kind=True,
                            scale_attr="query_pre_attn_scalar"),
}
_ACT_NAMES = {"silu": ("silu", "swish"), "gelu_tanh": ("gelu_pytorch_tanh",)}


def refusal(model) -> str | None:
    """Why the lean forward does not run `model` (None: it does)."""
    cfg = getattr(model, "config", None)
    model_type = getattr(cfg, "model_type", None)
    arch = ARCHS.get(model_type)
    if arch is None:
        return f"model type {model_type!r} is not in the lean forward's table ({sorted(ARCHS)})"
    inner = getattr(model, "model", None)
    if not hasattr(inner, "layers") or not hasattr(inner, "rotary_emb") or not hasattr(
            model, "lm_head"):
        return f"{type(model).__name__} is not a causal LM with model.layers and lm_head"
    act = getattr(cfg, arch.act_attr, None)
    if act not in _ACT_NAMES[arch.act]:
        return f"{arch.act_attr}={act!r} (the lean forward runs {_ACT_NAMES[arch.act]})"
    for name in ("attn_logit_softcapping", "final_logit_softcapping"):
        if getattr(cfg, name, None) is not None:
            return f"{name}={getattr(cfg, name)} (soft-capping is not implemented)"
    if getattr(cfg, "pretraining_tp", 1) > 1:
        return f"pretraining_tp={cfg.pretraining_tp}"
    if getattr(cfg, "mlp_bias", False) or (getattr(cfg, "attention_bias", False)
                                           and not arch.qkv_bias):
        return "attention_bias / mlp_bias in the config"
    layer = inner.layers[0]
    a, m = layer.self_attn, layer.mlp
    if any(getattr(p, "bias", None) is not None for p in (a.o_proj, m.gate_proj, m.up_proj,
                                                           m.down_proj)):
        return "biases on o_proj or the MLP"
    if (a.q_proj.bias is not None) != arch.qkv_bias:
        return f"q_proj bias {a.q_proj.bias is not None} (the table declares {arch.qkv_bias})"
    if hasattr(a, "q_norm") != arch.qk_norm:
        return f"q / k norms {hasattr(a, 'q_norm')} (the table declares {arch.qk_norm})"
    try:
        attention_layout(cfg, strict=True)
    except InvalidValue as exc:
        return str(exc)
    return None


def layer_kinds(cfg) -> list[str]:
    """Each layer's attention kind, "full_attention" or "sliding_attention" (the keys of
    `AttentionLayout.visibility`)."""
    layout = attention_layout(cfg, strict=True)
    if layout.per_layer_type and getattr(cfg, "layer_types", None):
        return list(cfg.layer_types)
    kind = "sliding_attention" if layout.sliding else "full_attention"
    return [kind] * cfg.num_hidden_layers
