"""The `exactspec` command line: parses arguments, calls the library, prints. Nothing else.

Each subcommand is a `_add_<name>` parser builder plus a `_cmd_<name>` runner. User mistakes
exit with code 2 and one line on stderr, never a traceback.
"""

from __future__ import annotations

import argparse
import logging
import sys

from exactspec.audit import (
    CAT_DOG_FISH,
    AuditConfig,
    explain,
    format_explanation,
    format_table,
    money_diagram,
    run_audit,
)


class UsageError(Exception):
    """A mistake in the command line; printed as one line, exit code 2."""


def _floats(text: str) -> list[float]:
    try:
        return [float(x) for x in text.split(",") if x.strip()]
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"expected comma-separated numbers, got {text!r}") from exc


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="exactspec",
        description="Lossless speculative decoding: faster generation, the same distribution.",
    )
    parser.add_argument("-v", "--verbose", action="store_true", help="log diagnostics")
    sub = parser.add_subparsers(dest="command", required=True)
    for add in (_add_explain, _add_audit, _add_generate, _add_train_draft, _add_bench):
        add(sub)
    return parser


# --- explain -------------------------------------------------------------------------------

def _add_explain(sub) -> None:
    p = sub.add_parser(
        "explain", help="walk through one accept/reject step for any p and q",
        description="The seeds' walk-through of one speculative step: a(x) = min(1, p/q), "
        "min(p, q), (p - q)+, P(accept), Z = P(reject), p'(x) and P(output = x) = p(x), "
        "computed by the library's own acceptance law. Example: "
        "exactspec explain --p 0.6,0.3,0.1 --q 0.4,0.5,0.1 --labels cat,dog,fish")
    p.add_argument("--p", type=_floats, default=None, help="target distribution, e.g. 0.6,0.3,0.1")
    p.add_argument("--q", type=_floats, default=None, help="draft distribution, e.g. 0.4,0.5,0.1")
    p.add_argument("--labels", default=None, help="comma-separated token names")
    p.add_argument("--png", default="explain.png",
                   help="where to write the money diagram ('' to skip)")
    p.set_defaults(run=_cmd_explain)


def _cmd_explain(args) -> int:
    if (args.p is None) != (args.q is None):
        raise UsageError("give both --p and --q, or neither for the cat/dog/fish example")
    p, q, labels = (args.p, args.q, None) if args.p is not None else CAT_DOG_FISH
    if args.labels is not None:
        labels = [x.strip() for x in args.labels.split(",")]
    ex = explain(p, q, labels)
    print(format_explanation(ex))
    if args.png:
        money_diagram(ex, args.png)
        print(f"wrote the money diagram to {args.png}")
    return 0


# --- audit ---------------------------------------------------------------------------------

def _add_audit(sub) -> None:
    p = sub.add_parser(
        "audit", help="exact and statistical audit of every verifier and pitfall",
        description="Runs token, block and greedy verification on random, point-mass, "
        "zero-holding, disjoint and parameter-folded p/q, and every seed pitfall: exact TV "
        "distance of the first generated tokens from the target, and a chi-square test on "
        "batched samples. Exits 1 if a lossless method fails or a pitfall is missed.")
    p.add_argument("--seed", type=int, default=0, help="seed for the statistical samples")
    p.add_argument("--samples", type=int, default=AuditConfig.samples,
                   help="sequences drawn per case (default %(default)s)")
    p.set_defaults(run=_cmd_audit)


def _cmd_audit(args) -> int:
    if args.samples < 100:
        raise UsageError(f"--samples {args.samples} is too small; use at least 100")
    cfg = AuditConfig(seed=args.seed, samples=args.samples,
                      greedy_samples=min(AuditConfig.greedy_samples, args.samples))
    rows = run_audit(cfg)
    print(format_table(rows, cfg))
    return 0 if all(row.ok for row in rows) else 1


# --- generate ------------------------------------------------------------------------------

def _add_generate(sub) -> None:
    p = sub.add_parser(
        "generate", help="generate text, speculatively",
        description="Stream a continuation of PROMPT, lossless: speculative decoding emits text "
        "distributed exactly as the target model alone would. Example: exactspec generate "
        "'Write a haiku about tea' --prompt-lookup --temperature 0.7 --seed 1",
    )
    p.add_argument("prompt", help="the prompt text (chat-templated unless --no-chat)")
    p.add_argument("--model", default="smollm2-135m",
                   help="target: embedded name, transformers directory or .gguf file")
    drafters = p.add_mutually_exclusive_group()
    drafters.add_argument("--draft", metavar="MODEL", default=None,
                          help="draft model sharing the target's vocabulary")
    drafters.add_argument("--prompt-lookup", action="store_true",
                          help="draft by copying n-grams from the prompt and output")
    drafters.add_argument("--eagle", metavar="HEAD", nargs="?", const="smollm2-135m", default=None,
                          help="draft with an EAGLE-style head over the target's features: the "
                          "shipped name (default smollm2-135m) or a directory from train-draft")
    p.add_argument("--temperature", type=float, default=1.0, help="0 = greedy (default 1.0)")
    p.add_argument("--top-k", type=int, default=0, help="0 = off")
    p.add_argument("--top-p", type=float, default=1.0, help="1.0 = off")
    p.add_argument("--min-p", type=float, default=0.0, help="0 = off")
    p.add_argument("--repetition-penalty", type=float, default=1.0, help="1.0 = off")
    p.add_argument("--seed", type=int, default=None, help="same seed, same text")
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--num-draft-tokens", default="4", metavar="N|auto",
                   help="draft tokens per step, or 'auto' to adapt per row from measured "
                   "speed (still lossless, but a seed's text then depends on timings; default 4)")
    p.add_argument("--verify", choices=["token", "block", "greedy"], default="token",
                   help="verification method (token and block are lossless)")
    p.add_argument("--stop", action="append", default=None, metavar="TEXT",
                   help="stop before this text (repeatable)")
    p.add_argument("--no-chat", action="store_true", help="do not apply the chat template")
    p.add_argument("--json", action="store_true",
                   help="print one JSON object (text, token ids, stats) instead of streaming")
    p.add_argument("--threads", type=int, default=None,
                   help="CPU threads for torch (default: torch's choice); 1 is often fastest "
                   "for small models on a busy machine")
    p.add_argument("--compare-plain", action="store_true",
                   help="afterwards, run plain decoding with the same settings and print both "
                   "speeds (the baseline every speedup is measured against)")
    p.set_defaults(run=_cmd_generate)


def _cmd_generate(args) -> int:
    import json

    from exactspec.drafters import DraftModel, PromptLookup, load_drafter
    from exactspec.engine import generate, stream
    from exactspec.models import load
    from exactspec.sampling import SamplingParams

    if not args.prompt.strip():
        raise UsageError("the prompt is empty")
    k = args.num_draft_tokens
    if k != "auto":
        try:
            k = int(k)
        except ValueError:
            raise UsageError(f"--num-draft-tokens must be an int or 'auto', got {k!r}") from None
    params = SamplingParams(
        temperature=args.temperature, top_k=args.top_k, top_p=args.top_p, min_p=args.min_p,
        repetition_penalty=args.repetition_penalty, seed=args.seed,
    )
    if args.max_new_tokens < 1:
        raise UsageError(f"--max-new-tokens must be >= 1, got {args.max_new_tokens}")
    if args.threads is not None:
        if args.threads < 1:
            raise UsageError(f"--threads must be >= 1, got {args.threads}")
        import torch

        torch.set_num_threads(args.threads)
    model = load(args.model)
    drafter, drafter_name = None, "plain"
    if args.draft:
        drafter, drafter_name = DraftModel(load(args.draft)), f"draft {args.draft}"
    elif args.prompt_lookup:
        drafter, drafter_name = PromptLookup(), "prompt lookup"
    elif args.eagle:
        drafter, drafter_name = load_drafter(args.eagle, target=model), f"eagle {args.eagle}"
    ids = model.encode(args.prompt, chat=not args.no_chat)
    if len(ids) >= model.max_context:
        raise UsageError(f"the prompt has {len(ids)} tokens; {model.name} takes at most "
                         f"{model.max_context - 1}")
    kwargs = dict(drafter=drafter, params=params, max_new_tokens=args.max_new_tokens,
                  num_draft_tokens=k, verify=args.verify, stop=args.stop)
    if args.json:
        g = generate(model, [ids], **kwargs)[0]
        print(json.dumps({"model": model.name, "drafter": drafter_name, "text": g.text,
                          "token_ids": g.token_ids, "finish_reason": g.finish_reason,
                          "stats": g.stats.as_dict()}))
        return 0
    if args.compare_plain:  # warm both paths up first, so neither timing pays first-call costs
        for d in (drafter, None):
            generate(model, [ids], **{**kwargs, "drafter": d, "max_new_tokens": 4})
    s = stream(model, ids, **kwargs)
    for piece in s:
        sys.stdout.write(piece)
        sys.stdout.flush()
    assert s.generation is not None
    print()
    print(f"[{model.name}, {drafter_name}, {args.verify} verification] {s.generation.stats.summary()}")
    if args.compare_plain and drafter is not None:
        plain = generate(model, [ids], **{**kwargs, "drafter": None})[0]
        fast, slow = s.generation.stats.tokens_per_second, plain.stats.tokens_per_second
        print(f"[{model.name}, plain decoding, same settings] {plain.stats.summary()}")
        print(f"speculative {fast:.1f} tok/s vs plain {slow:.1f} tok/s: "
              f"{fast / slow if slow else float('nan'):.2f}x")
    return 0


# --- train-draft ---------------------------------------------------------------------------

def _add_train_draft(sub) -> None:
    p = sub.add_parser(
        "train-draft", help="train an EAGLE-style draft head for a target, on this CPU",
        description="Builds training data offline (the target's own replies to the shipped "
        "chat prompts, with its hidden states and soft labels), trains a one-layer draft head "
        "over the target's features with a progress bar and checkpoints, then writes "
        "OUT/head (load it with exactspec.load_drafter(OUT/head)), OUT/loss.png and "
        "OUT/eval.json (alpha and mean acceptance length on held-out prompts, T=1 and greedy, "
        "K=4). About an hour on 2 CPU cores with the defaults (half of it building data). "
        "Example: exactspec train-draft --model smollm2-135m --out runs/head --minutes 30")
    p.add_argument("--model", default="smollm2-135m",
                   help="target: embedded name, transformers directory or .gguf file")
    p.add_argument("--out", required=True, help="output directory (data, checkpoint, head)")
    p.add_argument("--minutes", type=float, default=30.0,
                   help="training-loop budget in minutes, data building excluded (default 30)")
    p.add_argument("--resume", action="store_true", help="continue the checkpoint in --out")
    p.add_argument("--replies", type=int, default=2,
                   help="target replies per training prompt: 1 alternates greedy and T=1 "
                   "between prompts (half the data time), 2+ adds a greedy reply to T=1 ones "
                   "(default 2)")
    p.add_argument("--max-steps", type=int, default=0, help="also stop after N steps (0 = off)")
    p.add_argument("--threads", type=int, default=2, help="torch CPU threads (default 2)")
    p.set_defaults(run=_cmd_train_draft)


def _cmd_train_draft(args) -> int:
    import torch

    from exactspec.training.train import TrainConfig, train_draft

    if args.minutes < 0 or (args.minutes == 0 and args.max_steps <= 0):
        raise UsageError("give --minutes > 0 or --max-steps > 0")
    if args.replies < 1:
        raise UsageError("--replies must be at least 1")
    torch.set_num_threads(max(1, args.threads))
    cfg = TrainConfig(model=args.model, minutes=args.minutes, max_steps=args.max_steps,
                      replies=args.replies)
    res = train_draft(cfg, args.out, resume=args.resume)
    print(f"head: {res.head_dir} ({res.steps} steps, {res.train_seconds / 60:.1f} min training, "
          f"{res.data_seconds / 60:.1f} min data)")
    print(f"loss curve: {res.loss_png}")
    for mode in ("t1", "greedy"):
        e = res.eval[mode]
        print(f"{mode:>6}: alpha by depth {e['alpha_by_depth']}, P(first k accepted) "
              f"{e['accept_first_k']}, mean acceptance length {e['mean_acceptance_length']}")
    return 0


# --- bench ---------------------------------------------------------------------------------

def _add_bench(sub) -> None:
    p = sub.add_parser(
        "bench", help="measure every engine side by side: tokens/s, acceptance, bounds, plots",
        description="Runs exactspec (plain, prompt lookup, a draft model, the EAGLE head when "
        "installed; token / block verification, fixed K and auto) and transformers generate "
        "(plain, assisted generation with the same draft model, prompt lookup) on the shipped "
        "workloads, greedy and sampling, interleaved round by round. Prints a table, writes "
        "OUT/bench.json and PNG plots. Example: exactspec bench --quick --threads 1")
    p.add_argument("--quick", action="store_true", help="a smoke check in under 3 minutes")
    p.add_argument("--out", default="out/bench", help="output directory (default %(default)s)")
    p.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: "
                   "torch's choice)")
    p.add_argument("--model", default="smollm2-135m",
                   help="target: embedded name, transformers directory or .gguf file")
    p.add_argument("--rounds", type=int, default=None, help="measured rounds (default 3; quick 1)")
    p.add_argument("--draft-layers", type=int, default=None,
                   help="the draft model is the target's first N layers (default 4)")
    p.add_argument("--no-eagle", action="store_true", help="skip the EAGLE head engine")
    p.add_argument("--device", default=None, help="cpu, cuda, cuda:1 ... (default: cuda if "
                   "available, else cpu)")
    p.set_defaults(run=_cmd_bench)


def _cmd_bench(args) -> int:
    import json
    from pathlib import Path

    import torch

    from exactspec.bench import Bench, BenchConfig, format_report, truncated_draft, write_plots
    from exactspec.models import load

    if args.threads is not None:
        if args.threads < 1:
            raise UsageError(f"--threads must be >= 1, got {args.threads}")
        torch.set_num_threads(args.threads)
    cfg = BenchConfig.quick_config() if args.quick else BenchConfig()
    if args.rounds is not None:
        if args.rounds < 1:
            raise UsageError(f"--rounds must be >= 1, got {args.rounds}")
        cfg.rounds = args.rounds
    if args.draft_layers is not None:
        cfg.draft_layers = args.draft_layers
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    if not args.verbose:  # transformers warns on every assisted-generation call
        import transformers

        transformers.logging.set_verbosity_error()
    model = load(args.model, device=device)
    draft = truncated_draft(model.model, cfg.draft_layers)
    layers = model.model.config.num_hidden_layers
    note = (f"no separate small model with the target's vocabulary is available offline, so the "
            f"draft model is the target truncated to its first {cfg.draft_layers} of {layers} "
            f"layers (+ final norm and head, weights shared); its acceptance is low, so the "
            f"draft rows mostly measure overhead")
    eagle = None
    if not args.no_eagle:
        try:
            from exactspec.drafters import eagle as eagle_mod

            eagle_mod.load_drafter(args.model, model)  # probe now; a missing head skips it
            eagle = lambda: eagle_mod.load_drafter(args.model, model)  # noqa: E731
        except Exception as exc:  # the head ships separately; any failure just skips it
            logging.getLogger(__name__).warning("EAGLE head unavailable: %s", exc)
            note += f"; EAGLE head unavailable ({type(exc).__name__})"
    result = Bench(model, cfg, draft=draft, draft_note=note, eagle_factory=eagle).run()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "bench.json").write_text(json.dumps(result, indent=1))
    report = format_report(result)
    (out / "bench.md").write_text(format_report(result, markdown=True) + "\n")
    pngs = write_plots(result, out)
    print(report)
    print(f"\nbench took {result['duration_seconds']:.0f} s; wrote {out / 'bench.json'}, "
          f"{out / 'bench.md'}, " + ", ".join(str(p) for p in pngs))
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING)
    try:
        return int(args.run(args) or 0)
    except (UsageError, ValueError, TypeError, FileNotFoundError) as exc:
        print(f"exactspec {args.command}: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
