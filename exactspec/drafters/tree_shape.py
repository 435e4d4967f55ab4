"""The shapes a drafter's token tree may take, both `TreeSpec`s (exactspec.drafters.base):
`Branching`, a fixed branching per depth such as (3, 2, 1), and `DynamicTree`, EAGLE-2's tree
grown where the draft is confident (its growth: exactspec.drafters.dynamic_tree). Also the
validation of a drafter's `tree=` / `siblings=` arguments and the CLI's spelling of a tree.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import asdict, dataclass

from exactspec.drafters.base import TreeDrafter, TreeSpec
from exactspec.errors import InvalidType, InvalidValue
from exactspec.sampling import SIBLING_KINDS, branching_parents


class Branching(tuple):
    """A fixed tree: branching factors per depth, e.g. Branching((3, 2, 1)); equal to the
    plain tuple. The layout of its nodes is fixed before anything is drawn."""

    fixed = True  # see TreeSpec

    def __new__(cls, branching: Iterable[int]) -> Branching:
        if isinstance(branching, int | str) or not isinstance(branching, Iterable):
            raise InvalidType(f"tree={branching!r} must be a sequence of branching factors, one "
                              "per depth, e.g. tree=(3, 2, 1), or DynamicTree(node_budget=16)")
        branching = tuple(branching)  # (dataclasses.asdict rebuilds it from a generator)
        branching_parents(branching)  # raises InvalidValue on zeros and non-ints
        return super().__new__(cls, branching)

    @property
    def node_budget(self) -> int:
        """Nodes of the full tree."""
        return len(branching_parents(self))

    @property
    def depth(self) -> int:
        """The deepest node's depth (draft forwards per step)."""
        return len(self)

    def text(self) -> str:
        """'3,2,1', as the CLI spells it."""
        return ",".join(map(str, self))

    def as_json(self) -> list[int]:
        return list(self)


@dataclass(frozen=True)
class DynamicTree:
    """How a dynamic tree grows: `drafter.tree = DynamicTree(node_budget=16)`."""

    node_budget: int = 16  # nodes kept per step (the target verifies node_budget + 1 tokens)
    top_k: int = 4  # children per expanded node, and nodes expanded per depth
    max_depth: int = 6  # deepest node; the draft runs max_depth - 1 times after its root

    fixed = False  # the nodes kept depend on the draft's q (see TreeSpec); not a field

    def __post_init__(self) -> None:
        for name in ("node_budget", "top_k", "max_depth"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int):
                raise InvalidType(f"DynamicTree.{name} must be an int, got {value!r}")
            if value < 1:
                raise InvalidValue(f"DynamicTree.{name}={value} must be >= 1, e.g. "
                                   "DynamicTree(node_budget=16, top_k=4, max_depth=6)")

    @property
    def depth(self) -> int:
        """The deepest node's depth (draft forwards per step)."""
        return self.max_depth

    def text(self) -> str:
        """'dynamic:16', or 'dynamic:BUDGET:TOP_K:DEPTH' when top_k / depth differ from the
        defaults, as the CLI spells it."""
        plain = self == DynamicTree(self.node_budget)
        return f"dynamic:{self.node_budget}" + ("" if plain else
                                                 f":{self.top_k}:{self.max_depth}")

    def as_json(self) -> dict:
        return asdict(self)

    @classmethod
    def parse(cls, text: str) -> DynamicTree:
        """'dynamic:16' or 'dynamic:16:4:6' (node_budget, top_k, max_depth)."""
        head, _, rest = text.partition(":")
        try:
            if head != "dynamic" or not rest:
                raise ValueError
            values = [int(part) for part in rest.split(":")]
            if len(values) > 3:
                raise ValueError
        except ValueError:
            raise InvalidValue(f"{text!r}: expected dynamic:BUDGET[:TOP_K[:DEPTH]], e.g. "
                               "dynamic:16 or dynamic:24:4:8") from None
        return cls(*values)


def as_tree(tree) -> TreeSpec | None:
    """A drafter's `tree` as a TreeSpec: None (chains), a TreeSpec as given, a sequence of branching factors as a Branching, 'dynamic' / 'dynamic:16[:4[:6]]' as a
    DynamicTree. Raises InvalidType / InvalidValue naming the accepted forms."""
    if tree is None or isinstance(tree, TreeSpec):
        return tree
    if isinstance(tree, str) and tree.startswith("dynamic"):
        return DynamicTree() if tree == "dynamic" else DynamicTree.parse(tree)
    return Branching(tree)


def parse_tree(text: str) -> Branching | DynamicTree:
    """The CLI's spelling: '3,2,1' (branching per depth) or 'dynamic[:16[:4[:6]]]'."""
    if text.startswith("dynamic"):
        return as_tree(text)
    try:
        branching = tuple(int(b) for b in text.split(","))
    except ValueError:
        raise InvalidValue(f"tree {text!r}: expected branching factors per depth such as "
                           "3,2,1, or dynamic:16[:TOP_K[:DEPTH]]") from None
    return Branching(branching)


def tree_of(drafter) -> TreeSpec | None:
    """The tree `drafter` drafts now, as a TreeSpec; None for chains (or a chain drafter)."""
    return as_tree(drafter.tree) if isinstance(drafter, TreeDrafter) else None


def check_tree(tree, siblings: str) -> tuple[Branching | DynamicTree | None, str]:
    """Validate a drafter's `tree=` (see `as_tree`) and `siblings=` arguments."""
    if siblings not in SIBLING_KINDS:
        raise InvalidValue(f"siblings={siblings!r} must be one of {', '.join(SIBLING_KINDS)}")
    return as_tree(tree), siblings
