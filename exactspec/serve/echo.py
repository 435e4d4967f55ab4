"""`echo` with logprobs: the log p of every prompt token after the first, and its top
alternatives, from one teacher-forced forward of the target over the prompt (in the engine).

"raw" reports the model's own law (log_softmax of the raw logits), "processed" the law the
token would be drawn from if the prompt ended before it (the request's sampling parameters,
the prefix as the penalties' history and as the prompt). On a float32 Llama the forward runs
under `es.batch_invariant()`, so a prompt token's raw logprob is the very float the engine
reports for the same token generated after the same prefix. This is what lm-evaluation-
harness's log-likelihood requests read (`echo: true`, `logprobs`, `max_tokens` 0 or 1).
"""

from __future__ import annotations

import contextlib

import torch

from exactspec.engine.commit import top_lists, top_tokens
from exactspec.invariant import batch_invariant
from exactspec.invariant.mode import covered
from exactspec.models.loading import Model
from exactspec.sampling import SamplingParams
from exactspec.sampling.history import prefix_history
from exactspec.sampling.logprobs import raw_log_probs, token_log_probs
from exactspec.sampling.standardize import law_groups, probs_from_logits_rows


@torch.inference_mode()
def prompt_logprobs(model: Model, prompt: list[int], params: SamplingParams, mode: str,
                    top: int) -> tuple[list[float | None], list[list[tuple[int, float]] | None]]:
    """Per prompt token, its log p given the tokens before it (None for the first) and, with
    `top` > 0, the `top` most likely (token id, log p) there (None for the first)."""
    net = model.model
    ids = torch.tensor([prompt], dtype=torch.long, device=next(net.parameters()).device)
    if len(prompt) < 2:
        return [None] * len(prompt), [None] * len(prompt)
    exact = covered(net) if isinstance(net, torch.nn.Module) else False
    with batch_invariant() if exact else contextlib.nullcontext():
        logits = net(input_ids=ids, use_cache=False).logits[:, :-1].float()  # [1, T-1, V]
    tokens = ids[:, 1:]  # [1, T-1] each position's next prompt token
    if mode == "raw":
        law = raw_log_probs(logits)  # [1, T-1, V]
        lps = law.gather(-1, tokens[..., None])[..., 0]  # [1, T-1]
        tops = top_tokens(law, top, log=False)
    else:
        ends = torch.arange(1, len(prompt), device=ids.device)[None, :]  # [1, T-1]
        prev = prefix_history(ids, ends) if params.uses_history else None  # [1, T-1, T]
        p = probs_from_logits_rows(logits, [params], prev, ends, groups=law_groups([params]))
        lps = token_log_probs(p, tokens)  # [1, T-1]
        tops = top_tokens(p, top)
    lp_list = lps[0].tolist()
    top_out: list = [None]
    if tops is not None:
        top_out += top_lists(tops[0][0], tops[1][0], prompt[1:], lp_list, top,
                             keep_impossible=mode == "raw")
    else:
        top_out += [None] * len(lp_list)
    return [None, *lp_list], top_out
