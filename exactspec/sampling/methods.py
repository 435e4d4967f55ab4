"""Verification methods as objects: one class per method, parsed once from its name.

A method knows its chain rule (`chain_law`: p, drafts, q -> AcceptanceLaw), its tree rule
(`tree_law`: p, DraftTree -> TreeLaw; None when it verifies chains only), whether it is
lossless, and whether it is exact only for greedy decoding (T = 0). The boundary (the CLI, a
server request, the `generate` / `verify` argument) calls `parse_method` once; below it the
object travels, never the string. Adding a method is one class and one line in `_BY_NAME` (or,
for a "name:value" rule, in `_PARAMETRIZED`).

    token      Leviathan et al. 2023; on trees SpecInfer / RSD       lossless
    block      Sun et al. 2024 (chains; its tree form is traversal)  lossless
    traversal  Weng et al. 2025 (trees; on a chain it is block)      lossless
    greedy     argmax matching                                       exact at T = 0 only
    coupled    one uniform per output position for draft and target  lossless; the same text
               (chains; exactspec.sampling.coupled)                  as plain decoding per seed
    lenient:L  Leviathan et al. 2023, A.5                            LOSSY (opt-in)
    typical:EPS  Medusa's typical acceptance                         LOSSY (opt-in)
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import ClassVar

import torch

from exactspec.errors import InvalidValue
from exactspec.sampling.chain import AcceptanceLaw, Verdict, block_law, greedy_law, token_law
from exactspec.sampling.coupled import coupled_law, coupled_verdict
from exactspec.sampling.lossy import lenient_law, typical_law
from exactspec.sampling.streams import Randomness, position_uniforms
from exactspec.sampling.tree import DraftTree
from exactspec.sampling.tree_verify import RULES, TreeLaw, greedy_tree_law, rule_law

ChainLaw = Callable[..., AcceptanceLaw]  # (p [B, K+1, V], x [B, K], q [B, K, V] | None, *, check)
TreeRule = Callable[..., TreeLaw]  # (p [B, N+1, V], tree: DraftTree, *, check)


@dataclass(frozen=True)
class VerifyMethod:
    """One verification method (see the module docstring); subclasses are the methods."""

    name: ClassVar[str]  # what users write: "token", "lenient:0.5", ...
    lossless: ClassVar[bool] = True  # False: an opt-in lossy rule
    greedy_only: ClassVar[bool] = False  # exact only when every row decodes greedily (T = 0)
    tree_hint: ClassVar[str] = ""  # said when this chain-only method meets a tree drafter
    # proven only for trees whose shape is fixed before the draws (or drawn deterministically)
    fixed_shape_only: ClassVar[bool] = False
    # the draft and the target draw from one uniform per output position (Coupled): the engine
    # calls `verdict` with the rows' positions, and drafters draw with those uniforms too
    coupled: ClassVar[bool] = False

    def chain_law(self, p: torch.Tensor, x: torch.Tensor, q: torch.Tensor | None, *,
                  check: bool = True) -> AcceptanceLaw:
        """The exact law of one chain step (p [B, K+1, V], x [B, K], q [B, K, V] or None)."""
        raise NotImplementedError

    # (p, tree, *, check) -> TreeLaw; a method that verifies trees overrides it with its rule
    tree_law: ClassVar[TreeRule | None] = None

    def __str__(self) -> str:
        return self.name


@dataclass(frozen=True)
class Token(VerifyMethod):
    """Token-level verification, on chains and (SpecInfer / RSD) on trees."""

    name: ClassVar[str] = "token"

    def chain_law(self, p, x, q, *, check=True):
        return token_law(p, x, q, check=check)

    def tree_law(self, p: torch.Tensor, tree: DraftTree, *, check: bool = True) -> TreeLaw:
        return rule_law(RULES["token"], p, tree, check=check)


@dataclass(frozen=True)
class Block(VerifyMethod):
    """Block verification: chains only; its tree form is Traversal."""

    name: ClassVar[str] = "block"
    tree_hint: ClassVar[str] = " (block verification's tree form is 'traversal')"

    def chain_law(self, p, x, q, *, check=True):
        return block_law(p, x, q, check=check)


@dataclass(frozen=True)
class Traversal(VerifyMethod):
    """Traversal verification on trees; on a chain it is block verification."""

    name: ClassVar[str] = "traversal"
    fixed_shape_only: ClassVar[bool] = True

    def chain_law(self, p, x, q, *, check=True):
        return block_law(p, x, q, check=check, name=self.name)

    def tree_law(self, p: torch.Tensor, tree: DraftTree, *, check: bool = True) -> TreeLaw:
        return rule_law(RULES["traversal"], p, tree, check=check)


@dataclass(frozen=True)
class Greedy(VerifyMethod):
    """Greedy verification: the target's argmax; the exact rule of greedy decoding only."""

    name: ClassVar[str] = "greedy"
    greedy_only: ClassVar[bool] = True

    def chain_law(self, p, x, q, *, check=True):
        return greedy_law(p, x, q, check=check)

    def tree_law(self, p: torch.Tensor, tree: DraftTree, *, check: bool = True) -> TreeLaw:
        return greedy_tree_law(p, tree, check=check)


@dataclass(frozen=True)
class Coupled(VerifyMethod):
    """Coupled verification (exactspec.sampling.coupled): the target's draw at each output
    position is plain decoding's, from the position's own uniform; drafts are kept while they
    equal it. The same seed gives the same text at any draft length and without a drafter."""

    name: ClassVar[str] = "coupled"
    coupled: ClassVar[bool] = True
    tree_hint: ClassVar[str] = (" (coupled verification checks one chain against the target's "
                                "own draws; use a chain drafter, tree=None)")

    def chain_law(self, p, x, q, *, check=True):
        return coupled_law(p, x, q, check=check)

    def target_uniforms(self, streams: Randomness,
                        positions: torch.Tensor) -> torch.Tensor:  # [B, n] -> [B, n] f64
        """The uniforms the target draws with at the rows' output positions."""
        return position_uniforms(streams, positions)

    def verdict(self, p: torch.Tensor, x: torch.Tensor, streams: Randomness,
                positions: torch.Tensor, *, greedy: bool = False) -> Verdict:
        """The engine's coupled step: p [B, K+1, V], x [B, K], positions [B, K+1] (the output
        position of each p); greedy: every p is a one-hot, no uniform is needed."""
        u = None if greedy else self.target_uniforms(streams, positions)
        return coupled_verdict(p, x, u)


@dataclass(frozen=True)
class LossyRule(VerifyMethod):
    """A lossy rule with one parameter, written "rule:value" (exactspec.sampling.lossy)."""

    value: float  # lenient's L in (0, 1], typical's EPS in (0, 1)
    rule: ClassVar[str]  # the name before the colon
    lossless: ClassVar[bool] = False
    example: ClassVar[str]  # the error message's advice

    def __post_init__(self) -> None:
        if not self.accepts(self.value):
            raise InvalidValue(f"verify={self.name!r}: {self.example}")

    @staticmethod
    def accepts(value: float) -> bool:
        raise NotImplementedError

    @property
    def name(self) -> str:  # type: ignore[override]
        return f"{self.rule}:{self.value:g}"

    @property
    def method(self) -> str:
        """The method string (kept for callers of the former LossyRule)."""
        return self.name


@dataclass(frozen=True)
class Lenient(LossyRule):
    """lenient:L, Leviathan et al.'s lenient acceptance min(1, p / (L q))."""

    rule: ClassVar[str] = "lenient"
    example: ClassVar[str] = ("L must be a number in (0, 1], e.g. 'lenient:0.5' "
                              "(1 is the exact rule)")

    @staticmethod
    def accepts(value: float) -> bool:
        return 0 < value <= 1

    def chain_law(self, p, x, q, *, check=True):
        return lenient_law(self.value, self.name, p, x, q, check=check)


@dataclass(frozen=True)
class Typical(LossyRule):
    """typical:EPS, Medusa's typical acceptance."""

    rule: ClassVar[str] = "typical"
    example: ClassVar[str] = ("EPS must be a number in (0, 1), e.g. 'typical:0.09' "
                              "(Medusa's default)")

    @staticmethod
    def accepts(value: float) -> bool:
        return 0 < value < 1

    def chain_law(self, p, x, q, *, check=True):
        return typical_law(self.value, self.name, p, x, q, check=check)


_BY_NAME: dict[str, VerifyMethod] = {m.name: m for m in (Token(), Block(), Traversal(), Greedy(),
                                                         Coupled())}
_PARAMETRIZED: dict[str, type[LossyRule]] = {c.rule: c for c in (Lenient, Typical)}
METHODS = ("token", "block", "greedy")  # the lossless chain methods (traversal is block there)
TREE_METHODS = tuple(n for n, m in _BY_NAME.items() if m.tree_law is not None)
LOSSY_RULES = tuple(_PARAMETRIZED)  # the lossy rule names, used as "name:PARAMETER"
CHOICES = (*_BY_NAME, *(f"{r}:{'L' if r == 'lenient' else 'EPS'}" for r in _PARAMETRIZED))


def parse_method(method: str | VerifyMethod) -> VerifyMethod:
    """The method a name means ("token", "lenient:0.5", ...); a VerifyMethod passes through.

    Raises InvalidValue naming the choices for an unknown name or a value out of range.
    """
    if isinstance(method, VerifyMethod):
        return method
    if not isinstance(method, str):
        raise InvalidValue(f"verify={method!r} must be a method string such as 'token'")
    if method in _BY_NAME:
        return _BY_NAME[method]
    rule, sep, raw = method.partition(":")
    if not sep or rule not in _PARAMETRIZED:
        raise InvalidValue(f"unknown verify method: verify={method!r}; choose one of "
                           f"{', '.join(CHOICES)}")
    try:
        value = float(raw)
    except ValueError:
        value = math.nan
    cls = _PARAMETRIZED[rule]
    if not cls.accepts(value):
        raise InvalidValue(f"verify={method!r}: {cls.example}")
    return cls(value)


def parse_lossy(method: str | VerifyMethod) -> LossyRule | None:
    """The lossy rule a method names, None for a lossless method (raises like parse_method)."""
    parsed = parse_method(method)
    return parsed if isinstance(parsed, LossyRule) else None


def is_lossless(method: str | VerifyMethod | Callable) -> bool:
    """True for the exact methods ("token", "block", "traversal", "greedy", "coupled"), False for a lossy
    rule. "greedy" counts as exact: it is the exact rule of greedy decoding, the only one it is
    for. A callable verify is not known to be exact, so it gives False. Unknown strings raise."""
    if callable(method):
        return False
    return parse_method(method).lossless


def tree_method(method: str | VerifyMethod) -> VerifyMethod:
    """The method, refused (InvalidValue naming the choices) when it cannot verify trees."""
    parsed = parse_method(method)
    if parsed.tree_law is None:
        raise InvalidValue(f"verify method {parsed.name!r} is not a tree method{parsed.tree_hint};"
                           f" choose one of {', '.join(TREE_METHODS)}")
    return parsed
