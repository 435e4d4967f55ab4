"""llama.cpp plain decoding as bench engines: the target's own weights, written as GGUF.

`llama.cpp f32`, `llama.cpp bf16`, `llama.cpp q8_0`, `llama.cpp q4_0`, `llama.cpp q4_1` and
`llama.cpp q4_k` run the target's current weights (bf16: rounded to bfloat16, a bf16 target's own
weights; q4_k: llama.cpp's Q4_K_M mix, made by llama.cpp's own quantizer from a lossless export),
exported once by `models/gguf_export.py` into the cache directory (the file is named by the same
weight fingerprint as the quantized self-draft's GGUF, so `qdraft int8` and `llama.cpp q8_0`
share one file), through llama-cpp-python's low-level API: one `llama_decode` of the prompt,
then one of one token per step, with llama.cpp's own sampler reading the logits in C.

Sampling. Greedy: llama.cpp's argmax of its logits (ties to the lowest id, as ours). T > 0:
llama.cpp's sampler chain in exactspec's order (temperature, top-k, top-p, min-p, then a draw
with its own generator seeded per run): for `f32` that is exactspec's law up to the float32
rounding of the logits and the tie rule at the top-p edge, drawn from other random numbers;
`bf16` of a float32 target, `q8_0`, `q4_0`, `q4_1` and `q4_k` are other models (rounded or
quantized weights): speed rows only, their text is not the target's. The f32 context keeps its KV cache in float32 and turns flash attention off (llama.cpp's
CPU flash attention rounds through float16 even over a float32 cache: logits off by ~4e-3
instead of ~2e-6 on a tiny model); the others run llama.cpp's defaults (float16 KV cache, flash
attention auto), what a llama.cpp user gets.

Weight bytes a step reads (the bandwidth column): every 2-D tensor of the GGUF but the token
embedding (a step reads one row of it), plus the embedding when the head is tied to it.
"""

from __future__ import annotations

import logging
import os
import time
from pathlib import Path

import numpy as np
import torch

from exactspec.bench.specs import EngineSpec, Mode, Run
from exactspec.errors import InvalidValue

log = logging.getLogger(__name__)

FORMATS = ("f32", "bf16", "q8_0", "q4_0", "q4_1", "q4_k")  # the GGUF types of the llama.cpp rows
GGML_TYPE_F32 = 0  # ggml_type of a float32 KV cache
FLASH_ATTN_DISABLED = 0  # llama_flash_attn_type: off (its CPU kernel rounds through float16)


def llama_cpp_engines(formats: tuple[str, ...] = FORMATS) -> list[EngineSpec]:
    """One plain llama.cpp engine per GGUF type, compared with exactspec plain."""
    return [EngineSpec(f"llama.cpp {f}", "llama.cpp", "none", weights=f) for f in formats]


def supports(model) -> bool:
    """Whether the llama.cpp rows can run for this target (why_not says why not)."""
    return why_not(model) is None


def why_not(model) -> str | None:
    """Why the llama.cpp rows cannot run for this target, or None: llama.cpp installed and
    passed its smoke test here (drafters/llama_cpp_check.py), a model the GGUF export writes
    (models/gguf_export.ARCHS: Llama, Mistral, Qwen 2 / 3, Gemma 3), on the CPU."""
    from exactspec.drafters.gguf_draft import llama_cpp_available, llama_cpp_why
    from exactspec.models.gguf_export import unsupported

    if not llama_cpp_available():
        return llama_cpp_why()
    if (why := unsupported(model)) is not None:
        return why
    if not all(p.device.type == "cpu" for p in model.parameters()):
        return "the llama.cpp rows run on the CPU only"
    return None


def gguf_for(model, qtype: str) -> Path:
    """The GGUF of `model`'s current weights in `qtype`, exported once into the cache."""
    from exactspec.drafters.quantized_llama_cpp import fingerprint as _fingerprint
    from exactspec.models.gguf_export import export_gguf
    from exactspec.models.registry import cache_root

    path = cache_root() / "gguf-drafts" / f"{_fingerprint(model)}-{qtype}.gguf"
    if not path.is_file():
        t0 = time.perf_counter()
        export_gguf(model, path, qtype)
        log.info("wrote the %s GGUF of the target to %s in %.1f s", qtype, path,
                 time.perf_counter() - t0)
    return path


def gguf_weight_bytes(path: str | os.PathLike[str]) -> int:
    """Bytes of weights one llama.cpp decode step reads (see the module docstring)."""
    tensors = gguf_tensor_bytes(path)
    total = sum(n for name, (dims, n) in tensors.items()
                if dims == 2 and name != "token_embd.weight")
    if "output.weight" not in tensors:  # tied head: the step multiplies by the whole embedding
        total += tensors["token_embd.weight"][1]
    return total


# bytes of each fixed-size GGUF value type (gguf.GGUFValueType: u8 i8 u16 i16 u32 i32 f32 bool,
# 8 string, 9 array, u64 i64 f64)
_VALUE_BYTES = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}


def gguf_tensor_bytes(path: str | os.PathLike[str]) -> dict[str, tuple[int, int]]:
    """name -> (dimensions, bytes) of every tensor of a GGUF file, read from its header alone
    (gguf.GGUFReader also parses every metadata value, a tokenizer's ~100k strings: seconds a
    file, docs/performance.md's third Zen 4 pass)."""
    import mmap
    import struct

    import gguf

    with open(path, "rb") as f:
        if os.fstat(f.fileno()).st_size < 24:
            raise InvalidValue(f"{path}: not a GGUF file (shorter than a GGUF header)")
        buf = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)  # the header's pages only read
    if buf[:4] != b"GGUF":
        raise InvalidValue(f"{path}: not a GGUF file (its first bytes are {buf[:4]!r})")
    n_tensors, n_kv = struct.unpack_from("<QQ", buf, 8)
    pos = 24

    def u32() -> int:
        nonlocal pos
        pos += 4
        return struct.unpack_from("<I", buf, pos - 4)[0]

    def u64() -> int:
        nonlocal pos
        pos += 8
        return struct.unpack_from("<Q", buf, pos - 8)[0]

    def string() -> bytes:  # its length, then its bytes
        nonlocal pos
        length = u64()
        pos += length
        return buf[pos - length:pos]

    def skip(kind: int) -> None:
        nonlocal pos
        if kind == 8:
            string()
        elif kind == 9:  # an array: its element type, its length, its elements
            elem, count = u32(), u64()
            if elem in _VALUE_BYTES:
                pos += _VALUE_BYTES[elem] * count
            else:
                for _ in range(count):
                    skip(elem)
        else:
            pos += _VALUE_BYTES[kind]

    for _ in range(n_kv):
        skip(8)  # the key
        skip(u32())  # the value
    out = {}
    for _ in range(n_tensors):
        name = string().decode()
        dims = u32()
        numel = 1
        for _ in range(dims):
            numel *= u64()
        block, size = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType(u32())]
        u64()  # the tensor's offset
        out[name] = (dims, numel // block * size)
    buf.close()
    return out


class LlamaCppPlain:
    """Plain decoding of one GGUF by llama.cpp (see the module docstring); rows of a batch run
    one after another."""

    def __init__(self, path: str | os.PathLike[str], qtype: str, eos_token_ids: list[int], *,
                 threads: int | None = None) -> None:
        from exactspec.drafters.gguf_draft import _lib, _load_model

        if qtype not in FORMATS:
            raise InvalidValue(f"qtype={qtype!r} must be one of {list(FORMATS)}")
        self.qtype = qtype  # the GGUF type
        self.path = Path(path)  # the GGUF file llama.cpp runs (gguf_for)
        self.weight_bytes = gguf_weight_bytes(self.path)  # read per one-token step
        self.eos = set(eos_token_ids)  # a run stops after emitting one of these
        self.threads = threads  # llama.cpp threads, None = torch's at each run
        self._lib = _lib()
        self._model = _load_model(str(self.path))
        vocab = self._lib.llama_model_get_vocab(self._model)
        self.vocab_size = int(self._lib.llama_vocab_n_tokens(vocab))  # logits width
        self._ctx = None  # the llama.cpp context, reused while it is large enough
        self._ctx_key: tuple[int, int] = (0, 0)  # (its tokens, its threads)

    @classmethod
    def for_model(cls, model, qtype: str, eos_token_ids: list[int], *,
                  threads: int | None = None) -> LlamaCppPlain:
        """The engine of `model`'s current weights in `qtype` (exported once, gguf_for)."""
        return cls(gguf_for(model, qtype), qtype, eos_token_ids, threads=threads)

    def __del__(self) -> None:
        ctx, self._ctx = getattr(self, "_ctx", None), None
        free = getattr(getattr(self, "_lib", None), "llama_free", None)  # None at shutdown
        if ctx is not None and free is not None:
            free(ctx)

    def _context(self, tokens: int):
        """A context with room for `tokens`, its memory cleared."""
        lib = self._lib
        threads = self.threads or torch.get_num_threads()
        if self._ctx is None or self._ctx_key[0] < tokens or self._ctx_key[1] != threads:
            if self._ctx is not None:
                lib.llama_free(self._ctx)
                self._ctx = None
            n_ctx = -(-max(tokens, 256) // 256) * 256
            params = lib.llama_context_default_params()
            params.n_ctx = n_ctx
            params.n_batch = params.n_ubatch = n_ctx
            params.n_seq_max = 1
            params.n_threads = params.n_threads_batch = threads
            params.no_perf = True
            if self.qtype == "f32":  # float32 throughout (see the module docstring)
                params.type_k = params.type_v = GGML_TYPE_F32
                params.flash_attn_type = FLASH_ATTN_DISABLED
            ctx = lib.llama_init_from_model(self._model, params)
            if not ctx:
                raise InvalidValue(f"llama.cpp could not make a context of {n_ctx} tokens")
            self._ctx, self._ctx_key = ctx, (n_ctx, threads)
        lib.llama_memory_clear(lib.llama_get_memory(self._ctx), True)
        return self._ctx

    def _sampler(self, mode: Mode, seed: int):
        """llama.cpp's sampler chain for `mode`, in exactspec's transform order."""
        lib = self._lib
        chain = lib.llama_sampler_chain_init(lib.llama_sampler_chain_default_params())
        params = mode.params(seed)
        if params.is_greedy:
            lib.llama_sampler_chain_add(chain, lib.llama_sampler_init_greedy())
            return chain
        if params.temperature != 1.0:
            lib.llama_sampler_chain_add(chain, lib.llama_sampler_init_temp(params.temperature))
        if params.top_k > 0:
            lib.llama_sampler_chain_add(chain, lib.llama_sampler_init_top_k(params.top_k))
        if params.top_p < 1.0:
            lib.llama_sampler_chain_add(chain, lib.llama_sampler_init_top_p(params.top_p, 1))
        if params.min_p > 0.0:
            lib.llama_sampler_chain_add(chain, lib.llama_sampler_init_min_p(params.min_p, 1))
        lib.llama_sampler_chain_add(chain, lib.llama_sampler_init_dist(seed & 0xFFFFFFFF))
        return chain

    def _decode(self, ctx, tokens: list[int]) -> None:
        """Feed `tokens` after what the context holds (logits of the last one kept)."""
        arr = (self._lib.llama_token * len(tokens))(*tokens)
        rc = self._lib.llama_decode(ctx, self._lib.llama_batch_get_one(arr, len(tokens)))
        if rc != 0:
            raise RuntimeError(f"llama_decode failed with code {rc}")

    def run(self, prompts: list[list[int]], mode: Mode, max_new_tokens: int, seed: int) -> Run:
        """Each prompt decoded to `max_new_tokens` (or an EOS token, which is kept)."""
        run = Run(tokens=0, seconds=0.0)
        for i, prompt in enumerate(prompts):
            ctx = self._context(len(prompt) + max_new_tokens + 1)
            sampler = self._sampler(mode, seed + i)
            try:
                t0 = time.perf_counter()
                self._decode(ctx, prompt)
                run.prefill_seconds += time.perf_counter() - t0
                out: list[int] = []
                while True:
                    tok = int(self._lib.llama_sampler_sample(sampler, ctx, -1))
                    out.append(tok)
                    if tok in self.eos or len(out) >= max_new_tokens:
                        break
                    t1 = time.perf_counter()
                    self._decode(ctx, [tok])
                    run.target_seconds += time.perf_counter() - t1
                    run.steps += 1
                run.seconds += time.perf_counter() - t0
            finally:
                self._lib.llama_sampler_free(sampler)
            run.texts.append(out)
            run.tokens += len(out)
        run.forwards = run.steps
        return run

    def logits(self, ids: list[int]) -> torch.Tensor:  # -> [T, V] float32
        """llama.cpp's logits at every position of `ids` (one decode of the whole sequence)."""
        lib = self._lib
        ctx = self._context(len(ids) + 1)
        batch = lib.llama_batch_init(len(ids), 0, 1)
        try:
            batch.n_tokens = len(ids)
            for n, tok in enumerate(ids):
                batch.token[n], batch.pos[n], batch.n_seq_id[n] = tok, n, 1
                batch.seq_id[n][0] = 0
                batch.logits[n] = 1
            rc = lib.llama_decode(ctx, batch)
            if rc != 0:
                raise RuntimeError(f"llama_decode failed with code {rc}")
            rows = [np.ctypeslib.as_array(lib.llama_get_logits_ith(ctx, n),
                                          shape=(self.vocab_size,)).copy()
                    for n in range(len(ids))]
        finally:
            lib.llama_batch_free(batch)
        return torch.from_numpy(np.stack(rows))

