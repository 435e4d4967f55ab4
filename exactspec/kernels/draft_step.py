"""The tail of a draft step in one native call (`exactspec::draft_step`, csrc/ops_draft.cpp):
the final norm, the head product, q's standardization and the draw of the draft token.

It supports the laws `probs_from_logits` computes from the logits alone: greedy, temperature,
top-k, top-p, min-p (`supports`); anything that reads more (penalties over the history, logit
bias, a grammar's mask) stays on the Python path. Its q and tokens are the Python path's bit
for bit (tests/kernels/test_draft_step.py): what depends on a reduction order runs the same
ATen operators as `probs_from_logits`, the rest (the renormalization's sequential float64
sum, the inverse-CDF draw of `sample_from_weights`) has one defined order.
"""

from __future__ import annotations

import torch

from exactspec.kernels.ops import enabled
from exactspec.sampling import SamplingParams

_FAKE: list[bool] = []  # the fake implementation, registered once


def _register_fake() -> None:
    if _FAKE:
        return

    @torch.library.register_fake("exactspec::draft_step")
    def _draft_step(x, norm_w, eps, head, head_scales, temperature, top_k, top_p, min_p, u,
                    head_rows=None, vocab_size=0):
        vocab = head[0].shape[0] if head[0].dim() == 2 else head_scales.shape[0]
        if len(head) > 1:
            vocab = sum(w.shape[0] for w in head)
        if head_rows is not None:
            vocab = vocab_size
        return (x.new_empty(x.shape[0], dtype=torch.long), x.new_empty(x.shape[0], vocab))

    _FAKE.append(True)


def supports(params: SamplingParams) -> bool:
    """Whether the native step standardizes `params` exactly as `probs_from_logits` does: no
    penalty reading the history and no logit bias (a grammar's mask is the caller's check)."""
    return not params.uses_history and not params.logit_bias


def available() -> bool:
    """Whether the native step can run here: our kernels built and on."""
    if not enabled():
        return False
    _register_fake()
    return True


def draft_step(x: torch.Tensor,  # [B, H] float32: the last layer's output per row
               norm: tuple[torch.Tensor, float],  # the final RMSNorm: weight [H], eps
               head: tuple[list[torch.Tensor], torch.Tensor | None],  # Matrix.kernel_args()
               params: SamplingParams,
               u: torch.Tensor | None,  # [B] float64: the draw's uniforms (None: greedy)
               head_rows: torch.Tensor | None = None,  # [N] long: a reduced head's token ids
               vocab_size: int = 0,  # the vocabulary those ids lie in (with head_rows)
               ) -> tuple[torch.Tensor, torch.Tensor]:  # [B] long tokens, [B, V] float32 q
    """norm, head product, `probs_from_logits(logits, params)` and the inverse-CDF draw with
    u, in one call; greedy params give the one-hot q and its index (u unused). A reduced
    head's logits are placed at `head_rows` with OFF_HEAD elsewhere first, as
    `LeanLlama.full_logits` does."""
    if not supports(params):
        raise ValueError(f"the native draft step does not standardize {params} (penalties or "
                         "logit bias): use the Python path (DraftContext.standardize)")
    if not _FAKE and not available():
        raise RuntimeError("the native draft step needs the exactspec kernels (not built here or "
                           "turned off): use the Python path")
    weights, scales = head
    greedy = params.is_greedy
    return torch.ops.exactspec.draft_step(
        x, norm[0], float(norm[1]), weights, scales, 0.0 if greedy else float(params.temperature),
        int(params.top_k), float(params.top_p), float(params.min_p), None if greedy else u,
        head_rows, int(vocab_size))
