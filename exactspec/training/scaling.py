"""Held-out alpha of a draft head against the amount of training data and of training steps.

    python -m exactspec.training.scaling OUT --steps 300 --fractions 0.0625,0.25,1 \\
        --out docs/runs/head_scaling.json
    python -m exactspec.training.scaling OUT --steps 300,600 --fractions 1

OUT is a `train-draft` output directory: its `data/train` and `data/heldout` are reused, nothing
is generated. For every fraction f a head is trained from the same initialisation, with the
shipped recipe (TrainConfig defaults), on the replies to a random f of the training prompts
(both replies of a prompt go together) for exactly `--steps` optimizer steps, so every fraction
gets the same compute, and evaluated teacher-forced on the held-out replies (`evaluate_head`).
Several `--steps` train every fraction for each of them.

The fit is least squares of depth-1 alpha on log2 of whichever varies (training tokens or
steps); its extrapolation to the alpha an acceptance-length target needs is rough (curves
bend), but it says how many doublings of data or of training stand between a head and the
target.
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import random
import tempfile
import time
from pathlib import Path

import torch

from exactspec.training.data import Sequence, draft_vocab, load_parts
from exactspec.training.evaluate import evaluate_head
from exactspec.training.train import TrainConfig, fit, init_head


def by_prompt(seqs: list[Sequence]) -> list[list[Sequence]]:
    """Sequences grouped by their prompt tokens, in first-seen order."""
    groups: dict[tuple[int, ...], list[Sequence]] = {}
    for s in seqs:
        groups.setdefault(tuple(s.tokens[: s.prompt_len].tolist()), []).append(s)
    return list(groups.values())


def chain_alpha(length: float, k: int) -> float:
    """The per-draft alpha a K-draft chain needs for mean acceptance length `length`, when every
    depth accepts with the same alpha: 1 + a + ... + a^K = length (bisection)."""
    lo, hi = 0.0, 1.0
    for _ in range(60):
        a = (lo + hi) / 2
        lo, hi = (a, hi) if sum(a**i for i in range(k + 1)) < length else (lo, a)
    return (lo + hi) / 2


def log_fit(xs: list[int], alpha: list[float]) -> tuple[float, float]:
    """Least squares alpha = c + slope * log2(x): (c, slope per doubling of x)."""
    x = [math.log2(t) for t in xs]
    mx, my = sum(x) / len(x), sum(alpha) / len(alpha)
    sxx = sum((v - mx) ** 2 for v in x)
    slope = sum((v - mx) * (w - my) for v, w in zip(x, alpha, strict=True)) / sxx if sxx else 0.0
    return my - slope * mx, slope


def scaling(model, data_dir: Path, fractions: list[float], steps: int | list[int], *,
            cfg: TrainConfig | None = None, seed: int = 0) -> list[dict]:
    """One row per (fraction, steps): data used, train-batch alpha at the end, held-out eval."""
    base = cfg or TrainConfig()
    tm = model.model
    groups = by_prompt(load_parts(data_dir / "train"))
    random.Random(seed).shuffle(groups)
    held = load_parts(data_dir / "heldout")
    vocab_ids = draft_vocab(data_dir / "train", base.draft_vocab_size, model.eos_token_ids)
    rows = []
    for frac, n_steps in itertools.product(fractions, [steps] if isinstance(steps, int) else steps):
        n = max(1, round(frac * len(groups)))
        sub = [s for g in groups[:n] for s in g]
        run = TrainConfig(**{**base.__dict__, "minutes": 0.0, "max_steps": n_steps})
        head = init_head(run, tm, vocab_ids)
        start = time.time()
        with tempfile.TemporaryDirectory() as tmp:
            state = fit(head, tm, sub, run, Path(tmp) / "checkpoint.pt", desc=f"fraction {frac}")
        last = state["history"][-min(50, len(state["history"])):]
        ev = evaluate_head(head, held, depth=run.eval_depth)
        rows.append({"fraction": frac, "prompts": n, "sequences": len(sub),
                     "tokens": sum(len(s.tokens) for s in sub), "steps": state["step"],
                     "train_alpha1_last50": round(sum(h["depth"][0][1] for h in last) / len(last), 4),
                     "seconds": round(time.time() - start), "t1": ev["t1"], "greedy": ev["greedy"]})
    return rows


def summary(rows: list[dict], k: int = 4, along: str = "tokens") -> dict:
    """Slope of depth-1 alpha per doubling of `along` ("tokens" of data or optimizer "steps")
    and how much of it a target would need, the rest held as in `rows`."""
    out = {}
    xs = [r[along] for r in rows]
    for mode, length in (("t1", 2.5), ("greedy", 3.0)):
        alpha = [r[mode]["alpha_by_depth"][0] for r in rows]
        c, slope = log_fit(xs, alpha)
        need = chain_alpha(length, k)
        at_most = c + slope * math.log2(max(xs))  # the fitted line at the largest x
        doublings = (need - at_most) / slope if slope > 0 else math.inf
        out[mode] = {"target_acceptance_length": length, "alpha_needed": round(need, 3),
                     "alpha1_slope_per_doubling": round(slope, 4),
                     "doublings_needed": round(doublings, 1),
                     # None: beyond 2^60 times the largest x, i.e. out of any reach
                     f"{along}_needed": (round(max(xs) * 2**doublings) if doublings < 60
                                         else None)}
    return out


def table(rows: list[dict]) -> str:
    lines = ["| training prompts | tokens | steps | alpha1 on training batches | held-out alpha by depth, T=1 "
             "| held-out alpha by depth, greedy | acceptance length T=1 / greedy (teacher-forced) |",
             "|---|---|---|---|---|---|---|"]
    for r in rows:
        a1 = ", ".join(f"{a:.2f}" for a in r["t1"]["alpha_by_depth"])
        ag = ", ".join(f"{a:.2f}" for a in r["greedy"]["alpha_by_depth"])
        lines.append(f"| {r['prompts']} | {r['tokens']:,} | {r['steps']} "
                     f"| {r['train_alpha1_last50']:.2f} | {a1} "
                     f"| {ag} | {r['t1']['mean_acceptance_length']:.2f} / "
                     f"{r['greedy']['mean_acceptance_length']:.2f} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    from exactspec.models.loading import load

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("run", help="a train-draft output directory (its data/ is reused)")
    ap.add_argument("--model", default="smollm2-135m", help="the target the data came from")
    ap.add_argument("--steps", default="300",
                    help="optimizer steps per run; comma-separated for several (default 300)")
    ap.add_argument("--fractions", default="0.0625,0.25,1",
                    help="comma-separated fractions of the training prompts")
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--out", default=None, help="write rows and fit as JSON here")
    a = ap.parse_args(argv)
    if a.threads:
        torch.set_num_threads(a.threads)
    fractions = [float(f) for f in a.fractions.split(",")]
    if not fractions or any(not 0 < f <= 1 for f in fractions):
        ap.error("--fractions must be numbers in (0, 1]")
    steps = [int(s) for s in a.steps.split(",")]
    if any(s < 1 for s in steps):
        ap.error("--steps must be positive")
    rows = scaling(load(a.model), Path(a.run) / "data", fractions, steps)
    # fit along whichever of data and steps varies (no fit for a grid or a single run)
    varies = [name for name, v in (("tokens", fractions), ("steps", steps)) if len(v) > 1]
    fit_ = summary(rows, along=varies[0]) if len(varies) == 1 else {}
    print(table(rows))
    print(json.dumps(fit_, indent=2))
    if a.out:
        meta = {"run": str(a.run), "steps": steps, "threads": torch.get_num_threads(),
                "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())}
        Path(a.out).write_text(json.dumps({**meta, "rows": rows, "fit": fit_}, indent=2) + "\n")


if __name__ == "__main__":
    main()
