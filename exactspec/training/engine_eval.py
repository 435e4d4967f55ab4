"""A draft head measured through the engine on held-out prompts: acceptance and speed.

`evaluate_head` (run by `train-draft`) is teacher-forced along recorded replies; this runs the
real decode loop (`exactspec.generate`) and reads its `GenerationStats`:

    python -m exactspec.training.engine_eval smollm2-135m --out eval.json
    python -m exactspec.training.engine_eval OUT/head --k 4 --max-new-tokens 64

Acceptance: all held-out prompts in one batch, K drafts per step, T=1 and greedy; mean
acceptance length = emitted tokens / target forwards (the bonus token counted), P(first k
accepted) = steps that kept draft k / steps that drafted it. Speed: batch 1, the first
`--speed-prompts` prompts, plain decoding and the head (fixed K and "auto") interleaved
prompt by prompt with the same seed; tokens/s = tokens / wall time, summed over prompts.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch
from tqdm.auto import tqdm

from exactspec.drafters.eagle import load_drafter
from exactspec.engine.api import generate
from exactspec.engine.results import GenerationStats, mean_acceptance_length
from exactspec.errors import UserError
from exactspec.models.loading import load, progress_off
from exactspec.sampling import SamplingParams
from exactspec.training.data import read_prompts

MODES = {"t1": 1.0, "greedy": 0.0}  # name -> temperature


def acceptance(model, drafter, prompts: list[list[int]], *, temperature: float, k: int,
               max_new_tokens: int, seed: int = 1) -> dict:
    """Engine statistics summed over `prompts` decoded in one batch with `k` drafts a step."""
    gens = generate(model, prompts, drafter=drafter, max_new_tokens=max_new_tokens,
                    params=SamplingParams(temperature=temperature, seed=seed),
                    num_draft_tokens=k)
    total = GenerationStats.total(g.stats for g in gens)
    steps, emitted, drafted, accepted = total.steps, total.emitted, total.drafted, total.accepted
    kept = (total.accepted_per_position + [0] * k)[:k]
    tried = (total.drafted_per_position + [0] * k)[:k]
    return {"rows": len(gens), "steps": steps, "emitted": emitted,
            "mean_acceptance_length": round(mean_acceptance_length(emitted, steps), 3),
            "acceptance_rate": round(accepted / max(drafted, 1), 3),
            "accept_first_k": [round(a / max(t, 1), 3) for a, t in zip(kept, tried, strict=True)]}


def speed(model, drafter, prompts: list[list[int]], *, temperature: float, k: int,
          max_new_tokens: int, seed: int = 1) -> dict:
    """tokens/s at batch 1: plain, the head at K=k and at "auto", interleaved per prompt."""
    engines = {"plain": (None, 1), f"K={k}": (drafter, k), "auto": (drafter, "auto")}
    params = SamplingParams(temperature=temperature, seed=seed)
    generate(model, prompts[:1], drafter=drafter, params=params, max_new_tokens=8)  # warm-up
    tokens = dict.fromkeys(engines, 0)
    seconds = dict.fromkeys(engines, 0.0)
    for ids in prompts:
        for name, (d, kk) in engines.items():
            start = time.perf_counter()
            g = generate(model, [ids], drafter=d, params=params, max_new_tokens=max_new_tokens,
                         num_draft_tokens=kk)[0]
            seconds[name] += time.perf_counter() - start
            tokens[name] += g.stats.emitted
    tps = {name: tokens[name] / seconds[name] for name in engines}
    return {"tok_s": {n: round(v, 2) for n, v in tps.items()},
            "speedup": {n: round(v / tps["plain"], 3) for n, v in tps.items() if n != "plain"},
            "prompts": len(prompts), "max_new_tokens": max_new_tokens}


def main(argv: list[str] | None = None) -> int:
    """Run the evaluation; a user's mistake (no such head, a head for another target) is one
    line on stderr and exit status 2, as in the `exactspec` command."""
    ap = argparse.ArgumentParser(prog="python -m exactspec.training.engine_eval",
                                 description=__doc__.splitlines()[0])
    ap.add_argument("head", help="an embedded name with a shipped head, or a head directory")
    ap.add_argument("--model", default="smollm2-135m", help="the target")
    ap.add_argument("--k", type=int, default=4, help="drafts per step (default 4)")
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--speed-prompts", type=int, default=4)
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--out", default=None, help="write the figures as JSON here")
    a = ap.parse_args(argv)
    try:
        _run(a)
    except UserError as exc:
        print(f"{ap.prog}: error: {' '.join(str(exc).split())}", file=sys.stderr)
        return 2
    return 0


def _run(a: argparse.Namespace) -> None:
    if a.threads:
        torch.set_num_threads(a.threads)
    drafter = load_drafter(a.head)  # first: a wrong head is refused before the model loads
    model = load(a.model)
    drafter.attach(model)
    prompts = [model.encode(p, chat=True) for p in read_prompts("heldout_prompts.txt")]
    result = {"head": a.head, "k": a.k, "threads": torch.get_num_threads(),
              "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())}
    for mode, temp in tqdm(MODES.items(), desc="engine eval", disable=progress_off()):
        result[mode] = acceptance(model, drafter, prompts, temperature=temp, k=a.k,
                                  max_new_tokens=a.max_new_tokens)
        result[mode]["speed"] = speed(model, drafter, prompts[: a.speed_prompts],
                                      temperature=temp, k=a.k,
                                      max_new_tokens=a.max_new_tokens)
        print(mode, json.dumps(result[mode]), flush=True)
    if a.out:
        Path(a.out).write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    sys.exit(main())
