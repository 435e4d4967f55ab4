"""Acceptance length of EAGLE chains and token trees on the embedded smollm2-135m (no timing).

For each drafter configuration: mean acceptance length (tokens / target forwards, bonus
included), verify width (tokens per target forward: drafted nodes / steps + 1) and the
fraction of steps that accepted at least d drafts, d = 1, 2, ... (per-depth acceptance), over
the first PROMPTS held-out prompts (chat template), TOKENS new tokens, seed i for prompt i.

    .venv/bin/python scripts/tree_acceptance.py chain:4 dynamic:16:4:6 fixed:4,1,1,1:deterministic
    .venv/bin/python scripts/tree_acceptance.py --temperature 0 chain:4 dynamic:16

Configurations: chain:K (the head's chain, K drafts), dynamic:BUDGET[:TOP_K[:DEPTH]][@SIBLINGS]
(default deterministic, EAGLE-2's top-k), fixed:B1,B2,..[:SIBLINGS] (default
without_replacement).
"""

from __future__ import annotations

import argparse

import exactspec as es
from exactspec.drafters.eagle import load_drafter
from exactspec.training.data import read_prompts


def drafter_for(config: str, model):
    """(drafter, generate kwargs) for one configuration string."""
    kind, _, rest = config.partition(":")
    if kind == "chain":
        return load_drafter("smollm2-135m", target=model), {"num_draft_tokens": int(rest)}
    if kind == "dynamic":
        dyn, _, siblings = config.partition("@")
        return load_drafter("smollm2-135m", target=model, tree=dyn,
                            siblings=siblings or "deterministic"), {}
    if kind == "fixed":
        branching, _, siblings = rest.partition(":")
        tree = tuple(int(b) for b in branching.split(","))
        return load_drafter("smollm2-135m", target=model, tree=tree,
                            siblings=siblings or "without_replacement"), {}
    raise SystemExit(f"unknown configuration {config!r}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("configs", nargs="+")
    ap.add_argument("--temperature", type=float, default=1.0)
    ap.add_argument("--prompts", type=int, default=6)
    ap.add_argument("--tokens", type=int, default=64)
    args = ap.parse_args()
    model = es.load("smollm2-135m")
    prompts = [model.encode(p, chat=True) for p in read_prompts("heldout_prompts.txt")]
    prompts = prompts[: args.prompts]
    print(f"smollm2-135m + shipped EAGLE head, {len(prompts)} held-out prompts, "
          f"{args.tokens} tokens, T={args.temperature}", flush=True)
    for config in args.configs:
        drafter, kwargs = drafter_for(config, model)
        tokens = steps = drafted = 0
        depth: list[int] = []
        for i, ids in enumerate(prompts):
            params = es.SamplingParams(temperature=args.temperature, seed=i)
            g = es.generate(model, [ids], drafter=drafter, params=params,
                            max_new_tokens=args.tokens, **kwargs)[0]
            tokens += len(g.token_ids)
            steps += g.stats.steps
            drafted += g.stats.drafted
            acc = g.stats.accepted_per_position
            n = max(len(depth), len(acc))
            depth = [(depth[j] if j < len(depth) else 0) + (acc[j] if j < len(acc) else 0)
                     for j in range(n)]
        per_depth = " ".join(f"{a / steps:.2f}" for a in depth[:8])
        print(f"{config:32s} acceptance length {tokens / steps:.3f}  verify width "
              f"{drafted / steps + 1:5.1f}  steps {steps:4d}  P(>= d accepted) d=1..: "
              f"{per_depth}", flush=True)


if __name__ == "__main__":
    main()
