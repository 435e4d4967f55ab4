"""Target and draft models: load embedded, local or GGUF models; wrap transformers models.

loading.py / registry.py  `es.load`: embedded GGUFs from PyPI packages, the checked cache
adapter.py                the target adapter: batched prefill / extend / rollback, any model
architectures.py          the attention layouts (causal, window, layer_types) a target may have
cache.py                  SlotCache, the preallocated KV cache written by position
lean.py, lean_kernels.py  the lean Llama forward (on torch, or on our kernels)
formats.py                weight formats (float32, bfloat16, int8, int4) and their products
quantize_modules.py       quantized copies of any transformers model (the generic self-draft)
gguf_export.py            a Llama model written as GGUF for llama.cpp
tree_attention.py         scoring a whole token tree in one forward, keeping one path
"""

from exactspec.models.adapter import set_kv_cache
from exactspec.models.loading import Model, as_model, cache_root, load
from exactspec.models.registry import known_names

__all__ = ["Model", "as_model", "cache_root", "known_names", "load", "set_kv_cache"]
