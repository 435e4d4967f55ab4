"""Validation of `generate` / `stream` arguments: every caller mistake is named, with its fix.

Wrong types raise `InvalidType`, wrong values and combinations that would silently change the
output law raise `InvalidValue` (subclasses of TypeError / ValueError). Nothing here runs a
model; the checks run before any prefill.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

from exactspec.drafters.base import Drafter, TreeDrafter
from exactspec.engine.verifier import Method, UserRule
from exactspec.errors import InvalidType, InvalidValue
from exactspec.sampling import LOSSY_RULES, SamplingParams, VerifyMethod, parse_method
from exactspec.sampling.grammar import Grammar
from exactspec.sampling.logprobs import LOGPROBS_MODES
from exactspec.sampling.methods import CHOICES, LossyRule

log = logging.getLogger(__name__)


def check_int(name: str, value, low: int, hint: str = "") -> int:
    """`value` as an int >= low, or an error naming `name`, the value and what is expected."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise InvalidType(f"{name}={value!r} must be an int >= {low}{hint}, "
                          f"got {type(value).__name__}")
    if value < low:
        raise InvalidValue(f"{name}={value!r} must be an int >= {low}{hint}")
    return value


def row_params(params, num_rows: int) -> tuple[list[SamplingParams], bool]:
    """One SamplingParams per row, and whether the caller gave them per row (a list)."""
    if params is None:
        return [SamplingParams()] * num_rows, False
    if isinstance(params, SamplingParams):
        return [params] * num_rows, False
    if isinstance(params, Sequence) and not isinstance(params, str | bytes):
        bad = [i for i, p in enumerate(params) if not isinstance(p, SamplingParams)]
        if bad:
            got = type(params[bad[0]]).__name__
            raise InvalidType(f"params[{bad[0]}] is a {got}; params must be an "
                              "exactspec.SamplingParams or a list of them, one per prompt")
        if len(params) != num_rows:
            raise InvalidValue(f"params has {len(params)} SamplingParams for {num_rows} prompts; "
                               "pass one SamplingParams (shared) or exactly one per prompt")
        return list(params), True
    raise InvalidType(f"params must be an exactspec.SamplingParams or a list of them (one per "
                      f"prompt), got {type(params).__name__}")


def row_grammars(grammar, num_rows: int) -> list[Grammar | None]:
    """One Grammar (or None) per row: one shared, or a list with one per prompt."""
    if grammar is None or isinstance(grammar, Grammar):
        return [grammar] * num_rows
    if isinstance(grammar, Sequence) and not isinstance(grammar, str | bytes):
        bad = [i for i, g in enumerate(grammar) if g is not None and not isinstance(g, Grammar)]
        if bad:
            raise InvalidType(f"grammar[{bad[0]}] is a {type(grammar[bad[0]]).__name__}; "
                              "grammar must be an exactspec.Grammar (Grammar.json_schema(...), "
                              "Grammar.regex(...), ...), None, or a list of them, one per prompt")
        if len(grammar) != num_rows:
            raise InvalidValue(f"grammar has {len(grammar)} entries for {num_rows} prompts; "
                               "pass one Grammar (shared) or exactly one per prompt")
        return list(grammar)
    raise InvalidType(f"grammar must be an exactspec.Grammar (Grammar.json_schema(...), "
                      f"Grammar.regex(...), ...), a list of them or None, got "
                      f"{type(grammar).__name__}")


def check_drafter(drafter) -> Drafter | None:
    if drafter is None:
        return drafter
    if isinstance(drafter, Drafter):
        if (getattr(drafter, "tree", None) is not None and hasattr(drafter, "propose_tree")
                and not isinstance(drafter, TreeDrafter)):
            raise InvalidType(f"{type(drafter).__name__} proposes trees (tree={drafter.tree!r}) "
                              "but declares no `siblings`; set siblings = 'deterministic' "
                              "(point masses), 'iid' or 'without_replacement' "
                              "(exactspec.drafters.base.TreeDrafter)")
        return drafter
    missing = [m for m in ("begin", "propose", "select", "hidden_layers")
               if not hasattr(drafter, m)]
    hint = (f" ({type(drafter).__name__} lacks {', '.join(missing)}; `hidden_layers = None` "
            "declares a drafter that needs no target features)") if missing else ""
    raise InvalidType(f"drafter must be a Drafter (DraftModel, PromptLookup, ...) or None, got "
                      f"{type(drafter).__name__}{hint}")


def check_layers(drafter: Drafter | None) -> tuple[int, ...] | None:
    """The drafter's declared `hidden_layers`, validated: None or a tuple of ints."""
    if drafter is None or drafter.hidden_layers is None:
        return None
    layers = drafter.hidden_layers
    if (not isinstance(layers, tuple | list) or not layers
            or any(isinstance(i, bool) or not isinstance(i, int) for i in layers)):
        raise InvalidType(f"drafter.hidden_layers={layers!r} must be None (no target features) "
                          "or a non-empty tuple of ints (indices into transformers' "
                          "hidden_states)")
    return tuple(layers)


def parse_verify(verify) -> Method:
    """The verify argument as the rule object the engine uses, parsed once: a method name or a
    `VerifyMethod` (sampling/methods.py), or a user's callable with `exactspec.verify`'s
    signature as a `UserRule`. Raises InvalidValue naming the choices for an unknown name."""
    if isinstance(verify, VerifyMethod | UserRule):
        return verify
    if callable(verify):
        return UserRule(verify)
    if isinstance(verify, str) and not _known(verify):
        raise InvalidValue(f"unknown verify method: verify={verify!r}; choose one of "
                           f"{', '.join(CHOICES)}, or a callable with exactspec.verify's "
                           "signature")
    return parse_method(verify)


def _known(name: str) -> bool:
    """Whether `name` names a method (its value, for "rule:value", not yet checked)."""
    rule, sep, _ = name.partition(":")
    return name in CHOICES or (bool(sep) and rule in LOSSY_RULES)


def check_verify(verify, params: list[SamplingParams]) -> Method:
    """The verify method, parsed once (`parse_verify`); refuses a method that is not exact
    for some row's parameters and warns about a lossy one."""
    method = parse_verify(verify)
    if isinstance(method, LossyRule):
        log.warning("verify=%r is a LOSSY rule: the output is not distributed as the target's "
                    "(see `exactspec audit --lossy` for its drift)", method.name)
    if method.greedy_only:
        hot = next((p for p in params if not p.is_greedy), None)
        if hot is not None:
            raise InvalidValue(
                f"verify={method.name!r} with temperature={hot.temperature}: greedy "
                "verification emits the target's argmax, which is the target's law only for "
                "greedy decoding; use temperature=0, or verify='token' / 'block' to sample at "
                "this temperature")
    return method


def check_stop(stop, tokenizer) -> list[str]:
    if stop is None:
        return []
    stops = [stop] if isinstance(stop, str) else stop
    if not isinstance(stops, Sequence) or isinstance(stops, bytes):
        raise InvalidType(f"stop={stop!r} must be a string or a list of strings, got "
                          f"{type(stop).__name__}")
    for s in stops:
        if not isinstance(s, str):
            raise InvalidType(f"stop={stop!r} must hold strings, got a {type(s).__name__}")
        if not s:
            raise InvalidValue(f"stop={stop!r} holds an empty string; every stop string needs "
                               "at least one character")
    if stops and tokenizer is None:
        raise InvalidValue(f"stop={stop!r} needs a tokenizer to find text; pass an exactspec "
                           "Model (or es.as_model(model, tokenizer))")
    return list(stops)


def check_bool(name: str, value) -> bool:
    if not isinstance(value, bool):
        raise InvalidType(f"{name}={value!r} must be True or False")
    return value


def check_logprobs_mode(value) -> str:
    if value not in LOGPROBS_MODES:
        raise InvalidValue(f"logprobs_mode={value!r} must be one of {list(LOGPROBS_MODES)}: "
                           "'processed' reports the sampling law (after temperature, top-k/p, "
                           "penalties), 'raw' the model's own log_softmax of its logits")
    return value


def check_num_draft_tokens(value) -> int | str:
    if isinstance(value, str):
        if value != "auto":
            raise InvalidValue(f"num_draft_tokens={value!r} must be an int >= 0 or \"auto\"")
        return value
    return check_int("num_draft_tokens", value, 0, hint=' or "auto"')


def check_logit_bias(params: list[SamplingParams], vocab: int) -> None:
    for i, p in enumerate(params):
        if p.logit_bias and max(p.logit_bias) >= vocab:
            where = "" if len(set(params)) == 1 else f" (params[{i}])"
            raise InvalidValue(f"logit_bias names token id {max(p.logit_bias)}{where}, outside "
                               f"the target's vocabulary of {vocab} tokens")


def encode_prompts(model, prompts) -> list[list[int]]:
    """Prompts as token-id lists, validated: non-empty, ids inside the vocabulary."""
    if isinstance(prompts, str):
        prompts = [prompts]
    if not isinstance(prompts, Sequence) or isinstance(prompts, bytes):
        raise InvalidType(f"prompts must be a string, a list of strings or a list of token-id "
                        f"lists, got {type(prompts).__name__}")
    if len(prompts) == 0:
        raise InvalidValue("prompts is empty; pass at least one prompt")
    vocab = model.vocab_size
    if all(isinstance(p, str) for p in prompts):
        if model.tokenizer is None:
            raise InvalidValue("text prompts need a tokenizer; pass token ids or an exactspec Model")
        cache: dict[str, list[int]] = {}
        out = []
        for i, p in enumerate(prompts):
            if not p:
                raise InvalidValue(f"prompt {i} is empty")
            if p not in cache:
                cache[p] = model.encode(p)
            out.append(cache[p])
    elif all(isinstance(p, Sequence) and not isinstance(p, str) for p in prompts):
        out = []
        for i, p in enumerate(prompts):
            ids = list(p)
            if not ids:
                raise InvalidValue(f"prompt {i} is empty")
            if any(isinstance(t, bool) or not isinstance(t, int) for t in ids):
                raise InvalidType(f"prompt {i} must hold int token ids, got {next(type(t).__name__ for t in ids if isinstance(t, bool) or not isinstance(t, int))}")
            if min(ids) < 0 or max(ids) >= vocab:
                raise InvalidValue(f"prompt {i} has token id {min(ids) if min(ids) < 0 else max(ids)}, outside the "
                                   f"target's vocabulary [0, {vocab})")
            out.append(ids)
    else:
        raise InvalidType("prompts must be a string, a list of strings or a list of token-id lists "
                        "(one list per prompt: [[1, 2, 3]], not [1, 2, 3])")
    for i, p in enumerate(out):
        if not p:
            raise InvalidValue(f"prompt {i} encodes to no tokens")
    return out
