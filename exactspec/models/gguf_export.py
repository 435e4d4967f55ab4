"""Write a Llama-architecture transformers model as a GGUF file, for llama.cpp to draft with.

Weights are stored as F32, Q8_0 (8-bit blocks of 32), Q4_0 (4-bit blocks of 32, a scale) or Q4_1
(4-bit blocks of 32, a scale and a minimum), quantized by
the `gguf` package's own reference quantizers from the model's current float32 weights; the
norms stay F32. q / k projections are permuted from transformers' rotate-half RoPE layout into
llama.cpp's, as llama.cpp's own converter does. The vocabulary is written as placeholder
strings: exactspec feeds llama.cpp token ids and reads logits, never text.
"""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import torch

from exactspec.errors import InvalidValue

QUANT_TYPES = ("f32", "q8_0", "q4_0", "q4_1")  # what `export_gguf` writes


def _permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """transformers' q / k rows (rotate-half pairs) into llama.cpp's interleaved pairs."""
    return (w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:])
            .swapaxes(1, 2).reshape(w.shape))


def export_gguf(model, path: str | os.PathLike[str], qtype: str = "q8_0") -> Path:
    """Write `model` (a transformers LlamaForCausalLM) to `path` as GGUF in `qtype`."""
    import gguf

    if qtype not in QUANT_TYPES:
        raise InvalidValue(f"qtype={qtype!r} must be one of {list(QUANT_TYPES)}")
    cfg = model.config
    if getattr(cfg, "model_type", None) != "llama":
        raise InvalidValue(f"GGUF export supports Llama-architecture models, not "
                           f"{getattr(cfg, 'model_type', type(model).__name__)!r}")
    heads, kv_heads = cfg.num_attention_heads, cfg.num_key_value_heads
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // heads
    vocab = int(model.get_output_embeddings().weight.shape[0])
    quant = {"f32": gguf.GGMLQuantizationType.F32, "q8_0": gguf.GGMLQuantizationType.Q8_0,
             "q4_0": gguf.GGMLQuantizationType.Q4_0,
             "q4_1": gguf.GGMLQuantizationType.Q4_1}[qtype]
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + f".tmp{os.getpid()}")
    w = gguf.GGUFWriter(str(tmp), "llama")
    w.add_block_count(cfg.num_hidden_layers)
    w.add_context_length(int(getattr(cfg, "max_position_embeddings", 2048)))
    w.add_embedding_length(cfg.hidden_size)
    w.add_feed_forward_length(cfg.intermediate_size)
    w.add_head_count(heads)
    w.add_head_count_kv(kv_heads)
    w.add_rope_dimension_count(head_dim)
    w.add_key_length(head_dim)
    w.add_value_length(head_dim)
    w.add_layer_norm_rms_eps(float(cfg.rms_norm_eps))
    rope = getattr(cfg, "rope_parameters", None) or {}
    theta = rope.get("rope_theta", getattr(cfg, "rope_theta", 10000.0))
    w.add_rope_freq_base(float(theta))
    w.add_file_type(int({"f32": 0, "q8_0": 7, "q4_0": 2, "q4_1": 3}[qtype]))  # llama_ftype
    w.add_tokenizer_model("llama")
    w.add_token_list([f"<t{i}>".encode() for i in range(vocab)])
    w.add_token_scores([0.0] * vocab)
    w.add_token_types([1] * vocab)  # normal tokens
    w.add_bos_token_id(0)
    w.add_eos_token_id(0)
    w.add_unk_token_id(0)

    def add(name: str, t: torch.Tensor, quantize: bool = True) -> None:
        a = t.detach().float().cpu().numpy()
        if quantize and quant != gguf.GGMLQuantizationType.F32 and a.ndim == 2 \
                and a.shape[1] % 32 == 0:
            w.add_tensor(name, gguf.quants.quantize(a, quant), raw_dtype=quant)
        else:
            w.add_tensor(name, a.astype(np.float32))

    inner = model.model
    with torch.no_grad():
        add("token_embd.weight", inner.embed_tokens.weight)
        for i, layer in enumerate(inner.layers):
            a, m = layer.self_attn, layer.mlp
            add(f"blk.{i}.attn_norm.weight", layer.input_layernorm.weight, quantize=False)
            add(f"blk.{i}.attn_q.weight",
                torch.from_numpy(_permute(a.q_proj.weight.float().numpy(), heads)))
            add(f"blk.{i}.attn_k.weight",
                torch.from_numpy(_permute(a.k_proj.weight.float().numpy(), kv_heads)))
            add(f"blk.{i}.attn_v.weight", a.v_proj.weight)
            add(f"blk.{i}.attn_output.weight", a.o_proj.weight)
            add(f"blk.{i}.ffn_norm.weight", layer.post_attention_layernorm.weight,
                quantize=False)
            add(f"blk.{i}.ffn_gate.weight", m.gate_proj.weight)
            add(f"blk.{i}.ffn_up.weight", m.up_proj.weight)
            add(f"blk.{i}.ffn_down.weight", m.down_proj.weight)
        add("output_norm.weight", inner.norm.weight, quantize=False)
        if not getattr(cfg, "tie_word_embeddings", False):
            add("output.weight", model.lm_head.weight)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    os.replace(tmp, path)
    return path
