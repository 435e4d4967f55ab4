"""`token_logprobs`: the trainer's side of on-policy RL, the log p of each generated token
under the standardized distribution, computed with the engine's own functions.

The engine standardizes a position's logits with `probs_from_logits_rows` (each row's params,
the tokens before the position as the penalties' history, the prompt length) and takes
`token_log_probs` of the emitted token; this does the same on a teacher-forced forward. Under
`es.batch_invariant()` that forward reproduces the engine's lean forward bit for bit, so the
result equals `Generation.logprobs` bit for bit, whatever the batch and its padding.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from exactspec.errors import InvalidType, InvalidValue
from exactspec.invariant.mode import is_batch_invariant, warn_if_uncovered
from exactspec.sampling import SamplingParams
from exactspec.sampling.history import prefix_history
from exactspec.sampling.logprobs import token_log_probs
from exactspec.sampling.standardize import law_groups, probs_from_logits_rows


def _rows(sequences) -> list[list[int]]:
    if isinstance(sequences, torch.Tensor):
        if sequences.dim() != 2:
            raise InvalidValue(f"sequences has shape {list(sequences.shape)}; pass [B, T] "
                               "token ids padded with -1, or a list of token-id lists")
        return [[t for t in row if t >= 0] for row in sequences.tolist()]
    if not isinstance(sequences, Sequence) or not sequences:
        raise InvalidType("sequences must be a [B, T] tensor padded with -1 or a non-empty list "
                          "of token-id lists (prompt followed by the generated tokens)")
    return [list(map(int, s)) for s in sequences]


def token_logprobs(model, sequences, prompt_lengths,
                   params: SamplingParams | Sequence[SamplingParams]) -> torch.Tensor:
    """log p of each generated token, [B, C] float32 with grad (C: the longest completion).

    model: a transformers causal LM (or an `es.Model`); sequences: per row its prompt followed
    by its generated tokens ([B, T] padded with -1, or lists); prompt_lengths: [B] ints;
    params: the SamplingParams the rows were drawn with (one, or one per row). Entry [i, j] is
    the log p of row i's j-th generated token, exactly as `Generation.logprobs[j]` is computed;
    entries past a row's completion are 0. Rows are right-padded into one forward (positions
    0.. per row), so a row's values do not depend on the others under `es.batch_invariant()`.
    """
    model = getattr(model, "model", model) if not isinstance(model, torch.nn.Module) else model
    rows = _rows(sequences)
    plen = [int(p) for p in (prompt_lengths.tolist() if isinstance(prompt_lengths, torch.Tensor)
                             else prompt_lengths)]
    if len(plen) != len(rows):
        raise InvalidValue(f"got {len(plen)} prompt_lengths for {len(rows)} sequences")
    for i, (r, p) in enumerate(zip(rows, plen, strict=True)):
        if not 1 <= p <= len(r):
            raise InvalidValue(f"prompt_lengths[{i}]={p} must be in 1..{len(r)} (the length of "
                               f"sequence {i})")
    laws = [params] * len(rows) if isinstance(params, SamplingParams) else list(params)
    if len(laws) != len(rows) or not all(isinstance(p, SamplingParams) for p in laws):
        raise InvalidType("params must be one SamplingParams or one per sequence")
    dev = next(model.parameters()).device
    b, width = len(rows), max(len(r) for r in rows)
    comp = torch.tensor([len(r) - p for r, p in zip(rows, plen, strict=True)])  # [B]
    c = int(comp.max())
    hist = torch.full((b, width), -1, dtype=torch.long)  # [B, L], -1 padded
    for i, r in enumerate(rows):
        hist[i, : len(r)] = torch.tensor(r, dtype=torch.long)
    prompt = torch.tensor(plen)  # [B]
    if c == 0:
        return torch.zeros(b, 0, device=dev)
    # one right-padded forward; logits from the first position that predicts a generated token
    ids = hist.clamp(min=0).to(dev)  # [B, L]
    mask = (hist >= 0).long().to(dev)  # [B, L]
    pos = torch.arange(width, device=dev).expand(b, width)  # [B, L]
    keep = width - int(prompt.min()) + 1  # positions min(P) - 1 .. L - 1
    if is_batch_invariant():
        warn_if_uncovered(model)
    logits = model(input_ids=ids, attention_mask=mask, position_ids=pos, use_cache=False,
                   logits_to_keep=keep).logits  # [B, keep, V]
    if logits.dtype != torch.float64:  # float32 as the engine's (float64 kept: tests)
        logits = logits.float()
    j = torch.arange(c)  # [C]
    at = (prompt[:, None] - 1 + j - (width - keep)).clamp(max=keep - 1)  # [B, C]
    logits = logits.gather(1, at.to(dev)[..., None].expand(-1, -1, logits.shape[-1]))  # [B, C, V]
    ends = prompt[:, None] + j  # [B, C]: generated token j of a row is drawn after ends tokens
    prev = None
    if any(law.uses_history for law in laws):
        prev = prefix_history(hist, ends).to(dev)  # [B, C, L]
    plens = prompt[:, None].expand(-1, c).to(dev)  # [B, C]
    p = probs_from_logits_rows(logits, laws, prev, plens, groups=law_groups(laws))  # [B, C, V]
    tokens = hist.gather(1, ends.clamp(max=width - 1))  # [B, C]
    valid = (j < comp[:, None]).to(dev)  # [B, C]
    # past a row's end read its most likely token (p > 0: no log 0, so no NaN gradients)
    tokens = torch.where(valid, tokens.to(dev), p.detach().argmax(-1))
    lp = token_log_probs(p, tokens)  # [B, C]
    return torch.where(valid, lp, torch.zeros((), device=dev))
