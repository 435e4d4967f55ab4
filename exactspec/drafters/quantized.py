"""QuantizedDraft: the target itself, weight-only quantized, drafts for the target.

Self-speculation needs no training and no second model: at `begin` the drafter builds (once per
target and weight version, then cached) a copy of the target's weights in 8 or 4 bits (or
bfloat16) and runs it with its own KV cache, on one of two backends:
- "torch" (`quantized_torch.py`): int8 per output channel, int4 groups or bfloat16 weights
  through the same lean forward as the target, optionally over a subset of its layers and with
  its LM head over the target's frequent tokens only (`vocab`), on the target's own KV cache
  where it can; a target the lean forward does not run (gemma3, GPT-2, ...)
  is drafted by a quantized copy of its transformers model;
- "llama.cpp" (`quantized_llama_cpp.py`): the target's weights written as a Q8_0 / Q4_0 GGUF and
  run by llama.cpp (optional package), for the targets the GGUF export covers
  (`models/gguf_export.ARCHS`); it is refused for the others.
"auto" picks between them (`quantized_auto.py`). q is its standardized distribution, computed
by the same function with the same parameters and history as the target's p, so the
verification is exact for every verify method; quantization only lowers how often drafts are
accepted. The copy follows in-place weight updates of the target (an RL policy step): its
weights' version counters are checked at every `begin`. Measurements: docs/quantized.md.
"""

from __future__ import annotations

import os
from collections.abc import Sequence

import torch

from exactspec.drafters import quantized_auto
from exactspec.drafters.base import DraftContext, TargetInfo
from exactspec.drafters.gguf_draft import GgufDraft, llama_cpp_available, llama_cpp_why
from exactspec.drafters.quantized_formats import BACKENDS, BITS, GGUF_TYPES, GROUP_SIZES, bits_text
from exactspec.drafters.quantized_llama_cpp import LlamaCppBackend
from exactspec.drafters.quantized_torch import TorchBackend, shares_cache
from exactspec.drafters.tree_shape import check_tree
from exactspec.errors import InvalidType, InvalidValue
from exactspec.models.adapter import unwrap_model
from exactspec.models.gguf_export import unsupported as gguf_unsupported
from exactspec.models.lean import LeanLlama, head_rows_of
from exactspec.sampling import DraftTree

# the lean self-draft drafts on the target's KV cache of the context (no prefill, no catch-up
# forwards; exact: it writes only slots the target rewrites before reading); off: its own cache
SHARE_TARGET_CACHE = True


class QuantizedDraft:
    """Drafts with a weight-only quantized copy of the target it is asked to draft for.

    bits: 8 (int8 per output channel / Q8_0), 4 (min-max int4 groups of `group_size` along
    the input / Q4_0) or 16 (bfloat16 weights, torch only). layers: the target's decoder layers
    the draft keeps (None = all; layer skipping, LayerSkip / SWIFT style, torch only; on
    smollm2-135m it drafts badly, see the README). backend: "torch", "llama.cpp", or "auto":
    where both can run (llama-cpp-python installed, bits 8 / 4, all layers, group_size 32, a
    chain, a target on the CPU that `models/gguf_export.py` covers), the faster by a measurement
    at the first `begin` per target and bits (`drafters/quantized_auto.py`;
    EXACTSPEC_QUANTIZED_BACKEND forces it), else torch; `backend` reads llama.cpp until that
    `begin` then. tree / siblings: token trees as for DraftModel, fixed (3, 2, 1) or
    DynamicTree(node_budget=16); torch backend only ("auto" then picks torch). vocab: the LM
    head keeps only these tokens' rows (FR-Spec / VocabTrim; lean forward, torch backend):
    a number N (the N tokens the target itself uses most, special tokens included: found once
    per model by letting it generate, then cached on disk; `drafters/frequent_tokens.py`),
    token ids (a tensor or list) or the path of a JSON list of them; q is 0 outside them and
    the residual norm(max(p - q, 0)) still covers the whole vocabulary, so the output is
    exact; None (default): the whole head. A target the
    lean forward does not run (not a Llama architecture) is drafted by a quantized copy of its
    transformers model (torch, all layers); a target the GGUF export refuses (its reason is in
    the error) is drafted by torch ("auto" picks torch for it, "llama.cpp" is refused).

    The drafting is its backend's (`active`: a TorchBackend or a LlamaCppBackend); attributes
    this class does not have are read from the active backend (its cache state, which tests
    inspect).
    """

    standardized_q = True  # its backends' q come from DraftContext.standardize (base.trusts_q)

    hidden_layers = None  # needs no target features

    def __init__(self, bits: int = 8, layers: Sequence[int] | None = None, *,
                 group_size: int = 32, backend: str = "auto", tree=None,
                 siblings: str = "without_replacement", vocab=None) -> None:
        _check_arguments(bits, layers, group_size, backend)
        vocab = _check_vocab(vocab)
        tree, siblings = check_tree(tree, siblings)
        if vocab is not None and backend == "llama.cpp":
            raise InvalidValue(f"backend='llama.cpp' runs the whole head; vocab={vocab!r:.40} "
                               "needs backend='torch' (or 'auto', which picks torch for it)")
        # where llama.cpp could draft this configuration, if it is installed
        fits = (bits in GGUF_TYPES and layers is None and group_size == 32 and tree is None
                and vocab is None)
        _check_backend(backend, fits, tree, bits, layers, group_size)
        self._auto = backend == "auto"  # resolved again at begin per target (quantized_auto)
        if backend == "auto":
            backend = "llama.cpp" if llama_cpp_available() and fits else "torch"
        self.backend = backend  # "torch" | "llama.cpp", resolved
        self.bits = bits  # weight bits of the copy
        self.fmt = BITS[bits]  # its weight format
        self.layers = None if layers is None else tuple(layers)  # kept decoder layers
        self.group_size = group_size  # int4 group along the input dimension
        self.vocab = vocab  # the head's kept tokens (a count, ids, a file); None: all
        self._torch = TorchBackend(bits, self.layers, group_size, tree, siblings, vocab)
        # the llama.cpp backend where it may draft (explicitly, or "auto" may pick it)
        self._llama_cpp = LlamaCppBackend(bits) if backend == "llama.cpp" else None

    @staticmethod
    def supports(model) -> bool:
        """Whether `model` (a transformers model or an exactspec Model) can be self-drafted: any
        transformers model (the lean forward for Llama architectures, else the generic copy)."""
        try:
            unwrap_model(model)
        except TypeError:
            return False
        return True

    def __repr__(self) -> str:
        layers = "" if self.layers is None else f", layers={list(self.layers)}"
        tree = "" if self.tree is None else f", tree={self.tree}, siblings={self.siblings!r}"
        vocab = "" if self.vocab is None else f", vocab={_vocab_text(self.vocab)}"
        return (f"QuantizedDraft(bits={self.bits}{layers}, backend={self.backend!r}{tree}"
                f"{vocab})")

    def __getattr__(self, name: str):
        """An attribute this class lacks: the active backend's (DraftModel's cache state of the
        torch backend, the GGUF draft of the llama.cpp one)."""
        if name.startswith("__") or name in ("_torch", "_llama_cpp", "backend"):
            raise AttributeError(name)  # not built yet (unpickling, copying)
        return getattr(self.active, name)

    @property
    def active(self) -> TorchBackend | LlamaCppBackend:
        """The backend that drafts now (`backend`)."""
        return self._torch if self.backend == "torch" else self._llama_cpp

    @property
    def tree(self):
        """The token tree it drafts (a TreeSpec; None: chains); the torch backend's."""
        return self._torch.tree

    @tree.setter
    def tree(self, value) -> None:
        self._torch.tree = value

    @property
    def siblings(self) -> str:
        """How a tree's children are drawn (SIBLING_KINDS); the torch backend's."""
        return self._torch.siblings

    @siblings.setter
    def siblings(self, value: str) -> None:
        self._torch.siblings = value

    @property
    def forward(self):
        """The quantized lean forward the torch backend drafts with (None: none built)."""
        return self._torch.forward

    @property
    def copy(self):
        """The quantized transformers copy the torch backend drafts with (None: none built)."""
        return self._torch.copy

    @property
    def gguf(self) -> GgufDraft | None:
        """The llama.cpp draft in use (None: none built, or auto measured it slower)."""
        return None if self._llama_cpp is None else self._llama_cpp.gguf

    @property
    def lags_behind(self) -> bool:
        """Whether rows it does not draft for fall behind in its cache (base.py's contract)."""
        return self.active.lags_behind

    def begin(self, context: DraftContext, target: TargetInfo) -> None:
        if target.model is None:
            raise InvalidValue("QuantizedDraft drafts with the target's own weights; the engine "
                               "did not pass the target model")
        if self._auto:
            self.backend = self._pick(target)
        if self.backend == "llama.cpp":
            self._llama_cpp.begin(context, target)
        else:
            self._torch.begin(context, target, share=SHARE_TARGET_CACHE)

    def propose(self, context: DraftContext, num_tokens: torch.Tensor):  # [B]
        return self.active.propose(context, num_tokens)  # [B, K] -1 padded, [B, K, V]

    def propose_tree(self, context: DraftContext, max_depth: torch.Tensor) -> DraftTree:
        """The tree of `self.tree` (torch backend; max_depth [B])."""
        return self._torch.propose_tree(context, max_depth)

    def admit(self, context: DraftContext, target: TargetInfo, start: int) -> None:
        """Rows start.. are new: prefilled alone into the quantized copy's cache (or given
        llama.cpp sequences); the running rows keep theirs."""
        self.active.admit(context, target, start)

    def select(self, rows: torch.Tensor) -> None:
        self.active.select(rows)

    def _pick(self, target: TargetInfo) -> str:
        """auto's backend for `target.model`: where both can run, the environment's choice or
        the faster measured (`quantized_auto.pick`; the slower llama.cpp draft then freed);
        else torch. llama.cpp is built for the CPU here, its export covers gguf_export.ARCHS.
        The torch draft on the target's cache prefills and catches up nothing, which a
        per-token timing does not see: it is taken unmeasured unless the environment forces a
        backend (docs/quantized.md)."""
        model = target.model
        on_cpu = next(model.parameters()).device.type == "cpu"
        shares = (SHARE_TARGET_CACHE and LeanLlama.supports(model)
                  and shares_cache(target.adapter, model, self.layers))
        both = (on_cpu and gguf_unsupported(model) is None and self._llama_cpp is not None
                and (quantized_auto.forced() is not None or not shares))
        backend = quantized_auto.pick(model, target, self.bits, {
            "llama.cpp": lambda: self._llama_cpp.draft_for(model),
            "torch": lambda: QuantizedDraft(self.bits, backend="torch",
                                            group_size=self.group_size),
        }) if both else "torch"
        if backend == "torch" and self._llama_cpp is not None:  # measured, and slower
            self._llama_cpp.release()
        return backend


def _check_arguments(bits, layers, group_size, backend) -> None:
    """QuantizedDraft's arguments, each mistake named (InvalidType / InvalidValue)."""
    if isinstance(bits, bool) or not isinstance(bits, int):
        raise InvalidType(f"bits must be an int (8, 4 or 16), got {type(bits).__name__}")
    if bits not in BITS:
        raise InvalidValue(f"bits={bits} is not supported; use {bits_text()}")
    if layers is not None:
        if isinstance(layers, str | bytes) or not isinstance(layers, Sequence):
            raise InvalidType(f"layers must be a list of layer indices or None, got "
                              f"{type(layers).__name__}")
        if any(isinstance(i, bool) or not isinstance(i, int) for i in layers):
            raise InvalidType(f"layers must hold ints, got {list(layers)!r}")
        if len(set(layers)) != len(layers) or list(layers) != sorted(layers):
            raise InvalidValue(f"layers={list(layers)!r} must be increasing, without repeats")
    if isinstance(group_size, bool) or group_size not in GROUP_SIZES:
        raise InvalidValue(f"group_size={group_size!r} must be 32, 64, 128 or 256")
    if backend not in BACKENDS:
        raise InvalidValue(f"backend={backend!r} must be one of {list(BACKENDS)}")


def _check_vocab(vocab):
    """QuantizedDraft's `vocab`: None, a count >= 1, a path, or token ids (a tensor or a
    sequence of ints, kept as a tensor); their range is checked against the target at begin."""
    if vocab is None or isinstance(vocab, str | os.PathLike):
        return vocab
    if isinstance(vocab, bool):
        raise InvalidType("vocab must be a number of tokens, token ids or a path, not a bool")
    if isinstance(vocab, int):
        if vocab < 1:
            raise InvalidValue(f"vocab={vocab} must be a number of tokens >= 1")
        return vocab
    if isinstance(vocab, torch.Tensor | Sequence):
        try:  # ints >= 0, at least one (their range: at begin)
            return head_rows_of(vocab, None)
        except InvalidValue as exc:
            raise InvalidValue(f"vocab: {exc}") from None
    raise InvalidType(f"vocab must be a number of tokens, token ids or a path, got "
                      f"{type(vocab).__name__}")


def _vocab_text(vocab) -> str:
    """How repr and labels show `vocab`: the count, the path, or 'N ids'."""
    if isinstance(vocab, torch.Tensor):
        return f"<{vocab.numel()} ids>"
    return repr(str(vocab)) if isinstance(vocab, os.PathLike) else repr(vocab)


def _check_backend(backend: str, fits: bool, tree, bits, layers, group_size) -> None:
    """Whether `backend` can draft this configuration (`fits`: one llama.cpp could draft) here;
    auto forced to llama.cpp by the environment where it would draft and cannot run is
    refused too."""
    if tree is not None and backend == "llama.cpp":
        raise InvalidValue(f"backend='llama.cpp' drafts chains only; tree={tree!r} "
                           "needs backend='torch' (or 'auto', which picks torch for trees)")
    if backend == "llama.cpp":
        if not fits:
            raise InvalidValue(
                f"backend='llama.cpp' takes bits 8 or 4 with all layers and group_size 32 "
                f"(got bits={bits}, layers={layers!r}, group_size={group_size}); use "
                "backend='torch' for the others")
        if not llama_cpp_available():
            raise InvalidValue(f"backend='llama.cpp' cannot run here: {llama_cpp_why()}")
    elif (backend == "auto" and quantized_auto.forced() == "llama.cpp" and fits
          and not llama_cpp_available()):  # forced where it would draft, and cannot run
        raise InvalidValue(f"{quantized_auto.ENV}=llama.cpp cannot run here: "
                           f"{llama_cpp_why()}; unset it to draft with torch")
