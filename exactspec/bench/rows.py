"""The figures of one bench row: an engine's runs in one mode and workload, against plain's."""

from __future__ import annotations

import statistics

from exactspec.bench.figures import analytic_bound, fit_alpha
from exactspec.bench.specs import EngineSpec, Run, add_counts
from exactspec.engine.results import mean_acceptance_length


def _median(xs: list[float]) -> float:
    return statistics.median(xs) if xs else 0.0


def step_seconds(spec: EngineSpec, runs: list[Run]) -> float | None:
    """Seconds of one target step of the engine, pooled over `runs`: exactspec and llama.cpp,
    the target forward per forward of the batch (a speculative engine's is the verify
    forward over K+1 tokens); transformers plain, its wall time per token of the longest row
    (prefill and sampling included: it reports no split); None for transformers' speculative
    engines (their target forwards are not counted)."""
    if spec.family in ("exactspec", "llama.cpp"):
        forwards = sum(r.forwards for r in runs)
        return sum(r.target_seconds for r in runs) / forwards if forwards else None
    if spec.drafter == "none":
        tokens = sum(max(map(len, r.texts), default=0) for r in runs)
        return sum(r.seconds for r in runs) / tokens if tokens else None
    return None


def bandwidth_figures(spec: EngineSpec, runs: list[Run], weight_bytes: int | None,
                      read_gbs: float | None) -> dict:
    """weight_bytes (read per target step), step_ms, bandwidth_gbs (weight bytes / step time)
    and bandwidth (that over the read bandwidth measured on this machine); None when unknown."""
    step = step_seconds(spec, runs)
    gbs = weight_bytes / step / 1e9 if step and weight_bytes else None
    return {"weight_bytes": weight_bytes, "step_ms": 1e3 * step if step else None,
            "bandwidth_gbs": gbs, "bandwidth": gbs / read_gbs if gbs and read_gbs else None}


def first_token_figures(runs: list[Run]) -> dict:
    """ttft_ms: the median time to the first token (the prefill, which samples it) over the
    runs; decode_tokens_per_second: the tokens after each row's first over the time after the
    prefill. None where the engine reports no prefill time (transformers')."""
    timed = [r for r in runs if r.prefill_seconds > 0]
    if not timed:
        return {"ttft_ms": None, "decode_tokens_per_second": None}
    after = sum(r.tokens - len(r.texts) for r in timed)
    seconds = sum(r.seconds - r.prefill_seconds for r in timed)
    return {"ttft_ms": 1e3 * _median([r.prefill_seconds for r in timed]),
            "decode_tokens_per_second": after / seconds if seconds > 0 else None}


def engine_row(spec: EngineSpec, mode: str, workload: str, rounds: list[list[Run]],
               plain: list[list[Run]] | None, *, weight_bytes: int | None = None,
               read_gbs: float | None = None) -> dict:
    """One engine's figures in one mode and workload from its runs (rounds of Runs) and
    plain decoding's: medians over rounds, acceptance, alpha, c, the bound, w, the split, and
    the target step against the memory bandwidth (`bandwidth_figures`)."""
    tps = [sum(r.tokens for r in rr) / sum(r.seconds for r in rr) for rr in rounds if rr]
    flat = [r for rr in rounds for r in rr]
    tokens = sum(r.tokens for r in flat)
    seconds = sum(r.seconds for r in flat)
    steps = sum(r.steps for r in flat)
    drafted = sum(r.drafted for r in flat)
    accepted = sum(r.accepted for r in flat)
    app: list[int] = []
    dpp: list[int] = []
    for r in flat:
        app, dpp = add_counts(app, r.accepted_per_position), add_counts(dpp, r.drafted_per_position)
    row = {
        "engine": spec.name, "family": spec.family, "drafter": spec.drafter,
        "k": spec.k, "verify": spec.verify if spec.family == "exactspec" else None,
        "tree": spec.tree_json(), "verify_width": spec.verify_width,
        "mode": mode, "workload": workload,
        "tokens": tokens, "seconds": seconds,
        "tokens_per_second": _median(tps),
        "tokens_per_second_rounds": tps,
        "tokens_per_second_min": min(tps) if tps else 0.0,
        "tokens_per_second_max": max(tps) if tps else 0.0,
        **bandwidth_figures(spec, flat, weight_bytes, read_gbs),
        **first_token_figures(flat),
    }
    plain_tps = None
    if plain:
        pt = [sum(r.tokens for r in rr) / sum(r.seconds for r in rr) for rr in plain if rr]
        plain_tps = _median(pt)
    row["ratio_to_plain"] = row["tokens_per_second"] / plain_tps if plain_tps else None
    if spec.family != "exactspec":
        row.update(mean_acceptance_length=None, acceptance_rate=None, alpha=None,
                   mean_k=None, c=None, bound=None, share_of_bound=None, time_split=None,
                   target_width_cost=None, bound_with_width_cost=None,
                   verify_share_of_step=None, acceptance_by_position=None,
                   accepted_per_position=None, drafted_per_position=None)
        return row
    mean_len = mean_acceptance_length(tokens, steps)
    mean_k = drafted / steps if steps else 0.0  # a tree's: nodes drafted per step
    alpha = fit_alpha(mean_len, mean_k)
    c = None
    plain_flat = [r for rr in (plain or []) for r in rr]
    plain_steps = sum(r.steps for r in plain_flat)
    plain_target = sum(r.target_seconds for r in plain_flat)
    draft_s = sum(r.draft_seconds for r in flat)
    if drafted and plain_steps and plain_target > 0 and spec.tree is None:
        # per draft token; a tree's cost per forward is in the tree table (bench/trees.py)
        c = (draft_s / drafted) / (plain_target / plain_steps)
    bound = analytic_bound(alpha, mean_k, c) if c is not None else None
    # the bound assumes a target forward over K+1 tokens costs what one over 1 token does;
    # on a CPU it does not: the measured ratio, and the bound with it in place of 1
    target_s = sum(r.target_seconds for r in flat)
    width_cost = ((target_s / steps) / (plain_target / plain_steps)
                  if steps and plain_steps and plain_target > 0 else None)
    bound_w = None
    if c is not None and width_cost:
        bound_w = analytic_bound(alpha, mean_k, 0.0) / (mean_k * c + width_cost)
    split = {
        "prefill": sum(r.prefill_seconds for r in flat),
        "draft": draft_s,
        "target_forward": sum(r.target_seconds for r in flat),
        "standardize_verify": sum(r.verify_seconds for r in flat),
    }
    split["bookkeeping"] = max(0.0, seconds - sum(split.values()))
    decode = seconds - split["prefill"]
    row.update(
        steps=steps, drafted=drafted, accepted=accepted,
        mean_acceptance_length=mean_len,
        acceptance_rate=accepted / drafted if drafted else None,
        # a chain's law: for a tree neither alpha nor the chain bound means anything
        alpha=alpha if drafted and spec.tree is None else None, mean_k=mean_k, c=c,
        bound=bound,
        target_width_cost=width_cost, bound_with_width_cost=bound_w,
        share_of_bound=(row["ratio_to_plain"] / bound
                        if bound and row["ratio_to_plain"] is not None else None),
        time_split={k: v / seconds for k, v in split.items()} if seconds else None,
        verify_share_of_step=split["standardize_verify"] / decode if decode > 0 else None,
        accepted_per_position=app, drafted_per_position=dpp,
        # P(draft i kept | the step drafted an i-th token), i = 1..K
        acceptance_by_position=[a / d if d else 0.0 for a, d in zip(app, dpp, strict=False)],
    )
    return row


def merge_runs(a: Run, b: Run) -> Run:
    return Run(tokens=a.tokens + b.tokens, seconds=a.seconds + b.seconds, steps=a.steps + b.steps,
               forwards=a.forwards + b.forwards, texts=a.texts + b.texts,
               drafted=a.drafted + b.drafted, accepted=a.accepted + b.accepted,
               accepted_per_position=add_counts(a.accepted_per_position, b.accepted_per_position),
               drafted_per_position=add_counts(a.drafted_per_position, b.drafted_per_position),
               prefill_seconds=a.prefill_seconds + b.prefill_seconds,
               draft_seconds=a.draft_seconds + b.draft_seconds,
               target_seconds=a.target_seconds + b.target_seconds,
               verify_seconds=a.verify_seconds + b.verify_seconds)
