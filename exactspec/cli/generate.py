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
    at_least,
    draft_tokens,
    refuse_without,
    value_or,
    warn_lossy,
)

DTYPES = ("float32", "bfloat16")  # what exactspec.load accepts as dtype
DRAFTER_FLAGS = ("a drafter (--draft, --cross-vocab-draft, --prompt-lookup, --eagle, "
                 "--quantized-draft or --gguf-draft)")
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
    p.add_argument("--dtype", choices=DTYPES, default="float32",
                   help="weights of the target (and --draft model); bfloat16 is fast only on "
                   "CPUs with native bf16 (avx512_bf16 / AMX)")
    drafters = p.add_mutually_exclusive_group()
    drafters.add_argument("--draft", metavar="MODEL", default=None,
                          help="draft model sharing the target's vocabulary")
    drafters.add_argument("--cross-vocab-draft", metavar="MODEL", default=None,
                          help="draft model with another tokenizer (es.CrossVocabDraft: tokens "
                          "matched by the text they stand for; still exact)")
    drafters.add_argument("--prompt-lookup", action="store_true",
                          help="draft by copying n-grams from the prompt and output")
    drafters.add_argument("--eagle", metavar="HEAD", nargs="?", const="smollm2-135m", default=None,
                          help="draft with an EAGLE-style head over the target's features: the "
                          "shipped name (default smollm2-135m) or a directory from train-draft")
    drafters.add_argument("--quantized-draft", metavar="BITS", type=int, choices=(8, 4, 16),
                          default=None, help="draft with the target itself, weight-only "
                          "quantized to 8 or 4 bits (or bf16: 16); needs no training")
    drafters.add_argument("--gguf-draft", metavar="GGUF", nargs="?", const="", default=None,
                          help="draft with llama.cpp running a GGUF of the target (default: "
                          "the embedded model's own file); needs llama-cpp-python")
    p.add_argument("--draft-backend", choices=("auto", "torch", "llama.cpp"), default=None,
                   help="how --quantized-draft runs: llama.cpp (fastest; `make llama-cpp`), "
                   "torch, or auto (llama.cpp when installed; default)")
    p.add_argument("--draft-layers", metavar="I,J,..", default=None,
                   help="--quantized-draft keeps only these target layers (e.g. 0-9,20-29; "
                   "torch backend)")
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
    p.add_argument("--tree", type=_tree, default=None, metavar="B1,B2,..|dynamic:N",
                   help="draft a token tree: branching B1 at depth 1, B2 at depth 2, ... (e.g. "
                   "--tree 3,2,1), or dynamic:BUDGET[:TOP_K[:DEPTH]] for a tree grown where "
                   "the draft is confident (EAGLE-2; e.g. --tree dynamic:16, default top-k 4, "
                   "depth 6); with --draft, --eagle, --quantized-draft (torch backend) or "
                   "--prompt-lookup (fixed only: B1 matches as branches, depth = the count)")
    p.add_argument("--siblings", choices=("without_replacement", "iid", "deterministic"),
                   default=None, help="how a tree's children are drafted: sampled without "
                   "replacement (default), i.i.d., or the draft's top-k (deterministic; "
                   "EAGLE-2's choice, best at temperature 0); needs --tree")
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
    has_drafter = bool(args.draft or args.cross_vocab_draft or args.prompt_lookup or args.eagle
                       or args.quantized_draft or args.gguf_draft is not None)
    refuse_without(args, {"num_draft_tokens": "--num-draft-tokens", "verify": "--verify",
                          "compare_plain": "--compare-plain"}, has_drafter,
                   DRAFTER_FLAGS + "; without one, decoding is plain")
    refuse_without(args, {"tree": "--tree"}, bool(args.draft or args.prompt_lookup or args.eagle
                                                  or args.quantized_draft),
                   "--draft, --eagle, --quantized-draft or --prompt-lookup")
    refuse_without(args, {"siblings": "--siblings"}, args.tree is not None, "--tree")
    if args.prompt_lookup and args.tree is not None and not isinstance(args.tree, tuple):
        raise UsageError("--prompt-lookup drafts fixed trees only (--tree B,1,1: B matches as "
                         "branches); a dynamic tree needs --draft, --eagle or --quantized-draft")
    if args.prompt_lookup and args.siblings is not None:
        raise UsageError("--siblings does not apply to --prompt-lookup: its branches are copied "
                         "matches (point masses)")
    if args.quantized_draft and args.tree is not None and args.draft_backend == "llama.cpp":
        raise UsageError("--draft-backend llama.cpp drafts chains only; --tree needs "
                         "--draft-backend torch (or auto, which picks torch for trees)")
    refuse_without(args, {"draft_backend": "--draft-backend", "draft_layers": "--draft-layers"},
                   bool(args.quantized_draft), "--quantized-draft")
    args.draft_layers = _layers(args.draft_layers)


def _tree(text: str):
    """'3,2,1' -> (3, 2, 1): branching per depth; 'dynamic:16[:4[:6]]' -> a DynamicTree."""
    if text.startswith("dynamic"):
        from exactspec.drafters.dynamic_tree import DynamicTree
        from exactspec.errors import InvalidValue

        try:
            return DynamicTree() if text == "dynamic" else DynamicTree.parse(text)
        except InvalidValue as e:
            raise argparse.ArgumentTypeError(str(e)) from None
    try:
        tree = tuple(int(part) for part in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: expected branching factors like 3,2,1 "
                                         "or dynamic:16") from None
    if not tree or min(tree) < 1:
        raise argparse.ArgumentTypeError(f"{text!r}: every branching factor must be >= 1")
    return tree


def _layers(text: str | None) -> list[int] | None:
    """'0-3,7' -> [0, 1, 2, 3, 7]; the library checks them against the target."""
    if text is None:
        return None
    out: list[int] = []
    try:
        for part in text.split(","):
            lo, _, hi = part.strip().partition("-")
            out += list(range(int(lo), int(hi) + 1)) if hi else [int(lo)]
    except ValueError:
        raise UsageError(f"--draft-layers {text!r}: expected layer indices like 0-9,20-29") \
            from None
    return out


def run(args: argparse.Namespace) -> int:
    check_combinations(args)
    import json

    from exactspec.drafters import (
        CrossVocabDraft,
        DraftModel,
        PromptLookup,
        QuantizedDraft,
        load_drafter,
    )
    from exactspec.drafters.gguf_draft import GgufDraft
    from exactspec.engine import generate, stream
    from exactspec.models import load
    from exactspec.sampling import SamplingParams

    params = SamplingParams(
        temperature=args.temperature, top_k=args.top_k, top_p=args.top_p, min_p=args.min_p,
        repetition_penalty=args.repetition_penalty, seed=args.seed,
    )
    if args.threads is not None:
        import torch

        torch.set_num_threads(args.threads)
    model = load(args.model, dtype=args.dtype)
    drafter, drafter_name = None, "plain"  # the name is read again after decoding (_named)
    trees = {"tree": args.tree, "siblings": args.siblings or "without_replacement"}
    tree_name = "" if args.tree is None else f", tree {args.tree}, siblings {trees['siblings']}"
    if args.draft:
        drafter = DraftModel(load(args.draft, dtype=args.dtype), **trees)
        drafter_name = f"draft {args.draft}{tree_name}"
    elif args.cross_vocab_draft:
        drafter = CrossVocabDraft(load(args.cross_vocab_draft, dtype=args.dtype))
        drafter_name = f"cross-vocabulary draft {args.cross_vocab_draft}"
    elif args.prompt_lookup:
        drafter, drafter_name = PromptLookup(), "prompt lookup"
        if args.tree:
            drafter = PromptLookup(branches=args.tree[0], depth=len(args.tree))
            drafter_name = f"prompt lookup, {args.tree[0]} branches"
    elif args.eagle:
        drafter = load_drafter(args.eagle, target=model, **trees)
        drafter_name = f"eagle {args.eagle}{tree_name}"
    elif args.quantized_draft:
        drafter = QuantizedDraft(args.quantized_draft, layers=args.draft_layers,
                                 backend=args.draft_backend or "auto", **trees)
        drafter_name = f"quantized draft {drafter.bits}-bit ({{backend}}){tree_name}"
    elif args.gguf_draft is not None:
        drafter = GgufDraft(args.gguf_draft or args.model)
        drafter_name = f"gguf draft {drafter!r}"
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
        out = {"model": model.name, "drafter": _named(drafter_name, drafter),
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
    label = (f"{model.name}, {_named(drafter_name, drafter)}, {verify} verification"
             if drafter is not None else f"{model.name}, plain decoding")
    print(f"[{label}] {s.generation.stats.summary()}")
    if args.compare_plain:
        plain = generate(model, [ids], **{**kwargs, "drafter": None})[0]
        fast, slow = s.generation.stats.tokens_per_second, plain.stats.tokens_per_second
        print(f"[{model.name}, plain decoding, same settings] {plain.stats.summary()}")
        print(f"speculative {fast:.1f} tok/s vs plain {slow:.1f} tok/s: "
              f"{_ratio(fast, slow) or float('nan'):.2f}x")
    return 0


def _named(name: str, drafter) -> str:
    """The drafter's label after decoding: a QuantizedDraft's backend is settled at `begin`
    (backend="auto" runs torch for a target llama.cpp cannot export), so it is read then."""
    return name.replace("{backend}", str(getattr(drafter, "backend", "")))


def _stats(stats, speculative: bool) -> dict:
    """GenerationStats as JSON; plain decoding has no acceptance rate (null, not 0.0)."""
    out = stats.as_dict()
    if not speculative:
        out["acceptance_rate"] = None
    return out


def _ratio(fast: float, slow: float) -> float | None:
    return fast / slow if slow else None
