"""Write a transformers model as a GGUF file, for llama.cpp to draft with.

Architectures: Llama, Mistral (llama.cpp's "llama"), Qwen 2 (q / k / v biases), Qwen 3 (q / k
RMSNorm) and Gemma 3 text (RMSNorm weights stored as 1 + w, scaled embeddings, GeGLU, the
extra norms, q / k norm, interleaved local and global attention with their own RoPE bases);
their differences are the rows of ARCHS, one writer serves them all. A model llama.cpp would
compute differently (a sliding window its architecture lacks, logit soft-capping, a RoPE
scaling it cannot express, an unknown parameter) is refused (`unsupported` says why), never
written approximately: a wrong file would make a silently useless draft.

Weights are stored as F32, BF16 (rounded to bfloat16), Q8_0 (8-bit blocks of 32), Q4_0 (4-bit
blocks of 32, a scale) or Q4_1 (4-bit blocks of 32, a scale and a minimum), quantized by the
`gguf` package's own reference quantizers from the model's current float32 weights; norms and
biases stay F32. "q4_k" is llama.cpp's Q4_K_M mix, which the `gguf` package cannot quantize:
the model is written losslessly first (F32, or BF16 when its matrices are bfloat16) and
llama.cpp's own quantizer (`llama_model_quantize`, as `llama-quantize ... Q4_K_M`, through
llama-cpp-python) rewrites it: Q4_K (4-bit super-blocks of 256 values, 6-bit scales and
minimums per 32) for most matrices, Q6_K for the output head and some attn_v / ffn_down
layers; a matrix whose rows are not whole super-blocks gets llama.cpp's fallback type. For llama.cpp's
"llama" architecture the q / k projections are permuted from transformers' rotate-half RoPE
layout into its interleaved one, as llama.cpp's own converter does (its qwen2 / qwen3 / gemma3
use rotate-half, like transformers). The vocabulary is written as placeholder strings of one
SentencePiece-style list for every architecture: exactspec feeds llama.cpp token ids and reads
logits, never text, so llama.cpp's tokenizer is never used.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from exactspec.errors import InvalidValue

QUANT_TYPES = ("f32", "bf16", "q8_0", "q4_0", "q4_1", "q4_k")  # what `export_gguf` writes
LLAMA_QUANTIZED = {"q4_k": "LLAMA_FTYPE_MOSTLY_Q4_K_M"}  # qtype -> llama.cpp's quantizer ftype

# transformers' per-layer parameter (module path in a decoder layer) -> GGUF tensor, shared
LAYER_TENSORS = {
    "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output", "self_attn.q_norm": "attn_q_norm",
    "self_attn.k_norm": "attn_k_norm", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down", "input_layernorm": "attn_norm",
    "post_attention_layernorm": "ffn_norm",
}


@dataclass(frozen=True)
class Arch:
    """How one transformers architecture is written for llama.cpp."""

    gguf: str  # llama.cpp's architecture name
    permute_qk: bool = False  # q / k rows into llama.cpp's interleaved RoPE pairs ("llama")
    norm_shift: float = 0.0  # added to every RMSNorm weight (Gemma's x * (1 + w))
    rope_freqs: bool = False  # llama.cpp reads a per-frequency factor tensor (Llama 3 RoPE)
    windows: bool = False  # llama.cpp runs its local layers (window, period, their RoPE base)
    tensors: dict[str, str] = field(default_factory=dict)  # LAYER_TENSORS overrides / additions
    biases: tuple[str, ...] = ()  # GGUF tensors that may carry a bias


_ATTN_BIASES = ("attn_q", "attn_k", "attn_v", "attn_output")  # llama.cpp's optional ones

# transformers model_type -> its GGUF writing; every other architecture is refused
ARCHS: dict[str, Arch] = {
    "llama": Arch("llama", permute_qk=True, rope_freqs=True, biases=_ATTN_BIASES),
    "mistral": Arch("llama", permute_qk=True, rope_freqs=True, biases=_ATTN_BIASES),
    "qwen2": Arch("qwen2", biases=("attn_q", "attn_k", "attn_v")),
    "qwen3": Arch("qwen3"),
    "gemma3_text": Arch("gemma3", norm_shift=1.0, windows=True, tensors={
        "post_attention_layernorm": "post_attention_norm",
        "pre_feedforward_layernorm": "ffn_norm",
        "post_feedforward_layernorm": "post_ffw_norm"}),
}


def _permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """transformers' q / k rows (rotate-half pairs) into llama.cpp's interleaved pairs."""
    return (w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:])
            .swapaxes(1, 2).reshape(w.shape))


def _head_dim(cfg) -> int:
    return getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads


def _sliding(cfg) -> list[bool]:
    """Per layer, whether its attention is windowed narrower than the model's context."""
    window = getattr(cfg, "sliding_window", None)
    if window is None or window >= int(getattr(cfg, "max_position_embeddings", 0) or 0) > 0:
        return [False] * cfg.num_hidden_layers
    types = getattr(cfg, "layer_types", None)
    if types is None:  # Mistral: the window on every layer
        return [bool(getattr(cfg, "use_sliding_window", True))] * cfg.num_hidden_layers
    return [t == "sliding_attention" for t in types]


def _period(sliding: list[bool]) -> int | None:
    """llama.cpp's SWA pattern p (layer i local iff i % p < p - 1) giving `sliding`, or None."""
    for p in range(1, len(sliding) + 2):
        if all(s == (i % p < p - 1) for i, s in enumerate(sliding)):
            return p
    return None


def _rope(model, cfg, kind: str | None) -> tuple[float, torch.Tensor]:
    """(RoPE base, per-frequency divisors of it) for the layers of `kind` (None: all layers):
    the divisors are the default frequencies over the ones transformers actually uses."""
    rotary = model.model.rotary_emb
    params = getattr(cfg, "rope_parameters", None) or {}
    if kind is not None:
        params = params.get(kind, {})
    theta = float(params.get("rope_theta", getattr(cfg, "rope_theta", 10000.0)))
    inv = getattr(rotary, f"{kind}_inv_freq" if kind else "inv_freq").detach().double().cpu()
    d = 2 * inv.numel()
    default = 1.0 / theta ** (torch.arange(0, d, 2, dtype=torch.float64) / d)  # [d/2]
    return theta, default / inv


def unsupported(model) -> str | None:
    """Why `model` cannot be exported for llama.cpp (None: it can)."""
    cfg = getattr(model, "config", None)
    kind = getattr(cfg, "model_type", None)
    if kind not in ARCHS:
        return (f"the GGUF export covers {sorted(ARCHS)}, not "
                f"{kind or type(model).__name__!r}")
    arch = ARCHS[kind]
    rotary = model.model.rotary_emb
    inv = getattr(rotary, "inv_freq", None)
    if inv is None:
        inv = getattr(rotary, "full_attention_inv_freq", None)
    if inv is None or 2 * inv.numel() != _head_dim(cfg):
        return "its RoPE turns part of each head only (llama.cpp's rotates it all here)"
    if float(getattr(rotary, "attention_scaling", 1.0) or 1.0) != 1.0:
        return "its RoPE scales attention (YaRN / LongRoPE), which the export does not write"
    for cap in ("attn_logit_softcapping", "final_logit_softcapping"):
        if getattr(cfg, cap, None) is not None:
            return f"{cap}={getattr(cfg, cap)} (llama.cpp's {arch.gguf} does not apply it)"
    sliding = _sliding(cfg)
    if any(sliding) and not arch.windows:
        return (f"its layers {[i for i, s in enumerate(sliding) if s]} attend through a "
                f"window of {cfg.sliding_window} positions; llama.cpp's {arch.gguf} has none")
    if arch.windows:
        if not any(sliding):  # llama.cpp's gemma3 without SWA soft-caps its logits
            return "Gemma 3 without local layers (llama.cpp soft-caps those at 30)"
        if _period(sliding) is None:
            return f"its local layers {sliding} follow no period llama.cpp can express"
    for kinds in (["sliding_attention", "full_attention"] if arch.windows else [None]):
        _, div = _rope(model, cfg, kinds)
        uniform = bool(torch.allclose(div, div[0].expand_as(div), rtol=1e-5))
        if not uniform and not arch.rope_freqs:
            return "its RoPE scales frequencies unevenly, which llama.cpp's " \
                   f"{arch.gguf} cannot express"
        if kinds == "sliding_attention" and abs(float(div[0]) - 1) > 1e-5:
            return "its local layers' RoPE is scaled (llama.cpp scales only global layers)"
    tensors = {**LAYER_TENSORS, **arch.tensors}
    for name, _ in model.model.layers[0].named_parameters():
        module, _, leaf = name.rpartition(".")
        if module not in tensors or (leaf == "bias" and tensors[module] not in arch.biases):
            return f"its layer parameter {name!r} has no place in llama.cpp's {arch.gguf}"
    return None


def export_gguf(model, path: str | os.PathLike[str], qtype: str = "q8_0") -> Path:
    """Write `model` (a transformers causal LM of an architecture in ARCHS) to `path` as GGUF
    in `qtype`."""
    import gguf

    if qtype not in QUANT_TYPES:
        raise InvalidValue(f"qtype={qtype!r} must be one of {list(QUANT_TYPES)}")
    why = unsupported(model)
    if why is not None:
        raise InvalidValue(f"cannot export {type(model).__name__} for llama.cpp: {why}; "
                           "draft it with QuantizedDraft(backend='torch')")
    if qtype in LLAMA_QUANTIZED:  # lossless first, then llama.cpp's quantizer
        path = Path(path)
        bf16 = all(p.dtype == torch.bfloat16 for p in model.parameters() if p.ndim == 2)
        src = export_gguf(model, path.with_name(path.name + f".src{os.getpid()}"),
                          "bf16" if bf16 else "f32")
        try:
            return llama_quantize(src, path, qtype)
        finally:
            src.unlink(missing_ok=True)
    cfg = model.config
    arch = ARCHS[cfg.model_type]
    heads, kv_heads, head_dim = cfg.num_attention_heads, cfg.num_key_value_heads, _head_dim(cfg)
    vocab = int(model.get_output_embeddings().weight.shape[0])
    quant = {"f32": gguf.GGMLQuantizationType.F32, "bf16": gguf.GGMLQuantizationType.BF16,
             "q8_0": gguf.GGMLQuantizationType.Q8_0,
             "q4_0": gguf.GGMLQuantizationType.Q4_0,
             "q4_1": gguf.GGMLQuantizationType.Q4_1}[qtype]
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + f".tmp{os.getpid()}")
    w = gguf.GGUFWriter(str(tmp), arch.gguf)
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
    freqs = None  # [head_dim / 2] per-frequency divisors, where llama.cpp reads them
    if arch.windows:  # global layers: rope.freq_base (+ linear scaling), local: freq_base_swa
        theta, div = _rope(model, cfg, "full_attention")
        w.add_rope_freq_base_swa(_rope(model, cfg, "sliding_attention")[0])
        sliding = _sliding(cfg)
        w.add_sliding_window(int(cfg.sliding_window))
        w.add_sliding_window_pattern(int(_period(sliding)))
    else:
        theta, div = _rope(model, cfg, None)
    w.add_rope_freq_base(theta)
    if bool(torch.allclose(div, div[0].expand_as(div), rtol=1e-5)):
        if abs(float(div[0]) - 1.0) > 1e-6:
            w.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
            w.add_rope_scaling_factor(float(div[0]))
    else:
        freqs = div.float()
    w.add_file_type(int({"f32": 0, "bf16": 32, "q8_0": 7, "q4_0": 2, "q4_1": 3}[qtype]))  # llama_ftype
    w.add_tokenizer_model("llama")
    w.add_token_list([f"<t{i}>".encode() for i in range(vocab)])
    w.add_token_scores([0.0] * vocab)
    w.add_token_types([1] * vocab)  # normal tokens
    w.add_bos_token_id(0)
    w.add_eos_token_id(0)
    w.add_unk_token_id(0)

    def add(name: str, t: torch.Tensor) -> None:
        a = t.detach().float().cpu().numpy()
        bf16 = quant == gguf.GGMLQuantizationType.BF16
        if quant != gguf.GGMLQuantizationType.F32 and a.ndim == 2 and (bf16 or a.shape[1] % 32 == 0):
            w.add_tensor(name, gguf.quants.quantize(a, quant), raw_dtype=quant)
        else:  # norms, biases, rows not in whole blocks
            w.add_tensor(name, a.astype(np.float32))

    tensors = {**LAYER_TENSORS, **arch.tensors}
    # llama.cpp's gemma3 scales q by 1/sqrt(head_dim) (the 27B: 1/sqrt(hidden/heads)) where
    # transformers uses query_pre_attn_scalar: the ratio goes into q's norm (RoPE is linear)
    q_scale = 1.0
    if getattr(cfg, "query_pre_attn_scalar", None) is not None:
        ours = head_dim if cfg.num_hidden_layers != 62 else cfg.hidden_size / heads
        q_scale = math.sqrt(ours / cfg.query_pre_attn_scalar)
    inner = model.model
    with torch.no_grad():
        add("token_embd.weight", inner.embed_tokens.weight)
        if freqs is not None:
            add("rope_freqs.weight", freqs)
        for i, layer in enumerate(inner.layers):
            for name, p in layer.named_parameters():
                module, _, leaf = name.rpartition(".")
                t = p.detach().float()
                if module.endswith("norm"):
                    t = t + arch.norm_shift
                    if module == "self_attn.q_norm":
                        t = t * q_scale
                if arch.permute_qk and module in ("self_attn.q_proj", "self_attn.k_proj"):
                    n = heads if module == "self_attn.q_proj" else kv_heads
                    t = torch.from_numpy(_permute(t.cpu().numpy(), n))
                add(f"blk.{i}.{tensors[module]}.{leaf}", t)
        add("output_norm.weight", inner.norm.weight.detach().float() + arch.norm_shift)
        if not getattr(cfg, "tie_word_embeddings", False):
            add("output.weight", model.get_output_embeddings().weight)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    os.replace(tmp, path)
    return path


_LOG_CALLBACK = None  # llama.cpp's log silenced while it quantizes (kept alive: it holds it)


def llama_quantize(src: str | os.PathLike[str], path: str | os.PathLike[str], qtype: str,
                   threads: int | None = None) -> Path:
    """Rewrite the GGUF `src` (F32 / BF16) as `qtype` (a key of LLAMA_QUANTIZED) at `path`
    with llama.cpp's own quantizer (llama-cpp-python's `llama_model_quantize`)."""
    import ctypes

    global _LOG_CALLBACK
    if qtype not in LLAMA_QUANTIZED:
        raise InvalidValue(f"qtype={qtype!r}: llama.cpp's quantizer writes "
                           f"{list(LLAMA_QUANTIZED)} here")
    try:
        import llama_cpp
    except ImportError as e:
        raise InvalidValue(f"the {qtype} GGUF is quantized by llama.cpp, and llama-cpp-python "
                           f"is not importable ({e}); install it (make llama-cpp) or export "
                           "q4_0 / q4_1, which need only the gguf package") from e
    if _LOG_CALLBACK is None:  # it prints every tensor it converts to stderr
        _LOG_CALLBACK = llama_cpp.llama_log_callback(lambda level, text, data: None)
        llama_cpp.llama_log_set(_LOG_CALLBACK, ctypes.c_void_p(0))
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + f".tmp{os.getpid()}")
    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = getattr(llama_cpp, LLAMA_QUANTIZED[qtype])
    params.nthread = threads or torch.get_num_threads()
    rc = llama_cpp.llama_model_quantize(str(src).encode(), str(tmp).encode(),
                                        ctypes.byref(params))
    if rc != 0:
        tmp.unlink(missing_ok=True)
        raise RuntimeError(f"llama.cpp's quantizer failed (code {rc}) writing {qtype} from {src}")
    os.replace(tmp, path)
    return path
