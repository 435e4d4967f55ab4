"""The verifier: built once per decoder from the verify method and the drafter, it gives each
step's verdict (accepted counts, recovered / bonus tokens) from p, the drafts and q.

Its rules are objects picked when it is built, never re-read from a name at a step: the chain
rule (the method's law; a user's callable, `UserRule`, is one more rule; the plain draw without a
drafter; the coupled verdict), the rule of a step whose rows are all greedy, and the tree method
when the drafter drafts trees. Rows marked `Row.coupled` (the server's seeded requests) take
the coupled verdict whatever the method.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from typing import ClassVar

import torch

from exactspec.drafters.base import trusts_q
from exactspec.drafters.tree_shape import tree_of
from exactspec.errors import InvalidValue
from exactspec.sampling import (
    DOMAIN_RESAMPLE,
    DOMAIN_SAMPLE,
    DraftTree,
    RowStreams,
    Verdict,
    VerifyMethod,
    sample,
)
from exactspec.sampling.chain import greedy_law
from exactspec.sampling.methods import Block, Coupled, LossyRule, Token, Traversal

# rule(target_probs [B, K+1, V], drafts [B, K], q [B, K, V] | None, streams) -> Verdict
ChainRule = Callable[[torch.Tensor, torch.Tensor, torch.Tensor | None, RowStreams], Verdict]
COUPLED = Coupled()  # the rule of rows marked Row.coupled
# the methods whose verdict when no row drafted (K = 0) is the bonus draw from p with the
# law's own uniform (`bonus_rule`), so the law need not be built
BONUS_AT_EMPTY = (Token, Block, Traversal)
# the methods whose verdict on one-hot p with the engine's own q is greedy verification's
# (`greedy_shortcut`)
GREEDY_AT_ONE_HOT = (Token,)


@dataclass(frozen=True)
class UserRule:
    """A user's callable with `exactspec.verify`'s signature, as a rule: called as
    fn(target_probs, draft_tokens, draft_probs, generator=streams). Not known to be exact
    (Generation.lossless is False), nor known to be lossy (a grammar may use it); chains only."""

    fn: Callable[..., Verdict]  # the user's function
    lossless: ClassVar[bool] = False
    greedy_only: ClassVar[bool] = False
    coupled: ClassVar[bool] = False
    tree_law: ClassVar[None] = None  # verifies no tree
    tree_hint: ClassVar[str] = " (a callable verifies chains)"

    @property
    def name(self) -> str:
        return getattr(self.fn, "__qualname__", repr(self.fn))

    def __call__(self, p, x, q, streams) -> Verdict:
        return self.fn(p, x, q, generator=streams)


Method = VerifyMethod | UserRule  # what the argument parser gives (engine/arguments.py)


def plain_rule(p: torch.Tensor, drafts: torch.Tensor, q: torch.Tensor | None,
               streams: RowStreams, greedy: bool = False) -> Verdict:
    """Plain decoding's verification of an empty proposal: one draw from p (greedy: every
    row's p is a one-hot, its hot index is the draw, `sample`'s greedy)."""
    tok = sample(p[:, 0], streams, domain=DOMAIN_SAMPLE, greedy=greedy)  # [B]
    return Verdict(tokens=tok[:, None], num_accepted=torch.zeros_like(tok))


def bonus_rule(p: torch.Tensor, streams) -> Verdict:  # p [B, 1, V]
    """An exact chain law's verdict when no row drafted: its bonus token, drawn from p with the
    uniform the law would use (the same token), without building the law."""
    tok = sample(p[:, 0], streams, domain=DOMAIN_RESAMPLE)  # [B]
    return Verdict(tokens=tok[:, None], num_accepted=torch.zeros_like(tok))


@dataclass(frozen=True)
class LawRule:
    """A verify method's chain law, drawn with the rows' streams (p is made by the engine and a
    user drafter's q is checked before: no second check)."""

    method: VerifyMethod
    bonus_at_empty: bool  # no row drafted: `bonus_rule`, plain decoding's cost

    def __call__(self, p, x, q, streams) -> Verdict:
        if self.bonus_at_empty and x.shape[1] == 0:
            return bonus_rule(p, streams)
        return self.method.chain_law(p, x, q, check=False).draw(streams)


def chain_rule(drafter, method: Method) -> ChainRule:
    """The step's acceptance rule: the plain draw without a drafter, else the method's."""
    if drafter is None:
        return plain_rule
    if isinstance(method, UserRule):
        return method
    return LawRule(method, isinstance(method, BONUS_AT_EMPTY))


def greedy_shortcut(drafter, method: Method) -> ChainRule | None:
    """Token verification's rule for steps whose rows are all greedy, when the drafter's q is
    the engine's (trusts_q): p is a one-hot at its argmax t and q(x) in (0, 1], so each draft is
    accepted with a = min(1, p(x) / q(x)), exactly 1 if x == t else 0, P(n) is a one-hot (its
    draw is its hot index whatever the uniform), and the residual max(p - q, 0) is positive at
    t alone (or empty, then p): greedy verification's tokens, drawn without uniforms, a residual
    or a float64 CDF. None for the other methods, a callable, or a q the engine checks."""
    if drafter is None or not isinstance(method, GREEDY_AT_ONE_HOT) or not trusts_q(drafter):
        return None
    return lambda p, x, q, streams: greedy_law(p, x, q, check=False).draw(streams)


def tree_method(drafter, method: Method) -> VerifyMethod | None:
    """The method that verifies `drafter`'s trees, or None for a chain drafter; a method that
    cannot verify trees ("block": its tree form is "traversal"; callables and lossy rules take
    chains) is refused here, with the fix."""
    shape = tree_of(drafter)
    if shape is None:
        return None
    if method.tree_law is None:
        raise InvalidValue(f"verify={method.name!r} cannot verify token trees{method.tree_hint}; "
                           "with a tree drafter use 'token', 'traversal' or 'greedy'")
    if method.fixed_shape_only and not shape.fixed and drafter.siblings != "deterministic":
        raise InvalidValue(f"verify={method.name!r} is proven for trees whose shape is fixed "
                           f"before the draws; a DynamicTree with siblings={drafter.siblings!r} "
                           "sizes its nodes by what was drawn: use verify='token', or "
                           "siblings='deterministic'")
    return method


class Verifier:
    """Each step's verdict, by rules chosen once from the method and the drafter."""

    def __init__(self, method: Method, drafter) -> None:
        self.method = method  # as parsed at the boundary (engine/arguments.py)
        self.lossless = method.lossless  # every output exactly the target's law
        # a grammar is refused with the opt-in lossy rules (its output would be neither the
        # target's law nor restricted exactly); a user's callable is not known to be lossy
        self.refuses_grammar = isinstance(method, LossyRule)
        # the coupled method: its verdict decides, the target drawing with the uniforms of the
        # rows' output positions (plain decoding included), and drafters draw with them too
        self.coupled: Coupled | None = method if method.coupled else None
        self.rule = chain_rule(drafter, method)  # the chain rule (plain: one draw from p)
        # the rule of a step whose rows are all greedy (the same tokens as `rule` there)
        self.greedy_rule = (partial(plain_rule, greedy=True) if drafter is None
                            else greedy_shortcut(drafter, method) or self.rule)
        self.tree = tree_method(drafter, method)  # verifies a tree drafter's trees, or None

    def verdict(self, p: torch.Tensor,  # [B, K+1, V]
                drafts: torch.Tensor,  # [B, K] -1 padded
                q: torch.Tensor | None,  # [B, K, V] or None (point masses)
                rows) -> Verdict:  # rows: engine.rows.RowBatch
        """The verdict of every row of `rows`. Rows always go through the rule, even when none
        drafted, so a row's randomness never depends on the others."""
        k = drafts.shape[1]
        if self.coupled is not None:  # one uniform per output position, shared with the drafter
            verdict = self.coupled.verdict(p, drafts, rows.streams, rows.output_positions(k + 1),
                                           greedy=rows.greedy)
        else:
            verdict = (self.greedy_rule if rows.greedy else self.rule)(p, drafts, q, rows.streams)
        own = rows.coupled_rows()  # [B] rows verified coupled by their own choice, or False
        if own is not False:
            mine = COUPLED.verdict(p, drafts, rows.streams, rows.output_positions(k + 1),
                                   greedy=rows.greedy)
            verdict = Verdict(tokens=torch.where(own[:, None], mine.tokens, verdict.tokens),
                              num_accepted=torch.where(own, mine.num_accepted,
                                                       verdict.num_accepted))
        return verdict

    def tree_verdict(self, p: torch.Tensor,  # [B, N+1, V]
                     tree: DraftTree, streams: RowStreams, *, check: bool):
        """The tree method's verdict (its accepted path) of every row."""
        return self.tree.tree_law(p, tree, check=check).draw(streams)
