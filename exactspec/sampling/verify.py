"""Verification's entry points: which draft tokens (or which tree path) to keep, and which token
to emit after them. Each row emits num_accepted + 1 tokens.

`method` is a VerifyMethod or its name, parsed here once (`exactspec.sampling.methods`); the
rules themselves live in `chain.py` (token, block, greedy), `lossy.py` (lenient, typical) and
`tree_verify.py` (trees), each split into an exact law and a draw from it.
"""

from __future__ import annotations

import torch

from exactspec.sampling.chain import AcceptanceLaw, Verdict
from exactspec.sampling.methods import VerifyMethod, parse_method, tree_method
from exactspec.sampling.streams import Randomness
from exactspec.sampling.tree import DraftTree
from exactspec.sampling.tree_verify import TreeLaw, TreeVerdict

__all__ = ["AcceptanceLaw", "TreeLaw", "TreeVerdict", "Verdict", "acceptance_law",
           "tree_acceptance_law", "verify", "verify_tree"]


def acceptance_law(
    target_probs: torch.Tensor,  # [B, K+1, V]
    draft_tokens: torch.Tensor,  # [B, K] long, -1 padded at the end of a row
    draft_probs: torch.Tensor | None = None,  # [B, K, V] or None (point-mass draft)
    *,
    method: str | VerifyMethod = "token",
    check: bool = True,
) -> AcceptanceLaw:
    """Validate the inputs and compute the exact law of n (number accepted) for `method`.

    The formulas are in exactspec.sampling.chain (and .lossy for the lossy rules). `check=False`
    skips the O(B K V) validation of the probabilities (shapes and ids are always checked); the
    engine uses it for distributions it made itself with probs_from_logits.
    """
    return parse_method(method).chain_law(target_probs, draft_tokens, draft_probs, check=check)


def verify(
    target_probs: torch.Tensor,  # [B, K+1, V]
    draft_tokens: torch.Tensor,  # [B, K] long, -1 padded
    draft_probs: torch.Tensor | None = None,  # [B, K, V] or None (point-mass draft)
    *,
    method: str | VerifyMethod = "token",
    generator: Randomness = None,
    check: bool = True,
) -> Verdict:
    """Keep a prefix of the drafts and emit one more token; lossless for "token" and "block".

    See `acceptance_law` for the formulas. Randomness: one float64 uniform per row picks n from
    its exact law (equivalent in distribution to the per-token coin flips), one more draws the
    extra token by inverse CDF. `generator` is a torch.Generator, one per row, or RowStreams.
    """
    law = acceptance_law(target_probs, draft_tokens, draft_probs, method=method, check=check)
    return law.draw(generator)


def tree_acceptance_law(
    target_probs: torch.Tensor,  # [B, N+1, V]: p after the root, then after each node
    tree: DraftTree,
    *,
    method: str | VerifyMethod = "token",
    check: bool = True,
) -> TreeLaw:
    """Validate the inputs and compute the exact law of the terminal node for `method`.

    See exactspec.sampling.tree_verify for the formulas. `check=False` skips the O(B N V)
    validation of the probabilities (shapes, ids and q(x) > 0 are always checked).
    """
    return tree_method(method).tree_law(target_probs, tree, check=check)


def verify_tree(
    target_probs: torch.Tensor,  # [B, N+1, V]
    tree: DraftTree,
    *,
    method: str | VerifyMethod = "token",
    generator: Randomness = None,
    check: bool = True,
) -> TreeVerdict:
    """Keep a root-to-node path of the tree and emit one more token; lossless for "token" and
    "traversal" whatever the sibling kind. On a chain, the same law as `verify` ("traversal" is
    "block"); "token" and "greedy" also give the same tokens for the same randomness.
    """
    law = tree_acceptance_law(target_probs, tree, method=method, check=check)
    return law.draw(generator)
