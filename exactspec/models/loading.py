"""Load a target/draft model by embedded name, local transformers directory, or GGUF file.

GGUF files are converted once (dequantized to float32, tokenizer converted) into a cache of
safetensors + tokenizer files, because transformers' GGUF path takes 20-100 s per load while
the cache loads in seconds. The cache is written into a temporary directory, its manifest
(every file's size and sha256) written last, and the directory renamed into place, so an
interrupted conversion never leaves a half-written model behind. Every load checks the files
against the manifest and rebuilds a damaged cache (saying so in one warning); a file lock
makes concurrent processes convert a model once. The cache holds float32 weights; `dtype`
converts while loading.
"""

from __future__ import annotations

import hashlib
import logging
import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError
from transformers import (
    AutoModelForCausalLM,
    AutoTokenizer,
    PreTrainedModel,
    PreTrainedTokenizerBase,
)

from exactspec.errors import InvalidType, InvalidValue, MissingFile
from exactspec.models import registry
from exactspec.models.architectures import check_target
from exactspec.models.cache import kv_dtype_named, mark_kv_cache
from exactspec.models.gguf_convert import convert
from exactspec.models.lean_arch import refusal
from exactspec.models.quiet import progress_off, quiet_transformers
from exactspec.models.registry import MARKER, cache_root

__all__ = ["DTYPES", "MARKER", "Model", "as_model", "cache_root", "load", "progress_off",
           "quiet_transformers"]

logger = logging.getLogger(__name__)

# Attention kernel used when `load` is not told otherwise. One-token decode steps of
# smollm2-135m on the shared 2-core CPU (300 steps each, interleaved): 2 threads sdpa 285-810 ms
# vs eager 390-1700 ms; 1 thread sdpa 56 vs eager 59 ms when quiet. Never slower, so sdpa.
DEFAULT_ATTN_IMPLEMENTATION = "sdpa"
# What `load(dtype=...)` accepts; the cache itself is always float32.
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


@dataclass
class Model:
    """A causal language model with its tokenizer, as the engine and the CLI consume it."""

    model: PreTrainedModel  # the transformers causal LM, in eval mode
    tokenizer: PreTrainedTokenizerBase | None  # None when wrapping a bare transformers model
    name: str  # embedded name, path, or the model's name_or_path; for logs and reports

    @property
    def path(self) -> str:
        """Which forward the engine runs for this model: "lean" (our lean forward of the Llama
        family, `models/lean_arch.py`) or "transformers" (the model's own forward)."""
        return "lean" if refusal(self.model) is None else "transformers"

    @property
    def device(self) -> torch.device:
        """Where the weights live; inputs must be moved here."""
        return self.model.device

    @property
    def vocab_size(self) -> int:
        """Width of the logits (rows of the output embedding), which can exceed len(tokenizer)."""
        head = self.model.get_output_embeddings()
        if head is not None and hasattr(head, "weight"):
            return int(head.weight.shape[0])
        return int(self.model.config.vocab_size)

    @property
    def eos_token_ids(self) -> list[int]:
        """Token ids that end a generation: generation_config first, then config, then tokenizer.

        generation_config.eos_token_id may be an int or a list (chat models often stop on
        several tokens); the result is always a list without duplicates, possibly empty.
        """
        sources: list[Any] = [
            getattr(self.model.generation_config, "eos_token_id", None),
            getattr(self.model.config, "eos_token_id", None),
            self.tokenizer.eos_token_id if self.tokenizer is not None else None,
        ]
        for eos in sources:
            if eos is None:
                continue
            ids = [eos] if isinstance(eos, int) else list(eos)
            if ids:
                return list(dict.fromkeys(int(i) for i in ids))
        return []

    @property
    def max_context(self) -> int:
        """Longest sequence (prompt + generated tokens) the position embeddings support."""
        config = self.model.config
        for attr in ("max_position_embeddings", "n_positions", "max_sequence_length", "seq_length"):
            value = getattr(config, attr, None)
            if isinstance(value, int) and value > 0:
                return value
        raise InvalidValue(
            f"{type(config).__name__} of {self.name!r} states no maximum context length "
            "(max_position_embeddings); set it in the model's config.json"
        )

    @property
    def has_chat_template(self) -> bool:
        """Whether the tokenizer carries a chat template (instruct models do, base models don't)."""
        return self.tokenizer is not None and bool(getattr(self.tokenizer, "chat_template", None))

    def apply_chat(self, prompt: str) -> str:
        """`prompt` as one user turn plus the assistant header, or unchanged without a template.

        The templated text already contains the model's special tokens; encode it with
        `encode(prompt, chat=True)` (or add_special_tokens=False) to avoid a doubled BOS.
        """
        if not self.has_chat_template:
            return prompt
        assert self.tokenizer is not None
        messages = [{"role": "user", "content": prompt}]
        text = self.tokenizer.apply_chat_template(
            messages, tokenize=False, add_generation_prompt=True
        )
        assert isinstance(text, str), type(text)
        return text

    def encode(self, prompt: str, *, chat: bool = False) -> list[int]:
        """Token ids of `prompt`, chat-templated when `chat` and a template exists."""
        if self.tokenizer is None:
            raise InvalidValue(
                f"model {self.name!r} has no tokenizer; pass token ids instead of text"
            )
        templated = chat and self.has_chat_template
        text = self.apply_chat(prompt) if templated else prompt
        return list(self.tokenizer(text, add_special_tokens=not templated)["input_ids"])


def as_model(
    obj: Model | PreTrainedModel, tokenizer: PreTrainedTokenizerBase | None = None
) -> Model:
    """Accept what users pass as a target or drafter: an exactspec Model or a transformers model.

    A bare transformers model is put in eval mode (dropout would make decoding random) and
    wrapped with `tokenizer` (default None). Anything else is an InvalidType naming what it got.
    """
    if isinstance(obj, Model):
        if tokenizer is not None and tokenizer is not obj.tokenizer:
            return Model(model=obj.model, tokenizer=tokenizer, name=obj.name)
        return obj
    if isinstance(obj, PreTrainedModel):
        if obj.get_output_embeddings() is None:
            raise InvalidType(
                f"expected a causal language model, got {type(obj).__name__}, which has no "
                "language-model head; load it with AutoModelForCausalLM instead"
            )
        obj.eval()
        name = getattr(obj.config, "name_or_path", "") or type(obj).__name__
        return Model(model=obj, tokenizer=tokenizer, name=name)
    raise InvalidType(
        f"expected an exactspec Model or a transformers PreTrainedModel, got "
        f"{type(obj).__module__}.{type(obj).__qualname__}; use exactspec.load(name_or_path) "
        "to load one"
    )


def as_target(obj: Model | PreTrainedModel,
              tokenizer: PreTrainedTokenizerBase | None = None) -> Model:
    """`as_model` for a target: its architecture must be one the engine decodes from its own
    law (`models/architectures.py`); anything else is an InvalidValue naming the feature."""
    model = as_model(obj, tokenizer)
    check_target(model.model)
    return model


def load(
    name_or_path: str | os.PathLike[str],
    *,
    dtype: str | torch.dtype = "float32",
    device: str | torch.device | None = None,
    attn_implementation: str | None = None,
    kv_cache: str = "float32",
) -> Model:
    """Load a causal LM and its tokenizer, converting GGUF sources into the cache on first use.

    `name_or_path` is an embedded name (see `registry.known_names()`), a local transformers
    model directory, or a `.gguf` file. `dtype`: "float32" (default) or "bfloat16" (or the
    torch dtype); bfloat16 halves memory, and on our kernels a step's bytes too (torch's own
    operators are slow with it on CPUs without native bf16: there it logs a warning).
    `device=None` means CPU; `attn_implementation=None` means
    DEFAULT_ATTN_IMPLEMENTATION. `kv_cache`: "float32" (default) or "bfloat16", the target's
    keys and values stored rounded to bf16, half the bytes a step reads of a long context: a
    target of its own, decoded exactly (`exactspec.models.set_kv_cache`; our kernels only).
    """
    kv_dtype_named(kv_cache)  # a wrong name refused before the load
    model = _load(name_or_path, dtype=dtype, device=device,
                  attn_implementation=attn_implementation)
    mark_kv_cache(model.model, kv_cache)
    return model


def _load(name_or_path: str | os.PathLike[str], *, dtype: str | torch.dtype,
          device: str | torch.device | None, attn_implementation: str | None) -> Model:
    """`load` without its kv_cache."""
    torch_dtype = _dtype(dtype, device)
    attn = attn_implementation or DEFAULT_ATTN_IMPLEMENTATION
    if not isinstance(name_or_path, str | os.PathLike):
        raise InvalidType(f"name_or_path={name_or_path!r} must be a str or path (an embedded "
                          f"name, a model directory or a .gguf file), got "
                          f"{type(name_or_path).__name__}")
    raw = os.fspath(name_or_path)
    if isinstance(name_or_path, str) and raw in registry.EMBEDDED:
        return _load_directory(convert_embedded(raw), name=raw, dtype=torch_dtype,
                               device=device, attn=attn)

    path = Path(raw).expanduser()
    if not path.exists():
        if _looks_like_path(raw):
            raise MissingFile(
                f"no such file or directory: {raw!r} (exactspec loads embedded names "
                f"{', '.join(registry.known_names())}, local transformers model directories and "
                ".gguf files; there is no model hub access)"
            )
        registry.get(raw)  # raises the InvalidValue listing the embedded names
    path = path.resolve()
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise InvalidValue(
                f"{path} is a directory without config.json, not a transformers model"
            )
        return _load_directory(path, name=raw, dtype=torch_dtype, device=device, attn=attn)
    if path.suffix.lower() != ".gguf":
        raise InvalidValue(
            f"{path} is a file but not a .gguf; pass a .gguf file or a model directory"
        )
    stat = path.stat()
    source = {"gguf": str(path), "size": stat.st_size, "mtime_ns": stat.st_mtime_ns}
    key = f"gguf-{path.stem}-{hashlib.sha256(str(path).encode()).hexdigest()[:12]}"
    directory = registry.ensure_converted(key, source,
                                          lambda tmp: _convert(tmp, lambda _out: path, key))
    return _load_directory(directory, name=raw, dtype=torch_dtype, device=device, attn=attn)


def convert_embedded(name: str) -> Path:
    """The model cache's directory of embedded model `name`, converted from its packages' GGUF
    first if it is not there (or unusable); InvalidValue naming the pip command when a package
    is missing."""
    entry = registry.get(name)
    registry.locate_chunks(entry)  # a missing package fails now, before any cache lookup
    source = {"embedded": entry.name, "sha256": entry.sha256, "packages": entry.version}
    return registry.ensure_converted(entry.name, source, lambda tmp: _convert(
        tmp, lambda out: registry.assemble(entry, out / entry.gguf_filename), entry.name))


def _dtype(dtype: str | torch.dtype, device: str | torch.device | None) -> torch.dtype:
    """`dtype` as a torch dtype; warns when bfloat16 would run on torch's operators on a CPU
    without native bf16 (our kernels widen bf16 weights in registers: there a bf16 step reads
    half the bytes and runs 1.6-2x a float32 one, docs/performance.md)."""
    if isinstance(dtype, str) and dtype in DTYPES:
        out = DTYPES[dtype]
    elif isinstance(dtype, torch.dtype) and dtype in DTYPES.values():
        out = dtype
    elif isinstance(dtype, str | torch.dtype):
        raise InvalidValue(f"dtype={dtype!r} is not supported: use one of "
                           f"{', '.join(map(repr, DTYPES))}")
    else:
        raise InvalidType(f"dtype={dtype!r} must be a string ({', '.join(map(repr, DTYPES))}) "
                          f"or a torch dtype, got {type(dtype).__name__}")
    on_cpu = device is None or torch.device(device).type == "cpu"
    if out == torch.bfloat16 and on_cpu and not cpu_has_native_bf16() and not kernels_run():
        logger.warning(
            "bfloat16 on this CPU (torch capability %s, no avx512_bf16 / amx_bf16) is emulated "
            "and usually slower than float32; use dtype='float32' for speed",
            torch.backends.cpu.get_cpu_capability())
    return out


def kernels_run() -> bool:
    """Whether the lean forward runs on our kernels here (built and not turned off)."""
    from exactspec import kernels

    return kernels.enabled()


def cpu_has_native_bf16() -> bool:
    """Whether this CPU computes bfloat16 natively (x86 avx512_bf16 / AMX, Arm bf16)."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return False
    flags = {word for line in text.splitlines()
             if line.lower().startswith(("flags", "features")) for word in line.split()}
    return bool(flags & {"avx512_bf16", "amx_bf16", "bf16"})


def _looks_like_path(raw: str) -> bool:
    """Whether a missing `raw` was meant as a path (vs. a misspelt embedded name)."""
    return (
        os.sep in raw or "/" in raw or raw.startswith((".", "~")) or raw.lower().endswith(".gguf")
    )


def _load_directory(
    directory: Path, *, name: str, dtype: torch.dtype, device: str | torch.device | None, attn: str
) -> Model:
    """Load a transformers model directory (a converted cache or the user's own) onto `device`."""
    start = time.perf_counter()
    try:
        with quiet_transformers():
            model = AutoModelForCausalLM.from_pretrained(directory, dtype=dtype,
                                                         attn_implementation=attn)
    except (OSError, ValueError, KeyError, SafetensorError) as exc:  # damaged, or not a causal LM
        raise InvalidValue(f"{directory} cannot be loaded as a transformers causal LM: "
                           f"{type(exc).__name__}: {exc}") from exc
    model.to(torch.device(device) if device is not None else torch.device("cpu"))
    model.eval()
    tokenizer: PreTrainedTokenizerBase | None
    try:
        with quiet_transformers():
            tokenizer = AutoTokenizer.from_pretrained(directory)
    except (OSError, ValueError) as exc:  # a weights-only directory: still usable with token ids
        reason = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
        logger.warning("no tokenizer in %s (%s); text prompts will not work", directory, reason)
        tokenizer = None
    loaded = Model(model=model, tokenizer=tokenizer, name=name)
    why = refusal(model)
    logger.info("loaded %s from %s in %.1f s; forward: %s%s", name, directory,
                time.perf_counter() - start, loaded.path, f" ({why})" if why else "")
    return loaded


def _convert(out: Path, get_gguf: Callable[[Path], Path], key: str) -> None:
    """Convert a GGUF into a float32 safetensors model + tokenizer files in `out`
    (exactspec.models.gguf_convert)."""
    convert(out, get_gguf, key)
