"""What a worker does: build the engine once, encode rows, generate tasks into output records.

The same `Worker` runs in the local process and inside each Ray actor, so a local run and a
Ray run compute every sample the same way. A task is one sample: (row, index), its prompt
tokens, its SamplingParams with the seed derived from (seed, id, index), its token budget.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from exactspec.batch.rows import InputRow
from exactspec.drafters.registry import DrafterSpec, build
from exactspec.drafters.tree_shape import parse_tree
from exactspec.engine.engine import Engine
from exactspec.errors import InvalidValue
from exactspec.models.loading import Model
from exactspec.sampling import SamplingParams

# Statistics written with each sample: the ones a rerun reproduces exactly (no timings).
STATS_KEYS = ("steps", "drafted", "accepted", "emitted", "acceptance_rate",
              "mean_acceptance_length")


# A job's drafter kind -> the registry's name (exactspec.drafters.registry): kinds travel to
# Ray workers as (kind, argument[, options]) and are built there, through the one table.
KINDS = {"quantized": "quantized-draft", "prompt-lookup": "prompt-lookup", "draft": "draft",
         "cross-vocab": "cross-vocab-draft", "eagle": "eagle", "gguf": "gguf-draft"}
# DrafterSpec fields a job may carry, recorded where they differ from their default
OPTIONS = {"tree": None, "siblings": None, "backend": None, "layers": None, "vocab": None,
           "dtype": "float32"}


def drafter_spec(kind: str, arg: str, options: tuple = ()) -> DrafterSpec:
    """The registry's spec of a job's (kind, argument, options); options are (name, value)
    pairs of OPTIONS, JSON-ready (a tree as its text, layers as a list)."""
    if kind not in KINDS:
        raise InvalidValue(f"drafter kind {kind!r} is not one of {sorted(KINDS)}")
    opts = dict(options)
    if opts.get("tree") is not None:
        opts["tree"] = parse_tree(opts["tree"])
    if opts.get("layers") is not None:
        opts["layers"] = tuple(opts["layers"])
    source = int(arg) if kind == "quantized" else arg or None
    return DrafterSpec(KINDS[kind], source, **opts)


def job_drafter(spec: DrafterSpec | None) -> tuple | None:
    """A spec as the job records it: (kind, argument), plus the options when it has any."""
    if spec is None:
        return None
    kind = next(k for k, name in KINDS.items() if name == spec.name)
    opts = tuple((n, _json(n, getattr(spec, n))) for n, default in OPTIONS.items()
                 if getattr(spec, n) != default)
    arg = "" if spec.source is None else str(spec.source)
    return (kind, arg, opts) if opts else (kind, arg)


def _json(name: str, value):
    """An option as JSON holds it: a tree as its text, layers as a list."""
    return value.text() if name == "tree" else list(value) if name == "layers" else value


# Drafter kinds a job can name: kind -> factory(target, argument), the registry's constructors.
DRAFTERS: dict[str, Callable[[Model, str], object]] = {
    kind: (lambda target, arg, kind=kind: build(drafter_spec(kind, arg), target)) for kind in KINDS
}


@dataclass(frozen=True)
class EngineSpec:
    """How a worker builds its engine: plain data, so it can be sent to a Ray actor."""

    model: str  # embedded name, transformers directory or .gguf file (es.load)
    dtype: str = "float32"  # es.load's dtype: the target's weights
    kv_cache: str = "float32"  # es.load's kv_cache: the target's KV cache
    # (kind in DRAFTERS, argument) or (kind, argument, options: job_drafter); None = plain
    drafter: tuple | None = None
    num_draft_tokens: int | str = 4  # K, or "auto" (then a seed's text depends on timings)
    verify: str = "token"  # verification method
    stop: tuple[str, ...] = ()  # strings that end a sample
    batch_size: int = 64  # rows per forward pass
    threads: int | None = None  # torch threads in this worker (None: torch's choice)
    chat: bool = True  # encode "prompt" rows as one user turn of the chat template
    batch_invariant: bool = False  # run under es.batch_invariant() (Engine(batch_invariant=))

    def build(self, model: Model | None = None) -> Engine:
        """The engine: loads the model (unless given) and builds the drafter from it."""
        if self.threads is not None:
            import torch

            torch.set_num_threads(self.threads)
        if model is None:
            from exactspec.models import load

            model = load(self.model, dtype=self.dtype, kv_cache=self.kv_cache)
        drafter = None if self.drafter is None else build(drafter_spec(*self.drafter), model)
        return Engine(model, drafter, num_draft_tokens=self.num_draft_tokens,
                      verify=self.verify, stop=list(self.stop) or None,
                      batch_size=self.batch_size, batch_invariant=self.batch_invariant)


@dataclass(frozen=True)
class Task:
    """One sample to generate."""

    id: str | int  # the row's id
    index: int  # which of the row's n samples (0..n-1)
    prompt: tuple[int, ...]  # the prompt's token ids
    params: SamplingParams  # with the sample's own seed
    max_new_tokens: int  # token budget
    logprobs: bool = field(default=False)  # write log p of each token


class Worker:
    """One engine and the two things a job asks of it: encode rows, run tasks."""

    def __init__(self, spec: EngineSpec, engine: Engine | None = None) -> None:
        self.spec = spec
        self.engine = engine if engine is not None else spec.build()  # loaded once

    def encode(self, rows: list[InputRow], max_new_tokens: int) -> list[list[int] | str]:
        """Each row's prompt tokens, or the reason it cannot be run (e.g. too long for its
        token budget: the row's max_new_tokens, else the job's)."""
        model = self.engine.model
        out: list[list[int] | str] = []
        for row in rows:
            try:
                ids = self._encode(model, row)
            except (ValueError, TypeError) as exc:
                out.append(str(exc))
                continue
            budget = row.overrides.get("max_new_tokens", max_new_tokens)
            if not ids:
                out.append("the prompt encodes to no tokens")
            elif len(ids) + budget > model.max_context:
                out.append(f"the prompt has {len(ids)} tokens; with max_new_tokens={budget} "
                           f"that exceeds {model.name}'s context of {model.max_context}")
            else:
                out.append(ids)
        return out

    def _encode(self, model: Model, row: InputRow) -> list[int]:
        if row.messages is None:
            assert row.prompt is not None
            return model.encode(row.prompt, chat=self.spec.chat)
        if not model.has_chat_template:
            raise InvalidValue(f'"messages" needs a chat template, and {model.name} has none; '
                               'give a "prompt" instead')
        tok = model.tokenizer
        text = tok.apply_chat_template(row.messages, tokenize=False, add_generation_prompt=True)
        return list(tok(text, add_special_tokens=False)["input_ids"])

    def run(self, tasks: list[Task]) -> list[dict]:
        """Generate every task; one output record per task (grouped by token budget)."""
        records: list[dict] = []
        by_budget: dict[tuple[int, bool], list[Task]] = {}
        for t in tasks:
            by_budget.setdefault((t.max_new_tokens, t.logprobs), []).append(t)
        for (budget, logprobs), group in by_budget.items():
            gens = self.engine.generate_rows([list(t.prompt) for t in group],
                                             [t.params for t in group], max_new_tokens=budget,
                                             return_logprobs=logprobs)
            for t, g in zip(group, gens, strict=True):
                stats = g.stats.as_dict()
                records.append({
                    "id": t.id, "index": t.index, "text": g.text, "token_ids": g.token_ids,
                    "logprobs": g.logprobs, "finish_reason": g.finish_reason,
                    "stats": {k: stats[k] for k in STATS_KEYS},
                })
        return records
