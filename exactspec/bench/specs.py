"""What the bench compares: sampling modes, engine specs and the figures of one run."""

from __future__ import annotations

from dataclasses import dataclass, field

from exactspec.drafters.base import TreeSpec
from exactspec.drafters.tree_shape import as_tree
from exactspec.engine.results import add_counts as add_counts  # bench.engines, bench.rows use it
from exactspec.sampling import SamplingParams


@dataclass(frozen=True)
class Mode:
    """A sampling setting every engine is run with."""

    name: str  # "greedy" | "t1" | "t0.7p0.9"
    temperature: float  # 0 = greedy
    top_p: float = 1.0  # 1.0 = off

    def params(self, seed: int) -> SamplingParams:
        return SamplingParams(temperature=self.temperature, top_p=self.top_p, seed=seed)

    def hf_kwargs(self) -> dict:
        """The same setting for transformers `generate` (every other filter off)."""
        if self.temperature == 0:
            return dict(do_sample=False, temperature=None, top_p=None, top_k=None)
        return dict(do_sample=True, temperature=self.temperature, top_p=self.top_p, top_k=0)


MODES = {
    "greedy": Mode("greedy", 0.0),
    "t1": Mode("t1", 1.0),
    "t0.7p0.9": Mode("t0.7p0.9", 0.7, 0.9),
}


@dataclass(frozen=True)
class EngineSpec:
    """One engine of the comparison."""

    name: str  # shown in tables and plots
    family: str  # "exactspec" | "transformers" | "llama.cpp"
    # "none", or a bench word (bench/engine_names.py's BenchUse):
    # "lookup", "draft", "eagle", "qdraft int8", "qdraft int8 torch", "cross-vocab", ...
    drafter: str
    k: int | str = 0  # draft tokens per step, or "auto"; 0 for plain decoding
    verify: str = "token"  # exactspec verification method ("token" | "block")
    counterpart: str | None = None  # the transformers engine this one is compared with
    sampling_only: bool = False  # skip in greedy mode (block == token when p is one-hot)
    # a token tree: branching per depth (exactspec/drafters/tree_draft.py; prompt lookup's
    # M branches of depth D are (M, 1, ..., 1)) or an EAGLE-2 DynamicTree (node budget);
    # None: chains of k tokens
    tree: TreeSpec | tuple[int, ...] | None = None  # a tuple is read as a Branching
    siblings: str = "without_replacement"  # how a sampled tree's siblings are drawn
    weights: str | None = None  # llama.cpp's GGUF type ("f32", "q8_0", "q4_1"); None otherwise

    def __post_init__(self) -> None:
        object.__setattr__(self, "tree", as_tree(self.tree))

    @property
    def draft_nodes(self) -> int | None:
        """Draft positions the target scores per step (tree nodes, a dynamic tree's node
        budget, or K); None for auto."""
        if self.tree is not None:
            return self.tree.node_budget
        return self.k if isinstance(self.k, int) else None

    @property
    def verify_width(self) -> int | None:
        """Positions one verify forward scores: the draft nodes + 1 (the last committed
        token); None for auto (the policy picks K per step)."""
        n = self.draft_nodes
        return None if n is None else n + 1

    @property
    def draft_forwards(self) -> int | None:
        """Drafter calls per step: one per tree depth (a dynamic tree's deepest), one per
        chain token (K)."""
        return self.tree.depth if self.tree is not None else self.draft_nodes

    def tree_json(self) -> list[int] | dict | None:
        """The tree for the result JSON: the branching list, or a dynamic tree's fields."""
        return self.tree.as_json() if self.tree is not None else None


@dataclass
class Run:
    """One engine on one batch of prompts."""

    tokens: int  # generated tokens, all rows
    seconds: float  # wall time of the whole call, prefill included
    steps: int = 0  # target forwards (exactspec: summed over rows)
    forwards: int = 0  # target forwards of the whole batch (one per step, whatever the rows)
    drafted: int = 0  # draft tokens proposed
    accepted: int = 0  # draft tokens kept
    accepted_per_position: list[int] = field(default_factory=list)  # steps keeping draft i
    drafted_per_position: list[int] = field(default_factory=list)  # steps with a draft i
    prefill_seconds: float = 0.0  # exactspec's time split (first row's view of its batch)
    draft_seconds: float = 0.0
    target_seconds: float = 0.0
    verify_seconds: float = 0.0
    texts: list[list[int]] = field(default_factory=list)  # generated ids per row
