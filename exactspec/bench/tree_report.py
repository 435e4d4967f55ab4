"""The tree-vs-chain part of `exactspec bench`'s output: a table and trees.png (acceptance
length and speed against the verify width, chain against tree, per drafter)."""

from __future__ import annotations

from pathlib import Path

from exactspec.bench.engine_names import match_words
from exactspec.bench.table import render_table

COLUMNS = ["engine", "mode", "group", "width", "scored", "draft fwd", "acc len", "nodes/step",
           "tok/s", "x plain", "w run", "w(scored)", "c/fwd", "draft/step", "predicted",
           "vs chain acc", "vs chain speed"]

NOTE = ("trees against chains: width = positions one verify forward is sized for (tree nodes "
        "or K, + 1); scored = positions it really scored, mean per step (a tree all of its "
        "slots, used or not; a chain 1 + the tokens drafted); draft fwd = draft model forwards per step (one per tree depth or chain token; "
        "0 for point masses); acc len = tokens per target forward; nodes/step = draft nodes "
        "that held a token; w run = the run's target forward per step / plain's; w(scored) = "
        "t(scored) / t(1) probed at a fixed context (bench/width_cost.py, linear between "
        "widths); c/fwd = one draft "
        "forward / plain's target step; draft/step = draft time per step in plain target "
        "steps; predicted = acc len / (w(scored) + draft/step); vs chain: over the chain of "
        "as many draft tokens (equal width). x plain and tok/s: geometric means over the "
        "group's workloads; acc len, w, c pooled.")


def _f(x, fmt: str = "{:.2f}") -> str:
    return "-" if x is None else fmt.format(x)


def tree_table_rows(rows: list[dict]) -> list[list[str]]:
    return [[r["engine"], r["mode"], r["group"], str(r["verify_width"]),
             _f(r["scored_width"], "{:.1f}"), str(r["draft_forwards"]),
             _f(r["mean_acceptance_length"]), _f(r["nodes_per_step"], "{:.1f}"),
             _f(r["tokens_per_second"], "{:.1f}"), _f(r["ratio_to_plain"]),
             _f(r["width_cost_run"]), _f(r["width_cost"]), _f(r["c_per_forward"]),
             _f(r["draft_cost"]), _f(r["predicted"]), _f(r["acc_over_chain"]),
             _f(r["speed_over_chain"])] for r in rows]


def format_trees(trees: dict, *, markdown: bool = False) -> str:
    """The tree table with its probe line and the column notes."""
    wc = trees["width_cost"]
    probe = ", ".join(f"w({k})={v:.2f}" for k, v in sorted(wc["w"].items(), key=lambda kv:
                                                             int(kv[0])))
    head = (f"trees against chains at equal verify width (width-cost probe: batch "
            f"{wc['batch']}, {wc['context']} cached tokens, t(1) = {wc['ms'][_key(wc, 1)]:.1f} "
            f"ms; {probe}):")
    return "\n\n".join([head, render_table(COLUMNS, tree_table_rows(trees["rows"]), markdown), NOTE])


def _key(wc: dict, width: int):
    """The probe's dict key for `width` (an int, or a str after a JSON round trip)."""
    return width if width in wc["ms"] else str(width)


def shape_label(row: dict) -> str:
    """'4,1,1,1' for a tree (branching per depth), '3x4' for prompt lookup's, 'dynamic:16'
    for a dynamic one, 'K=8' for a chain."""
    if not row.get("tree"):
        return f"K={row['k']}" if row.get("k") else "plain"
    t = row["tree"]
    if isinstance(t, dict):  # a dynamic tree's fields
        text = f"dynamic:{t['node_budget']}"
    else:
        text = f"{t[0]}x{len(t)}" if row["drafter"] in match_words() else ",".join(map(str, t))
    sib = row.get("siblings")
    return text + ("" if sib in (None, "without_replacement") else f" {sib}")


def _kind(row: dict) -> str:
    """'chain', 'tree' (a fixed branching) or 'dynamic' (a node budget)."""
    if row["shape"] != "tree":
        return row["shape"]
    return "dynamic" if isinstance(row["tree"], dict) else "tree"


def plot_trees(result: dict, out_dir: str | Path) -> Path | None:
    """trees.png: per mode and workload group, acceptance length and x plain against the
    verify width; per drafter one colour, chains solid with circles, fixed trees dashed with
    squares, dynamic trees triangles (labelled with their shape). None when the run had no
    tree engine."""
    trees = result.get("trees")
    if not trees or not trees.get("rows"):
        return None
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = trees["rows"]
    panels = list(dict.fromkeys((r["mode"], r["group"]) for r in rows))
    drafters = [d for d in dict.fromkeys(r["drafter"] for r in rows) if d != "none"]
    colors = {d: f"C{i}" for i, d in enumerate(drafters)}
    fig, axes = plt.subplots(len(panels), 2, figsize=(11, 3.4 * len(panels)), squeeze=False)
    for (mode, group), (ax_acc, ax_x) in zip(panels, axes, strict=True):
        mine = [r for r in rows if r["mode"] == mode and r["group"] == group]
        for ax, key, label in ((ax_acc, "mean_acceptance_length", "acceptance length"),
                               (ax_x, "ratio_to_plain", "speed / exactspec plain")):
            for d in drafters:
                for kind, style in (("chain", "o-"), ("tree", "s--"), ("dynamic", "^")):
                    pts = sorted(((r["verify_width"], r[key], r) for r in mine
                                  if r["drafter"] == d and _kind(r) == kind
                                  and r[key] is not None), key=lambda p: p[:2])
                    if not pts:
                        continue
                    ax.plot([p[0] for p in pts], [p[1] for p in pts], style, color=colors[d],
                            label=f"{d} {kind}", mfc="none" if kind != "chain" else None)
                    if kind != "chain":
                        for x, y, r in pts:
                            ax.annotate(shape_label(r), (x, y), fontsize=6, xytext=(3, 3),
                                        textcoords="offset points")
            ax.plot([1], [1.0], "D", color="grey", label="plain")  # width 1, one token a step
            ax.axhline(1.0, color="grey", lw=0.8)
            ax.xaxis.get_major_locator().set_params(integer=True)
            ax.set_xlabel("verify width (positions scored per target forward)")
            ax.set_ylabel(label)
            ax.set_title(f"{mode}, {group}", fontsize=9)
        ax_acc.legend(fontsize=7)
    fig.suptitle(f"trees against chains, {result['model']}, {result['date_utc']}, "
                 f"{result['machine']['torch_threads']} torch thread(s)", fontsize=9)
    fig.tight_layout()
    path = Path(out_dir) / "trees.png"
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
