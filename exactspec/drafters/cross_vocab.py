"""CrossVocabDraft: a draft model with another tokenizer (Timor et al. 2025, arXiv 2502.05202).

Sampled rows, TLI (token-level intersection): the draft's logits are kept only at draft
tokens whose bytes are a target token, mapped to that target id (several draft ids for one
target id are merged by logsumexp, so their probabilities add), every other target id gets a
logit of -1e30 (probability exactly 0), and q is `context.standardize` of that: the row's own
SamplingParams and the target's token history, as for p. The draft token is drawn from this q,
so q is exactly the distribution it was drawn from, and token verification is lossless.
Greedy rows, SLEM (string-level exact match): the draft generates K + 1 of its own tokens
greedily, their text is re-tokenized by the target's tokenizer after a few tokens of context
(so a token boundary is read as the target would read it), the last, possibly cut, token is
dropped, and the rest are point-mass drafts: the greedy rule keeps exactly the target's argmax.
The draft reads each row as the target's text re-encoded by its own tokenizer (at every step;
its KV cache keeps the prefix that agrees with it).
"""

from __future__ import annotations

import torch

from exactspec.drafters.base import DraftContext, TargetInfo, rows_of
from exactspec.drafters.vocab_map import VocabMap, vocab_map
from exactspec.errors import InvalidValue
from exactspec.models.adapter import TargetAdapter
from exactspec.models.loading import as_model

NEG = -1e30  # the logit of a target token the draft cannot produce: probability exactly 0


class CrossVocabDraft:
    """A draft LM with its own tokenizer drafting for a target with another (TLI / SLEM).

    model: an exactspec Model (with its tokenizer) or a transformers causal LM with
    `tokenizer=`. lookbehind: target tokens of context re-tokenized with a SLEM draft's text.
    """

    standardized_q = True  # q made by exactspec, not re-checked (base.trusts_q)

    hidden_layers = None  # needs no target features

    def __init__(self, model, *, tokenizer=None, lookbehind: int = 4) -> None:
        self.model = as_model(model, tokenizer) if tokenizer is not None else as_model(model)
        if self.model.tokenizer is None:
            raise InvalidValue(f"CrossVocabDraft needs the draft's tokenizer: pass an exactspec "
                               f"Model or tokenizer=..., got {self.model.name!r} without one")
        if isinstance(lookbehind, bool) or not isinstance(lookbehind, int) or lookbehind < 1:
            raise InvalidValue(f"lookbehind={lookbehind!r} must be an int >= 1 (e.g. 4)")
        self.lookbehind = lookbehind  # target tokens re-tokenized before a SLEM draft's text
        self.map: VocabMap | None = None  # the vocabulary intersection, set by begin
        self._map_key: tuple[int, int] | None = None
        self._target_tok = None
        self._adapter: TargetAdapter | None = None
        self._fed: list[list[int]] = []  # per row: draft tokens in the draft's cache slots

    def __repr__(self) -> str:
        return f"CrossVocabDraft({self.model.name!r})"

    def begin(self, context: DraftContext, target: TargetInfo) -> None:
        if target.tokenizer is None:
            raise InvalidValue("CrossVocabDraft needs the target's tokenizer: pass the target "
                               "as an exactspec Model (es.load or es.as_model(model, tokenizer))")
        key = (id(target.tokenizer), target.vocab_size)
        if self._map_key != key:
            self.map = vocab_map(self.model.tokenizer, target.tokenizer, target.vocab_size)
            self._map_key = key
            if self.map.overlap == 0:
                raise InvalidValue(f"the draft {self.model.name!r} and the target share no "
                                   "token: a cross-vocabulary draft needs common token strings")
        self._target_tok = target.tokenizer
        self._width = target.vocab_size  # the target's logits width
        self._adapter = TargetAdapter(self.model.model, strict=False)
        seqs = self._draft_sequences(context)
        self._adapter.prefill([s[:-1] for s in seqs])
        self._fed = [s[:-1] for s in seqs]

    def admit(self, context: DraftContext, target: TargetInfo, start: int) -> None:
        """Rows start.. are new: their text re-encoded and prefilled alone into the draft
        cache (running rows keep theirs)."""
        assert self._adapter is not None, "begin() first"
        seqs = self._draft_sequences(rows_of(context, start))
        self._adapter.admit([s[:-1] for s in seqs])
        self._fed += [s[:-1] for s in seqs]

    def select(self, rows: torch.Tensor) -> None:
        assert self._adapter is not None
        self._adapter.select(rows)
        self._fed = [self._fed[i] for i in rows.tolist()]

    def _draft_sequences(self, context: DraftContext) -> list[list[int]]:
        """Each row's text (target tokens decoded) as draft tokens, at least one per row."""
        rows = [r[:n] for r, n in zip(context.tokens.tolist(), context.lengths.tolist(),
                                      strict=True)]
        texts = self._target_tok.batch_decode(rows, skip_special_tokens=True)
        enc = self.model.tokenizer(texts, add_special_tokens=True)["input_ids"]
        tok = self.model.tokenizer
        start = next((t for t in (tok.bos_token_id, tok.eos_token_id) if t is not None), 0)
        return [list(e) if len(e) else [start] for e in enc]

    def target_logits(self, logits: torch.Tensor) -> torch.Tensor:  # [B, Vd] -> [B, Vt]
        """The draft's logits on the intersection, at the target ids; NEG elsewhere."""
        m = self.map
        assert m is not None
        dev = logits.device
        d_ids, t_ids = m.draft_ids.to(dev), m.target_ids.to(dev)
        sel = logits.float().index_select(1, d_ids)  # [B, M]
        out = torch.full((logits.shape[0], self._width), NEG, dtype=torch.float32, device=dev)
        if not m.duplicates:
            out[:, t_ids] = sel
            return out
        idx = t_ids[None, :].expand_as(sel)
        top = torch.full_like(out, -torch.inf).scatter_reduce(1, idx, sel, "amax")
        mass = torch.zeros_like(out).scatter_add(1, idx, torch.exp(sel - top.gather(1, idx)))
        return torch.where(mass > 0, top + mass.clamp(min=1e-45).log(), out)

    @torch.inference_mode()
    def propose(
        self, context: DraftContext, num_tokens: torch.Tensor  # [B]
    ) -> tuple[torch.Tensor, torch.Tensor | None]:  # [B, K] -1 padded, [B, K, Vt] | None
        ad, m = self._adapter, self.map
        assert ad is not None and m is not None, "begin() first"
        dev = ad.device
        b = context.tokens.shape[0]
        k = int(num_tokens.max()) if b else 0
        greedy = torch.tensor([p.is_greedy for p in context.rows_params()], device=dev)  # [B]
        all_greedy = bool(greedy.all())
        drafts = torch.full((b, k), -1, dtype=torch.long, device=dev)
        q = None if all_greedy else torch.zeros(b, k, self._width, device=dev)
        if k == 0:
            return drafts, q
        seqs = self._draft_sequences(context)
        feed, last = self._roll_back(seqs)
        steps = k + 1 if bool(greedy.any()) else k  # SLEM drafts one more, then drops one
        own = torch.full((b, steps), -1, dtype=torch.long, device=dev)  # SLEM's draft tokens
        back = m.draft_for_target.to(dev)
        rows = torch.arange(b, device=dev)
        for j in range(steps):
            self._record(feed, last)
            logits = ad.extend(feed)[rows, last]  # [B, Vd]
            ad.commit(last + 1)
            nxt = own[:, j] = logits.argmax(-1)
            if q is not None and j < k:  # TLI: draw from q over the intersection
                q_j = context.standardize(self.target_logits(logits), drafts[:, :j])  # [B, Vt]
                x = context.draw(q_j, j)  # [B] target ids
                drafts[:, j] = torch.where(greedy, -1, x)
                q[:, j] = q_j
                mapped = back[x]
                assert bool((mapped[~greedy] >= 0).all()), "drew a token outside the intersection"
                nxt = torch.where(greedy, nxt, mapped)
            feed = nxt[:, None]
            last = torch.zeros_like(last)
        if q is not None:
            q[greedy] = 0.0  # SLEM rows: one-hot q at their point-mass drafts, set below
        for i in greedy.nonzero()[:, 0].tolist():
            got = self._slem(context.tokens[i, : int(context.lengths[i])].tolist(), seqs[i],
                             own[i].tolist())[: int(num_tokens[i])]
            if got:
                drafts[i, : len(got)] = torch.tensor(got, dtype=torch.long, device=dev)
                if q is not None:
                    q[i, torch.arange(len(got), device=dev), drafts[i, : len(got)]] = 1.0
        want = torch.arange(k, device=dev)[None, :] < num_tokens.to(dev)[:, None]
        return torch.where(want, drafts, -1), q

    def _roll_back(self, seqs: list[list[int]]) -> tuple[torch.Tensor, torch.Tensor]:
        """Keep each row's cached prefix that agrees with `seqs`; the rest to feed, padded."""
        ad = self._adapter
        assert ad is not None
        keep = []
        for fed, s, n in zip(self._fed, seqs, ad.lengths.tolist(), strict=True):
            a = 0
            for x, y in zip(fed, s[:-1], strict=False):
                if x != y:
                    break
                a += 1
            keep.append(min(a, n))
        ad.rewind(torch.tensor(keep, dtype=torch.long, device=ad.device))
        self._fed = [f[:c] for f, c in zip(self._fed, keep, strict=True)]
        pending = [s[c:] for s, c in zip(seqs, keep, strict=True)]  # >= 1 token each
        width = max(map(len, pending))
        feed = torch.full((len(seqs), width), ad.pad_token_id, dtype=torch.long)
        for i, p in enumerate(pending):
            feed[i, : len(p)] = torch.tensor(p, dtype=torch.long)
        last = torch.tensor([len(p) - 1 for p in pending], dtype=torch.long, device=ad.device)
        return feed.to(ad.device), last

    def _record(self, feed: torch.Tensor, last: torch.Tensor) -> None:
        """The tokens the next extend commits (up to `last` per row) join the draft's cache."""
        for i, (row, n) in enumerate(zip(feed.tolist(), last.tolist(), strict=True)):
            self._fed[i] = self._fed[i] + row[: n + 1]

    def _slem(self, context: list[int], before: list[int], own: list[int]) -> list[int]:
        """The target tokens of the draft's greedy text, read after the target's own context.

        context: the row in target ids; before: the same text in draft ids; own: the draft's
        greedy tokens after it.
        """
        dtok, ttok = self.model.tokenizer, self._target_tok
        eos = dtok.eos_token_id
        if eos is not None and eos in own:
            own = own[: own.index(eos)]
        if not own:
            return []
        before = before[-self.lookbehind:]
        base = dtok.decode(before, skip_special_tokens=True)
        full = dtok.decode(before + own, skip_special_tokens=True)
        if not full.startswith(base):
            return []
        text = full[len(base):].rstrip("\ufffd")
        tail = context[-self.lookbehind:]
        enc = ttok(ttok.decode(tail, skip_special_tokens=False) + text,
                   add_special_tokens=False)["input_ids"]
        n = len(tail)
        if enc[:n] != tail and enc[1:n] != tail[1:]:  # the boundary moved: no safe reading
            return []
        out = list(enc[n:])
        return out[:-1] if len(out) > 1 else out
