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
from exactspec.bench.engine_names import BenchUse, bench_uses
from exactspec.bench.figures import linear_weight_bytes
from exactspec.bench.hf_quantized import quantized_copy
from exactspec.bench.isolated import Isolated
from exactspec.bench.specs import MODES, EngineSpec, Mode, Run, add_counts
from exactspec.drafters.registry import DRAFTERS, DrafterSpec, build
from exactspec.engine import generate
from exactspec.errors import InvalidValue
from exactspec.models.lean import lean_forward_for
from exactspec.models.loading import Model

__all__ = ["MODES", "TRANSFORMERS", "EngineSpec", "Engines", "Mode", "Run", "add_counts",
           "default_engines", "truncated_draft"]

# transformers' engine compared with a bench word's engines ("{k}": their K), and its
# assistant ("draft": the bench's draft model; "int8" / "int4": a quantized copy of the
# target); a word's " torch" variant shares it; a word without one has no counterpart
TRANSFORMERS: dict[str, tuple[str, str | None]] = {
    "lookup": ("transformers lookup K={k}", None),
    "draft": ("transformers assisted K={k}", "draft"),
    "qdraft int8": ("transformers assisted int8 K={k}", "int8"),
    "qdraft int4": ("transformers assisted int4 K={k}", "int4"),
}


def default_engines(k: int = 4, eagle: bool = False, block: bool = True,
                    qk: int = 6) -> list[EngineSpec]:
    """exactspec plain and transformers plain; for every drafter of the registry with a bench
    word (bench/engine_names.py's BenchUse) its default engines (fixed K, block, auto; K = qk
    for the quantized self-draft) and its transformers counterpart if it has one; then
    llama.cpp's plain decoding of the target's weights as F32, Q8_0 and Q4_1 GGUF. `eagle`:
    include the EAGLE head's engines (the head ships separately)."""
    e = [
        EngineSpec("exactspec plain", "exactspec", "none", counterpart="transformers plain"),
        EngineSpec("transformers plain", "transformers", "none"),
    ]
    for word, (name, use) in bench_uses().items():
        if name == "eagle" and not eagle:
            continue
        kk = qk if use.k == "qk" else k
        hf = TRANSFORMERS.get(word.removesuffix(" torch"), (None, None))[0]
        hf = hf.format(k=kk) if hf else None
        made = {"K": EngineSpec(f"exactspec {word} K={kk}", "exactspec", word, kk,
                                counterpart=hf),
                "K block": EngineSpec(f"exactspec {word} K={kk} block", "exactspec", word, kk,
                                      "block", counterpart=hf, sampling_only=True),
                "auto": EngineSpec(f"exactspec {word} auto", "exactspec", word, "auto",
                                   counterpart=hf)}
        e += [made[kind] for kind in use.engines]
        if word in TRANSFORMERS:
            e.append(EngineSpec(hf, "transformers", word, kk))
    e += llama_cpp.llama_cpp_engines()
    return e if block else [s for s in e if s.verify != "block"]


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
    """Runs EngineSpecs on one target; builds each engine's drafter through the drafter
    registry from its bench word (bench/engine_names.py's BenchUse)."""

    def __init__(self, target: Model, draft: nn.Module | None = None,
                 eagle_factory: Callable[[], object] | None = None,
                 sources: dict[str, object] | None = None) -> None:
        self.target = target  # exactspec Model; its .model is shared with transformers
        # the bench's source per registry drafter that takes one (a loaded model, a head's
        # name); `draft`: the draft model (shares the vocabulary), or None
        self.sources = dict(sources or {})
        if draft is not None:
            self.sources["draft"] = draft
        self._eagle_factory = eagle_factory  # loads the EAGLE head (once), or None
        self._eagle = None
        dev = target.device
        self._hf_eos = target.eos_token_ids
        self._pad = self._hf_eos[0] if self._hf_eos else 0
        self.device = dev
        self._assistants: dict[str, nn.Module] = {}  # transformers assistant per drafter
        self._llama: dict[str, Isolated] = {}  # llama.cpp engine per GGUF type (a child each)
        self._llama_bytes: dict[str, int] = {}  # weight bytes its one-token step reads
        self._reused: dict[str, object] = {}  # engine name -> its drafter (BenchUse.reuse)

    @property
    def draft(self):
        """The bench's draft model (the `draft` drafter's source), or None."""
        return self.sources.get("draft")

    def available(self, spec: EngineSpec) -> bool:
        if spec.family == "llama.cpp":
            return llama_cpp.supports(self.target.model)
        if spec.drafter == "none":
            return True
        name, use = _use(spec)
        entry = DRAFTERS[name]
        if name == "eagle" and self._eagle_factory is not None:
            return True
        if entry.supports is not None and not entry.supports(self.target.model):
            return False
        return not (use.source is None and entry.takes_source and name not in self.sources)

    def why_not(self, spec: EngineSpec) -> str | None:
        """Why a llama.cpp engine cannot run for this target here (None: it can, or it is not
        llama.cpp's)."""
        return llama_cpp.why_not(self.target.model) if spec.family == "llama.cpp" else None

    def run(self, spec: EngineSpec, prompts: list[list[int]], mode: Mode, max_new_tokens: int,
            seed: int) -> Run:
        if spec.family == "exactspec":
            return self._run_exactspec(spec, prompts, mode, max_new_tokens, seed)
        if spec.family == "llama.cpp":
            return self.llama(spec).call("run", prompts, mode, max_new_tokens, seed)
        return self._run_transformers(spec, prompts, mode, max_new_tokens, seed)

    def llama(self, spec: EngineSpec) -> Isolated:
        """The llama.cpp engine of a spec, in a child process of its own (bench/isolated.py:
        a native crash loses its rows only); its GGUF exported here once."""
        if spec.weights not in self._llama:
            path = llama_cpp.gguf_for(self.target.model, spec.weights)
            self._llama[spec.weights] = Isolated(
                spec.name, llama_cpp.LlamaCppPlain, path, spec.weights, self._hf_eos,
                threads=torch.get_num_threads())
            self._llama_bytes[spec.weights] = llama_cpp.gguf_weight_bytes(path)
        return self._llama[spec.weights]

    def weight_bytes(self, spec: EngineSpec) -> int:
        """Weight bytes one target step of the engine reads: the lean forward's matrices for
        exactspec (when it runs the target, else transformers'), every nn.Linear weight for
        transformers, the GGUF's matrices for llama.cpp (bench/llama_cpp.py)."""
        if spec.family == "llama.cpp":
            self.llama(spec)
            return self._llama_bytes[spec.weights]
        lean = lean_forward_for(self.target.model) if spec.family == "exactspec" else None
        return lean.weight_bytes if lean is not None else linear_weight_bytes(self.target.model)

    def _drafter(self, spec: EngineSpec):
        """The engine's drafter: the registry's, built from the spec's bench word and tree
        (a fresh one per run, or one kept across runs where its BenchUse says reuse)."""
        if spec.drafter == "none":
            return None
        name, use = _use(spec)
        if name == "eagle" and self._eagle_factory is not None:
            return self._eagle_drafter(spec)
        if use.reuse and spec.name in self._reused:
            return self._reused[spec.name]
        trees = DRAFTERS[name].trees
        if spec.tree is not None and trees == "none":
            raise InvalidValue(f"{spec.name!r}: the {spec.drafter!r} drafter drafts chains "
                               "only; drop the tree or use one of " + ", ".join(
                                   w for w, (n, _) in bench_uses().items()
                                   if DRAFTERS[n].trees != "none"))
        if spec.tree is not None and trees == "fixed":
            _matches(spec, spec.drafter, "3x4")
        source = use.source if use.source is not None else self.sources.get(name)
        drafter = build(DrafterSpec(name, source, tree=spec.tree,
                                    siblings=spec.siblings if spec.tree is not None else None,
                                    backend=use.backend, vocab=use.vocab), self.target)
        if use.reuse:
            self._reused[spec.name] = drafter
        return drafter

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

    def _assistant(self, kind: str) -> nn.Module:
        """transformers' assistant model of an assisted engine (TRANSFORMERS; built once)."""
        if kind not in self._assistants:
            if kind == "draft":
                draft = self.draft
                assert draft is not None
                self._assistants[kind] = draft.model if isinstance(draft, Model) else draft
            else:  # the quantized self-draft's weights, as a transformers model
                self._assistants[kind] = quantized_copy(self.target.model, kind)
        return self._assistants[kind]

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
        assisted = TRANSFORMERS.get(spec.drafter, (None, None))[1]
        if spec.drafter == "lookup":
            kwargs.update(prompt_lookup_num_tokens=int(spec.k), max_matching_ngram_size=3)
        elif assisted is not None:
            assistant = self._assistant(assisted)
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


def _use(spec: EngineSpec) -> tuple[str, BenchUse]:
    """(registry name, BenchUse) of the spec's bench word; unknown words refused by name."""
    uses = bench_uses()
    if spec.drafter not in uses:
        raise InvalidValue(f"{spec.name!r}: unknown drafter {spec.drafter!r}; the bench's are "
                           f"{', '.join(uses)} (bench/engine_names.py's BenchUse words)")
    return uses[spec.drafter]


def _matches(spec: EngineSpec, word: str, example: str) -> tuple[int, int]:
    """(M, D) of a point-mass tree spelled '<word> tree MxD', tree (M, 1, ..., 1), M >= 2."""
    m, *rest = spec.tree if spec.tree.fixed else (0,)
    if m < 2 or any(b != 1 for b in rest):
        raise InvalidValue(f"{spec.name!r}: a {word} tree is M branches of depth D, tree "
                           f"(M, 1, ..., 1) with M >= 2, not {spec.tree}; spell it "
                           f"'{word} tree MxD', e.g. '{word} tree {example}'")
    return m, len(spec.tree)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
