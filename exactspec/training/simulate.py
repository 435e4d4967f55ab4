"""A minimal one-row speculative loop to measure a draft head before the engine passes features.

It uses the library's `verify` (no acceptance rule of its own) and `probs_from_logits`, a
transformers DynamicCache cropped after each verification, and feeds the drafter the target's
features exactly as the engine contract says (hidden[i] valid for i < length - 1). Temporary:
once `exactspec.generate` passes hidden states, measure with the engine's stats instead.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from transformers import DynamicCache

from exactspec.drafters.base import DraftContext, TargetInfo, history
from exactspec.drafters.eagle import EagleDrafter
from exactspec.sampling import RowStreams, SamplingParams, probs_from_logits, sample, verify


@dataclass
class SimStats:
    """Counts over every simulated step."""

    steps: int = 0  # target verification forwards
    emitted: int = 0  # tokens emitted (accepted + recovered / bonus)
    accepted_at: list[int] | None = None  # accepted_at[k]: steps whose first k+1 drafts passed

    def add(self, n: int, k: int) -> None:
        if self.accepted_at is None:
            self.accepted_at = [0] * k
        self.steps += 1
        self.emitted += n + 1
        for i in range(n):
            self.accepted_at[i] += 1

    def as_dict(self) -> dict:
        acc = self.accepted_at or []
        steps = max(self.steps, 1)
        return {"steps": self.steps, "mean_acceptance_length": round(self.emitted / steps, 4),
                "accept_first_k": [round(a / steps, 4) for a in acc]}


@torch.inference_mode()
def simulate(model, drafter: EagleDrafter, prompt: list[int], params: SamplingParams, *,
             max_new_tokens: int, k: int, seed: int, eos: list[int],
             stats: SimStats, method: str = "token") -> list[int]:
    """Generate one reply speculatively; returns the new tokens and updates `stats`."""
    layers = drafter.hidden_layers
    cache = DynamicCache(config=model.config)
    out = model(input_ids=torch.tensor([prompt]), cache=cache, use_cache=True,
                output_hidden_states=True)
    feats = torch.cat([out.hidden_states[i] for i in layers], -1)[0]  # [P, L*H]
    tokens = list(prompt)
    plen = len(prompt)
    streams = RowStreams.from_seed(seed, 1)
    p0 = probs_from_logits(out.logits[:, -1], params, torch.tensor([tokens]), plen)
    tokens.append(int(sample(p0, streams)[0]))
    streams.advance()
    feats_len = len(prompt)  # the target has run tokens[:feats_len]; cache holds them
    first = True
    while len(tokens) - plen < max_new_tokens and tokens[-1] not in eos:
        ctx = DraftContext(torch.tensor([tokens]), torch.tensor([len(tokens)]),
                           torch.tensor([plen]), params, streams)
        ctx.hidden = feats[None]  # [1, T-1, L*H] valid for i < len - 1
        if first:
            drafter.begin(ctx, TargetInfo(model.config.vocab_size, None))
            first = False
        drafts, q = drafter.propose(ctx, torch.tensor([k]))
        run = torch.tensor([[tokens[-1], *drafts[0].tolist()]])
        o = model(input_ids=run, cache=cache, use_cache=True, output_hidden_states=True)
        hist = history(ctx, drafts)
        ends = torch.arange(len(tokens), len(tokens) + k + 1)[None, :]
        prev = (hist[:, None, :].expand(1, k + 1, -1).masked_fill(
            torch.arange(hist.shape[1])[None, None, :] >= ends[..., None], -1)
            if params.uses_history else None)
        p = probs_from_logits(o.logits, params, prev, plen)  # [1, K+1, V]
        verdict = verify(p, drafts, q, method=method, generator=streams)
        n = int(verdict.num_accepted[0])
        new = verdict.tokens[0, : n + 1].tolist()
        stats.add(n, k)
        f_new = torch.cat([o.hidden_states[i] for i in layers], -1)[0, : n + 1]
        feats = torch.cat([feats, f_new])  # features of tokens[-1] and the accepted drafts
        cache.crop(-(k - n))  # keep tokens[-1] and the n accepted drafts
        feats_len += n + 1
        tokens.extend(new)
        streams.advance()
    return tokens[plen:]
