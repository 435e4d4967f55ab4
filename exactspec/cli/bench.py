"""`exactspec bench`: every engine side by side; Ctrl-C keeps what was measured so far."""

from __future__ import annotations

import argparse
import logging
import re
import sys

from exactspec.bench.engine_names import BENCH_USES, BenchUse
from exactspec.cli.common import add_dtype_flag, add_kv_cache_flag, at_least, load_model
from exactspec.cli.drafter_flags import FLAGS
from exactspec.drafters.registry import DRAFTERS


def add(sub) -> None:
    p = sub.add_parser(
        "bench", help="measure every engine side by side: tokens/s, acceptance, bounds, plots",
        description="Runs exactspec (plain and every drafter of the drafter registry with a "
        "bench word: prompt lookup, a draft model, a cross-vocabulary draft, the EAGLE head when "
        "installed, the quantized self-draft, suffix; token / block verification, fixed K and "
        "auto), transformers generate "
        "(plain, assisted generation with the same draft model, prompt lookup) and, when "
        "llama-cpp-python is installed, llama.cpp's plain decoding of the same weights as "
        "F32 / BF16 / Q8_0 / Q4_0 / Q4_1 / Q4_K_M GGUF, on the shipped workloads, greedy and "
        "sampling, interleaved round by round; the bw column is each engine's target step "
        "against the measured memory bandwidth. Prints a table, writes "
        "OUT/bench.json and PNG plots. Ctrl-C stops it and writes what was measured so far "
        "(exit code 130). Examples: exactspec bench --quick --threads 1; exactspec bench --trees "
        "--threads 2 --workloads chat,long,code_edit --modes greedy,t1; exactspec bench --busy 1 "
        "--threads 2 --engines 'exactspec plain' --workloads chat (one of two cores taken)")
    p.add_argument("--quick", action="store_true", help="a smoke check (3 min 26 s measured on 2 idle cores of the AMX Xeon, llama.cpp rows included, their GGUF files already exported)")
    p.add_argument("--out", default="out/bench", help="output directory (default %(default)s)")
    p.add_argument("--threads", type=at_least(1), default=None,
                   help="torch CPU threads (default: torch's choice)")
    p.add_argument("--model", default="smollm2-135m",
                   help="target: embedded name, transformers directory or .gguf file")
    p.add_argument("--rounds", type=at_least(1), default=None,
                   help="measured rounds (default 3; quick 1)")
    p.add_argument("--draft-layers", type=at_least(1), default=None,
                   help="the draft model is the target's first N layers (default 4)")
    for name, flag, use in model_drafters():  # --draft MODEL, --cross-vocab-draft MODEL
        default = use.default or ("the target's first --draft-layers layers" if name == "draft"
                                  else "none: its engines are skipped")
        p.add_argument(flag, dest=name.replace("-", "_"), metavar="MODEL", default=None,
                       help=f"the model of the '{use.word}' engines (drafters/registry.py): "
                       f"{FLAGS[name].help}; default {default} (skipped when it is the "
                       "target)")
    p.add_argument("--no-eagle", action="store_true", help="skip the EAGLE head engine")
    p.add_argument("--engines", default=None, metavar="A,B",
                   help="only engines whose name contains one of these (e.g. "
                   "'plain,qdraft,assisted int8,llama.cpp'; default: all); a tree or chain not in the "
                   "list is added by its name: 'eagle tree 4,1,1,1' (branching per depth, as "
                   "generate --tree; a comma before a digit stays in the name), 'lookup tree "
                   "3x4' (3 matches, depth 4), 'suffix tree 2x4' (<= 2 children per node, depth 4, 8 "
                   "nodes), 'eagle K=16'; suffixes ' iid' (siblings drawn "
                   "i.i.d.) and ' traversal'")
    p.add_argument("--trees", action="store_true",
                   help="trees against chains at equal verify width instead of the default "
                   "engines: plain; the EAGLE head's trees 2,1,1 / 2,1,1,1 / 4,1,1,1 and "
                   "dynamic:16 (sampled and deterministic siblings), prompt lookup's 2x3 / 2x4 "
                   "/ 4x4, the suffix drafter's 2x4, the 8-bit self-draft's (torch) 2,1,1,1,1,1; each drafter's chains "
                   "of as many draft tokens and K=4, 6. Writes the tree table, the probed "
                   "width cost w and OUT/trees.png (no K sweep, no batch)")
    p.add_argument("--modes", default=None, metavar="M,N",
                   help="sampling modes among greedy, t1, t0.7p0.9 (default: all; quick: 2)")
    p.add_argument("--workloads", default=None, metavar="W,X",
                   help="shipped workloads by name (e.g. chat,long; default: all but long_prompt, "
                   "whose 1k / 2k / 4k-token prompts run when named)")
    p.add_argument("--max-new-tokens", type=at_least(1), default=None,
                   help="token budget of every workload (default: each workload's, capped)")
    add_dtype_flag(p, "; transformers' engines decode the same model object, so both sides "
                   "run this dtype")
    add_kv_cache_flag(p, "; exactspec's engines, transformers' keep float32")
    p.add_argument("--device", default=None, help="cpu, cuda, cuda:1 ... (default: cuda if "
                   "available, else cpu)")
    p.add_argument("--busy", type=at_least(0), default=0, metavar="N",
                   help="keep N cores busy with other processes while the bench runs (a busy "
                   "machine: compare --threads 2 with --threads 1 under --busy 1); default 0")
    p.set_defaults(run=run)


def model_drafters() -> list[tuple[str, str, BenchUse]]:
    """(registry name, flag, BenchUse) of every benched drafter built from a model the bench
    is given (drafters/registry.py: a model as its source, and no source fixed by its first
    BenchUse, bench/engine_names.py)."""
    return [(name, e.flag, use) for name, e in DRAFTERS.items()
            for use in BENCH_USES.get(name, ())[:1]
            if e.flag and use.source is None and e.source == "model"]


def _sources(args, cfg, device: str) -> dict[str, object]:
    """The draft models named by the model flags (or their BenchUse default), loaded once;
    one that is the target itself, or whose engines --engines leaves out, is not loaded."""
    out = {}
    for name, _, use in model_drafters():
        source = getattr(args, name.replace("-", "_")) or use.default
        kept = cfg.engines is None or any(use.word in e or e in use.word for e in cfg.engines)
        if source and source != args.model and kept:
            out[name] = load_model(source, device=device, dtype=args.dtype)
    return out


def _split(text: str) -> list[str]:
    return [x.strip() for x in text.split(",") if x.strip()]


def split_engines(text: str) -> list[str]:
    """--engines items: split at a comma that a name follows, never inside a tree's
    branching ('plain,eagle tree 4,1,1,1' -> ['plain', 'eagle tree 4,1,1,1'])."""
    return [x.strip() for x in re.split(r",(?=\s*[^\d\s])", text) if x.strip()]


def run(args: argparse.Namespace) -> int:
    import json
    from pathlib import Path

    import torch

    from exactspec.bench import (
        MODES,
        Bench,
        BenchConfig,
        format_report,
        load_workloads,
        truncated_draft,
        write_plots,
    )
    from exactspec.bench.busy import busy_cores
    from exactspec.bench.harness import workload_names
    from exactspec.cli.common import UsageError
    from exactspec.models.loading import progress_off

    if args.threads is not None:
        torch.set_num_threads(args.threads)
    cfg = BenchConfig.quick_config() if args.quick else BenchConfig()
    if args.rounds is not None:
        cfg.rounds = args.rounds
    if args.draft_layers is not None:
        cfg.draft_layers = args.draft_layers
    cfg.trees = args.trees
    for flag in ("engines", "modes", "workloads"):
        if getattr(args, flag) is not None:
            split = split_engines if flag == "engines" else _split
            setattr(cfg, flag, split(getattr(args, flag)))
    known = {"modes": list(MODES), "workloads": workload_names(load_workloads())}
    for flag, names in known.items():  # checked before the model loads, each in one line
        bad = [x for x in getattr(cfg, flag) or [] if x not in names] if getattr(args, flag) else []
        if bad:
            raise UsageError(f"--{flag}: unknown {', '.join(bad)}; choose from {', '.join(names)}")
    if args.max_new_tokens is not None:
        cfg.max_new_tokens = args.max_new_tokens
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    if not args.verbose:  # transformers warns on every assisted-generation call
        import transformers

        transformers.logging.set_verbosity_error()
    model = load_model(args.model, device=device, dtype=args.dtype, kv_cache=args.kv_cache)
    layers = model.model.config.num_hidden_layers
    if not 1 <= cfg.draft_layers <= layers:
        raise UsageError(f"--draft-layers {cfg.draft_layers} must be in 1..{layers} "
                         f"({model.name} has {layers} layers)")
    sources = _sources(args, cfg, device)
    draft = None if "draft" in sources else truncated_draft(model.model, cfg.draft_layers)
    note = (f"the draft model is {args.draft}" if draft is None else
            f"no separate small model with the target's vocabulary is available offline, so the "
            f"draft model is the target truncated to its first {cfg.draft_layers} of {layers} "
            f"layers (+ final norm and head, weights shared); its acceptance is low, so the "
            f"draft rows mostly measure overhead")
    note += "".join(f"; {use.word}: {sources[name].name}" for name, _, use in model_drafters()
                    if name in sources and name != "draft")
    eagle = None
    if not args.no_eagle:
        try:
            from exactspec.drafters import eagle as eagle_mod

            eagle_mod.load_drafter(args.model, model)  # probe now; a missing head skips it
            eagle = lambda: eagle_mod.load_drafter(args.model, model)  # noqa: E731
        except Exception as exc:  # the head ships separately; any failure just skips it
            logging.getLogger(__name__).warning("EAGLE head unavailable: %s", exc)
            note += f"; EAGLE head unavailable ({type(exc).__name__})"
    off = progress_off()  # the bar only on a terminal, unless --progress
    progress = not off if off is not None else sys.stderr.isatty()
    with busy_cores(args.busy):
        result = Bench(model, cfg, draft=draft, draft_note=note, eagle_factory=eagle,
                       progress=progress, sources=sources).run()
    result["busy_cores"] = args.busy
    result["target_dtype"], result["kv_cache"] = args.dtype, args.kv_cache
    interrupted = bool(result.get("interrupted"))
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "bench.json").write_text(json.dumps(result, indent=1))
    report = format_report(result)
    (out / "bench.md").write_text(format_report(result, markdown=True) + "\n")
    pngs = [] if interrupted else write_plots(result, out)  # plots want every engine's rows
    print(report)
    wrote = ", ".join(str(p) for p in [out / "bench.json", out / "bench.md", *pngs])
    if interrupted:
        print(f"\nbench interrupted after {result['duration_seconds']:.0f} s; wrote what was "
              f"measured so far to {wrote} (no plots)")
        return 130
    print(f"\nbench took {result['duration_seconds']:.0f} s; wrote {wrote}")
    return 0
