"""Lossy verification rules, opt-in: more accepted drafts, at a measured price in exactness.

They are chosen with `verify="lenient:L"` or `verify="typical:EPS"` and are never a default.
Each computes an `AcceptanceLaw` like the lossless rules, so the audit enumerates them exactly
(`exactspec.audit.lossy` measures their drift); `verify` draws from it in the same way.

lenient:L (Leviathan et al. 2023, appendix A.5), L in (0, 1]:
    draft i is accepted with a_i = min(1, p_i(x_i) / (L q_i(x_i))), in order; after a
    rejection the recovered token is drawn from norm(max(p - q, 0)) (the residual of the exact
    rule, which is also the one of least TV given these acceptances); the bonus token from p.
    One step emits min(q, p / L) + (1 - sum min(q, p / L)) norm(max(p - q, 0)): exact at L = 1.
    A point-mass draft (q one-hot at x) is accepted with min(1, p(x) / L).
typical:EPS (Medusa, Cai et al. 2024, "typical acceptance"), EPS in (0, 1):
    draft i is accepted iff p_i(x_i) >= min(EPS, sqrt(EPS) exp(-H(p_i))), H the entropy of
    p_i in nats (a deterministic test: q is not consulted); after the first rejection the next
    token is drawn from p_i itself, the bonus token from p. Exact only when p is one-hot
    (greedy decoding), where it accepts exactly the argmax.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch

from exactspec.errors import InvalidValue
from exactspec.sampling.tree_verify import TREE_METHODS
from exactspec.sampling.verify import METHODS, AcceptanceLaw, _check_inputs

LOSSY_RULES = ("lenient", "typical")  # the lossy rule names, used as "name:PARAMETER"


@dataclass(frozen=True)
class LossyRule:
    """A parsed lossy method string."""

    name: str  # "lenient" | "typical"
    value: float  # L for lenient (0 < L <= 1), EPS for typical (0 < EPS < 1)

    @property
    def method(self) -> str:
        """The method string this rule parses from."""
        return f"{self.name}:{self.value:g}"


def parse_lossy(method: str) -> LossyRule | None:
    """The lossy rule a method string names, None for a lossless method name.

    Raises InvalidValue for a malformed "name:value" string or a value out of range.
    """
    if not isinstance(method, str):
        raise InvalidValue(f"verify={method!r} must be a method string such as 'token'")
    if method in METHODS:
        return None
    name, sep, raw = method.partition(":")
    if not sep or name not in LOSSY_RULES:
        choices = ", ".join([*METHODS, "lenient:L", "typical:EPS"])
        raise InvalidValue(f"unknown verify method: verify={method!r}; choose one of {choices}")
    try:
        value = float(raw)
    except ValueError:
        value = math.nan
    if name == "lenient" and not 0 < value <= 1:
        raise InvalidValue(f"verify={method!r}: L must be a number in (0, 1], e.g. 'lenient:0.5' "
                           "(1 is the exact rule)")
    if name == "typical" and not 0 < value < 1:
        raise InvalidValue(f"verify={method!r}: EPS must be a number in (0, 1), e.g. "
                           "'typical:0.09' (Medusa's default)")
    return LossyRule(name, value)


def is_lossless(method: str | Callable) -> bool:
    """True for the exact methods ("token", "block", "traversal", ...), False for a lossy rule.

    "greedy" counts as exact: it is the exact rule of greedy decoding, the only one it is for.
    A callable verify is not known to be exact, so it gives False. Unknown strings raise.
    """
    if callable(method):
        return False
    if not isinstance(method, str):
        raise InvalidValue(f"verify={method!r} must be a method string or a callable")
    if method in TREE_METHODS:  # "traversal": the trees' sequence-level rule
        return True
    return parse_lossy(method) is None


class TypicalLaw(AcceptanceLaw):
    """Typical acceptance: after the first rejection (or all K accepted) the token is from p."""

    def residual(self, n: torch.Tensor) -> torch.Tensor:  # n [B] -> [B, V]
        b = torch.arange(n.shape[0], device=n.device)
        return self.target_probs[b, n]


def lossy_law(
    rule: LossyRule,
    target_probs: torch.Tensor,  # [B, K+1, V]
    draft_tokens: torch.Tensor,  # [B, K] long, -1 padded
    draft_probs: torch.Tensor | None = None,  # [B, K, V] or None (point-mass draft)
    *,
    check: bool = True,
) -> AcceptanceLaw:
    """The exact law of one step of `rule` (formulas in the module docstring)."""
    p, x, q = target_probs, draft_tokens, draft_probs
    lengths = _check_inputs(p, x, q, values=check)
    bsz, k = x.shape
    dev = p.device
    weights = torch.ones(bsz, k + 1, dtype=torch.float64, device=dev)
    law_class = TypicalLaw if rule.name == "typical" else AcceptanceLaw
    if k == 0:
        return law_class(rule.method, torch.ones(bsz, 1, dtype=torch.float64, device=dev),
                         p, x, q, lengths, weights)
    valid = torch.arange(k, device=dev)[None, :] < lengths[:, None]  # [B, K]
    xs = x.clamp(min=0)
    p_x = p[:, :k].gather(2, xs[..., None]).squeeze(-1).to(torch.float64)  # [B, K]
    if rule.name == "lenient":
        q_x = (torch.ones_like(p_x) if q is None
               else q.gather(2, xs[..., None]).squeeze(-1).to(torch.float64))  # [B, K]
        if q is not None and ((q_x <= 0) & valid).any():
            raise InvalidValue("a draft token has q(x) = 0 under draft_probs: it cannot have "
                               "been sampled from q; pass the exact distribution the draft used")
        a = torch.clamp(p_x / (rule.value * q_x), max=1.0)  # [B, K]
    else:
        pk = p[:, :k].to(torch.float64)  # [B, K, V]
        entropy = -(pk * pk.clamp(min=1e-300).log()).sum(-1)  # [B, K] nats
        eps = rule.value
        threshold = torch.clamp(math.sqrt(eps) * torch.exp(-entropy), max=eps)  # [B, K]
        a = (p_x >= threshold).to(torch.float64)
    a = torch.where(valid, a, torch.zeros_like(a))
    reach = torch.cat([torch.ones_like(a[:, :1]), a.cumprod(1)], 1)  # [B, K+1] P(n >= i)
    stop = torch.cat([1.0 - a, torch.ones_like(a[:, :1])], 1)  # P(stop at i | reached i)
    return law_class(rule.method, reach * stop, p, x, q, lengths, weights)
