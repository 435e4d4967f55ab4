"""probs_from_logits: the one function that turns logits into the distribution a token is drawn from.

Both p (target) and q (draft) come from here, with the same parameters and history; a q that is
not exactly the distribution the draft token was drawn from breaks losslessness.

Order of the transforms (the same as transformers / vLLM):
  1. repetition penalty over prompt + output tokens (CTRL: logit / r if logit > 0 else logit * r)
  2. presence and frequency penalties over output tokens (OpenAI: logit -= f * count + pres * seen)
  3. logit bias (additive)
 3b. the allowed tokens (a grammar's mask, exactspec.sampling.grammar): -inf elsewhere
  4. greedy (temperature 0): one-hot at the argmax, ties to the lowest id; nothing below applies
  5. temperature: logits / T
  6. top-k on logits (every token tied with the k-th value is kept)
  7. softmax, in float32 (float64 if the logits are float64)
  8. top-p: keep the most likely tokens until their mass reaches top_p (ties at the edge kept)
  9. min-p: keep tokens with probability >= min_p * max probability
 10. renormalise

Steps 4-10 have a native twin for the draft step (exactspec/kernels/csrc/ops_draft.cpp: the
same ATen operators where the bits depend on a reduction order); tests/kernels/
test_draft_step.py holds the two equal bit for bit, so a change here fails there until the
twin follows.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from exactspec.errors import InvalidValue
from exactspec.sampling.params import SamplingParams


def probs_from_logits(
    logits: torch.Tensor,  # [..., V]
    params: SamplingParams,
    prev_tokens: torch.Tensor | None = None,  # [..., T] long, -1 = padding
    prompt_len: torch.Tensor | int | None = None,  # [...] or int: leading prev_tokens that are prompt
    allowed: torch.Tensor | None = None,  # [..., V] bool: the tokens a grammar allows, or None
) -> torch.Tensor:  # [..., V] float32 (float64 for float64 logits)
    """Standardized distribution over the vocabulary for each leading index of `logits`."""
    if not isinstance(params, SamplingParams):
        raise TypeError(f"params must be exactspec.SamplingParams, got {type(params).__name__}")
    if not isinstance(logits, torch.Tensor) or not logits.is_floating_point() or logits.dim() < 1:
        raise TypeError("logits must be a floating-point tensor of shape [..., V]")
    vocab = logits.shape[-1]
    if vocab == 0:
        raise ValueError("logits have an empty vocabulary (last dimension is 0)")
    _check_finite(logits)
    dtype = torch.float64 if logits.dtype == torch.float64 else torch.float32
    lead = logits.shape[:-1]
    x = logits.reshape(-1, vocab).to(dtype)  # [N, V]

    if params.uses_history and prev_tokens is not None:
        x = _apply_penalties(x, params, prev_tokens, prompt_len, lead)
    if params.logit_bias:
        ids = torch.tensor(list(params.logit_bias.keys()), dtype=torch.long)
        if int(ids.max()) >= vocab:
            raise ValueError(f"logit_bias names token id {int(ids.max())}, outside the vocabulary "
                             f"of size {vocab}")
        vals = torch.tensor(list(params.logit_bias.values()), dtype=dtype)
        x = x.clone()
        x[:, ids.to(x.device)] += vals.to(x.device)
    if allowed is not None:
        x = _restrict(x, allowed, lead)

    if params.is_greedy:  # argmax: the first max, i.e. the lowest id
        probs = torch.zeros_like(x).scatter_(1, x.argmax(-1, keepdim=True), 1.0)
        return probs.reshape(*lead, vocab)

    if params.temperature != 1.0:
        x = x / params.temperature
    if 0 < params.top_k < vocab:
        kth = torch.topk(x, params.top_k, dim=-1).values[:, -1:]  # [N, 1]
        x = x.masked_fill(x < kth, float("-inf"))
    probs = torch.softmax(x, dim=-1)  # [N, V]
    if params.top_p < 1.0:
        probs = probs.masked_fill(probs < _top_p_threshold(probs, params.top_p), 0.0)
    if params.min_p > 0.0:
        top = probs.max(-1, keepdim=True).values
        probs = probs.masked_fill(probs < params.min_p * top, 0.0)
    # one sequential float64 sum per row (cumsum), not `sum`, which splits a lone row's
    # reduction across threads: p must not depend on how many rows share the call
    total = probs.double().cumsum(-1)[:, -1:].to(probs.dtype)  # [N, 1]
    if (total <= 0).any():
        raise ValueError("the sampling filters left no token with positive probability")
    probs = probs / total
    return probs.reshape(*lead, vocab)


def _restrict(x: torch.Tensor,  # [N, V]
              allowed: torch.Tensor,  # [..., V] bool
              lead: torch.Size) -> torch.Tensor:  # [N, V]
    """Logit -inf outside `allowed` (a grammar's mask); a position with no allowed token is an
    error (a valid grammar always allows something, EOS at its end), never a made-up law."""
    n, vocab = x.shape
    if allowed.dtype != torch.bool or tuple(allowed.shape) != (*lead, vocab):
        raise ValueError(f"allowed must be a bool tensor of shape {[*lead, vocab]}, got "
                         f"{allowed.dtype} {list(allowed.shape)}")
    ok = allowed.reshape(n, vocab).to(x.device)
    if not bool(ok.any(-1).all()):
        raise ValueError("the grammar allows no token at some position (an empty mask): the "
                         "grammar cannot continue the text; check that it can end (EOS) where "
                         "the text may end")
    return x.masked_fill(~ok, float("-inf"))


def _check_finite(logits: torch.Tensor) -> None:  # [..., V]
    """Refuse NaN and inf logits. One reduction pass: min and max are finite exactly when every
    value is (both propagate NaN), where isfinite's elementwise chain takes several passes and
    a temporary per logit; the counting pass runs only to word the error."""
    if logits.numel() == 0:
        return
    lo, hi = torch.aminmax(logits)
    if bool(torch.isfinite(torch.stack((lo, hi))).all()):
        return
    bad = ~torch.isfinite(logits)
    kind = "NaN" if torch.isnan(logits).any() else "inf"
    raise ValueError(f"logits contain {kind} values ({int(bad.sum())} of {logits.numel()}); "
                     "the model output is broken, check its dtype and inputs")


def _top_p_threshold(probs: torch.Tensor, top_p: float,  # [N, V]
                     partial: int = 256) -> torch.Tensor:  # [N, 1]
    """Probability of the last token kept by top-p (the first whose cumulative mass reaches it).

    Tries the `partial` largest probabilities first (topk, sorted): when every row's cut falls
    inside them the result is bit-identical to a full sort, at a fraction of its cost on a large
    vocabulary; otherwise the whole vocabulary is sorted.
    """
    for width in (min(partial, probs.shape[-1]), probs.shape[-1]):
        sorted_p = probs.topk(width, dim=-1).values  # [N, width], descending
        before = sorted_p.cumsum(-1) - sorted_p  # mass strictly before each sorted token
        keep_count = (before < top_p).sum(-1, keepdim=True).clamp(min=1)  # [N, 1]
        if width == probs.shape[-1] or bool((keep_count < width).all()):
            return sorted_p.gather(-1, keep_count - 1)
    raise AssertionError("unreachable")


def _apply_penalties(
    x: torch.Tensor,  # [N, V]
    params: SamplingParams,
    prev_tokens: torch.Tensor,  # [..., T]
    prompt_len: torch.Tensor | int | None,
    lead: torch.Size,
) -> torch.Tensor:  # [N, V]
    """Repetition (prompt + output), presence and frequency (output only) penalties."""
    n, vocab = x.shape
    if prev_tokens.dtype not in (torch.int64, torch.int32):
        raise TypeError("prev_tokens must be an integer tensor padded with -1")
    t = prev_tokens.shape[-1]
    try:
        prev = torch.broadcast_to(prev_tokens, (*lead, t)).reshape(n, t).to(x.device).long()
    except RuntimeError:
        raise InvalidValue(
            f"prev_tokens has shape {list(prev_tokens.shape)}, but logits of shape "
            f"{[*lead, x.shape[-1]]} need [{', '.join(map(str, lead))}, T]: one history per "
            "position (or dimensions of size 1 that broadcast, e.g. history[:, None, :] for "
            "one history shared by the positions of a row)") from None
    if (prev >= vocab).any() or (prev < -1).any():
        raise ValueError(f"prev_tokens holds ids outside [0, {vocab}) (and -1 for padding)")
    valid = prev >= 0
    idx = torch.where(valid, prev, vocab)  # padding goes to a spare column
    if prompt_len is None:
        prompt_len = 0
    plen = torch.as_tensor(prompt_len, device=x.device).long()
    plen = torch.broadcast_to(plen, lead).reshape(n, 1)
    is_output = valid & (torch.arange(t, device=x.device)[None, :] >= plen)  # [N, T]

    x = x.clone()
    if params.repetition_penalty != 1.0:
        seen = torch.zeros(n, vocab + 1, dtype=torch.bool, device=x.device)
        seen.scatter_(1, idx, True)
        seen = seen[:, :vocab]
        r = params.repetition_penalty
        x = torch.where(seen, torch.where(x > 0, x / r, x * r), x)
    if params.presence_penalty != 0.0 or params.frequency_penalty != 0.0:
        counts = torch.zeros(n, vocab + 1, dtype=x.dtype, device=x.device)
        counts.scatter_add_(1, torch.where(is_output, prev, vocab), is_output.to(x.dtype))
        counts = counts[:, :vocab]
        x = x - params.frequency_penalty * counts - params.presence_penalty * (counts > 0).to(x.dtype)
    return x


def law_groups(params: Sequence[SamplingParams]) -> list[tuple[SamplingParams, torch.Tensor | None]]:
    """Rows grouped by law (their params without the seed): [(params, row indices [R] or None)].

    One group whose indices are None means every row shares it (the common case, checked first
    by identity, so a batch with one shared SamplingParams costs no hashing).
    """
    first = params[0]
    if all(p is first for p in params):
        return [(first, None)]
    groups: dict[SamplingParams, list[int]] = {}
    for i, p in enumerate(params):
        groups.setdefault(p.without_seed(), []).append(i)
    if len(groups) == 1:
        return [(first, None)]
    return [(params[rows[0]], torch.tensor(rows, dtype=torch.long)) for rows in groups.values()]


def probs_from_logits_rows(
    logits: torch.Tensor,  # [B, ..., V]
    params: Sequence[SamplingParams],  # one per row b
    prev_tokens: torch.Tensor | None = None,  # [B, ..., T] long, -1 = padding
    prompt_len: torch.Tensor | None = None,  # [B, ...] long
    groups: list[tuple[SamplingParams, torch.Tensor | None]] | None = None,  # law_groups(params)
    allowed: torch.Tensor | None = None,  # [B, ..., V] bool: a grammar's mask, or None
) -> torch.Tensor:  # [B, ..., V]
    """`probs_from_logits` with each row's own parameters; rows of one law in one call.

    With a single law this is exactly `probs_from_logits(logits, params[0], ...)`.
    """
    if len(params) != logits.shape[0]:
        raise ValueError(f"got {len(params)} SamplingParams for {logits.shape[0]} rows")
    groups = law_groups(params) if groups is None else groups
    if len(groups) == 1 and groups[0][1] is None:
        return probs_from_logits(logits, groups[0][0], prev_tokens, prompt_len, allowed)
    dtype = torch.float64 if logits.dtype == torch.float64 else torch.float32
    out = torch.empty(logits.shape, dtype=dtype, device=logits.device)
    for law, rows in groups:
        rows = rows.to(logits.device)
        prev = prev_tokens[rows] if prev_tokens is not None else None
        plen = prompt_len[rows] if prompt_len is not None else None
        ok = allowed[rows.to(allowed.device)] if allowed is not None else None
        out[rows] = probs_from_logits(logits[rows], law, prev, plen, ok)
    return out
