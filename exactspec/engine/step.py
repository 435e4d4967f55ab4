"""One decode step for every row: propose -> target forward -> standardize -> verify -> commit.

Plain decoding is the same step with an empty proposal (`NoDrafter`) and the plain rule (one
draw from p); nothing else differs. Rows accept different numbers of tokens (ragged).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from exactspec.drafters.base import DraftContext, TargetInfo, trusts_q
from exactspec.engine.batch import FAULT, BatchState, Row
from exactspec.errors import InvalidValue
from exactspec.sampling import (
    DOMAIN_SAMPLE,
    RowStreams,
    Verdict,
    VerifyMethod,
    acceptance_law,
    parse_method,
    sample,
)
from exactspec.sampling.chain import greedy_law
from exactspec.sampling.history import history, prefix_history
from exactspec.sampling.logprobs import raw_log_probs, token_log_probs
from exactspec.sampling.standardize import probs_from_logits_rows

COUPLED = parse_method("coupled")  # the rule of rows marked Row.coupled
# rule(target_probs [B, K+1, V], drafts [B, K], q [B, K, V] | None, streams) -> Verdict
VerifyRule = Callable[[torch.Tensor, torch.Tensor, torch.Tensor | None, RowStreams], Verdict]


@dataclass
class StepRules:
    """How a step decides; fixed for a whole decode."""

    verify: VerifyRule  # the acceptance rule (or the plain draw for plain decoding)
    check_q: bool  # validate the drafter's q (a user drafter's; the engine's own are exact)
    return_logprobs: bool  # collect log p of each emitted token
    # a tree drafter's step, tree_step(batch, rules, clock, room [B]) (engine/tree_step.py)
    tree_step: Callable | None = None
    # the rule of a step whose rows are all greedy, drawing the very tokens `verify` draws
    # there, without its uniforms and residual (greedy_shortcut); None: `verify` always
    greedy_verify: VerifyRule | None = None
    # a coupled method (VerifyMethod.coupled): its `verdict` decides instead of `verify`, the
    # target drawing with the uniforms of the rows' output positions, plain decoding included
    coupled: VerifyMethod | None = None
    # which law logprobs and top alternatives report: "processed" (the standardized p the
    # token was drawn from) or "raw" (log_softmax of the raw logits; sampling/logprobs.py)
    logprobs_mode: str = "processed"


class NoDrafter:
    """The empty proposal: plain decoding is a speculative step with no draft tokens."""

    standardized_q = True  # no drafts, not re-checked (base.trusts_q)

    hidden_layers = None  # needs no target features

    def begin(self, context: DraftContext, target: TargetInfo) -> None:
        pass

    def select(self, rows: torch.Tensor) -> None:
        pass

    def propose(self, context: DraftContext, num_tokens: torch.Tensor  # [B]
                ) -> tuple[torch.Tensor, None]:  # [B, 0], None
        b = context.tokens.shape[0]
        return torch.zeros(b, 0, dtype=torch.long, device=context.tokens.device), None


def plain_rule(p: torch.Tensor, drafts: torch.Tensor, q: torch.Tensor | None,
               streams: RowStreams, greedy: bool = False) -> Verdict:
    """Plain decoding's verification of an empty proposal: one draw from p (greedy: every
    row's p is a one-hot, its hot index is the draw, `sample`'s greedy)."""
    tok = sample(p[:, 0], streams, domain=DOMAIN_SAMPLE, greedy=greedy)  # [B]
    return Verdict(tokens=tok[:, None], num_accepted=torch.zeros_like(tok))


def greedy_shortcut(drafter, verify_arg) -> VerifyRule | None:
    """Token verification's rule for steps whose rows are all greedy, when the drafter's q is
    the engine's (trusts_q): p is a one-hot at its argmax t and q(x) in (0, 1], so each draft is
    accepted with a = min(1, p(x) / q(x)), exactly 1 if x == t else 0, P(n) is a one-hot (its
    draw is its hot index whatever the uniform), and the residual max(p - q, 0) is positive at
    t alone (or empty, then p): greedy verification's tokens, drawn without uniforms, a residual
    or a float64 CDF. None for the other methods, a callable, or a q the engine checks."""
    if drafter is None or callable(verify_arg) or not trusts_q(drafter):
        return None
    if parse_method(verify_arg).name != "token":
        return None
    return lambda p, x, q, streams: greedy_law(p, x, q, check=False).draw(streams)


class Clock:
    """Step timing, in one place: seconds between marks, after the device has finished."""

    def __init__(self, device: torch.device) -> None:
        self.device = device  # synchronised before each reading (CUDA runs asynchronously)
        self.start = self.last = time.perf_counter()  # the decode's start, the last mark

    def lap(self) -> float:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        now = time.perf_counter()
        seconds, self.last = now - self.last, now
        return seconds


def decode_step(batch: BatchState, rules: StepRules, clock: Clock) -> list[tuple[Row, list[int]]]:
    """Advance every row by one target forward; returns (row, tokens it gained) per row."""
    dev = batch.target.device
    clock.lap()
    # 1. propose: up to `want` drafts per row, within each row's budget and the context
    room = torch.tensor([r.stop.max_new_tokens - len(r.output.tokens) for r in batch.rows])
    room = torch.minimum(room - 1, batch.target.max_context - batch.lengths.cpu())
    drafting = batch.drafting()  # False: the drafter failed, these rows continue plain
    if rules.tree_step is not None and drafting:  # a token tree instead of a chain
        gained = rules.tree_step(batch, rules, clock, room.clamp(min=0))
        if gained is not None:  # None: the drafter failed before anything ran
            return gained
        drafting = False
    want = batch.policy.choose(room, len(batch))  # [B]
    proposal = FAULT
    if drafting:
        proposal = batch.guard(batch.drafter.propose, batch.context(), want.to(dev))
    if proposal is FAULT:  # plain: an empty proposal
        proposal = NoDrafter().propose(batch.context(), want)
    drafts, q = proposal  # [B, K'], [B, K', V]
    drafts = drafts.to(dev)
    if q is None and batch.grammar is not None and batch.grammar.active:
        drafts = batch.grammar.forbidden_cut(drafts)  # point masses a grammar forbids: cut
    num_real = (drafts >= 0).sum(1)  # [B]
    k = int(num_real.max()) if len(batch) else 0
    drafts, q = drafts[:, :k], (q[:, :k].to(dev) if q is not None else None)
    draft_s = clock.lap()
    # 2. one target forward over each row's last token and its drafts
    last = batch.tokens.gather(1, (batch.lengths - 1)[:, None])  # [B, 1]
    out = batch.target.extend(torch.cat([last, drafts.clamp(min=0)], 1),
                              hidden_layers=batch.layers)
    logits, feats = out if batch.layers is not None else (out, None)  # [B, K+1, V], [B, K+1, F]
    target_s = clock.lap()
    # 3. standardize: p at every position, each row with its own params and history
    p = target_probs(batch, logits, drafts)  # [B, K+1, V]
    # 4. verify. Rows always go through the rule, even when none drafted, so a row's
    # randomness never depends on the others.
    if q is not None and rules.check_q and k > 0 and batch.guard(
            check_draft_probs, batch.drafter, p, drafts, q) is FAULT:
        # a user drafter's q failed its check: the step keeps only the token after the
        # context (p at position 0 does not depend on the drafts), drawn as in plain decoding
        drafts, q, p, k = drafts[:, :0], q[:, :0], p[:, :1], 0
        logits = logits[:, :1]
        num_real = torch.zeros_like(num_real)
        feats = feats[:, :1] if feats is not None else None
    if rules.coupled is not None:  # one uniform per output position, shared with the drafter
        positions = batch.context().output_positions(0, k + 1)  # [B, K+1]
        verdict = rules.coupled.verdict(p, drafts, batch.streams, positions, greedy=batch.greedy)
    elif rules.verify is plain_rule:
        verdict = plain_rule(p, drafts, q, batch.streams, greedy=batch.greedy)
    elif rules.greedy_verify is not None and batch.greedy:
        verdict = rules.greedy_verify(p, drafts, q, batch.streams)
    else:
        verdict = rules.verify(p, drafts, q, batch.streams)
    own = batch.coupled_rows()  # [B] rows verified coupled by their own choice, or False
    if own is not False:
        positions = batch.context().output_positions(0, k + 1)  # [B, K+1]
        mine = COUPLED.verdict(p, drafts, batch.streams, positions, greedy=batch.greedy)
        verdict = Verdict(tokens=torch.where(own[:, None], mine.tokens, verdict.tokens),
                          num_accepted=torch.where(own, mine.num_accepted, verdict.num_accepted))
    batch.streams.advance()
    n = verdict.num_accepted.to(dev)  # [B]
    verify_s = clock.lap()
    assert verdict.tokens.shape == (len(batch), k + 1), verdict.tokens.shape
    # 5. commit: the target keeps the verified tokens, each row what its stop rule allows
    batch.target.commit(n + 1)
    return finish_step(batch, rules, clock, p, verdict.tokens.to(dev), n, num_real, feats,
                       (draft_s, target_s, verify_s), k + 1, logits)


def finish_step(batch: BatchState, rules: StepRules, clock: Clock,
                p: torch.Tensor,  # [B, K+1, V] p at the root and after each accepted token
                emitted: torch.Tensor,  # [B, K+1] verified tokens, -1 padded
                n: torch.Tensor,  # [B] accepted drafts
                num_real: torch.Tensor,  # [B] tokens drafted per row
                feats: torch.Tensor | None,  # [B, K+1, F] target features at those positions
                seconds: tuple[float, float, float],  # draft, target, verify time of the step
                width: int,  # tokens the target forward scored
                logits: torch.Tensor | None,  # [B, K+1, V] raw logits p came from (raw mode)
                ) -> list[tuple[Row, list[int]]]:
    """Hand a verified step to every row (the target's cache already keeps it): outputs, stop
    rules, logprobs, statistics, the draft-length policy, the batch's token buffer."""
    dev = batch.target.device
    draft_s, target_s, verify_s = seconds
    batch.policy.observe(num_real, n)
    batch.policy.observe_costs(draft_s, width - 1, target_s, width, len(batch))
    num_top = max((r.top_logprobs for r in batch.rows), default=0)
    modes = {r.logprobs_mode or rules.logprobs_mode for r in batch.rows}  # a row may choose
    reports = {}  # mode -> (logprobs [B][K+1] | None, tops), for the modes some row reports
    if "raw" in modes and (rules.return_logprobs or num_top):
        assert logits is not None, "raw logprobs need the step's logits"
        log_raw = raw_log_probs(logits)  # [B, K+1, V] the model's own law
        reports["raw"] = (log_raw.gather(-1, emitted.clamp(min=0)[..., None])[..., 0].tolist()
                          if rules.return_logprobs else None, top_tokens(log_raw, num_top,
                                                                         log=False))
    if "processed" in modes or not reports:  # es.token_logprobs's [B][K+1]
        reports["processed"] = (token_log_probs(p, emitted).tolist() if rules.return_logprobs
                                else None, top_tokens(p, num_top))
    gained = []
    now = time.perf_counter() - clock.start
    for j, (row, new, drafted, accepted) in enumerate(zip(
            batch.rows, emitted.tolist(), num_real.tolist(), n.tolist(), strict=True)):
        out = row.output
        raw = (row.logprobs_mode or rules.logprobs_mode) == "raw" and "raw" in reports
        logprobs, tops = reports["raw" if raw else "processed"]
        c, reason = row.stop.keep(out.tokens, new[: accepted + 1])
        out.tokens += new[:c]
        if logprobs is not None:
            out.logprobs += logprobs[j][:c]
        if row.top_logprobs and tops is not None:
            out.top += top_lists(tops[0][j][:c], tops[1][j][:c], new[:c],
                                 logprobs[j][:c] if logprobs is not None else None,
                                 row.top_logprobs, keep_impossible=raw)
        out.stats.record_step(drafted, accepted, len(out.tokens), draft_s, target_s, verify_s,
                              now - row.started)
        if reason is not None:
            out.finish_reason, out.cut = reason, row.stop.cut
        gained.append((row, new[:c]))
    batch.append(emitted, torch.tensor([len(g) for _, g in gained], dtype=torch.long,
                                       device=dev), feats)
    return gained


def top_tokens(p: torch.Tensor,  # [B, K+1, V]
               k: int, *, log: bool = True) -> tuple[list, list] | None:  # ids, log p lists
    """The k most likely tokens at every position and their log p ([B][K+1][k] lists), from
    the very p the step verified with (log taken in float32 as the emitted tokens' logprobs
    are, so a token's entry here equals its logprob bit for bit); log=False: `p` holds log
    probabilities already (raw mode's log_softmax). None when k == 0."""
    if k <= 0:
        return None
    vals, idx = p.topk(min(k, p.shape[-1]), dim=-1)  # [B, K+1, k]
    return idx.tolist(), (vals.log() if log else vals).tolist()


def top_lists(ids: list[list[int]], vals: list[list[float]], emitted: list[int],
              logprobs: list[float] | None, k: int, *,
              keep_impossible: bool = False) -> list[list[tuple[int, float]]]:
    """Per emitted token, its position's k most likely (token, log p) with p > 0 (all k,
    -inf included, when keep_impossible: raw mode always gives k entries); the emitted
    token's own entry carries its logprob (the same float: one log, not two)."""
    out = []
    for j, (i_row, v_row) in enumerate(zip(ids, vals, strict=True)):
        pairs = [(i, v) for i, v in zip(i_row[:k], v_row[:k], strict=True)
                 if keep_impossible or v > -float("inf")]
        if logprobs is not None:
            pairs = [(i, logprobs[j] if i == emitted[j] else v) for i, v in pairs]
        out.append(pairs)
    return out


def target_probs(batch: BatchState, logits: torch.Tensor,  # [B, K+1, V]
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


def check_draft_probs(drafter, p: torch.Tensor, drafts: torch.Tensor, q: torch.Tensor) -> None:
    """A user drafter's q ([B, K, V]) must be the distributions its drafts ([B, K]) came from:
    finite, non-negative, summing to 1, with q(x) > 0 at each draft token."""
    try:
        acceptance_law(p, drafts, q, method="token", check=True)
    except ValueError as e:
        raise InvalidValue(f"drafter {type(drafter).__name__} returned draft_probs that cannot "
                           f"be the q its draft tokens were drawn from: {e}") from None
