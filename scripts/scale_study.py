"""How the quantized self-draft's costs scale with the model: random-init Llama models of the
SmolLM2 family's shapes (~135M, ~360M, ~1.2B) benched by `exactspec bench`'s own harness.

For every shape it builds a Llama with random weights (the smollm2 tokenizer and vocabulary,
seeded; saved in bfloat16 into --cache and reused when there), loads it as a bf16 target (and,
with --dtypes, as float32), and runs the bench engines exactspec plain, the int8 and int4
self-drafts on torch at K=6 (`exactspec qdraft int8 torch K=6`, `... int4 torch K=6`) and
llama.cpp's plain decoding of the same weights as BF16 and Q8_0 GGUF (with the bf16 target
only: a float32 target holds the same bf16-rounded weights, so its GGUFs would be the same). From the bench rows it
keeps, per self-draft, c (draft-token cost over a plain target step) and w (the K+1-token verify
forward's cost over a plain step), and plain's and llama.cpp's tokens/s.

Random weights make acceptance meaningless (a random model's int8 copy agrees with it for no
reason a trained model would), so the random models' acceptance is never reported: the speedup
is *predicted* from the measured c and w at the acceptance rates alpha measured on real models
(--alphas-from: a real-model `exactspec bench` JSON; by default the repository's
docs/runs/bench_amx/bench.json, smollm2-135m), with the bench's own formula (bench/rows.py's
bound_with_width_cost): speedup = (1 - a^(K+1)) / ((1 - a) (K c + w)).

Writes into --out: measured.csv (one row per scale, dtype, engine, mode, workload), predicted.csv
(one row per scale, dtype, self-draft, mode and real-model alpha), scale_study.json (both, the
alpha source, the machine, the shapes) and scale_study.png (tokens/s, predicted speedup, c and w
against model size). docs/scale_study.md says how to read them.

Examples (from the repository root):

    .venv/bin/python scripts/scale_study.py --threads 2
    .venv/bin/python scripts/scale_study.py --shapes 135m,360m --rounds 2 --dtypes bfloat16,float32
    .venv/bin/python scripts/scale_study.py --custom tiny=64,2,128,4,2 --shapes '' \\
        --workloads chat --modes greedy --rounds 1 --max-new-tokens 8 --out /tmp/scale
"""

from __future__ import annotations

import argparse
import csv
import gc
import json
import logging
import os
import shutil
import statistics
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DEFAULT_ALPHAS = ROOT / "docs" / "runs" / "bench_amx" / "bench.json"
DRAFTS = ("int8", "int4")  # the self-drafts compared (bench words "qdraft <fmt> torch")
LLAMA_FORMATS = ("bf16", "q8_0")  # llama.cpp's rows of the same weights (--llama-formats)
MARKER = "scale-study.json"  # written last into a cached model directory
NOTE = ("Random weights: the random models' own acceptance means nothing and is not reported. "
        "Measured here: plain exactspec and llama.cpp tokens/s, and each self-draft's c (draft "
        "token cost / plain target step) and w (verify forward over K+1 tokens / plain target "
        "step). The speedups are predicted from those c and w at acceptance rates alpha "
        "measured on real models (alpha_source), with the bench's formula "
        "(1 - a^(K+1)) / ((1 - a) (K c + w)).")

log = logging.getLogger("scale_study")


@dataclass(frozen=True)
class Shape:
    """One random-init Llama of the study (the rest of its config is the tokenizer model's)."""

    name: str  # "135m", "360m", "1.2b", or a --custom name
    hidden_size: int
    num_hidden_layers: int
    intermediate_size: int
    num_attention_heads: int
    num_key_value_heads: int

    def overrides(self) -> dict:
        return {k: v for k, v in asdict(self).items() if k != "name"}


SHAPES = {s.name: s for s in (
    Shape("135m", 576, 30, 1536, 9, 3),  # smollm2-135m's own config
    Shape("360m", 960, 32, 2560, 15, 5),  # smollm2-360m's
    Shape("1.2b", 2048, 16, 8192, 32, 8),  # Llama 3.2 1B's body, smollm2's vocabulary
)}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="scale_study.py", description=__doc__.split("\n\n")[0],
        epilog="Examples:\n  .venv/bin/python scripts/scale_study.py --threads 2\n"
        "  .venv/bin/python scripts/scale_study.py --shapes 135m,360m --dtypes bfloat16,float32\n"
        "  .venv/bin/python scripts/scale_study.py --shapes '' --custom tiny=64,2,128,4,2 "
        "--workloads chat --modes greedy --rounds 1 --max-new-tokens 8 --out /tmp/scale\n\n"
        + NOTE, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shapes", default="135m,360m,1.2b",
                   help=f"comma-separated among {', '.join(SHAPES)} (default %(default)s; "
                   "'' for none, with --custom)")
    p.add_argument("--custom", action="append", default=[], metavar="NAME=H,L,I,A,KV",
                   help="an extra shape: hidden, layers, intermediate, heads, kv heads "
                   "(e.g. tiny=64,2,128,4,2); repeatable")
    p.add_argument("--dtypes", default="bfloat16",
                   help="target dtypes, among bfloat16, float32 (default %(default)s)")
    p.add_argument("--tokenizer", default="smollm2-135m",
                   help="where the tokenizer, vocabulary and the rest of the config come from: "
                   "an embedded name or a transformers directory (default %(default)s)")
    p.add_argument("--seed", type=int, default=0, help="weight init seed (default 0)")
    p.add_argument("--cache", default=None,
                   help="random models' directory (default: exactspec's cache / scale-study)")
    p.add_argument("--out", default=str(ROOT / "docs" / "runs" / "scale_study"),
                   help="output folder (default docs/runs/scale_study/)")
    p.add_argument("--alphas-from", nargs="+", default=[str(DEFAULT_ALPHAS)], metavar="JSON",
                   help="real-model `exactspec bench` results whose self-draft alphas the "
                   "predictions use (default docs/runs/bench_amx/bench.json, smollm2-135m)")
    p.add_argument("--k", type=int, default=6, help="draft tokens per step (default 6)")
    p.add_argument("--rounds", type=int, default=3, help="bench rounds (default 3)")
    p.add_argument("--modes", default="greedy,t1", help="bench modes (default %(default)s)")
    p.add_argument("--workloads", default="chat,long",
                   help="bench workloads (default %(default)s, those of the default alphas)")
    p.add_argument("--max-new-tokens", type=int, default=None,
                   help="token budget of every workload (default: the bench's, capped)")
    p.add_argument("--threads", type=int, default=None, help="torch / llama.cpp threads")
    p.add_argument("--llama-formats", default=",".join(LLAMA_FORMATS),
                   help="llama.cpp's GGUF types of the same weights (bench/llama_cpp.py "
                   "FORMATS, e.g. bf16,q8_0,q4_k; default %(default)s)")
    p.add_argument("--no-llama-cpp", action="store_true", help="skip llama.cpp's rows")
    args = p.parse_args(argv)
    args.shapes = [s.strip() for s in args.shapes.split(",") if s.strip()]
    for s in args.shapes:
        if s not in SHAPES:
            p.error(f"--shapes: unknown {s!r}; choose from {', '.join(SHAPES)} or use --custom")
    args.custom = [_custom(p, text) for text in args.custom]
    if not args.shapes and not args.custom:
        p.error("no shape: give --shapes and / or --custom")
    args.dtypes = [d.strip() for d in args.dtypes.split(",") if d.strip()]
    bad = [d for d in args.dtypes if d not in ("bfloat16", "float32")]
    if bad or not args.dtypes:
        p.error(f"--dtypes: {bad or 'none'}; choose among bfloat16, float32")
    from exactspec.bench.llama_cpp import FORMATS

    args.llama_formats = [f.strip() for f in args.llama_formats.split(",") if f.strip()]
    bad = [f for f in args.llama_formats if f not in FORMATS]
    if bad:
        p.error(f"--llama-formats: unknown {bad}; choose among {', '.join(FORMATS)}")
    args.modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    args.workloads = [w.strip() for w in args.workloads.split(",") if w.strip()]
    for flag in ("k", "rounds", "max_new_tokens", "threads"):
        value = getattr(args, flag)
        if value is not None and value < 1:
            p.error(f"--{flag.replace('_', '-')} must be >= 1, not {value}")
    return args


def _custom(p: argparse.ArgumentParser, text: str) -> Shape:
    name, _, dims = text.partition("=")
    try:
        values = [int(x) for x in dims.split(",")]
        if not name or len(values) != 5 or min(values) < 1:
            raise ValueError
    except ValueError:
        p.error(f"--custom {text!r}: spell it NAME=HIDDEN,LAYERS,INTERMEDIATE,HEADS,KV_HEADS, "
                "e.g. tiny=64,2,128,4,2")
    h, layers, inter, heads, kv = values
    if h % heads or heads % kv or (h // heads) % 2:
        p.error(f"--custom {text!r}: hidden must split into heads of an even size, and heads "
                "into kv heads")
    return Shape(name, h, layers, inter, heads, kv)


# --- the random models ---------------------------------------------------------------------

def base(source: str):
    """(config, tokenizer) of the tokenizer model: a directory's files, or an embedded model
    loaded once (its config and tokenizer kept, its weights dropped)."""
    from transformers import AutoConfig, AutoTokenizer

    if Path(source).is_dir():
        return AutoConfig.from_pretrained(source), AutoTokenizer.from_pretrained(source)
    from exactspec.models import load

    model = load(source)
    if model.tokenizer is None:
        raise SystemExit(f"--tokenizer {source}: it has no tokenizer")
    return model.model.config, model.tokenizer


def build(shape: Shape, seed: int, cache: Path, config, tokenizer) -> Path:
    """The directory of `shape`'s random Llama in bfloat16 (built once, then reused)."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    if config.model_type != "llama":
        raise SystemExit(f"--tokenizer: a Llama model's config is needed, not "
                         f"{config.model_type!r}")
    fields = {**config.to_dict(), **shape.overrides(), "head_dim": None, "dtype": "bfloat16"}
    fields.pop("_name_or_path", None)
    fields["head_dim"] = shape.hidden_size // shape.num_attention_heads
    # as JSON writes it (integer keys become strings), to compare with the marker read back
    want = json.loads(json.dumps({"shape": asdict(shape), "seed": seed, "config": fields}))
    final = cache / f"{shape.name}-seed{seed}"
    try:
        if json.loads((final / MARKER).read_text()) == want:
            return final
    except (OSError, ValueError):
        pass
    t0 = time.perf_counter()
    cfg = LlamaConfig(**{k: v for k, v in fields.items() if k != "dtype"})
    torch.manual_seed(seed)
    model = LlamaForCausalLM(cfg).to(torch.bfloat16).eval()
    tmp = cache / f".{final.name}.tmp{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    model.save_pretrained(tmp)
    tokenizer.save_pretrained(tmp)
    (tmp / MARKER).write_text(json.dumps(want, indent=1))
    shutil.rmtree(final, ignore_errors=True)
    os.replace(tmp, final)
    log.info("built %s (%d parameters) in %.0f s", final, _params(model),
             time.perf_counter() - t0)
    return final


def _params(model) -> int:
    """Parameters, a tied embedding counted once."""
    return sum(p.numel() for p in model.parameters())


# --- the bench -----------------------------------------------------------------------------

def engines(k: int, llama: list[str]) -> list:
    from exactspec.bench.engine_names import bench_uses
    from exactspec.bench.engines import EngineSpec
    from exactspec.bench.llama_cpp import llama_cpp_engines

    words = [f"qdraft {fmt} torch" for fmt in DRAFTS]
    known = bench_uses()
    missing = [w for w in words if w not in known]
    if missing:
        raise SystemExit(f"the bench has no engines {missing} (bench/engine_names.py: "
                         f"{', '.join(known)})")
    out = [EngineSpec("exactspec plain", "exactspec", "none")]
    out += [EngineSpec(f"exactspec {w} K={k}", "exactspec", w, k) for w in words]
    return out + llama_cpp_engines(tuple(llama))


MEASURED = ("scale", "params", "dtype", "engine", "family", "draft", "mode", "workload",
            "tokens", "tokens_per_second", "tokens_per_second_min", "tokens_per_second_max",
            "ratio_to_plain", "step_ms", "weight_bytes", "bandwidth", "k", "c", "w")


def measure(path: Path, shape: Shape, dtype: str, args) -> tuple[list[dict], dict, int]:
    """The bench rows of one model (acceptance left out), what it left out, its parameters."""
    from exactspec.bench import Bench, BenchConfig
    from exactspec.models import load

    target = load(path, dtype=dtype)
    target.name = shape.name
    params = _params(target.model)
    cfg = BenchConfig(rounds=args.rounds, modes=args.modes, workloads=args.workloads,
                      prompts_per_workload=1, max_new_tokens=args.max_new_tokens, sweep_ks=[],
                      batch_rows=0, block=False, qk=args.k)
    # llama.cpp's rows once per shape: its GGUF of a float32 target holds the same weights
    once = dtype == "bfloat16" or "bfloat16" not in args.dtypes
    llama = args.llama_formats if once and not args.no_llama_cpp else []
    bench = Bench(target, cfg, engines=engines(args.k, llama),
                  progress=sys.stderr.isatty())
    result = bench.run()
    rows = []
    for r in result["results"]:  # the bench's figures, without its acceptance ones
        draft = r["drafter"].split()[1] if r["drafter"].startswith("qdraft") else None
        row = {**{k: r.get(k) for k in MEASURED}, "scale": shape.name, "params": params,
               "dtype": dtype, "draft": draft, "k": r["k"] or None,
               "w": r.get("target_width_cost") if draft else None}
        rows.append({k: row[k] for k in MEASURED})
    left = {**result.get("left_out", {}), **result.get("crashed", {})}
    del bench, target
    gc.collect()
    return rows, left, params


# --- the predictions -----------------------------------------------------------------------

def read_alphas(paths: list[str]) -> tuple[list[dict], list[dict]]:
    """(alpha rows, sources): per real-model bench file, the fitted alpha of every self-draft
    row at a fixed K (the torch backend's where the file has them, else the default's)."""
    rows, sources = [], []
    for path in paths:
        try:
            result = json.loads(Path(path).read_text())
        except (OSError, ValueError) as e:
            raise SystemExit(f"--alphas-from {path}: {e}") from e
        found = 0
        for fmt in DRAFTS:
            cands = [r for r in result.get("results", []) if isinstance(r.get("k"), int)
                     and r.get("alpha") is not None and r.get("tree") is None
                     and r.get("family") == "exactspec"]
            picked = ([r for r in cands if r["drafter"] == f"qdraft {fmt} torch"]
                      or [r for r in cands if r["drafter"] == f"qdraft {fmt}"])
            for r in picked:
                rows.append({"alpha_model": result.get("model"), "alpha_engine": r["engine"],
                             "draft": fmt, "mode": r["mode"], "alpha_workload": r["workload"],
                             "alpha": r["alpha"]})
                found += 1
        if not found:
            raise SystemExit(f"--alphas-from {path}: no qdraft int8 / int4 row at a fixed K "
                             "with an alpha (a real-model `exactspec bench` JSON is needed)")
        sources.append({"file": str(path), "model": result.get("model"),
                        "date_utc": result.get("date_utc"),
                        "machine": (result.get("machine") or {}).get("processor"),
                        "rows": found})
    return rows, sources


PREDICTED = ("scale", "params", "dtype", "draft", "mode", "k", "c", "w", "alpha_model",
             "alpha_engine", "alpha_workload", "alpha", "predicted_speedup",
             "plain_tokens_per_second", "predicted_tokens_per_second",
             "llama_cpp_bf16_tokens_per_second", "llama_cpp_q8_0_tokens_per_second")


def speedup(alpha: float, k: int, c: float, w: float) -> float:
    """The bench's bound with the measured width cost (bench/rows.py bound_with_width_cost):
    tokens per step (1 - a^(K+1)) / (1 - a) over the step's cost K c + w in plain steps."""
    from exactspec.bench.figures import analytic_bound

    return analytic_bound(alpha, k, 0.0) / (k * c + w)


def predict(measured: list[dict], alphas: list[dict], k: int) -> list[dict]:
    """Per (scale, dtype, self-draft, mode) the mean c and w over workloads, at every real
    alpha of that self-draft and mode; tokens/s = plain's (mean over workloads) x speedup."""
    def mean(rows, key):
        xs = [r[key] for r in rows if r[key] is not None]
        return statistics.fmean(xs) if xs else None

    out = []
    groups = {(r["scale"], r["dtype"], r["mode"]) for r in measured}
    for scale, dtype, mode in sorted(groups):
        here = [r for r in measured if (r["scale"], r["dtype"], r["mode"]) == (scale, dtype, mode)]
        tps = {e: mean([r for r in here if r["engine"] == e], "tokens_per_second")
               for e in {r["engine"] for r in here}}
        for fmt in DRAFTS:
            rows = [r for r in here if r["draft"] == fmt]
            c, w = mean(rows, "c"), mean(rows, "w")
            if c is None or w is None:
                continue
            for a in (a for a in alphas if a["draft"] == fmt and a["mode"] == mode):
                s = speedup(a["alpha"], k, c, w)
                plain = tps.get("exactspec plain")
                out.append({
                    "scale": scale, "params": here[0]["params"], "dtype": dtype, "draft": fmt,
                    "mode": mode, "k": k, "c": c, "w": w, **a, "predicted_speedup": s,
                    "plain_tokens_per_second": plain,
                    "predicted_tokens_per_second": plain * s if plain else None,
                    "llama_cpp_bf16_tokens_per_second": tps.get("llama.cpp bf16"),
                    "llama_cpp_q8_0_tokens_per_second": tps.get("llama.cpp q8_0")})
    return [{k: r.get(k) for k in PREDICTED} for r in out]


# --- outputs -------------------------------------------------------------------------------

def write_csv(path: Path, rows: list[dict], columns: tuple[str, ...]) -> None:
    with path.open("w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=columns)
        writer.writeheader()
        writer.writerows(rows)


COLORS = {"exactspec plain": "C0", "llama.cpp bf16": "C1", "llama.cpp q8_0": "C2",
          "int8": "C3", "int4": "C4"}  # one color per engine in every panel


def plot(path: Path, measured: list[dict], predicted: list[dict], mode: str,
         llama: list[str]) -> None:
    """Three panels against parameters (log x; ticks named by scale), in `mode`: tokens/s
    (measured plain and llama.cpp; predicted self-drafts: the median over the real alphas, the
    bars their range), the predicted speedup, and the measured c and w. A second dtype is
    dashed."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(16, 4.8))
    dtypes = sorted({r["dtype"] for r in measured})

    def label(text: str, dtype: str) -> str:
        return text if len(dtypes) == 1 else f"{text} ({dtype})"

    def by_params(rows, key) -> dict[int, list[float]]:
        by: dict[int, list[float]] = {}
        for r in rows:
            if r[key] is not None:
                by.setdefault(r["params"], []).append(r[key])
        return dict(sorted(by.items()))

    for dtype in dtypes:
        style = "-" if dtype == "bfloat16" else "--"
        m = [r for r in measured if r["dtype"] == dtype and r["mode"] == mode]
        p = [r for r in predicted if r["dtype"] == dtype and r["mode"] == mode]
        for engine in ("exactspec plain", *(f"llama.cpp {f}" for f in llama)):
            by = by_params([r for r in m if r["engine"] == engine], "tokens_per_second")
            if by:
                axes[0].plot(list(by), [statistics.fmean(v) for v in by.values()], style,
                             marker="o", color=COLORS.get(engine), label=label(engine, dtype))
        for fmt in DRAFTS:
            rows = [r for r in p if r["draft"] == fmt]
            for ax, key in ((axes[0], "predicted_tokens_per_second"),
                            (axes[1], "predicted_speedup")):
                by = by_params(rows, key)
                if not by:
                    continue
                mid = [statistics.median(v) for v in by.values()]
                err = [[y - min(v) for y, v in zip(mid, by.values(), strict=True)],
                       [max(v) - y for y, v in zip(mid, by.values(), strict=True)]]
                ax.errorbar(list(by), mid, yerr=err, fmt=style, marker="s", capsize=3,
                            color=COLORS[fmt], label=label(
                                f"{fmt} self-draft K={rows[0]['k']} (predicted)", dtype))
            for key, marker in (("c", "^"), ("w", "v")):
                by = by_params([r for r in m if r["draft"] == fmt], key)
                if by:
                    axes[2].plot(list(by), [statistics.fmean(v) for v in by.values()], style,
                                 marker=marker, color=COLORS[fmt],
                                 label=label(f"{fmt} {key}", dtype))
    axes[1].axhline(1.0, color="grey", lw=0.8)
    names = {r["params"]: r["scale"] for r in measured}
    titles = (f"tokens/s ({mode}); predicted: median, bars the range over the real alphas",
              "predicted speedup over exactspec plain", "measured c (draft token) and w (verify)")
    ylabels = ("tokens / s", "speedup", "cost in plain target steps")
    for ax, title, ylabel in zip(axes, titles, ylabels, strict=True):
        ax.set_xscale("log")
        ax.set_xticks(list(names), [f"{n}\n{x / 1e6:.0f}M" for x, n in names.items()])
        ax.minorticks_off()
        ax.set_xlabel("parameters")
        ax.set_ylabel(ylabel)
        ax.set_title(title, fontsize=9)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    fig.suptitle("random-init Llama shapes: measured costs, speedups predicted at real-model "
                 "alphas (the random models' own acceptance is not used)", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(message)s")
    log.setLevel(logging.INFO)
    import torch

    from exactspec.bench.figures import machine_info
    from exactspec.models.registry import cache_root

    if args.threads:
        torch.set_num_threads(args.threads)
    alphas, sources = read_alphas(args.alphas_from)  # a bad file fails before any model
    missing = sorted({m for m in args.modes} - {a["mode"] for a in alphas})
    if missing:
        log.warning("the alpha source has no alpha in modes %s: no predictions there", missing)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    cache = Path(args.cache) if args.cache else cache_root() / "scale-study"
    cache.mkdir(parents=True, exist_ok=True)
    config, tokenizer = base(args.tokenizer)
    shapes = [SHAPES[s] for s in args.shapes] + args.custom
    measured: list[dict] = []
    left_out: dict[str, dict] = {}
    scales = []
    for shape in shapes:
        path = build(shape, args.seed, cache, config, tokenizer)
        for dtype in args.dtypes:
            log.info("benching %s in %s", shape.name, dtype)
            rows, left, params = measure(path, shape, dtype, args)
            measured += rows
            if left:
                left_out[f"{shape.name} {dtype}"] = left
        scales.append({"params": params, "path": str(path), **asdict(shape)})
    predicted = predict(measured, alphas, args.k)
    write_csv(out / "measured.csv", measured, MEASURED)
    write_csv(out / "predicted.csv", predicted, PREDICTED)
    summary = {"note": NOTE, "date_utc": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
               "machine": machine_info(), "alpha_source": sources,
               "formula": "(1 - a^(K+1)) / ((1 - a) (K c + w)) (bench/rows.py "
                          "bound_with_width_cost)",
               "args": {k: v if not isinstance(v, list) or not v or not isinstance(v[0], Shape)
                        else [asdict(s) for s in v] for k, v in vars(args).items()},
               "scales": scales, "left_out": left_out, "measured": measured,
               "predicted": predicted}
    (out / "scale_study.json").write_text(json.dumps(summary, indent=1))
    plot(out / "scale_study.png", measured, predicted, args.modes[0], args.llama_formats)
    print(NOTE)
    for r in predicted:
        if r["mode"] == args.modes[0]:
            print(f"{r['scale']:>6s} {r['dtype']:8s} {r['draft']} c={r['c']:.3f} w={r['w']:.3f} "
                  f"alpha={r['alpha']:.3f} ({r['alpha_model']} {r['alpha_workload']}) -> "
                  f"{r['predicted_speedup']:.2f}x")
    print(f"wrote {', '.join(str(out / n) for n in ('measured.csv', 'predicted.csv', 'scale_study.json', 'scale_study.png'))}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
