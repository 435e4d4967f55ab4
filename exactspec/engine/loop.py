"""The decode loop for one batch of rows: propose -> target forward -> verify -> emit -> stop.

Invariant: the target's KV cache holds every token of a row but the last, which is fed at the
next step together with the drafts, so one forward of width K+1 scores all K drafts and gives
the distribution of the bonus token. Rows accept different numbers of tokens (ragged); a row
that ends leaves the batch at the end of the step.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import torch

from exactspec.drafters.base import DraftContext, Drafter, TargetInfo, history, prefix_history
from exactspec.drafters.draft_model import DraftModel
from exactspec.drafters.eagle import EagleDrafter
from exactspec.drafters.prompt_lookup import PromptLookup
from exactspec.engine.policy import DraftLengthPolicy
from exactspec.engine.results import GenerationStats
from exactspec.engine.stopping import StopRule
from exactspec.errors import InvalidValue
from exactspec.models.adapter import TargetAdapter
from exactspec.models.loading import Model
from exactspec.sampling import (
    DOMAIN_SAMPLE,
    RowStreams,
    SamplingParams,
    Verdict,
    acceptance_law,
    probs_from_logits,
    sample,
    verify,
)

VerifyFn = Callable[..., Verdict]
# drafters whose q is made by probs_from_logits inside exactspec: not re-validated per step
TRUSTED_DRAFTERS = (DraftModel, EagleDrafter, PromptLookup)


def check_draft_probs(drafter: Drafter, p: torch.Tensor, drafts: torch.Tensor,
                      q: torch.Tensor) -> None:
    """A user drafter's q ([B, K, V]) must be the distributions its drafts ([B, K]) came from:
    finite, non-negative, summing to 1, with q(x) > 0 at each draft token."""
    try:
        acceptance_law(p, drafts, q, method="token", check=True)
    except ValueError as e:
        raise InvalidValue(f"drafter {type(drafter).__name__} returned draft_probs that cannot "
                           f"be the q its draft tokens were drawn from: {e}") from None


@dataclass
class DecodeConfig:
    """Everything about how rows are decoded, shared by every batch of one `generate` call."""

    params: SamplingParams  # p and q are standardized with these
    max_new_tokens: int  # per row
    num_draft_tokens: int | str  # K, or "auto"
    verify: str | VerifyFn  # "token" | "block" | "greedy" | a callable with verify's signature
    return_logprobs: bool  # collect log p of each emitted token
    eos_token_ids: list[int]  # tokens that end a row
    stop: list[str]  # strings that end a row
    tokenizer: object | None  # for stop strings


@dataclass
class RowOutput:
    """One row's growing output inside the loop."""

    tokens: list[int] = field(default_factory=list)  # generated token ids
    logprobs: list[float] = field(default_factory=list)  # log p per token, if asked
    stats: GenerationStats = field(default_factory=GenerationStats)
    finish_reason: str | None = None  # set when the row ends
    cut: int | None = None  # where a stop string starts in the decoded text


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class BatchDecoder:
    """Decodes one batch of prompts; `run()` yields (row, new token ids) after every step."""

    def __init__(self, target: Model, drafter: Drafter | None, prompts: list[list[int]],
                 streams: RowStreams, cfg: DecodeConfig) -> None:
        self.target = target
        self.drafter = drafter
        self.prompts = prompts  # [B] token lists, each non-empty
        self.streams = streams  # one stream per row, identities from the caller's row index
        self.cfg = cfg
        self.outputs = [RowOutput() for _ in prompts]  # indexed like `prompts`

    @torch.inference_mode()
    def run(self) -> Iterator[tuple[int, list[int]]]:
        cfg, params = self.cfg, self.cfg.params
        start = time.perf_counter()
        adapter = TargetAdapter(self.target.model)
        dev = adapter.device
        b = len(self.prompts)
        longest = max(map(len, self.prompts))
        need = longest + cfg.max_new_tokens
        if need > adapter.max_context:
            raise ValueError(
                f"prompt of {longest} tokens plus max_new_tokens={cfg.max_new_tokens} exceeds the "
                f"model's context of {adapter.max_context} tokens; shorten the prompt or lower "
                "max_new_tokens"
            )
        k_fixed = 0 if self.drafter is None else cfg.num_draft_tokens
        extra = 1 + (8 if k_fixed == "auto" else int(k_fixed))
        layers = getattr(self.drafter, "hidden_layers", None) if self.drafter else None
        layers = tuple(layers) if layers is not None else None
        hid0 = adapter.prefill([p[:-1] for p in self.prompts],
                               capacity=min(need + extra, adapter.max_context), hidden_layers=layers)
        cap = longest + cfg.max_new_tokens + extra
        hid = None  # [B, cap, F] target features per token, for drafters with hidden_layers
        if layers is not None:
            feat = adapter.model.config.get_text_config(decoder=True).hidden_size * len(layers)
            hid = torch.zeros(b, cap, feat, dtype=adapter.dtype, device=dev)
            if hid0 is not None:
                hid[:, : hid0.shape[1]] = hid0
        ctx = torch.full((b, cap), -1, dtype=torch.long)  # [B, cap]
        for i, p in enumerate(self.prompts):
            ctx[i, : len(p)] = torch.tensor(p, dtype=torch.long)
        ctx = ctx.to(dev)
        lengths = torch.tensor([len(p) for p in self.prompts], dtype=torch.long, device=dev)  # [B]
        prompt_lengths = lengths.clone()  # [B]
        rows = list(range(b))  # batch position -> index into self.prompts
        streams = self.streams
        stops = [StopRule(eos_token_ids=cfg.eos_token_ids, stop=cfg.stop, tokenizer=cfg.tokenizer,
                          max_new_tokens=cfg.max_new_tokens) for _ in range(b)]
        policy = DraftLengthPolicy(k_fixed if self.drafter else 0, b)

        def context() -> DraftContext:
            return DraftContext(ctx, lengths, prompt_lengths, params, streams, hid)

        if self.drafter is not None:
            self.drafter.begin(context(), TargetInfo(adapter.vocab_size, self.target.tokenizer,
                                                         adapter.model))
        prefill_seconds = time.perf_counter() - start
        for o in self.outputs:
            o.stats.prefill_seconds = prefill_seconds

        while rows:
            bsz = len(rows)
            # 1. propose
            t0 = time.perf_counter()
            if self.drafter is None:
                drafts, q = torch.zeros(bsz, 0, dtype=torch.long, device=dev), None
            else:
                room = torch.tensor([cfg.max_new_tokens - len(self.outputs[i].tokens) for i in rows])
                room = torch.minimum(room - 1, adapter.max_context - lengths.cpu())
                want = torch.minimum(policy.choose(), room.clamp(min=0))  # [B]
                drafts, q = self.drafter.propose(context(), want.to(dev))
                drafts = drafts.to(dev)
                num_real = (drafts >= 0).sum(1)  # [B]
                k = int(num_real.max()) if bsz else 0
                drafts = drafts[:, :k]
                q = q[:, :k].to(dev) if q is not None else None
            _sync(dev)
            t1 = time.perf_counter()
            # 2. one target forward over the last token and the drafts
            k = drafts.shape[1]
            last = ctx.gather(1, (lengths - 1)[:, None])  # [B, 1]
            out = adapter.extend(torch.cat([last, drafts.clamp(min=0)], 1), hidden_layers=layers)
            logits, feats = out if layers is not None else (out, None)  # [B, K+1, V], [B, K+1, F]
            _sync(dev)
            t2 = time.perf_counter()
            prev = None
            if params.uses_history:
                hist = history(context(), drafts)  # [B, T']
                ends = lengths[:, None] + torch.arange(k + 1, device=dev)  # [B, K+1]
                prev = prefix_history(hist, ends)  # [B, K+1, T']
            plen = prompt_lengths[:, None].expand(-1, k + 1)  # [B, K+1]
            p = probs_from_logits(logits, params, prev, plen)  # [B, K+1, V]
            # 3. verify (plain decoding: one draw from p). With a drafter, rows always go through
            # verify, even when no row drafted, so a row's randomness never depends on the others.
            if self.drafter is None:
                tok = sample(p[:, 0], streams, domain=DOMAIN_SAMPLE)  # [B]
                verdict = Verdict(tokens=tok[:, None], num_accepted=torch.zeros_like(tok))
            else:
                if q is not None and type(self.drafter) not in TRUSTED_DRAFTERS:
                    check_draft_probs(self.drafter, p, drafts, q)
                if callable(cfg.verify):
                    verdict = cfg.verify(p, drafts, q, generator=streams)
                else:  # p made here, q made here or checked above
                    verdict = verify(p, drafts, q, method=cfg.verify, generator=streams,
                                     check=False)
            streams.advance()
            n = verdict.num_accepted.to(dev)  # [B]
            _sync(dev)
            t3 = time.perf_counter()
            assert verdict.tokens.shape == (bsz, k + 1), verdict.tokens.shape
            adapter.commit(n + 1)
            if self.drafter is not None:
                policy.observe(num_real, n)
                policy.observe_costs(t1 - t0, k, t2 - t1, k + 1)
            # 4. emit, per row: budget, EOS, stop strings
            emitted = verdict.tokens.to(dev)  # [B, K+1]
            if cfg.return_logprobs:
                lp = p.gather(2, emitted.clamp(min=0)[..., None]).squeeze(-1).log()  # [B, K+1]
                lp_rows = lp.tolist()
            em_rows, n_rows = emitted.tolist(), n.tolist()
            real_rows = num_real.tolist() if self.drafter is not None else [0] * bsz
            kept = []
            now = time.perf_counter()
            for j, i in enumerate(rows):
                out, st = self.outputs[i], self.outputs[i].stats
                new = em_rows[j][: n_rows[j] + 1]
                c, reason = stops[i].keep(out.tokens, new)
                out.tokens += new[:c]
                if cfg.return_logprobs:
                    out.logprobs += lp_rows[j][:c]
                st.steps += 1
                st.draft_seconds += t1 - t0
                st.target_seconds += t2 - t1
                st.verify_seconds += t3 - t2
                st.drafted += real_rows[j]
                st.accepted += n_rows[j]
                if n_rows[j] > len(st.accepted_per_position):
                    st.accepted_per_position += [0] * (n_rows[j] - len(st.accepted_per_position))
                for pos in range(n_rows[j]):
                    st.accepted_per_position[pos] += 1
                if real_rows[j] > len(st.drafted_per_position):
                    st.drafted_per_position += [0] * (real_rows[j] - len(st.drafted_per_position))
                for pos in range(real_rows[j]):
                    st.drafted_per_position[pos] += 1
                st.emitted = len(out.tokens)
                st.seconds = now - start
                kept.append(c)
                if reason is not None:
                    out.finish_reason, out.cut = reason, stops[i].cut
                if c:
                    yield i, new[:c]
            # 5. append the kept tokens; drop the rows that ended
            counts = torch.tensor(kept, dtype=torch.long, device=dev)  # [B]
            cols = torch.arange(k + 1, device=dev)
            idx = (lengths[:, None] + cols).clamp(max=ctx.shape[1] - 1)  # [B, K+1]
            write = cols[None, :] < counts[:, None]
            ctx.scatter_(1, idx, torch.where(write, emitted, ctx.gather(1, idx)))
            if hid is not None:  # features of the last token and the drafts, by position
                pos = (lengths - 1)[:, None] + cols  # [B, K+1]
                hid.scatter_(1, pos.clamp(max=cap - 1)[..., None].expand(-1, -1, hid.shape[2]),
                             feats.to(hid.dtype))
            lengths = lengths + counts
            alive = [j for j, i in enumerate(rows) if self.outputs[i].finish_reason is None]
            if len(alive) < bsz:
                sel = torch.tensor(alive, dtype=torch.long, device=dev)
                rows = [rows[j] for j in alive]
                if not rows:
                    break
                adapter.select(sel)
                ctx, lengths, prompt_lengths = ctx[sel], lengths[sel], prompt_lengths[sel]
                hid = hid[sel] if hid is not None else None
                streams = streams.select(sel)
                policy.select(sel)
                if self.drafter is not None:
                    self.drafter.select(sel)
