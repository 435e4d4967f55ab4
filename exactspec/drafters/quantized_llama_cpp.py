"""QuantizedDraft's llama.cpp backend: the target's current weights written as a Q8_0 / Q4_0
GGUF (`models/gguf_export.py`, into the cache directory, the file named by a fingerprint of the
weights so later processes reuse it) and drafted by `GgufDraft` (`drafters/gguf_draft.py`, the
optional llama-cpp-python package). It runs the targets the GGUF export covers
(`models/gguf_export.ARCHS`), on the CPU, with every layer, and drafts chains only.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import time
from pathlib import Path

import torch

from exactspec.drafters.base import DraftContext, TargetInfo
from exactspec.drafters.gguf_draft import GgufDraft, unload
from exactspec.drafters.quantized_formats import GGUF_TYPES
from exactspec.errors import InvalidValue
from exactspec.models.gguf_export import export_gguf
from exactspec.models.gguf_export import unsupported as gguf_unsupported

log = logging.getLogger(__name__)


class LlamaCppBackend:
    """Drafts with llama.cpp running a `bits`-bit GGUF export of the target it is asked to draft
    for, exported once per weight version (an in-place update, as an RL step makes, writes a new
    file and deletes the one it supersedes, if this backend wrote it)."""

    standardized_q = True  # q made by exactspec (GgufDraft), not re-checked (base.trusts_q)

    hidden_layers = None  # needs no target features

    # rows it does not draft for fall behind in their llama.cpp sequences (a catch-up when they
    # next draft, which the draft-length policy charges)
    lags_behind = True

    def __init__(self, bits: int) -> None:
        self.qtype = GGUF_TYPES[bits]  # the GGUF type llama.cpp runs
        self._gguf: GgufDraft | None = None  # the llama.cpp draft in use
        self._key: tuple | None = None  # (target id, weight versions) it was built from
        self._written: set[str] = set()  # GGUF files this backend exported

    @property
    def gguf(self) -> GgufDraft | None:
        """The llama.cpp draft in use (None: none built, or released)."""
        return self._gguf

    def begin(self, context: DraftContext, target: TargetInfo) -> None:
        model = target.model
        why = gguf_unsupported(model)
        if why is not None:
            raise InvalidValue(f"backend='llama.cpp' cannot run {type(model).__name__}: {why}; "
                               "use backend='torch' (or 'auto')")
        self.draft_for(model).begin(context, target)

    def propose(self, context: DraftContext, num_tokens: torch.Tensor):  # [B]
        assert self._gguf is not None, "begin() first"
        return self._gguf.propose(context, num_tokens)  # [B, K], [B, K, V]

    def admit(self, context: DraftContext, target: TargetInfo, start: int) -> None:
        """Rows start.. are new: given llama.cpp sequences; the running rows keep theirs."""
        assert self._gguf is not None, "begin() first"
        self._gguf.admit(context, target, start)

    def select(self, rows: torch.Tensor) -> None:
        assert self._gguf is not None, "begin() first"
        self._gguf.select(rows)

    def draft_for(self, model) -> GgufDraft:
        """The llama.cpp draft of `model`'s current weights, exported once per weight version
        (the draft of superseded weights freed, its file deleted if this backend wrote it)."""
        key = (id(model), tuple(p._version for p in model.parameters()))
        if self._gguf is not None and self._key == key:
            return self._gguf
        path = gguf_path(model, self.qtype)
        if not path.is_file():
            t0 = time.perf_counter()
            export_gguf(model, path, self.qtype)
            log.info("wrote the %s llama.cpp draft of the target to %s in %.1f s",
                     self.qtype, path, time.perf_counter() - t0)
            self._written.add(str(path))
        if self._gguf is not None:
            old = self._gguf.path
            self._gguf.free()
            if old != str(path):
                unload(old)
                if old in self._written:  # superseded weights (an RL step): a file kept per
                    self._written.discard(old)  # step would fill the disk
                    os.remove(old)
        self._gguf, self._key = GgufDraft(path), key
        return self._gguf

    def release(self) -> None:
        """Free the llama.cpp draft and its model (auto measured it slower: not kept loaded)."""
        if self._gguf is not None:
            self._gguf.free()
            unload(self._gguf.path)
            self._gguf = self._key = None


def gguf_path(model, qtype: str) -> Path:
    """Where the `qtype` GGUF of `model`'s current weights lives in the cache directory."""
    from exactspec.models.registry import cache_root

    return cache_root() / "gguf-drafts" / f"{fingerprint(model)}-{qtype}.gguf"


def fingerprint(model) -> str:
    """A digest of the model's weights (every 997th value of every tensor, shapes, config; not
    the directory it was loaded from, so a copy elsewhere keys the same cache files)."""
    config = json.loads(model.config.to_json_string(use_diff=False))
    config.pop("_name_or_path", None)
    h = hashlib.sha256(json.dumps(config, sort_keys=True).encode())
    with torch.no_grad():
        for name, p in model.named_parameters():
            h.update(name.encode())
            h.update(str(tuple(p.shape)).encode())
            h.update(p.detach().reshape(-1)[::997].float().cpu().numpy().tobytes())
    return h.hexdigest()[:20]
