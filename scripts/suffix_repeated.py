"""Repeated requests: suffix decoding's shared cache against prompt lookup (and plain).

Each drafter instance serves REPEATS + 1 requests of the same prompt in a row (seeds 0, 1, ...
at T=1; greedy repeats the same text), as a server answering the same question again would;
the first request warms SuffixDrafter's cache of earlier outputs (prompt lookup has none).
Reported per workload and mode, over the repeats only: tokens per target step (acceptance
length, bonus included), tok/s (tokens / wall time of the repeats) and the ratio to plain.
Writes OUT/repeated.json and prints a table:

    .venv/bin/python scripts/suffix_repeated.py --threads 2 --out docs/runs/bench_repeated
"""

from __future__ import annotations

import argparse
import json
import math
import time
from pathlib import Path

import torch

import exactspec as es
from exactspec.bench.harness import load_workloads

DRAFTERS = {"plain": lambda: None, "lookup": es.PromptLookup, "suffix": es.SuffixDrafter}


def serve_repeats(model, ids, make, temperature, tokens, repeats):
    """(acceptance length, tok/s) over `repeats` requests after one warm-up request."""
    drafter = make()
    steps = emitted = 0
    seconds = 0.0
    for r in range(repeats + 1):
        params = es.SamplingParams(temperature=temperature, seed=r)
        start = time.perf_counter()
        (g,) = es.generate(model, [ids], drafter=drafter, params=params,
                           max_new_tokens=tokens, **({} if drafter is None
                                                     else {"num_draft_tokens": 4}))
        if r:  # the first request only warms the cache
            seconds += time.perf_counter() - start
            steps += g.stats.steps
            emitted += len(g.token_ids)
    return emitted / steps, emitted / seconds


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--workloads", default="chat,code_edit,summarise")
    ap.add_argument("--max-new-tokens", type=int, default=48)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    model = es.load("smollm2-135m")
    works = {w.name: w for w in load_workloads()}
    es.generate(model, ["warm-up"], max_new_tokens=4)
    rows = []
    for mode, temperature in (("greedy", 0.0), ("t1", 1.0)):
        for name in args.workloads.split(","):
            ids = model.encode(works[name].prompts[0], chat=True)
            base = None
            for drafter, make in DRAFTERS.items():
                acc, speed = serve_repeats(model, ids, make, temperature, args.max_new_tokens,
                                           args.repeats)
                base = speed if drafter == "plain" else base
                rows.append(dict(mode=mode, workload=name, drafter=drafter, acceptance=acc,
                                 tok_s=speed, x_plain=speed / base))
                print(f"{mode:6s} {name:12s} {drafter:7s} acc len {acc:5.2f}  {speed:6.1f} tok/s"
                      f"  {speed / base:4.2f}x plain", flush=True)
    for mode in ("greedy", "t1"):
        for drafter in ("lookup", "suffix"):
            xs = [r["x_plain"] for r in rows if r["mode"] == mode and r["drafter"] == drafter]
            print(f"{mode:6s} {drafter:7s} geometric mean {math.prod(xs) ** (1 / len(xs)):.2f}x "
                  "plain")
    if args.out:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        (out / "repeated.json").write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
