"""Load a target/draft model by embedded name, local transformers directory, or GGUF file.

GGUF files are converted once (dequantized to float32, tokenizer converted) into a cache of
safetensors + tokenizer files, because transformers' GGUF path takes 20-100 s per load while
the cache loads in seconds. The cache is written into a temporary directory and renamed into
place, so an interrupted conversion never leaves a half-written model behind.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from tqdm.auto import tqdm
from transformers import (
    AutoModelForCausalLM,
    AutoTokenizer,
    PreTrainedModel,
    PreTrainedTokenizerBase,
)

from exactspec.models import registry

logger = logging.getLogger(__name__)

# Attention kernel used when `load` is not told otherwise. One-token decode steps of
# smollm2-135m on the shared 2-core CPU (300 steps each, interleaved): 2 threads sdpa 285-810 ms
# vs eager 390-1700 ms; 1 thread sdpa 56 vs eager 59 ms when quiet. Never slower, so sdpa.
DEFAULT_ATTN_IMPLEMENTATION = "sdpa"
# Bump when the cache layout changes; older caches are then rebuilt.
CACHE_FORMAT = 1
# Written last into a converted directory; its presence (with a matching source) means "done".
MARKER = "exactspec-cache.json"
# Leftover temporary conversion directories older than this are deleted (crashed runs).
_STALE_TMP_SECONDS = 3600.0


@dataclass
class Model:
    """A causal language model with its tokenizer, as the engine and the CLI consume it."""

    model: PreTrainedModel  # the transformers causal LM, in eval mode
    tokenizer: PreTrainedTokenizerBase | None  # None when wrapping a bare transformers model
    name: str  # embedded name, path, or the model's name_or_path; for logs and reports

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
        raise ValueError(
            f"{type(config).__name__} of {self.name!r} states no maximum context length"
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
            raise ValueError(
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
    wrapped with `tokenizer` (default None). Anything else is a TypeError naming what it got.
    """
    if isinstance(obj, Model):
        if tokenizer is not None and tokenizer is not obj.tokenizer:
            return Model(model=obj.model, tokenizer=tokenizer, name=obj.name)
        return obj
    if isinstance(obj, PreTrainedModel):
        if obj.get_output_embeddings() is None:
            raise TypeError(
                f"expected a causal language model, got {type(obj).__name__}, which has no "
                "language-model head; load it with AutoModelForCausalLM instead"
            )
        obj.eval()
        name = getattr(obj.config, "name_or_path", "") or type(obj).__name__
        return Model(model=obj, tokenizer=tokenizer, name=name)
    raise TypeError(
        f"expected an exactspec Model or a transformers PreTrainedModel, got "
        f"{type(obj).__module__}.{type(obj).__qualname__}; use exactspec.load(name_or_path) "
        "to load one"
    )


def cache_root() -> Path:
    """Root of converted models: $EXACTSPEC_CACHE, else $XDG_CACHE_HOME/exactspec, else ~/.cache/exactspec."""
    if env := os.environ.get("EXACTSPEC_CACHE"):
        return Path(env).expanduser()
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base).expanduser() / "exactspec"


def load(
    name_or_path: str | os.PathLike[str],
    *,
    dtype: torch.dtype = torch.float32,
    device: str | torch.device | None = None,
    attn_implementation: str | None = None,
) -> Model:
    """Load a causal LM and its tokenizer, converting GGUF sources into the cache on first use.

    `name_or_path` is an embedded name (see `registry.known_names()`), a local transformers
    model directory, or a `.gguf` file. `device=None` means CPU; `attn_implementation=None`
    means DEFAULT_ATTN_IMPLEMENTATION.
    """
    if not isinstance(dtype, torch.dtype):
        raise TypeError(f"dtype must be a torch.dtype such as torch.float32, got {dtype!r}")
    attn = attn_implementation or DEFAULT_ATTN_IMPLEMENTATION
    raw = os.fspath(name_or_path)
    if isinstance(name_or_path, str) and raw in registry.EMBEDDED:
        entry = registry.EMBEDDED[raw]
        registry.locate_chunks(entry)  # a missing package fails now, before any cache lookup
        source = {"embedded": entry.name, "sha256": entry.sha256, "packages": entry.version}
        directory = _ensure_converted(
            entry.name, source, lambda tmp: registry.assemble(entry, tmp / entry.gguf_filename)
        )
        return _load_directory(directory, name=entry.name, dtype=dtype, device=device, attn=attn)

    path = Path(raw).expanduser()
    if not path.exists():
        if _looks_like_path(raw):
            raise FileNotFoundError(
                f"no such file or directory: {raw!r} (exactspec loads embedded names "
                f"{', '.join(registry.known_names())}, local transformers model directories and "
                ".gguf files; there is no model hub access)"
            )
        registry.get(raw)  # raises the ValueError listing the embedded names
    path = path.resolve()
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise ValueError(f"{path} is a directory without config.json, not a transformers model")
        return _load_directory(path, name=raw, dtype=dtype, device=device, attn=attn)
    if path.suffix.lower() != ".gguf":
        raise ValueError(
            f"{path} is a file but not a .gguf; pass a .gguf file or a model directory"
        )
    stat = path.stat()
    source = {"gguf": str(path), "size": stat.st_size, "mtime_ns": stat.st_mtime_ns}
    key = f"gguf-{path.stem}-{hashlib.sha256(str(path).encode()).hexdigest()[:12]}"
    directory = _ensure_converted(key, source, lambda _tmp: path)
    return _load_directory(directory, name=raw, dtype=dtype, device=device, attn=attn)


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
    model = AutoModelForCausalLM.from_pretrained(directory, dtype=dtype, attn_implementation=attn)
    model.to(torch.device(device) if device is not None else torch.device("cpu"))
    model.eval()
    tokenizer: PreTrainedTokenizerBase | None
    try:
        tokenizer = AutoTokenizer.from_pretrained(directory)
    except (OSError, ValueError) as exc:  # a weights-only directory: still usable with token ids
        logger.warning("no tokenizer in %s (%s); text prompts will not work", directory, exc)
        tokenizer = None
    logger.info("loaded %s from %s in %.1f s", name, directory, time.perf_counter() - start)
    return Model(model=model, tokenizer=tokenizer, name=name)


def _ensure_converted(key: str, source: dict[str, Any], get_gguf: Callable[[Path], Path]) -> Path:
    """Return the cache directory for `key`, converting the GGUF once if it is missing or stale.

    `get_gguf(tmp)` yields the GGUF to convert, possibly by writing it into the temporary
    directory `tmp` (which is deleted afterwards either way).
    """
    root = cache_root()
    final = root / key
    if _is_valid(final, source):
        return final
    root.mkdir(parents=True, exist_ok=True)
    _remove_stale_temporaries(root, key)
    tmp = root / f".{key}.tmp-{uuid.uuid4().hex[:8]}"
    tmp.mkdir()
    try:
        _convert(tmp, source, get_gguf, key)
        _publish(tmp, final, source)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return final


def _is_valid(directory: Path, source: dict[str, Any]) -> bool:
    """Whether `directory` is a finished conversion of exactly `source` in the current format."""
    try:
        marker = json.loads((directory / MARKER).read_text())
    except (OSError, ValueError):
        return False
    return marker.get("format") == CACHE_FORMAT and marker.get("source") == source


def _remove_stale_temporaries(root: Path, key: str) -> None:
    """Delete temporary directories that crashed conversions of `key` left behind."""
    for old in root.glob(f".{key}.*-*"):
        if time.time() - old.stat().st_mtime > _STALE_TMP_SECONDS:
            logger.info("removing leftover %s", old)
            shutil.rmtree(old, ignore_errors=True)


def _convert(out: Path, source: dict[str, Any], get_gguf: Callable[[Path], Path], key: str) -> None:
    """Convert a GGUF into a float32 safetensors model + tokenizer files in `out`."""
    start = time.perf_counter()
    with tqdm(total=4, desc=f"exactspec: converting {key}", unit="step") as bar:

        def step(what: str) -> None:
            logger.info("converting %s: %s (step %d/4)", key, what, bar.n + 1)
            bar.set_postfix_str(what)

        step("locate gguf")
        gguf = get_gguf(out)
        bar.update()
        step("convert tokenizer")
        tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
        tokenizer.save_pretrained(out)
        bar.update()
        step("dequantize weights")
        loaded = AutoModelForCausalLM.from_pretrained(
            gguf.parent, gguf_file=gguf.name, dtype=torch.float32
        )
        bar.update()
        step("write safetensors")
        # save_pretrained refuses a GGUF-quantized model: rebuild a plain one from its config.
        config_dict = loaded.config.to_dict()
        config_dict.pop("quantization_config", None)
        config_dict.pop("_name_or_path", None)
        plain = AutoModelForCausalLM.from_config(
            type(loaded.config).from_dict(config_dict), dtype=torch.float32
        )
        plain.load_state_dict(loaded.state_dict())
        plain.generation_config = loaded.generation_config
        del loaded
        if gguf.parent == out:
            gguf.unlink()  # the assembled copy; the safetensors replace it
        plain.save_pretrained(out)
        bar.update()
    (out / MARKER).write_text(json.dumps({"format": CACHE_FORMAT, "source": source}, indent=2))
    logger.info("converted %s in %.1f s", key, time.perf_counter() - start)


def _publish(tmp: Path, final: Path, source: dict[str, Any]) -> None:
    """Move the finished conversion `tmp` to `final` atomically, replacing a stale one."""
    if final.exists():
        if _is_valid(final, source):  # another process finished first; keep theirs
            return
        trash = final.with_name(f".{final.name}.old-{uuid.uuid4().hex[:8]}")
        final.rename(trash)
        tmp.rename(final)
        shutil.rmtree(trash, ignore_errors=True)
        return
    try:
        tmp.rename(final)
    except OSError:
        if not _is_valid(final, source):  # lost a race, and the winner's cache is unusable
            raise
