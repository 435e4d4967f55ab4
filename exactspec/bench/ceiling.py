"""How fast a drafter can make the target on this machine, as a function of acceptance length.

A scripted drafter proposes K tokens of the target's own greedy reply (recorded by a plain run)
with exactly the first `a` of them right and the rest wrong, so under greedy verification every
step accepts `a` drafts and emits a + 1 tokens: acceptance length L = a + 1, set by hand. The
tokens/s it reaches against plain decoding is then the best any drafter with that acceptance
length can do here, because the drafter itself costs nothing. Run a second time with a trained
head drafting first (its features filled by the engine, its proposals computed and discarded)
it gives the ceiling of that head: the speed it would reach if it drafted as well as `a`.

    python -m exactspec.bench.ceiling --head smollm2-135m --threads 2 --out docs/runs/ceiling.json

Batch 1, the first `--prompts` held-out prompts, every configuration interleaved with plain
decoding prompt by prompt; tokens/s = tokens / wall time summed over prompts. Temperature does
not change the cost of a step beyond standardize + verify (1-4% of a step, `exactspec bench`),
so the greedy figures stand for T=1 at the same acceptance length.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch
from tqdm.auto import tqdm

from exactspec.drafters.base import DraftContext, TargetInfo
from exactspec.engine.api import generate
from exactspec.sampling import SamplingParams

GREEDY = SamplingParams(temperature=0.0)


class ScriptedDrafter:
    """Proposes each row's recorded greedy reply with the first `right` tokens of every draft
    right and the others wrong (the right token + 1). `inner`: a real drafter run first for its
    cost only (its proposals are discarded)."""

    standardized_q = True  # point masses, not re-checked (base.trusts_q)

    def __init__(self, replies: list[list[int]], right: int, vocab: int, inner=None) -> None:
        self.replies = [torch.tensor(r, dtype=torch.long) for r in replies]
        self.right, self.vocab, self.inner = right, vocab, inner
        # the engine fills the target's features as it does for the inner drafter
        self.hidden_layers = inner.hidden_layers if inner is not None else None
        self._rows = list(range(len(replies)))

    def begin(self, context: DraftContext, target: TargetInfo) -> None:
        self._rows = list(range(context.tokens.shape[0]))
        if self.inner is not None:
            self.inner.begin(context, target)

    def propose(self, context: DraftContext, num_tokens: torch.Tensor):
        if self.inner is not None:
            self.inner.propose(context, num_tokens)
        k = int(num_tokens.max()) if num_tokens.numel() else 0
        out = torch.full((len(self._rows), k), -1, dtype=torch.long)
        for b, row in enumerate(self._rows):
            at = int(context.lengths[b] - context.prompt_lengths[b])  # reply tokens so far
            ref = self.replies[row][at : at + int(num_tokens[b])].clone()
            ref[self.right :] = (ref[self.right :] + 1) % self.vocab
            out[b, : len(ref)] = ref
        return out.to(context.tokens.device), None

    def select(self, rows: torch.Tensor) -> None:
        self._rows = [self._rows[int(i)] for i in rows]
        if self.inner is not None:
            self.inner.select(rows)


def measure(model, prompts: list[list[int]], *, k: int, max_new_tokens: int,
            head=None, head_name: str = "head") -> list[dict]:
    """One row per (drafter cost, a): acceptance length measured, tokens/s, speed vs plain."""
    from exactspec.models.adapter import unwrap_model

    vocab = unwrap_model(model).config.vocab_size
    replies = [generate(model, [p], params=GREEDY, max_new_tokens=max_new_tokens)[0].token_ids
               for p in prompts]
    costs = {"free": None} if head is None else {"free": None, head_name: head}
    configs = [(c, a) for c in costs for a in range(k + 1)]
    tokens = {cfg: 0 for cfg in configs} | {"plain": 0}
    seconds = {cfg: 0.0 for cfg in configs} | {"plain": 0.0}
    steps = dict.fromkeys(configs, 0)
    generate(model, prompts[:1], params=GREEDY, max_new_tokens=8)  # warm-up
    for i, ids in enumerate(tqdm(prompts, desc="ceiling", unit="prompt")):
        for cfg in ["plain", *configs]:
            drafter, kk = None, 1
            if cfg != "plain":
                cost, a = cfg
                drafter, kk = ScriptedDrafter([replies[i]], a, vocab, costs[cost]), k
            start = time.perf_counter()
            g = generate(model, [ids], drafter=drafter, params=GREEDY,
                         max_new_tokens=max_new_tokens, num_draft_tokens=kk)[0]
            seconds[cfg] += time.perf_counter() - start
            tokens[cfg] += g.stats.emitted
            if cfg != "plain":
                steps[cfg] += g.stats.steps
    plain = tokens["plain"] / seconds["plain"]
    rows = [{"drafter_cost": "none (plain decoding)", "right": None,
             "acceptance_length": 1.0, "tok_s": round(plain, 2), "speedup": 1.0}]
    for cfg in configs:
        tps = tokens[cfg] / seconds[cfg]
        rows.append({"drafter_cost": cfg[0], "right": cfg[1],
                     "acceptance_length": round(tokens[cfg] / max(steps[cfg], 1), 3),
                     "tok_s": round(tps, 2), "speedup": round(tps / plain, 3)})
    return rows


def table(rows: list[dict], k: int) -> str:
    """Markdown: speed against acceptance length, free drafter and the head's cost."""
    lines = [f"| drafts right per step (K={k}) | acceptance length | drafter cost | tok/s "
             "| speedup vs plain |", "|---|---|---|---|---|"]
    for r in rows:
        right = "-" if r["right"] is None else str(r["right"])
        lines.append(f"| {right} | {r['acceptance_length']:.2f} | {r['drafter_cost']} "
                     f"| {r['tok_s']:.1f} | {r['speedup']:.2f}x |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    from exactspec.drafters.registry import DrafterSpec, build
    from exactspec.models.loading import load
    from exactspec.training.data import read_prompts

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2-135m", help="the target")
    ap.add_argument("--head", default=None,
                    help="also measure with this head's drafting cost (embedded name or directory)")
    ap.add_argument("--qdraft", type=int, choices=(8, 4), default=None,
                    help="also measure with the quantized self-draft's cost (QuantizedDraft)")
    ap.add_argument("--k", type=int, default=4, help="drafts per step (default 4)")
    ap.add_argument("--prompts", type=int, default=4, help="held-out prompts (default 4)")
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--out", default=None, help="write the rows as JSON here")
    a = ap.parse_args(argv)
    if a.threads:
        torch.set_num_threads(a.threads)
    model = load(a.model)
    if a.head and a.qdraft:
        ap.error("give --head or --qdraft, not both")
    head, name = (build(DrafterSpec("eagle", a.head), model), "head") if a.head else (None,
                                                                                       "head")
    if a.qdraft:
        head = build(DrafterSpec("quantized-draft", a.qdraft), model)
        name = f"qdraft {a.qdraft}-bit ({head.backend})"
    prompts = [model.encode(p, chat=True) for p in read_prompts("heldout_prompts.txt")]
    rows = measure(model, prompts[: a.prompts], k=a.k, max_new_tokens=a.max_new_tokens,
                   head=head, head_name=name)
    print(table(rows, a.k))
    if a.out:
        meta = {"model": a.model, "head": a.head, "qdraft": a.qdraft, "k": a.k, "prompts": a.prompts,
                "max_new_tokens": a.max_new_tokens, "threads": torch.get_num_threads(),
                "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())}
        Path(a.out).write_text(json.dumps({**meta, "rows": rows}, indent=2) + "\n")


if __name__ == "__main__":
    main()
