"""Tiny random models of every architecture the engine declares (models/architectures.py),
built from a transformers config in the test (no downloads), with sliding windows of 4
positions wherever the architecture has them, so prompts of 10 tokens run past them."""

from __future__ import annotations

import torch
from transformers import AutoConfig, AutoModelForCausalLM

WINDOW = 4  # sliding window of every windowed tiny model, in positions
COMMON = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, max_position_embeddings=64, bos_token_id=None,
              eos_token_id=None, pad_token_id=None, tie_word_embeddings=False)
ALTERNATING = ["sliding_attention", "full_attention"]  # layer 0 slides, layer 1 sees all

# model_type -> config overrides; one entry per model type in architectures.LAYOUTS
CONFIGS: dict[str, dict] = {
    "llama": {},
    "gemma": {"head_dim": 8},
    "gpt2": {"n_embd": 32, "n_layer": 2, "n_head": 4, "n_positions": 64},
    "gpt_neox": {"rotary_pct": 0.5},
    "olmo2": {},
    "granite": {},
    "mistral": {"sliding_window": WINDOW},
    "mixtral": {"sliding_window": WINDOW, "num_local_experts": 4, "num_experts_per_tok": 2},
    "phi3": {"sliding_window": WINDOW},
    "starcoder2": {"sliding_window": WINDOW},
    "qwen3_moe": {"use_sliding_window": True, "sliding_window": WINDOW, "num_experts": 4, "num_experts_per_tok": 2,
                  "moe_intermediate_size": 32},
    "qwen2": {"use_sliding_window": True, "sliding_window": WINDOW, "max_window_layers": 1},
    "qwen2_moe": {"use_sliding_window": True, "sliding_window": WINDOW, "max_window_layers": 1,
                  "num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 32,
                  "shared_expert_intermediate_size": 32},
    "qwen3": {"use_sliding_window": True, "sliding_window": WINDOW, "max_window_layers": 1},
    "gemma2": {"head_dim": 8, "sliding_window": WINDOW, "layer_types": ALTERNATING,
               "attn_logit_softcapping": 5.0, "final_logit_softcapping": 3.0},
    "gemma3_text": {"head_dim": 8, "sliding_window": WINDOW, "layer_types": ALTERNATING},
    "ministral": {"head_dim": 8, "sliding_window": WINDOW, "layer_types": ALTERNATING},
    "smollm3": {"use_sliding_window": True, "sliding_window": WINDOW, "max_window_layers": 1,
                "no_rope_layer_interval": 2},
}
REQUIRED = ("llama", "mistral", "qwen2", "qwen3", "gemma2", "gemma3_text", "phi3", "gpt2",
            "gpt_neox")  # the families the sliding-window issue names


def tiny(model_type: str, seed: int = 0, *, vocab: int = 8, head_scale: float = 5.0,
         **overrides):
    """A 2-layer `model_type` model with random weights, float32, eval mode, its output head
    scaled by `head_scale` (a spread of probabilities, neither flat nor one-hot)."""
    torch.manual_seed(seed)
    kwargs = {**COMMON, **CONFIGS[model_type], **overrides, "vocab_size": vocab}
    cfg = AutoConfig.for_model(model_type, **kwargs)
    cfg._attn_implementation = "sdpa" if model_type != "gemma2" else "eager"
    model = AutoModelForCausalLM.from_config(cfg).eval()
    with torch.no_grad():
        model.get_output_embeddings().weight.mul_(head_scale)
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = 0
    return model


def windowed(model_type: str) -> bool:
    """Whether the tiny model of `model_type` has a sliding window."""
    return "sliding_window" in CONFIGS[model_type]
