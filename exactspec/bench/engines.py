"""The engines `exactspec bench` compares: exactspec's decoders, transformers' `generate` and
llama.cpp's plain decoding of the same weights (bench/llama_cpp.py).

Every engine runs a batch of token-id prompts with the same max_new_tokens and sampling mode
and returns a `Run` (tokens, wall seconds, and, for exactspec, the engine's step statistics).
The transformers engines call `generate` on the very same model object exactspec decodes with,
so the weights are identical; assisted generation gets the same draft model as exactspec.
"""

from __future__ import annotations

import copy
import time
from collections.abc import Callable

import torch
from torch import nn

from exactspec.bench import llama_cpp
from exactspec.bench.figures import linear_weight_bytes
from exactspec.bench.hf_quantized import quantized_copy
from exactspec.bench.specs import MODES, EngineSpec, Mode, Run, add_counts
from exactspec.drafters import QuantizedDraft
from exactspec.drafters.registry import DrafterSpec, build
from exactspec.engine import generate
from exactspec.errors import InvalidValue
from exactspec.models.lean import lean_forward_for
from exactspec.models.loading import Model

__all__ = ["MODES", "EngineSpec", "Engines", "Mode", "Run", "add_counts", "default_engines",
           "quantized_engines", "truncated_draft"]


def default_engines(k: int = 4, eagle: bool = False, block: bool = True,
                    qk: int = 6) -> list[EngineSpec]:
    """exactspec plain / lookup / draft model (token, block, auto), transformers' three, the
    quantized self-draft (K = qk, auto) with its transformers counterpart, suffix, and
    llama.cpp's plain decoding of the target's weights as F32, Q8_0 and Q4_1 GGUF."""
    e = [
        EngineSpec("exactspec plain", "exactspec", "none", counterpart="transformers plain"),
        EngineSpec("transformers plain", "transformers", "none"),
    ]
    for drafter, hf in (("lookup", f"transformers lookup K={k}"),
                        ("draft", f"transformers assisted K={k}")):
        e += [
            EngineSpec(f"exactspec {drafter} K={k}", "exactspec", drafter, k, counterpart=hf),
            EngineSpec(f"exactspec {drafter} K={k} block", "exactspec", drafter, k, "block",
                       counterpart=hf, sampling_only=True),
            EngineSpec(f"exactspec {drafter} auto", "exactspec", drafter, "auto", counterpart=hf),
            EngineSpec(hf, "transformers", drafter, k),
        ]
    if eagle:
        e.append(EngineSpec(f"exactspec eagle K={k}", "exactspec", "eagle", k))
        e.append(EngineSpec("exactspec eagle auto", "exactspec", "eagle", "auto"))
    e += quantized_engines(qk)
    e += [EngineSpec(f"exactspec suffix K={k}", "exactspec", "suffix", k),
          EngineSpec("exactspec suffix auto", "exactspec", "suffix", "auto")]
    e += llama_cpp.llama_cpp_engines()
    return e if block else [s for s in e if s.verify != "block"]


def quantized_engines(k: int, formats: tuple[str, ...] = ("int8", "int4")) -> list[EngineSpec]:
    """The quantized self-draft at fixed K and auto, and transformers' assisted generation
    with the same quantized copy of the target as its assistant (apples to apples)."""
    e = []
    for fmt in formats:
        hf = f"transformers assisted {fmt} K={k}"
        e += [
            EngineSpec(f"exactspec qdraft {fmt} K={k}", "exactspec", fmt, k, counterpart=hf),
            EngineSpec(f"exactspec qdraft {fmt} auto", "exactspec", fmt, "auto", counterpart=hf),
            # the torch backend: the very kernels transformers' assistant runs (MatrixLinear)
            EngineSpec(f"exactspec qdraft {fmt} torch K={k}", "exactspec", f"{fmt}-torch", k,
                       counterpart=hf),
            EngineSpec(hf, "transformers", fmt, k),
        ]
    return e


def truncated_draft(model: nn.Module, num_layers: int) -> nn.Module:
    """The target's first `num_layers` decoder layers + its final norm and head, as a causal LM.

    Shares every weight with `model` (no copy): a draft model with the target's vocabulary
    when no separate small model is available. Works for decoder-only models whose layers live
    in `model.model.layers` (Llama, Qwen, Mistral, Gemma, ...).
    """
    inner = getattr(model, "model", None)
    layers = getattr(inner, "layers", None)
    if not isinstance(layers, nn.ModuleList):
        raise TypeError(f"cannot truncate {type(model).__name__}: no model.layers ModuleList")
    if not 1 <= num_layers <= len(layers):
        raise ValueError(f"num_layers={num_layers} must be in 1..{len(layers)}")
    cfg = copy.deepcopy(model.config)
    cfg.num_hidden_layers = num_layers
    if getattr(cfg, "layer_types", None):
        cfg.layer_types = list(cfg.layer_types[:num_layers])
    new_inner = copy.copy(inner)
    new_inner._modules = dict(inner._modules)
    new_inner.layers = nn.ModuleList(list(layers[:num_layers]))
    new_inner.config = cfg
    draft = copy.copy(model)
    draft._modules = dict(model._modules)
    draft.model = new_inner
    draft.config = cfg
    draft.generation_config = copy.deepcopy(model.generation_config)
    return draft


class Engines:
    """Runs EngineSpecs on one target; holds the drafters (built once, reused every run)."""

    def __init__(self, target: Model, draft: nn.Module | None = None,
                 eagle_factory: Callable[[], object] | None = None) -> None:
        self.target = target  # exactspec Model; its .model is shared with transformers
        self.draft = draft  # draft causal LM (shares the vocabulary), or None
        self._eagle_factory = eagle_factory
        self._eagle = None
        dev = target.device
        self._hf_eos = target.eos_token_ids
        self._pad = self._hf_eos[0] if self._hf_eos else 0
        self.device = dev
        self._assistants: dict[str, nn.Module] = {}  # transformers assistant per drafter
        self._llama: dict[str, llama_cpp.LlamaCppPlain] = {}  # llama.cpp engine per GGUF type
        # exactspec drafter per name, built from the spec (its tree, if any)
        self._drafters: dict[str, Callable[[EngineSpec], object]] = {
            "lookup": lambda s: self._build(s, "prompt-lookup", matches="3x4"),
            # a fresh cache per run: every engine sees each prompt the same number of times
            "suffix": lambda s: self._build(s, "suffix", matches="2x4"),
            "draft": lambda s: self._build(s, "draft", self.draft),
            "eagle": self._eagle_drafter,
            # backend auto: llama.cpp if installed (chains only)
            "int8": _chain_only(lambda s: self._build(s, "quantized-draft", 8)),
            "int4": _chain_only(lambda s: self._build(s, "quantized-draft", 4)),
            # trees on the torch backend only (llama.cpp drafts chains)
            "int8-torch": lambda s: self._build(s, "quantized-draft", 8, backend="torch"),
            "int4-torch": lambda s: self._build(s, "quantized-draft", 4, backend="torch"),
        }

    def available(self, spec: EngineSpec) -> bool:
        if spec.family == "llama.cpp":
            return llama_cpp.supports(self.target.model)
        if spec.drafter == "draft":
            return self.draft is not None
        if spec.drafter == "eagle":
            return self._eagle_factory is not None
        if spec.drafter.startswith(("int8", "int4")):
            return QuantizedDraft.supports(self.target.model)
        return True

    def run(self, spec: EngineSpec, prompts: list[list[int]], mode: Mode, max_new_tokens: int,
            seed: int) -> Run:
        if spec.family == "exactspec":
            return self._run_exactspec(spec, prompts, mode, max_new_tokens, seed)
        if spec.family == "llama.cpp":
            return self.llama(spec).run(prompts, mode, max_new_tokens, seed)
        return self._run_transformers(spec, prompts, mode, max_new_tokens, seed)

    def llama(self, spec: EngineSpec) -> llama_cpp.LlamaCppPlain:
        """The llama.cpp engine of a spec (its GGUF exported and loaded once)."""
        if spec.weights not in self._llama:
            self._llama[spec.weights] = llama_cpp.LlamaCppPlain(
                self.target.model, spec.weights, self._hf_eos)
        return self._llama[spec.weights]

    def weight_bytes(self, spec: EngineSpec) -> int:
        """Weight bytes one target step of the engine reads: the lean forward's matrices for
        exactspec (when it runs the target, else transformers'), every nn.Linear weight for
        transformers, the GGUF's matrices for llama.cpp (bench/llama_cpp.py)."""
        if spec.family == "llama.cpp":
            return self.llama(spec).weight_bytes
        lean = lean_forward_for(self.target.model) if spec.family == "exactspec" else None
        return lean.weight_bytes if lean is not None else linear_weight_bytes(self.target.model)

    def _drafter(self, spec: EngineSpec):
        if spec.drafter == "none":
            return None
        if spec.drafter not in self._drafters:
            raise InvalidValue(f"unknown drafter {spec.drafter!r}; have {sorted(self._drafters)}")
        return self._drafters[spec.drafter](spec)

    def _build(self, spec: EngineSpec, name: str, source=None, *, backend: str | None = None,
               matches: str | None = None):
        """The registry's drafter `name` (exactspec.drafters.registry) with the spec's tree;
        `matches`: a point-mass drafter whose trees are spelled MxD (example shown)."""
        if matches is not None and spec.tree is not None:
            _matches(spec, DRAFTER_WORD[name], matches)
        return build(DrafterSpec(name, source, tree=spec.tree,
                                 siblings=spec.siblings if spec.tree is not None else None,
                                 backend=backend), self.target)

    def _eagle_drafter(self, spec: EngineSpec):
        """The loaded head (loaded once); a tree engine gets its own drafter over the same
        head, so the shared chain drafter is never reconfigured."""
        if self._eagle is None:
            assert self._eagle_factory is not None
            self._eagle = self._eagle_factory()
        if spec.tree is None:
            return self._eagle
        from exactspec.drafters.eagle import EagleDrafter

        return EagleDrafter(self._eagle.head, self.target, name=self._eagle.name,
                            **_tree_kwargs(spec))

    def _assistant(self, drafter: str) -> nn.Module:
        """transformers' assistant model for an assisted engine (built once)."""
        if drafter not in self._assistants:
            if drafter == "draft":
                assert self.draft is not None
                self._assistants[drafter] = self.draft
            else:  # the quantized self-draft's weights, as a transformers model
                self._assistants[drafter] = quantized_copy(self.target.model, drafter)
        return self._assistants[drafter]

    def _run_exactspec(self, spec: EngineSpec, prompts, mode: Mode, max_new_tokens: int,
                       seed: int) -> Run:
        drafter = self._drafter(spec)
        _sync(self.device)
        t0 = time.perf_counter()
        gens = generate(self.target, prompts, drafter=drafter, params=mode.params(seed),
                        max_new_tokens=max_new_tokens, num_draft_tokens=spec.k or 0,
                        verify=spec.verify, batch_size=len(prompts))
        _sync(self.device)
        seconds = time.perf_counter() - t0
        run = Run(tokens=sum(len(g.token_ids) for g in gens), seconds=seconds,
                  texts=[g.token_ids for g in gens])
        for g in gens:
            st = g.stats
            run.steps += st.steps
            run.drafted += st.drafted
            run.accepted += st.accepted
            run.accepted_per_position = add_counts(run.accepted_per_position,
                                             st.accepted_per_position)
            run.drafted_per_position = add_counts(run.drafted_per_position, st.drafted_per_position)
        # the batch shares its steps: the longest-lived row saw every step of the batch
        st = max((g.stats for g in gens), key=lambda s: s.seconds)
        run.prefill_seconds, run.draft_seconds = st.prefill_seconds, st.draft_seconds
        run.target_seconds, run.verify_seconds = st.target_seconds, st.verify_seconds
        run.forwards = st.steps
        return run

    def _run_transformers(self, spec: EngineSpec, prompts, mode: Mode, max_new_tokens: int,
                          seed: int) -> Run:
        hf = self.target.model
        width = max(map(len, prompts))
        ids = torch.full((len(prompts), width), self._pad, dtype=torch.long)
        mask = torch.zeros((len(prompts), width), dtype=torch.long)
        for i, p in enumerate(prompts):  # left padding, as transformers expects
            ids[i, width - len(p):] = torch.tensor(p, dtype=torch.long)
            mask[i, width - len(p):] = 1
        kwargs = dict(max_new_tokens=max_new_tokens, pad_token_id=self._pad,
                      eos_token_id=self._hf_eos or None, **mode.hf_kwargs())
        if spec.drafter == "lookup":
            kwargs.update(prompt_lookup_num_tokens=int(spec.k), max_matching_ngram_size=3)
        elif spec.drafter in ("draft", "int8", "int4"):
            assistant = self._assistant(spec.drafter)
            gc = assistant.generation_config
            gc.num_assistant_tokens = int(spec.k)
            gc.num_assistant_tokens_schedule = "constant"
            gc.assistant_confidence_threshold = 0.0
            kwargs.update(assistant_model=assistant)
        elif spec.drafter != "none":
            raise ValueError(f"transformers has no {spec.drafter!r} engine")
        torch.manual_seed(seed)
        ids, mask = ids.to(self.device), mask.to(self.device)
        _sync(self.device)
        t0 = time.perf_counter()
        with torch.inference_mode():
            out = hf.generate(input_ids=ids, attention_mask=mask, **kwargs)
        _sync(self.device)
        seconds = time.perf_counter() - t0
        texts = []
        eos = set(self._hf_eos)
        for row in out[:, width:].tolist():
            toks = []
            for t in row:
                toks.append(t)
                if t in eos:
                    break
            texts.append(toks)
        return Run(tokens=sum(map(len, texts)), seconds=seconds, texts=texts)


def _tree_kwargs(spec: EngineSpec) -> dict:
    """DraftModel / EagleDrafter keyword arguments for the spec's tree (none for a chain)."""
    return {} if spec.tree is None else dict(tree=spec.tree, siblings=spec.siblings)


DRAFTER_WORD = {"prompt-lookup": "lookup", "suffix": "suffix"}  # as engine names say them


def _matches(spec: EngineSpec, word: str, example: str) -> tuple[int, int]:
    """(M, D) of a point-mass tree spelled '<word> tree MxD', tree (M, 1, ..., 1), M >= 2."""
    m, *rest = spec.tree if spec.tree.fixed else (0,)
    if m < 2 or any(b != 1 for b in rest):
        raise InvalidValue(f"{spec.name!r}: a {word} tree is M branches of depth D, tree "
                           f"(M, 1, ..., 1) with M >= 2, not {spec.tree}; spell it "
                           f"'{word} tree MxD', e.g. '{word} tree {example}'")
    return m, len(spec.tree)


def _chain_only(make: Callable[[EngineSpec], object]) -> Callable[[EngineSpec], object]:
    """A factory for a drafter that drafts chains only: a tree spec is refused by name."""
    def chain(spec: EngineSpec):
        if spec.tree is not None:
            raise InvalidValue(f"{spec.name!r}: the {spec.drafter!r} drafter drafts chains "
                               "only in the bench; drop the tree or use eagle, lookup, draft or "
                               "qdraft int8 torch")
        return make(spec)
    return chain


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
