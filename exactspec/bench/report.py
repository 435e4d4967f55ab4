"""`exactspec bench` output: the terminal / markdown table and the PNG plots."""

from __future__ import annotations

import math
from pathlib import Path

from exactspec.bench.table import render_table
from exactspec.bench.tree_report import format_trees, plot_trees
from exactspec.engine.results import add_counts


def _f(x, fmt: str = "{:.2f}", none: str = "-") -> str:
    return none if x is None else fmt.format(x)


def _split(row: dict) -> str:
    s = row.get("time_split")
    if not s:
        return "-"
    return "/".join(f"{100 * s[k]:.0f}" for k in
                    ("prefill", "draft", "target_forward", "standardize_verify", "bookkeeping"))


COLUMNS = ["engine", "mode", "workload", "tok/s", "min-max", "bw", "x plain", "x hf", "acc len",
           "alpha", "c", "bound", "share", "w", "bound w", "split % p/d/t/v/o"]


def table_rows(rows: list[dict]) -> list[list[str]]:
    out = []
    for r in rows:
        out.append([
            r["engine"], r["mode"], r["workload"],
            f"{r['tokens_per_second']:.1f}",
            f"{r['tokens_per_second_min']:.1f}-{r['tokens_per_second_max']:.1f}",
            _f(r.get("bandwidth"), "{:.0%}"),
            _f(r.get("ratio_to_plain")), _f(r.get("ratio_to_counterpart")),
            _f(r.get("mean_acceptance_length")), _f(r.get("alpha")), _f(r.get("c")),
            _f(r.get("bound")), _f(r.get("share_of_bound"), "{:.0%}"),
            _f(r.get("target_width_cost")), _f(r.get("bound_with_width_cost")), _split(r),
        ])
    return out


def format_table(rows: list[dict], *, markdown: bool = False,
                 columns: list[str] | None = None) -> str:
    """Rows of the result JSON as an aligned text table, or a markdown one."""
    return render_table(columns or COLUMNS, table_rows(rows), markdown)


def format_long_prompts(result: dict, *, markdown: bool = False) -> str:
    """The long-prompt workloads' rows: prompt tokens, time to first token, prefill tok/s,
    decode tok/s (after the first token) and its ratio to plain's."""
    lengths = result["prompt_tokens"]
    rows = [r for r in result["results"] if r["workload"] in lengths]
    plain = {(r["mode"], r["workload"]): r for r in rows if r["engine"] == "exactspec plain"}
    body = []
    for r in rows:
        n, ttft, dec = lengths[r["workload"]], r.get("ttft_ms"), r.get("decode_tokens_per_second")
        base = plain.get((r["mode"], r["workload"]), {}).get("decode_tokens_per_second")
        body.append([r["engine"], r["mode"], r["workload"], str(n), _f(ttft, "{:.0f}"),
                     _f(1e3 * n / ttft if ttft else None, "{:.0f}"), _f(dec, "{:.1f}"),
                     _f(dec / base if dec and base else None)])
    return render_table(["engine", "mode", "workload", "prompt tokens", "ttft ms",
                         "prefill tok/s", "decode tok/s", "decode x plain"], body, markdown)


def _geomean(xs: list[float]) -> float | None:
    xs = [x for x in xs if x]
    return math.exp(sum(map(math.log, xs)) / len(xs)) if xs else None


def format_summary(result: dict, mode: str, *, markdown: bool = False) -> str:
    """One line per engine: tok/s per workload, geometric-mean ratios to plain and to hf."""
    rows = [r for r in result["results"] if r["mode"] == mode]
    workloads = list(dict.fromkeys(r["workload"] for r in rows))
    cols = ["engine", *workloads, "x plain (geo)", "x hf (geo)", "acc len (mean)", "bw (mean)"]
    body = []
    for e in dict.fromkeys(r["engine"] for r in rows):
        mine = {r["workload"]: r for r in rows if r["engine"] == e}
        lens = [r["mean_acceptance_length"] for r in mine.values()
                if r.get("mean_acceptance_length")]
        bws = [r["bandwidth"] for r in mine.values() if r.get("bandwidth")]
        body.append([e, *(f"{mine[w]['tokens_per_second']:.1f}" if w in mine else "-"
                          for w in workloads),
                     _f(_geomean([r["ratio_to_plain"] for r in mine.values()])),
                     _f(_geomean([r.get("ratio_to_counterpart") for r in mine.values()])),
                     _f(sum(lens) / len(lens) if lens else None),
                     _f(sum(bws) / len(bws) if bws else None, "{:.0%}")])
    return render_table(cols, body, markdown)


def format_report(result: dict, *, markdown: bool = False) -> str:
    """The whole run: header, main table, K sweep, batch comparison, notes."""
    m = result["machine"]
    head = (f"exactspec bench on {result['model']}, {result['date_utc']}; "
            f"{m['cpu_count']} CPUs ({m['processor']}), torch {m['torch']} with "
            f"{m['torch_threads']} threads, transformers {m.get('transformers', '?')}"
            + (f", GPU {m['cuda']}" if m.get("cuda") else ", no GPU")
            + f"; {result['config']['rounds']} round(s), duration {result['duration_seconds']:.0f} s"
            + (f"; {result['busy_cores']} core(s) kept busy by other processes (--busy)"
               if result.get("busy_cores") else "")
            + (f"; target {result['target_dtype']}" if result.get("target_dtype") else "")
            + ("; exactspec's engines on a bf16 KV cache (--kv-cache; transformers' keep float32)"
               if result.get("kv_cache") == "bfloat16" else ""))
    unit = m.get("kernel_unit")
    flags = " ".join(m.get("cpu_flags", [])) or "?"
    parts = [head, f"CPU: {m.get('cpu_model') or '?'}; torch capability "
                   f"{m.get('cpu_capability', '?')}, flags {flags}"
                   + (f"; our kernels' unit {unit}" if unit else
                      ("; our kernels off or not built" if "kernel_unit" in m else ""))]
    bw = result.get("bandwidth") or {}
    if bw.get("read_gbs"):
        line = f"memory: read bandwidth {bw['read_gbs']:.1f} GB/s"
        if "target_weight_bytes" in bw:
            line += f"; a target step reads {bw['target_weight_bytes'] / 1e6:.0f} MB of weights"
        for name in ("exactspec plain", "transformers plain"):
            if name in bw:
                line += (f"; {name} one-token step {bw[name]['step_ms']:.1f} ms = "
                         f"{100 * bw[name]['share_of_limit']:.0f}% of the bandwidth limit")
        if "qdraft draft token" in bw:
            line += f"; quantized draft token {bw['qdraft draft token']['step_ms']:.1f} ms"
        parts.append(line)
    if result.get("draft_note"):
        parts.append(f"draft model: {result['draft_note']}")
    for mode in dict.fromkeys(r["mode"] for r in result["results"]):
        parts.append(f"summary, {mode}: tok/s per workload (median over rounds)")
        parts.append(format_summary(result, mode, markdown=markdown))
    parts.append("every engine, mode and workload:")
    parts.append(format_table(result["results"], markdown=markdown))
    if result.get("prompt_tokens"):
        parts.append("long prompts: time to the first token and decoding after it:")
        parts.append(format_long_prompts(result, markdown=markdown))
    for name, why in (result.get("crashed") or {}).items():  # the rows a crash lost
        parts.append(f"{name}: CRASHED ({why.removeprefix(name + ': ')}); its rows are left "
                     "out, every other row is whole")
    for name, why in (result.get("left_out") or {}).items():
        parts.append(f"{name}: not run here: {why}")
    if result.get("sweep"):
        parts.append(f"speedup against K (greedy, {result['config']['sweep_workload']}):")
        parts.append(format_table(result["sweep"], markdown=markdown))
    if result.get("batch"):
        parts.append(f"batch of {result['config']['batch_rows']} rows (greedy, prompts of every "
                     "selected workload in turn), tok/s of the whole batch:")
        parts.append(format_table(result["batch"], markdown=markdown))
    if result.get("trees"):
        parts.append(format_trees(result["trees"], markdown=markdown))
    parts.append("bw: weight bytes one target step reads / its time, over the read bandwidth "
                 "measured above (exactspec and llama.cpp: target forward time per forward, a "
                 "speculative engine's being the verify forward; transformers plain: wall time "
                 "per token, prefill included; '-' where unknown). Weight bytes: every matrix a "
                 "step multiplies by (projections and the LM head; the one embedding row looked "
                 "up and the norms left out), in the engine's own format (exactspec's lean "
                 "forward, transformers' nn.Linear weights, the GGUF's tensors). llama.cpp rows: "
                 "plain decoding of the same weights written as GGUF; f32 samples exactspec's "
                 "law up to float32 rounding of the logits (llama.cpp's own sampler and random "
                 "numbers); bf16 (of a float32 target), q8_0, q4_0, q4_1 and q4_k (llama.cpp's "
                 "Q4_K_M) are rounded or quantized models: speed rows only.")
    parts.append("split % p/d/t/v/o: prefill / draft / target forward / standardize + verify / "
                 "bookkeeping, shares of wall time. x plain: tok/s over exactspec plain; x hf: "
                 "over the transformers counterpart; acc len: tokens per target forward; alpha: "
                 "per-token acceptance fitted to acc len; c: draft step / target step; bound: "
                 "(1 - a^(K+1)) / ((1 - a)(K c + 1)); share: x plain / bound; w: target "
                 "forward over K+1 tokens / over 1 token (the bound assumes 1); bound w: the "
                 "bound with w in place of 1, (1 - a^(K+1)) / ((1 - a)(K c + w)).")
    return "\n\n".join(parts)


def write_plots(result: dict, out_dir: str | Path) -> list[Path]:
    """tokens_per_second.png, speedup_vs_k.png (when the K sweep ran),
    acceptance_by_position.png in `out_dir`, and trees.png when tree engines ran
    (bench/tree_report.py)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    paths = []
    rows = result["results"]
    modes = list(dict.fromkeys(r["mode"] for r in rows))
    workloads = list(dict.fromkeys(r["workload"] for r in rows))
    engines = list(dict.fromkeys(r["engine"] for r in rows))

    fig, axes = plt.subplots(len(modes), 1, figsize=(max(8, 1.6 * len(workloads) + 4),
                                                     3.6 * len(modes)), squeeze=False)
    width = 0.8 / max(1, len(engines))
    for ax, mode in zip(axes[:, 0], modes, strict=True):
        for j, e in enumerate(engines):
            ys = []
            for w in workloads:
                hit = [r for r in rows if r["engine"] == e and r["mode"] == mode
                       and r["workload"] == w]
                ys.append(hit[0]["tokens_per_second"] if hit else 0.0)
            xs = [i + (j - (len(engines) - 1) / 2) * width for i in range(len(workloads))]
            ax.bar(xs, ys, width, label=e, hatch="//" if e.startswith("transformers") else None)
        ax.set_xticks(range(len(workloads)), workloads)
        ax.set_ylabel("tokens / s")
        ax.set_title(f"{result['model']}, {mode}")
    axes[0, 0].legend(fontsize=7, ncol=2, loc="upper right")
    fig.suptitle(f"exactspec bench, {result['date_utc']}, "
                 f"{result['machine']['torch_threads']} torch thread(s)", fontsize=9)
    fig.tight_layout()
    paths.append(out / "tokens_per_second.png")
    fig.savefig(paths[-1], dpi=110)
    plt.close(fig)

    sweep = result.get("sweep") or []
    if sweep:  # none in a tree comparison (it sweeps the verify width instead)
        fig, ax1 = plt.subplots(figsize=(6, 4))
        for d in dict.fromkeys(r["drafter"] for r in sweep if r["drafter"] != "none"):
            pts = sorted((r["k"], r["ratio_to_plain"], r["bound"], r.get("bound_with_width_cost"))
                         for r in sweep if r["drafter"] == d and r["ratio_to_plain"] is not None)
            if pts:
                line = ax1.plot([p[0] for p in pts], [p[1] for p in pts], "o-", label=f"{d} measured")
                color = line[0].get_color()
                if all(p[2] is not None for p in pts):
                    ax1.plot([p[0] for p in pts], [p[2] for p in pts], "--", color=color,
                             label=f"{d} analytic bound")
                if all(p[3] is not None for p in pts):
                    ax1.plot([p[0] for p in pts], [p[3] for p in pts], ":", color=color,
                             label=f"{d} bound with measured width cost")
        ax1.axhline(1.0, color="grey", lw=0.8)
        ax1.set_xlabel("K (draft tokens per step)")
        ax1.set_ylabel("speedup over exactspec plain")
        ax1.set_title(f"speedup against K (greedy, {result['config']['sweep_workload']})")
        ax1.legend(fontsize=7)
        fig.tight_layout()
        paths.append(out / "speedup_vs_k.png")
        fig.savefig(paths[-1], dpi=110)
        plt.close(fig)

    fig, ax2 = plt.subplots(figsize=(7, 4.5))
    lines: dict[str, tuple[list[int], list[int]]] = {}
    for r in rows + sweep:  # fixed-K token-verified engines, summed over workloads
        if not r.get("drafted_per_position") or not isinstance(r["k"], int) or \
                r["verify"] != "token" or r.get("tree"):  # a tree's positions are nodes
            continue
        key = f"{r['engine']} {r['mode']}"
        a, d = lines.get(key, ([], []))
        lines[key] = (add_counts(a, r["accepted_per_position"]),
                      add_counts(d, r["drafted_per_position"]))
    for key, (a, d) in list(lines.items())[:10]:
        ys = [x / y if y else 0.0 for x, y in zip(a, d, strict=False)]
        ax2.plot(range(1, len(ys) + 1), ys, "o-", label=key)
    if not lines:  # results without per-position draft counts: per-step rates, per workload
        for r in [r for r in sweep + rows if r.get("acceptance_by_position")
                  and isinstance(r["k"], int) and r["verify"] == "token"
                  and not r.get("tree")][:10]:
            ys = r["acceptance_by_position"]
            ax2.plot(range(1, len(ys) + 1), ys, "o-",
                     label=f"{r['engine']} {r['mode']} {r['workload']} (per step)")
    ax2.set_xlabel("draft position i")
    ax2.set_ylabel("P(draft i kept | drafted)")
    ax2.set_ylim(0, 1)
    ax2.set_title("acceptance by draft position")
    ax2.legend(fontsize=7)
    fig.tight_layout()
    paths.append(out / "acceptance_by_position.png")
    fig.savefig(paths[-1], dpi=110)
    plt.close(fig)
    trees = plot_trees(result, out)
    return paths + ([trees] if trees else [])
