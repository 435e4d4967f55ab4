"""QuantizedDraft: the target itself, weight-only quantized, drafts for the target.

Self-speculation needs no training and no second model: at `begin` the drafter builds (once per
target and weight version, then cached) a copy of the target's weights in 8 or 4 bits and runs
it with its own KV cache, on one of two backends:
- "torch": int8 per output channel or int4 groups (`exactspec/models/formats.py`), optionally
  over a subset of the target's layers, through the same lean forward as the target (on the
  CPU, int8 on our own kernel, `exactspec/kernels`, with float32 activations; int4 on torch's);
- "llama.cpp": the target's weights written as a Q8_0 / Q4_0 GGUF (`models/gguf_export.py`,
  in the cache directory) and run by llama.cpp (`drafters/gguf_draft.py`), whose fused CPU
  kernels make a draft token 3-4x cheaper than torch's here (optional package).
A target the lean forward does not support (gemma3, GPT-2, ...) takes the generic torch path: a
copy of its transformers model with every linear layer quantized the same way
(`models/quantize_modules.py`), driven by transformers' forward. llama.cpp runs the targets
the GGUF export covers (`models/gguf_export.ARCHS`: Llama, Mistral, Qwen 2 / 3, Gemma 3 text),
whichever torch path they take; it is refused for the others.
q is its standardized distribution,
computed by the same function with the same parameters and history as the target's p, so the
verification is exact for every verify method; quantization only lowers how often drafts are
accepted. The copy follows in-place weight updates of the target (an RL policy step): its
weights' version counters are checked at every `begin`.
"""

from __future__ import annotations

import hashlib
import logging
import os
import time
from collections.abc import Sequence

import torch

from exactspec.drafters import quantized_auto
from exactspec.drafters.base import DraftContext, TargetInfo
from exactspec.drafters.draft_model import DraftModel
from exactspec.drafters.gguf_draft import GgufDraft, llama_cpp_available, llama_cpp_why, unload
from exactspec.drafters.tree_shape import check_tree
from exactspec.errors import InvalidType, InvalidValue
from exactspec.models.adapter import TargetAdapter, unwrap_model
from exactspec.models.gguf_export import unsupported as gguf_unsupported
from exactspec.models.lean import LeanLlama, lean_forward_for
from exactspec.models.quantize_modules import quantized_copy_for

log = logging.getLogger(__name__)

BITS = {8: "int8", 4: "int4", 16: "bfloat16"}  # bits -> torch weight format
# the lean self-draft drafts on the target's KV cache of the context (no prefill, no catch-up
# forwards; exact: it writes only slots the target rewrites before reading); off: its own cache
SHARE_TARGET_CACHE = True
GGUF_TYPES = {8: "q8_0", 4: "q4_0"}  # bits -> llama.cpp GGUF type
BACKENDS = ("auto", "torch", "llama.cpp")


class QuantizedDraft(DraftModel):
    """Drafts with a weight-only quantized copy of the target it is asked to draft for.

    bits: 8 (int8 per output channel / Q8_0), 4 (min-max int4 groups of `group_size` along
    the input / Q4_0) or 16 (bfloat16 weights, torch only). layers: the target's decoder layers
    the draft keeps (None = all; layer skipping, LayerSkip / SWIFT style, torch only; on
    smollm2-135m it drafts badly, see the README). backend: "torch", "llama.cpp", or "auto":
    where both can run (llama-cpp-python installed, bits 8 / 4, all layers, group_size 32, a
    chain, a target on the CPU that `models/gguf_export.py` covers), the faster by a measurement at the first `begin` per
    target and bits (`drafters/quantized_auto.py`; EXACTSPEC_QUANTIZED_BACKEND forces it),
    else torch; `backend` reads llama.cpp until that `begin` then. tree / siblings: token trees as for DraftModel, fixed (3, 2, 1) or
    DynamicTree(node_budget=16); torch backend only ("auto" then picks torch). A target the
    lean forward does not run (not a Llama architecture) is drafted by a quantized copy of its
    transformers model (torch, all layers); a target the GGUF export refuses (its reason is in
    the error) is drafted by torch ("auto" picks torch for it, "llama.cpp" is refused).
    """

    standardized_q = True  # q from DraftContext.standardize, not re-checked (base.trusts_q)

    hidden_layers = None  # needs no target features

    def __init__(self, bits: int = 8, layers: Sequence[int] | None = None, *,
                 group_size: int = 32, backend: str = "auto", tree=None,
                 siblings: str = "without_replacement") -> None:
        if isinstance(bits, bool) or not isinstance(bits, int):
            raise InvalidType(f"bits must be an int (8, 4 or 16), got {type(bits).__name__}")
        if bits not in BITS:
            raise InvalidValue(f"bits={bits} is not supported; use 8 (int8), 4 (int4) or 16 "
                               "(bfloat16)")
        if layers is not None:
            if isinstance(layers, str | bytes) or not isinstance(layers, Sequence):
                raise InvalidType(f"layers must be a list of layer indices or None, got "
                                  f"{type(layers).__name__}")
            if any(isinstance(i, bool) or not isinstance(i, int) for i in layers):
                raise InvalidType(f"layers must hold ints, got {list(layers)!r}")
            if len(set(layers)) != len(layers) or list(layers) != sorted(layers):
                raise InvalidValue(f"layers={list(layers)!r} must be increasing, without repeats")
        if isinstance(group_size, bool) or group_size not in (32, 64, 128, 256):
            raise InvalidValue(f"group_size={group_size!r} must be 32, 64, 128 or 256")
        if backend not in BACKENDS:
            raise InvalidValue(f"backend={backend!r} must be one of {list(BACKENDS)}")
        # branching per depth or a DynamicTree (None: chains) and how siblings are drawn
        self.tree, self.siblings = check_tree(tree, siblings)
        if self.tree is not None and backend == "llama.cpp":
            raise InvalidValue(f"backend='llama.cpp' drafts chains only; tree={self.tree!r} "
                               "needs backend='torch' (or 'auto', which picks torch for trees)")
        if backend == "llama.cpp":
            if bits not in GGUF_TYPES or layers is not None or group_size != 32:
                raise InvalidValue(
                    f"backend='llama.cpp' takes bits 8 or 4 with all layers and group_size 32 "
                    f"(got bits={bits}, layers={layers!r}, group_size={group_size}); use "
                    "backend='torch' for the others")
            if not llama_cpp_available():
                raise InvalidValue(f"backend='llama.cpp' cannot run here: {llama_cpp_why()}")
        elif (backend == "auto" and quantized_auto.forced() == "llama.cpp" and bits in GGUF_TYPES
              and layers is None and group_size == 32 and self.tree is None
              and not llama_cpp_available()):  # forced where it would draft, and cannot run
            raise InvalidValue(f"{quantized_auto.ENV}=llama.cpp cannot run here: "
                               f"{llama_cpp_why()}; unset it to draft with torch")
        self._auto = backend == "auto"  # resolved again at begin per target (measured)
        if backend == "auto":
            backend = "llama.cpp" if (llama_cpp_available() and bits in GGUF_TYPES
                                      and layers is None and group_size == 32
                                      and self.tree is None) else "torch"
        self.backend = backend  # "torch" | "llama.cpp", resolved
        self.bits = bits  # weight bits of the copy
        self.fmt = BITS[bits]  # its weight format
        self.layers = None if layers is None else tuple(layers)  # kept decoder layers
        self.group_size = group_size  # int4 group along the input dimension
        self.model = None  # the target's Model view, set at begin
        self._auto_choice = backend  # llama.cpp: "auto" may pick it (both can run), torch: not
        self.forward: LeanLlama | None = None  # the quantized lean forward in use (Llama)
        self.copy = None  # the quantized transformers copy in use (other architectures)
        self._adapter: TargetAdapter | None = None
        self._fed: torch.Tensor | None = None  # [B, S] long: tokens in the draft cache slots
        self._gguf: GgufDraft | None = None  # the llama.cpp draft in use
        self._gguf_key: tuple | None = None  # (target id, weight versions) it was built from
        self._written: set[str] = set()  # GGUF files this drafter exported; deleted once superseded

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
        return f"QuantizedDraft(bits={self.bits}{layers}, backend={self.backend!r}{tree})"

    def begin(self, context: DraftContext, target: TargetInfo) -> None:
        model = target.model
        if model is None:
            raise InvalidValue("QuantizedDraft drafts with the target's own weights; the engine "
                               "did not pass the target model")
        n_layers = model.config.num_hidden_layers
        if self.layers is not None and not all(0 <= i < n_layers for i in self.layers):
            raise InvalidValue(f"layers={list(self.layers)} must lie in 0..{n_layers - 1} (the "
                               f"target has {n_layers} layers)")
        lean = LeanLlama.supports(model)
        no_gguf = gguf_unsupported(model)  # why llama.cpp cannot run it (None: it can)
        if self._auto:  # llama.cpp is built for the CPU here; its export covers gguf_export.ARCHS
            on_cpu = next(model.parameters()).device.type == "cpu"
            # the torch draft on the target's cache prefills and catches up nothing, which a
            # per-token timing does not see: unless the environment forces a backend it is
            # taken unmeasured (llama.cpp's draft token was 6% cheaper, its run 1.5x against
            # torch's 1.95x plain's speed, chat, 2026-12-02 00:43)
            shares = lean and _can_share(target.adapter, model, self.layers)
            both = (on_cpu and no_gguf is None and self._auto_choice == "llama.cpp"
                    and (quantized_auto.forced() is not None or not shares))
            self.backend = quantized_auto.pick(model, target, self.bits, {
                "llama.cpp": lambda: self._gguf_for(model),
                "torch": lambda: QuantizedDraft(self.bits, backend="torch",
                                                group_size=self.group_size),
            }) if both else "torch"
            if self.backend == "torch" and self._gguf is not None:  # measured, and slower
                self._gguf._free()
                unload(self._gguf.path)
                self._gguf = self._gguf_key = None
        if self.backend == "llama.cpp":
            if no_gguf is not None:
                raise InvalidValue(
                    f"backend='llama.cpp' cannot run {type(model).__name__}: {no_gguf}; use "
                    "backend='torch' (or 'auto')")
            self._gguf_for(model).begin(context, target)
            return
        self.model = _TargetView(model, target.vocab_size)
        if not lean:  # the generic path: a quantized copy of the transformers model
            if self.layers is not None:
                raise InvalidValue(
                    f"layers={list(self.layers)} needs the lean forward (a Llama-architecture "
                    f"target); {type(model).__name__} is drafted by a quantized copy of all "
                    "its layers: drop layers=")
            self.forward = None
            self.copy = quantized_copy_for(model, self.fmt, group_size=self.group_size)
            self._start(TargetAdapter(self.copy, lean=False, strict=False), context)
            return
        self.copy = None
        self.forward = lean_forward_for(model, self.fmt, layers=self.layers,
                                        group_size=self.group_size)
        self._shared = _cache_to_share(target.adapter, model, self.forward)
        self._start(TargetAdapter(model, forward=self.forward, strict=False), context)

    def propose(self, context: DraftContext, num_tokens: torch.Tensor):  # [B]
        if self.backend == "llama.cpp":
            assert self._gguf is not None, "begin() first"
            return self._gguf.propose(context, num_tokens)
        return super().propose(context, num_tokens)

    def admit(self, context: DraftContext, target: TargetInfo, start: int) -> None:
        """Rows start.. are new: prefilled alone into the quantized copy's cache (or given
        llama.cpp sequences); the running rows keep theirs."""
        if self.backend == "llama.cpp":
            assert self._gguf is not None, "begin() first"
            self._gguf.admit(context, target, start)
            return
        super().admit(context, target, start)

    def select(self, rows: torch.Tensor) -> None:
        if self.backend == "llama.cpp":
            assert self._gguf is not None, "begin() first"
            self._gguf.select(rows)
            return
        super().select(rows)

    def _gguf_for(self, model) -> GgufDraft:
        """The llama.cpp draft of `model`'s current weights, exported once per weight version
        (the file is named by a fingerprint of the weights, so later processes reuse it)."""
        key = (id(model), tuple(p._version for p in model.parameters()))
        if self._gguf is not None and self._gguf_key == key:
            return self._gguf
        from exactspec.models.gguf_export import export_gguf
        from exactspec.models.registry import cache_root

        path = cache_root() / "gguf-drafts" / f"{_fingerprint(model)}-{GGUF_TYPES[self.bits]}.gguf"
        if not path.is_file():
            t0 = time.perf_counter()
            export_gguf(model, path, GGUF_TYPES[self.bits])
            log.info("wrote the %s llama.cpp draft of the target to %s in %.1f s",
                     GGUF_TYPES[self.bits], path, time.perf_counter() - t0)
            self._written.add(str(path))
        if self._gguf is not None:
            old = self._gguf.path
            self._gguf._free()
            if old != str(path):
                unload(old)
                if old in self._written:  # superseded weights (an RL step): a file kept per
                    self._written.discard(old)  # step would fill the disk
                    os.remove(old)
        self._gguf, self._gguf_key = GgufDraft(path), key
        return self._gguf



def _can_share(adapter, model, layers) -> bool:
    """Whether a lean draft of `model` over `layers` (None: all) would draft on `adapter`'s
    cache (`_cache_to_share`, before the draft is built)."""
    lean = getattr(adapter, "lean", None)
    n_layers = model.config.num_hidden_layers
    return (SHARE_TARGET_CACHE and isinstance(adapter, TargetAdapter) and lean is not None
            and adapter.model is model
            and list(range(n_layers) if layers is None else layers) == lean.layer_ids)


def _cache_to_share(adapter, model, forward: LeanLlama) -> TargetAdapter | None:
    """The target's adapter when the quantized lean `forward` can draft on the target's own KV
    cache (DraftModel._shared): `_can_share`, and the same cache dtype; None (a cache of its
    own) otherwise."""
    same = _can_share(adapter, model, forward.layer_ids) and (
        (adapter.lean.kernels, adapter.lean.dtype) == (forward.kernels, forward.dtype))
    return adapter if same else None


class _TargetView:
    """What DraftModel.propose reads of `self.model`: the vocabulary size and a name."""

    def __init__(self, model, vocab_size: int) -> None:
        self.model = model  # the target's transformers model
        self.vocab_size = vocab_size  # logits width
        self.name = "target"


def _fingerprint(model) -> str:
    """A digest of the model's weights (every 997th value of every tensor, shapes, config)."""
    h = hashlib.sha256(model.config.to_json_string(use_diff=False).encode())
    with torch.no_grad():
        for name, p in model.named_parameters():
            h.update(name.encode())
            h.update(str(tuple(p.shape)).encode())
            h.update(p.detach().reshape(-1)[::997].float().cpu().numpy().tobytes())
    return h.hexdigest()[:20]
