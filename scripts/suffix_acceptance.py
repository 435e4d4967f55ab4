"""Suffix decoding against prompt lookup per target step (no timing): mean acceptance length
(tokens per target forward, bonus included) and verify width (1 + drafted per step) on the
bench's input-grounded workloads, smollm2-135m, K = 4, 48 new tokens, T = 1 summed over seeds
0 .. SEEDS-1, greedy once. The README's suffix table (Suffix decoding):

    .venv/bin/python scripts/suffix_acceptance.py 2
"""

from __future__ import annotations

import sys

import torch

import exactspec as es
from exactspec.bench.harness import load_workloads

WORKLOADS = ("code_edit", "list_transform", "summarise")
DRAFTERS = {
    "PromptLookup()": es.PromptLookup,
    "SuffixDrafter(spec_factor=1)": lambda: es.SuffixDrafter(spec_factor=1.0),
    "SuffixDrafter()": es.SuffixDrafter,
    "SuffixDrafter(min_prob=0.02)": lambda: es.SuffixDrafter(min_prob=0.02),
    "SuffixDrafter(branches=3, depth=6, tree_nodes=8)":
        lambda: es.SuffixDrafter(branches=3, depth=6, tree_nodes=8),
}


def main() -> None:
    seeds = range(int(sys.argv[1]) if len(sys.argv) > 1 else 2)
    torch.set_num_threads(1)  # a shared machine: one thread each is steadier
    model = es.load("smollm2-135m")
    works = {w.name: w for w in load_workloads()}
    prompts = {n: model.encode(works[n].prompts[0], chat=True) for n in WORKLOADS}
    for mode, temperature in (("t1", 1.0), ("greedy", 0.0)):
        for name, make in DRAFTERS.items():
            cells = []
            for n in WORKLOADS:
                steps = emitted = drafted = 0
                for s in seeds if temperature else [0]:
                    (g,) = es.generate(model, [prompts[n]], drafter=make(), max_new_tokens=48,
                                       num_draft_tokens=4, params=es.SamplingParams(
                                           temperature=temperature, seed=s))
                    steps += g.stats.steps
                    emitted += g.stats.emitted
                    drafted += g.stats.drafted
                cells.append(f"{n}: acc len {emitted / steps:.2f} width "
                             f"{1 + drafted / steps:.2f}")
            print(f"{mode:6s} {name:50s}", " | ".join(cells), flush=True)


if __name__ == "__main__":
    main()
