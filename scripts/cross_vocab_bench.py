"""The cross-vocabulary pair on the bench's workloads: target gemma3-270m, plain against
`CrossVocabDraft(smollm2-135m)` (TLI when sampling, SLEM when greedy) and against gemma3's own
int8 self-draft (`QuantizedDraft(8)`: a quantized copy of its transformers model, K =
--quantized-k), per workload, mode and drafter:
tokens per target step (mean acceptance length, bonus included), draft acceptance rate, verify
width (tokens per target forward), tok/s (median of ROUNDS timed calls after a warm-up) and the
ratio to plain; the vocabulary overlap once. Writes OUT/cross_vocab.json and prints a table.
A study script, not `exactspec bench` (whose harness runs one target): time it on an idle
machine, e.g.

    PYTHONPATH=. .venv/bin/python scripts/cross_vocab_bench.py --threads 2 --rounds 3 \
        --workloads code_edit,list_transform,summarise,chat --quantized-k 4 \
        --out docs/runs/bench_cross_vocab

gemma3 is not a Llama architecture, so its self-draft runs on the generic path (every linear
layer int8, transformers' forward), not the lean forward smollm2's self-draft uses.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

import exactspec as es
from exactspec.bench.harness import load_workloads
from exactspec.drafters import CrossVocabDraft

MODES = {"greedy": es.SamplingParams(temperature=0), "t1": es.SamplingParams(temperature=1.0)}


def timed(target, ids, drafter, params, tokens, k, rounds, seed):
    """(Generation of the first round, median tok/s over `rounds`), after one warm-up call."""
    kw = dict(drafter=drafter, max_new_tokens=tokens, num_draft_tokens=k)
    es.generate(target, [ids], params=params, **{**kw, "max_new_tokens": 4})
    speeds, first = [], None
    for r in range(rounds):
        p = params if params.is_greedy else es.SamplingParams(temperature=1.0, seed=seed + r)
        start = time.perf_counter()
        (g,) = es.generate(target, [ids], params=p, **kw)
        speeds.append(len(g.token_ids) / (time.perf_counter() - start))
        if first is None:
            first = g
    return first, statistics.median(speeds)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--workloads", default="code_edit,list_transform,summarise")
    ap.add_argument("--modes", default="greedy,t1")
    ap.add_argument("--max-new-tokens", type=int, default=48)
    ap.add_argument("--k", type=int, default=3)
    ap.add_argument("--drafters", default="cross_vocab,int8_self")
    ap.add_argument("--quantized-k", type=int, default=4, help="K of the int8 self-draft")
    ap.add_argument("--rounds", type=int, default=1)
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    target, draft = es.load("gemma3-270m"), es.load("smollm2-135m")
    drafter = CrossVocabDraft(draft)
    every = {"cross_vocab": (drafter, args.k),
             "int8_self": (es.QuantizedDraft(8), args.quantized_k)}  # name -> (drafter, K)
    drafters = {name: every[name] for name in args.drafters.split(",")}
    works = {w.name: w for w in load_workloads()}
    rows = []
    for name in args.workloads.split(","):
        ids = target.encode(works[name].prompts[0], chat=True)
        for mode in args.modes.split(","):
            plain, plain_speed = timed(target, ids, None, MODES[mode], args.max_new_tokens, 0,
                                       args.rounds, 0)
            for label, (d, k) in drafters.items():
                g, speed = timed(target, ids, d, MODES[mode], args.max_new_tokens, k,
                                 args.rounds, 0)
                st = g.stats
                rows.append({"workload": name, "mode": mode, "drafter": label, "k": k,
                             "mean_acceptance_length": st.emitted / st.steps,
                             "acceptance_rate": st.accepted / st.drafted if st.drafted else None,
                             "verify_width": 1 + st.drafted / st.steps,
                             "plain_tokens_per_second": plain_speed, "tokens_per_second": speed,
                             "ratio_to_plain": speed / plain_speed,
                             "greedy_equals_plain": (g.token_ids == plain.token_ids
                                                     if mode == "greedy" else None)})
                r = rows[-1]
                print(f"{name:15s} {mode:6s} {label:11s} K={k} acc len "
                      f"{r['mean_acceptance_length']:.2f}  width {r['verify_width']:.2f}  plain "
                      f"{plain_speed:5.1f} tok/s  drafted {speed:5.1f} tok/s  "
                      f"{r['ratio_to_plain']:.2f}x", flush=True)
    overlap = None
    if "cross_vocab" in drafters:  # the map is built at its first begin
        m = drafter.map
        overlap = {"shared_tokens": m.overlap, "draft_readable": m.draft_size,
                   "target_readable": m.target_size, "of_draft": m.overlap / m.draft_size,
                   "of_target": m.overlap / m.target_size}
        print(f"vocabulary overlap: {m.overlap:,} shared tokens = {overlap['of_draft']:.1%} of "
              f"smollm2's {m.draft_size:,} readable tokens, {overlap['of_target']:.1%} of gemma3's "
              f"{m.target_size:,}")
    if args.out:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        (out / "cross_vocab.json").write_text(json.dumps(
            {"date_utc": time.strftime("%Y-%m-%d %H:%M", time.gmtime()), "config": vars(args),
             "overlap": overlap, "results": rows}, indent=1))


if __name__ == "__main__":
    main()
