"""`exactspec generate`: stream a lossless speculative continuation of one prompt.

Every flag works in every combination or the combination is refused (`check_combinations`):
the drafting flags need a drafter, and the rest reach the library unchanged, so the
library's own checks (e.g. greedy verification with a temperature > 0) apply as they are.
"""

from __future__ import annotations

import argparse
import sys

from exactspec.cli.common import (
    UsageError,
    add_dtype_flag,
    add_kv_cache_flag,
    at_least,
    draft_tokens,
    load_model,
    refuse_without,
    value_or,
    warn_lossy,
)
from exactspec.cli.drafter_flags import add_drafter_flags, drafter_from_args, drafter_spec
from exactspec.drafters.registry import drafter_flags

DRAFTER_FLAGS = f"a drafter ({drafter_flags()})"
K_DEFAULT = 4  # draft tokens per step when --num-draft-tokens is not given
VERIFY_DEFAULT = "token"  # verification method when --verify is not given


def add(sub) -> None:
    p = sub.add_parser(
        "generate", help="generate text, speculatively",
        description="Stream a continuation of PROMPT, lossless: speculative decoding emits text "
        "distributed exactly as the target model alone would. Example: exactspec generate "
        "'Write a haiku about tea' --prompt-lookup --temperature 0.7 --seed 1",
    )
    p.add_argument("prompt", help="the prompt text (chat-templated unless --no-chat)")
    p.add_argument("--model", default="smollm2-135m",
                   help="target: embedded name, transformers directory or .gguf file")
    add_dtype_flag(p)
    add_kv_cache_flag(p)
    add_drafter_flags(p)  # --draft MODEL | --prompt-lookup | ..., --tree, --siblings, ...
    p.add_argument("--temperature", type=float, default=1.0, help="0 = greedy (default 1.0)")
    p.add_argument("--top-k", type=int, default=0, help="0 = off")
    p.add_argument("--top-p", type=float, default=1.0, help="1.0 = off")
    p.add_argument("--min-p", type=float, default=0.0, help="0 = off")
    p.add_argument("--repetition-penalty", type=float, default=1.0, help="1.0 = off")
    p.add_argument("--seed", type=int, default=None, help="same seed, same text")
    p.add_argument("--max-new-tokens", type=at_least(1), default=128)
    p.add_argument("--num-draft-tokens", type=draft_tokens, default=None, metavar="N|auto",
                   help="draft tokens per step, or 'auto' to adapt per row from measured "
                   "speed (still lossless, but a seed's text then depends on timings; "
                   f"default {K_DEFAULT}); needs a drafter")
    p.add_argument("--verify", default=None, metavar="METHOD",
                   help=f"verification method: token, block, traversal (lossless), greedy (exact "
                   f"only with --temperature 0), or the opt-in lossy rules lenient:L / "
                   f"typical:EPS (a warning is printed; `exactspec audit --lossy` prices them); "
                   f"default {VERIFY_DEFAULT}; needs a drafter")
    p.add_argument("--stop", action="append", default=None, metavar="TEXT",
                   help="stop before this text (repeatable)")
    p.add_argument("--no-chat", action="store_true", help="do not apply the chat template")
    p.add_argument("--json", action="store_true",
                   help="print one JSON object (text, token ids, stats) instead of streaming")
    p.add_argument("--threads", type=at_least(1), default=None,
                   help="CPU threads for torch (default: torch's choice); 1 is often fastest "
                   "for small models on a busy machine")
    p.add_argument("--compare-plain", action="store_true",
                   help="afterwards, run plain decoding with the same settings and print both "
                   "speeds (the baseline every speedup is measured against); needs a drafter")
    p.set_defaults(run=run)


def check_combinations(args: argparse.Namespace) -> None:
    """Refuse flags that would be silently ignored in this combination (one line each)."""
    if not args.prompt.strip():
        raise UsageError("the prompt is empty")
    has_drafter = drafter_spec(args) is not None  # refuses ignored drafter flags
    refuse_without(args, {"num_draft_tokens": "--num-draft-tokens", "verify": "--verify",
                          "compare_plain": "--compare-plain"}, has_drafter,
                   DRAFTER_FLAGS + "; without one, decoding is plain")



def _params_and_model(args: argparse.Namespace):
    """The sampling parameters (checked before the model loads) and the model, torch and
    transformers imported with the collector paused (exactspec/_collector.py)."""
    from exactspec._collector import collector_paused

    with collector_paused():
        from exactspec.sampling import SamplingParams

        params = SamplingParams(
            temperature=args.temperature, top_k=args.top_k, top_p=args.top_p, min_p=args.min_p,
            repetition_penalty=args.repetition_penalty, seed=args.seed,
        )
        if args.threads is not None:
            import torch

            torch.set_num_threads(args.threads)
        return params, load_model(args.model, dtype=args.dtype, kv_cache=args.kv_cache)


def run(args: argparse.Namespace) -> int:
    check_combinations(args)
    import json

    params, model = _params_and_model(args)
    from exactspec.engine import generate, stream  # imported by the load, paused

    drafter, spec = drafter_from_args(args, model)  # spec.label(drafter) names it
    verify = value_or(args, "verify", VERIFY_DEFAULT)
    ids = model.encode(args.prompt, chat=not args.no_chat)
    if len(ids) >= model.max_context:
        raise UsageError(f"the prompt has {len(ids)} tokens; {model.name} takes at most "
                         f"{model.max_context - 1}")
    kwargs = dict(drafter=drafter, params=params, max_new_tokens=args.max_new_tokens,
                  num_draft_tokens=value_or(args, "num_draft_tokens", K_DEFAULT),
                  verify=verify, stop=args.stop)
    from exactspec.sampling import is_lossless

    if drafter is not None and not is_lossless(verify):  # before any decoding: one line
        warn_lossy(verify)
    if args.compare_plain:  # warm both paths up first, so neither timing pays first-call costs
        for d in (drafter, None):
            generate(model, [ids], **{**kwargs, "drafter": d, "max_new_tokens": 4})
    if args.json:
        g = generate(model, [ids], **kwargs)[0]
        out = {"model": model.name, "drafter": _named(spec, drafter),
               "verify": verify if drafter is not None else None, "lossless": g.lossless,
               "text": g.text,
               "token_ids": g.token_ids, "finish_reason": g.finish_reason,
               "stats": _stats(g.stats, drafter is not None)}
        if args.compare_plain:
            plain = generate(model, [ids], **{**kwargs, "drafter": None})[0]
            out["plain_stats"] = _stats(plain.stats, False)
            out["speedup"] = _ratio(g.stats.tokens_per_second, plain.stats.tokens_per_second)
        print(json.dumps(out))
        return 0
    s = stream(model, ids, **kwargs)
    for piece in s:
        sys.stdout.write(piece)
        sys.stdout.flush()
    assert s.generation is not None
    print()
    label = (f"{model.name}, {_named(spec, drafter)}, {verify} verification"
             if drafter is not None else f"{model.name}, plain decoding")
    print(f"[{label}] {s.generation.stats.summary()}")
    if args.compare_plain:
        plain = generate(model, [ids], **{**kwargs, "drafter": None})[0]
        fast, slow = s.generation.stats.tokens_per_second, plain.stats.tokens_per_second
        print(f"[{model.name}, plain decoding, same settings] {plain.stats.summary()}")
        print(f"speculative {fast:.1f} tok/s vs plain {slow:.1f} tok/s: "
              f"{_ratio(fast, slow) or float('nan'):.2f}x")
    return 0


def _named(spec, drafter) -> str:
    """The drafter's label after decoding: a QuantizedDraft's backend is settled at `begin`
    (backend="auto" runs torch for a target llama.cpp cannot export), so it is read then."""
    return "plain" if spec is None else spec.label(drafter)


def _stats(stats, speculative: bool) -> dict:
    """GenerationStats as JSON; plain decoding has no acceptance rate (null, not 0.0)."""
    out = stats.as_dict()
    if not speculative:
        out["acceptance_rate"] = None
    return out


def _ratio(fast: float, slow: float) -> float | None:
    return fast / slow if slow else None
