"""Acceptance of coupled verification against rejection sampling ("token") on the shipped
workloads (exactspec/bench/workloads.json), smollm2-135m, int8 self-draft and prompt lookup.

    .venv/bin/python scripts/coupled_acceptance.py [--k 4] [--seeds 2] [--max-new-tokens N]
        [--out FILE.json]

Every workload prompt (chat-templated) is one row of one batched `generate` per (drafter,
temperature, method, seed), at the workload's max_new_tokens; rows with the same seed draw the
same per-row streams under both methods. Prints one line per configuration: draft tokens
accepted / drafted, and tokens per target forward (mean acceptance length, the extra token
included), pooled over every row. Under "coupled" it also checks that each row's text equals
plain decoding's under "coupled" with the same seed (the seed's guarantee).
"""

from __future__ import annotations

import argparse
import itertools
import json
import logging
import time
from pathlib import Path

import exactspec as es
from exactspec.bench.harness import load_workloads

log = logging.getLogger("coupled_acceptance")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--k", type=int, default=4, help="draft tokens per step (fixed K)")
    ap.add_argument("--seeds", type=int, default=2, help="seeds per configuration")
    ap.add_argument("--out", type=Path, default=None, help="write the figures as JSON")
    ap.add_argument("--max-new-tokens", type=int, default=None,
                    help="cap every workload's max_new_tokens (default: the workload's own)")
    args = ap.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    target = es.load("smollm2-135m")
    cap = args.max_new_tokens or 1 << 30
    work = [([target.encode(p, chat=True) for p in w.prompts], min(cap, w.max_new_tokens))
            for w in load_workloads()]
    rows = []
    for temperature in (0.7, 1.0):
        for dname, make in (("int8", lambda: es.QuantizedDraft(bits=8)),
                            ("prompt_lookup", es.PromptLookup)):
            for verify in ("token", "coupled"):
                acc = drafted = emitted = steps = 0
                same = True
                t0 = time.perf_counter()
                for seed, (prompts, budget) in itertools.product(range(args.seeds), work):
                    params = [es.SamplingParams(temperature=temperature, seed=1000 * seed + i)
                              for i in range(len(prompts))]
                    gens = es.generate(target, prompts, drafter=make(), params=params,
                                       max_new_tokens=budget, num_draft_tokens=args.k,
                                       verify=verify)
                    for g in gens:
                        acc += g.stats.accepted
                        drafted += g.stats.drafted
                        emitted += g.stats.emitted
                        steps += g.stats.steps
                    if verify == "coupled" and dname == "int8":
                        plain = es.generate(target, prompts, params=params,
                                            max_new_tokens=budget, verify="coupled")
                        same &= [g.token_ids for g in plain] == [g.token_ids for g in gens]
                row = dict(temperature=temperature, drafter=dname, verify=verify, k=args.k,
                           accepted=acc, drafted=drafted, acceptance=acc / max(drafted, 1),
                           tokens_per_step=emitted / max(steps, 1), emitted=emitted,
                           same_as_plain=same if verify == "coupled" and dname == "int8"
                           else None, seconds=round(time.perf_counter() - t0, 1))
                rows.append(row)
                log.info("T=%.1f %-13s %-7s accepted %5d/%5d = %.3f  tokens/step %.3f  %s",
                         temperature, dname, verify, acc, drafted, row["acceptance"],
                         row["tokens_per_step"],
                         "" if row["same_as_plain"] is None else f"same as plain: {same}")
    if args.out is not None:
        args.out.write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
