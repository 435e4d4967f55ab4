"""One decode step for every row: propose -> target forward -> standardize -> verify -> commit.

Plain decoding is the same step with an empty proposal (`NoDrafter`) and the plain rule (one
draw from p); nothing else differs. Rows accept different numbers of tokens (ragged). The step
takes the decoder's parts, built once (engine/decoder.py): the rows, the target, the draft side,
the verifier, the draft-length policy, the clock and what to report.
"""

from __future__ import annotations

import torch

from exactspec.engine.commit import Clock, Report, Verified, commit
from exactspec.engine.drafting import DraftSide
from exactspec.engine.policy import DraftLengthPolicy
from exactspec.engine.rows import Row, RowBatch
from exactspec.engine.tree_step import tree_step
from exactspec.engine.verifier import Verifier
from exactspec.kernels.threads import sampling_threads
from exactspec.models.adapter import TargetAdapter
from exactspec.sampling.history import history, prefix_history
from exactspec.sampling.standardize import probs_from_logits_rows


def decode_step(batch: RowBatch, target: TargetAdapter, draft: DraftSide, verifier: Verifier,
                policy: DraftLengthPolicy, clock: Clock,
                report: Report) -> list[tuple[Row, list[int]]]:
    """Advance every row by one target forward; returns (row, tokens it gained) per row."""
    clock.lap()
    # 1. propose: up to `want` drafts per row, within each row's budget and the context
    room = batch.room(target.max_context)  # [B]
    drafting = draft.ready(batch)  # False: the drafter failed, these rows continue plain
    if verifier.tree is not None and drafting:  # a token tree instead of a chain
        gained = tree_step(batch, target, draft, verifier, policy, clock, report,
                           room.clamp(min=0))
        if gained is not None:  # None: the drafter failed before anything ran
            return gained
        drafting = False
    want = policy.choose(room, len(batch))  # [B]
    drafts, q, num_real = draft.propose(batch, want, drafting)  # [B, K], [B, K, V] | None, [B]
    k = drafts.shape[1]
    draft_s = clock.lap()
    # 2. one target forward over each row's last token and its drafts
    out = target.extend(torch.cat([batch.last_tokens(), drafts.clamp(min=0)], 1),
                        hidden_layers=draft.layers)
    logits, feats = out if draft.layers is not None else (out, None)  # [B, K+1, V], [B, K+1, F]
    target_s = clock.lap()
    with sampling_threads(logits.numel()):
        # 3. standardize: p at every position, each row with its own params and history
        p = target_probs(batch, logits, drafts)  # [B, K+1, V]
        # 4. verify
        if q is not None and k > 0 and draft.q_fails(batch, p, drafts, q):
            # a user drafter's q failed its check: the step keeps only the token after the
            # context (p at position 0 does not depend on the drafts), drawn as in plain
            # decoding
            drafts, q, p, logits, k = drafts[:, :0], q[:, :0], p[:, :1], logits[:, :1], 0
            num_real = torch.zeros_like(num_real)
            feats = feats[:, :1] if feats is not None else None
        verdict = verifier.verdict(p, drafts, q, batch)
    batch.streams.advance()
    n = verdict.num_accepted.to(target.device)  # [B]
    verify_s = clock.lap()
    assert verdict.tokens.shape == (len(batch), k + 1), verdict.tokens.shape
    # 5. commit: the target keeps the verified tokens, each row what its stop rule allows
    target.commit(n + 1)
    return commit(batch, policy, clock, report, Verified(
        p=p, emitted=verdict.tokens.to(target.device), accepted=n, drafted=num_real,
        feats=feats, logits=logits, seconds=(draft_s, target_s, verify_s), width=k + 1))


def target_probs(batch: RowBatch, logits: torch.Tensor,  # [B, K+1, V]
                 drafts: torch.Tensor) -> torch.Tensor:  # [B, K] -> [B, K+1, V]
    """p after each draft prefix: every row's own params, with the history it has there."""
    k, dev = drafts.shape[1], logits.device
    prev = None
    if any(law.uses_history for law, _ in batch.groups):
        hist = history(batch.tokens, batch.lengths, drafts)  # [B, T']
        ends = batch.lengths[:, None] + torch.arange(k + 1, device=dev)  # [B, K+1]
        prev = prefix_history(hist, ends)  # [B, K+1, T']
    plen = batch.prompt_lengths[:, None].expand(-1, k + 1)  # [B, K+1]
    allowed = None  # [B, K+1, V] bool: each row's grammar mask after each draft prefix
    if batch.grammar is not None and batch.grammar.active:
        allowed = batch.grammar.along(drafts).to(dev)
    return probs_from_logits_rows(logits, batch.params, prev, plen, groups=batch.groups,
                                  allowed=allowed)
