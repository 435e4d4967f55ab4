"""Converting a GGUF file into a float32 transformers model directory (safetensors and
tokenizer files), through transformers' GGUF reader: what `load` runs once per embedded model
or .gguf path, into the model cache (exactspec.models.registry.ensure_converted)."""

from __future__ import annotations

import contextlib
import logging
import os
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from unittest import mock

import torch
from tqdm.auto import tqdm
from transformers import AutoModelForCausalLM, AutoTokenizer

from exactspec.models.quiet import progress_off, quiet_transformers

logger = logging.getLogger(__name__)


@contextlib.contextmanager
def one_gguf_parse() -> Iterator[None]:
    """transformers parses a GGUF's metadata once per call (config, tokenizer, weights: three
    times), each parse a Python loop over every field element: gemma3-270m's 262,144-token
    vocabulary made that 24 s a parse, 73 of the conversion's 118 s. Within this block a
    GGUFReader is made once per file and shared (it only reads its memory map)."""
    import gguf

    real = gguf.GGUFReader
    readers: dict[tuple, object] = {}

    def reader(path, *args, **kw):
        key = (os.fspath(path), args, tuple(sorted(kw.items())))
        if key not in readers:
            readers[key] = real(path, *args, **kw)
        return readers[key]

    with mock.patch.object(gguf, "GGUFReader", reader):
        yield


def convert(out: Path, get_gguf: Callable[[Path], Path], key: str) -> None:
    """Convert a GGUF into a float32 safetensors model + tokenizer files in `out`.

    `get_gguf(out)` yields the GGUF, possibly by writing it into `out` (it is deleted after).
    """
    start = time.perf_counter()
    with tqdm(total=4, desc=f"exactspec: converting {key}", unit="step", file=sys.stderr,
              disable=progress_off()) as bar, quiet_transformers(gguf=True), one_gguf_parse():

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
    logger.info("converted %s in %.1f s", key, time.perf_counter() - start)
