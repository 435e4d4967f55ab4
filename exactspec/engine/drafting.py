"""The draft side of the decoder: the drafter, what it reads of the target, and its faults.

Everything the engine calls on a drafter goes through `DraftSide`, which reads only the drafter
contract of `drafters/base.py` (its optional parts through the functions declared there). Under
on_fault="plain" (the server) a drafter that raises is logged, the rows in flight finish with
plain decoding (exact), and the drafter restarts with `begin` once they have all left.
"""

from __future__ import annotations

import logging

import torch

from exactspec.drafters.base import (
    DraftContext,
    Drafter,
    TargetInfo,
    admit_rows,
    lags_behind,
    trusts_q,
)
from exactspec.errors import InvalidValue
from exactspec.sampling import DraftTree, acceptance_law

log = logging.getLogger(__name__)
FAULT = object()  # what DraftSide._guard returns for a drafter call that raised


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


def check_draft_probs(drafter, p: torch.Tensor, drafts: torch.Tensor, q: torch.Tensor) -> None:
    """A user drafter's q ([B, K, V]) must be the distributions its drafts ([B, K]) came from:
    finite, non-negative, summing to 1, with q(x) > 0 at each draft token."""
    try:
        acceptance_law(p, drafts, q, method="token", check=True)
    except ValueError as e:
        raise InvalidValue(f"drafter {type(drafter).__name__} returned draft_probs that cannot "
                           f"be the q its draft tokens were drawn from: {e}") from None


class DraftSide:
    """The drafter (NoDrafter for plain decoding) and its state in the decoder. `rows` in the
    methods is the decoder's `engine.rows.RowBatch`, whose `context()` the drafter reads."""

    def __init__(self, drafter: Drafter | None, info: TargetInfo, *, on_fault: str) -> None:
        self.drafter = drafter if drafter is not None else NoDrafter()
        self.info = info  # what the drafter may check about the target
        layers = self.drafter.hidden_layers
        self.layers = tuple(layers) if layers is not None else None  # target features it reads
        self.checks_q = not trusts_q(self.drafter)  # validate its q (a user drafter's)
        # "raise" (generate, batch: a drafter's exception propagates) or "plain" (the server)
        self.on_fault = on_fault
        self.faulted: set[int] | None = None  # ids of the rows in flight at a fault, pending
        self.faults = 0  # drafter faults survived so far

    def admit(self, rows, start: int) -> bool | None:
        """Rows start.. of `rows` are new: the drafter's admission hook (or a `begin`). Returns
        whether the drafter lags behind on the rows it does not draft for (`lags_behind`), or
        None while a fault is pending (the drafter restarts later, not told now)."""
        if self.faulted is not None:
            return None
        self._guard(rows, admit_rows, self.drafter, rows.context(), self.info, start)
        return lags_behind(self.drafter)

    def select(self, rows, sel: torch.Tensor) -> None:  # sel [R] long
        """`rows` kept only the rows at `sel`; an empty batch restarts the drafter at the next
        admission (a pending fault is then over)."""
        if not len(rows):
            self.faulted = None
        elif self.faulted is None:
            self._guard(rows, self.drafter.select, sel)

    def ready(self, rows) -> bool:
        """Whether this step may draft: no fault pending, or every row that saw the last fault
        has left (then the drafter restarts over the rows in flight, with `begin`)."""
        if self.faulted is None:
            return True
        if self.faulted & {r.id for r in rows.rows}:
            return False
        self.faulted = None
        return self._guard(rows, self.drafter.begin, rows.context(), self.info) is not FAULT

    def propose(self, rows, want: torch.Tensor,  # [B] long drafts per row
                drafting: bool) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]:
        """The drafts [B, K] (-1 padded, K the most any row kept), their q [B, K, V] or None,
        on the rows' device, and each row's number of drafts [B]; the empty proposal when not
        `drafting` or when the drafter raised. Point masses a grammar forbids are cut (exact:
        each would be rejected with certainty, its residual is p)."""
        dev = rows.device
        proposal = FAULT
        if drafting:
            proposal = self._guard(rows, self.drafter.propose, rows.context(), want.to(dev))
        if proposal is FAULT:  # plain: an empty proposal
            proposal = NoDrafter().propose(rows.context(), want)
        drafts, q = proposal  # [B, K'], [B, K', V]
        drafts = drafts.to(dev)
        if q is None and rows.grammar is not None and rows.grammar.active:
            drafts = rows.grammar.forbidden_cut(drafts)
        num_real = (drafts >= 0).sum(1)  # [B]
        k = int(num_real.max()) if len(rows) else 0
        return drafts[:, :k], (q[:, :k].to(dev) if q is not None else None), num_real

    def propose_tree(self, rows, room: torch.Tensor) -> DraftTree | None:  # room [B] long
        """A tree per row (no node deeper than its room), or None when the drafter raised."""
        tree = self._guard(rows, self.drafter.propose_tree, rows.context(), room)
        return None if tree is FAULT else tree

    def q_fails(self, rows, p: torch.Tensor, drafts: torch.Tensor, q: torch.Tensor) -> bool:
        """Whether a user drafter's q failed its check (`check_draft_probs`; raised under
        on_fault="raise"); False for a drafter whose q the engine trusts."""
        return self.checks_q and self._guard(rows, check_draft_probs, self.drafter, p, drafts,
                                             q) is FAULT

    def _guard(self, rows, call, *args):
        """`call(*args)` for the drafter; under on_fault="plain" a raise is logged, the rows in
        flight continue plain, and FAULT is returned instead of the call's result."""
        if self.on_fault == "raise":
            return call(*args)
        try:
            return call(*args)
        except Exception:
            log.exception("the drafter %s failed; the %d rows in flight continue with plain "
                          "decoding", type(self.drafter).__name__, len(rows))
            self.faulted = {r.id for r in rows.rows}
            self.faults += 1
            return FAULT
