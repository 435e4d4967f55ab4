"""The end of a step, shared by chains and trees: the verified tokens handed to every row
(outputs, stop rules, logprobs and top alternatives, statistics), the draft-length policy told
what the step cost and kept, the rows' token buffer written; and the step's clock."""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from exactspec.engine.policy import DraftLengthPolicy
from exactspec.engine.rows import Row, RowBatch
from exactspec.sampling.logprobs import raw_log_probs, token_log_probs


class Clock:
    """Step timing, in one place: seconds between marks, after the device has finished."""

    def __init__(self, device: torch.device) -> None:
        self.device = device  # synchronised before each reading (CUDA runs asynchronously)
        self.start = self.last = time.perf_counter()  # the decode's start, the last mark

    def on(self, device: torch.device) -> None:
        """Synchronise `device` before each reading from now on (the target's, once built)."""
        self.device = device

    def lap(self) -> float:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        now = time.perf_counter()
        seconds, self.last = now - self.last, now
        return seconds


@dataclass(frozen=True)
class Report:
    """What a step reports besides the tokens; fixed for a whole decode."""

    return_logprobs: bool  # collect log p of each emitted token
    # which law logprobs and top alternatives report: "processed" (the standardized p the
    # token was drawn from) or "raw" (log_softmax of the raw logits; sampling/logprobs.py); a
    # row may choose its own (Row.logprobs_mode)
    logprobs_mode: str = "processed"


@dataclass(frozen=True)
class Verified:
    """One verified step, as `commit` takes it (chains and trees alike)."""

    p: torch.Tensor  # [B, K+1, V] p at the root and after each accepted token
    emitted: torch.Tensor  # [B, K+1] verified tokens, -1 padded
    accepted: torch.Tensor  # [B] accepted drafts
    drafted: torch.Tensor  # [B] tokens (or tree nodes) drafted per row
    feats: torch.Tensor | None  # [B, K+1, F] target features at those positions
    logits: torch.Tensor | None  # [B, K+1, V] raw logits p came from (raw mode)
    seconds: tuple[float, float, float]  # draft, target, verify time of the step
    width: int  # tokens the target forward scored


def commit(batch: RowBatch, policy: DraftLengthPolicy, clock: Clock, report: Report,
           step: Verified) -> list[tuple[Row, list[int]]]:
    """Hand a verified step to every row (the target's cache already keeps it): outputs, stop
    rules, logprobs, statistics, the draft-length policy, the batch's token buffer."""
    draft_s, target_s, verify_s = step.seconds
    policy.observe(step.drafted, step.accepted)
    policy.observe_costs(draft_s, step.width - 1, target_s, step.width, len(batch))
    reports = logprob_reports(batch, report, step)
    gained = []
    now = time.perf_counter() - clock.start
    for j, (row, new, drafted, accepted) in enumerate(zip(
            batch.rows, step.emitted.tolist(), step.drafted.tolist(), step.accepted.tolist(),
            strict=True)):
        out = row.output
        raw = (row.logprobs_mode or report.logprobs_mode) == "raw" and "raw" in reports
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
    batch.append(step.emitted, torch.tensor([len(g) for _, g in gained], dtype=torch.long,
                                            device=batch.device), step.feats)
    return gained


def logprob_reports(batch: RowBatch, report: Report, step: Verified) -> dict:
    """mode -> (logprobs [B][K+1] | None, top alternatives | None), for the modes some row
    reports ("processed" always)."""
    num_top = max((r.top_logprobs for r in batch.rows), default=0)
    modes = {r.logprobs_mode or report.logprobs_mode for r in batch.rows}  # a row may choose
    reports = {}
    if "raw" in modes and (report.return_logprobs or num_top):
        assert step.logits is not None, "raw logprobs need the step's logits"
        log_raw = raw_log_probs(step.logits)  # [B, K+1, V] the model's own law
        picked = log_raw.gather(-1, step.emitted.clamp(min=0)[..., None])[..., 0]  # [B, K+1]
        reports["raw"] = (picked.tolist() if report.return_logprobs else None,
                          top_tokens(log_raw, num_top, log=False))
    if "processed" in modes or not reports:  # es.token_logprobs's [B][K+1]
        reports["processed"] = (token_log_probs(step.p, step.emitted).tolist()
                                if report.return_logprobs else None, top_tokens(step.p, num_top))
    return reports


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
