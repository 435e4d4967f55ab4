"""Token trees against chains in `exactspec bench`: the engines at equal verify width, their
names, and the summary that says where a tree pays on this machine.

A tree of N nodes and a chain of K = N draft tokens both make the target score N + 1 positions
in one forward (the verify width). On a GPU that forward costs about one one-token step; on a
CPU it costs w(N+1) of them (`exactspec/bench/width_cost.py`), so a step is worth

    speed / plain ~ acceptance length / (w(N+1) + draft cost per step)

with the draft cost in target steps: (draft forwards per step) x c, c = one draft forward /
one target step. A tree buys acceptance length with width; it pays where its acceptance
length over the chain's at the same width beats the chain's depth advantage, and where w and
the tree's draft forwards (one per depth, each over that depth's nodes) stay cheap.

Engine names (usable with `exactspec bench --engines`): "eagle tree 4,1,1,1" (branching per
depth, as `exactspec generate --tree`), "eagle tree dynamic:16" (EAGLE-2's dynamic tree of 16
nodes; dynamic:BUDGET:TOP_K:DEPTH), "lookup tree 3x4" (3 matches of depth 4), optional
" iid" / " deterministic" (how siblings are drawn; default without replacement) and
" traversal" (traversal verification) suffixes, and any chain "eagle K=16".
"""

from __future__ import annotations

import math
import re

from exactspec.bench.engine_names import bench_uses, match_words
from exactspec.bench.engines import EngineSpec
from exactspec.drafters.base import TreeSpec
from exactspec.drafters.registry import DRAFTERS
from exactspec.drafters.tree_shape import DynamicTree, as_tree

Tree = TreeSpec | tuple[int, ...]  # a fixed branching per depth, or a dynamic tree

# the compared trees per drafter (a tree, or (tree, siblings)); each is run against the chain
# of as many draft tokens
TREE_SETS: dict[str, tuple] = {
    "eagle": ((2, 1, 1), (2, 1, 1, 1), (4, 1, 1, 1),  # 6, 8 and 16 nodes
              DynamicTree(16), (DynamicTree(16), "deterministic")),  # EAGLE-2's, 16 nodes
    "lookup": ((2, 1, 1), (2, 1, 1, 1), (4, 1, 1, 1)),  # 2x3, 2x4, 4x4 matches
    "suffix": ((2, 1, 1, 1),),  # <= 2 children per node, 4 deep, 8 nodes
    "qdraft int8 torch": ((2, 1, 1, 1, 1, 1),),  # 12 nodes at the chain's K=6 depth
}
REFERENCE_KS = (4, 6)  # the chains' usual K, run for reference


def _name_pattern() -> re.Pattern:
    """An engine name: a bench word of the drafter registry (drafters/registry.py's
    BenchUse, read at each call), then 'tree ...' or 'K=N' and the optional suffixes."""
    return re.compile(
        r"^(?:exactspec )?(?P<d>" + "|".join(sorted(map(re.escape, bench_uses()), key=len,
                                                    reverse=True)) + r") "
        r"(?:tree (?:(?P<m>\d+)x(?P<depth>\d+)|(?P<tree>\d+(?:,\d+)*)"
        r"|(?P<dyn>dynamic(?::\d+){0,3}))|K=(?P<k>\d+))(?: (?P<sib>iid|deterministic))?"
        r"(?P<traversal> traversal)?$")


def shape_text(drafter: str, tree: Tree) -> str:
    """'4,1,1,1', a lookup tree's '3x4', a dynamic tree's 'dynamic:16' (or :BUDGET:K:DEPTH)."""
    tree = as_tree(tree)
    return f"{tree[0]}x{len(tree)}" if drafter in match_words() and tree.fixed else tree.text()


def tree_name(drafter: str, tree: Tree, siblings: str = "without_replacement",
              verify: str = "token") -> str:
    """The engine name of a tree: 'exactspec eagle tree 4,1,1,1', 'exactspec lookup tree 3x4',
    'exactspec eagle tree dynamic:16 deterministic'."""
    name = f"exactspec {drafter} tree {shape_text(drafter, tree)}"
    name += "" if siblings == "without_replacement" else f" {siblings}"
    return name + (" traversal" if verify == "traversal" else "")


def tree_spec(drafter: str, tree: Tree, *, siblings: str = "without_replacement",
              verify: str = "token") -> EngineSpec:
    """A tree engine. Variants of the default (other siblings, traversal) run in sampling
    modes only: greedy rows always take the top-k and follow argmax p, so they are the same."""
    tree = as_tree(tree)
    return EngineSpec(tree_name(drafter, tree, siblings, verify), "exactspec", drafter, 0,
                      verify, tree=tree, siblings=siblings,
                      sampling_only=verify != "token" or siblings != "without_replacement")


def chain_spec(drafter: str, k: int) -> EngineSpec:
    """A chain engine, named as the default engines name it ('exactspec eagle K=8')."""
    return EngineSpec(f"exactspec {drafter} K={k}", "exactspec", drafter, k)


def tree_engines(sets: dict[str, tuple] | None = None) -> list[EngineSpec]:
    """exactspec plain, and per drafter its trees (a tree, or (tree, siblings)), the chain of
    as many draft tokens as each tree has nodes (equal verify width) and the chains of
    REFERENCE_KS."""
    out = [EngineSpec("exactspec plain", "exactspec", "none")]
    for drafter, entries in (sets or TREE_SETS).items():
        pairs = [e if isinstance(e, tuple) and isinstance(e[-1], str) else (e, None)
                 for e in entries]
        trees = [tree_spec(drafter, t, siblings=sib or "without_replacement")
                 for t, sib in pairs]
        ks = sorted(set(REFERENCE_KS) | {t.draft_nodes for t in trees})
        out += [chain_spec(drafter, k) for k in ks] + trees
    return out


def engine_from_name(text: str) -> EngineSpec | None:
    """The engine a name spells ('eagle tree 3,2,1', 'lookup tree 3x4 traversal',
    'eagle K=16'), or None when it spells none of these forms."""
    m = _name_pattern().match(text.strip())
    if m is None:
        return None
    drafter = m["d"]
    if m["k"] is not None:
        return None if m["sib"] or m["traversal"] else chain_spec(drafter, int(m["k"]))
    if DRAFTERS[bench_uses()[drafter][0]].trees == "none":
        return None  # a chain-only drafter has no tree engines
    if m["m"] is not None:
        if drafter not in match_words():
            return None
        tree: Tree = (int(m["m"]),) + (1,) * (int(m["depth"]) - 1)
    elif m["dyn"] is not None:
        if drafter in match_words():
            return None
        tree = as_tree(m["dyn"])
    else:
        tree = tuple(int(b) for b in m["tree"].split(","))
    return tree_spec(drafter, tree, siblings=m["sib"] or "without_replacement",
                     verify="traversal" if m["traversal"] else "token")


def with_named(specs: list[EngineSpec], names: list[str] | None) -> list[EngineSpec]:
    """`specs` plus every name in `names` that no spec's name contains but that spells an
    engine (engine_from_name): a user asks for any tree or chain by its name."""
    out = list(specs)
    for text in names or []:
        if any(text in s.name for s in out):
            continue
        spec = engine_from_name(text)
        if spec is not None:
            out.append(spec)
    return out


def draft_forwards(spec: EngineSpec) -> int | None:
    """Draft model forwards per step: one per tree depth or chain token; 0 for point masses."""
    if spec.drafter in match_words():  # point masses: no model forward
        return 0
    return spec.draft_forwards


def compared(specs: list[EngineSpec]) -> list[EngineSpec]:
    """The engines of the tree table: plain, and for every drafter with a tree engine its
    trees and its fixed-K chains (token verification)."""
    drafters = {s.drafter for s in specs if s.tree is not None}
    return [s for s in specs if (s.drafter == "none" and s.family == "exactspec")
            or (s.drafter in drafters and s.family == "exactspec"
                and (s.tree is not None or (isinstance(s.k, int) and s.verify == "token")))]


def summarise(specs: list[EngineSpec], rows: list[dict], grounded: dict[str, bool],
              width_ms: dict[int, float]) -> list[dict]:
    """One row per (engine, mode, workload group) of the compared engines, pooled over the
    group's workloads: acceptance length, speed, the width cost w (in the run, and probed:
    width_ms {width: ms} from width_cost.time_widths), the draft cost and the predicted speed
    acc / (w(scored width) + draft cost). `rows`: the bench's per-workload result rows."""
    by = {(r["engine"], r["mode"], r["workload"]): r for r in rows}
    out = []
    modes = list(dict.fromkeys(r["mode"] for r in rows))
    groups: dict[str, list[str]] = {}
    for w in dict.fromkeys(r["workload"] for r in rows):
        groups.setdefault("grounded" if grounded.get(w) else "open-ended", []).append(w)
    for mode in modes:
        for group, wls in groups.items():
            plain = [by[k] for w in wls if (k := ("exactspec plain", mode, w)) in by]
            plain_step = _per_step(plain, "target_forward")
            for s in compared(specs):
                mine = [by[k] for w in wls if (k := (s.name, mode, w)) in by]
                if mine:
                    out.append(_group_row(s, mode, group, mine, plain_step, width_ms))
    _pair_with_chains(out)
    return out


def _per_step(rows: list[dict], part: str) -> float | None:
    """Seconds of `part` of the time split per target forward, pooled over rows."""
    steps = sum(r.get("steps") or 0 for r in rows)
    secs = sum(r["seconds"] * (r.get("time_split") or {}).get(part, 0.0) for r in rows)
    return secs / steps if steps and secs > 0 else None


def _geomean(xs: list) -> float | None:
    xs = [x for x in xs if x]
    return math.exp(sum(map(math.log, xs)) / len(xs)) if xs else None


def width_cost_at(width_ms: dict[int, float], width: float) -> float | None:
    """w(width) = t(width) / t(1) from the probe, linear between the probed widths (a chain's
    mean scored width is fractional); None outside them or without t(1)."""
    t1, ws = width_ms.get(1), sorted(width_ms)
    if not t1 or not ws or not ws[0] <= width <= ws[-1]:
        return None
    hi = next(w for w in ws if w >= width)
    lo = max(w for w in ws if w <= width)
    f = 0.0 if hi == lo else (width - lo) / (hi - lo)
    return ((1 - f) * width_ms[lo] + f * width_ms[hi]) / t1


def _group_row(s: EngineSpec, mode: str, group: str, mine: list[dict],
               plain_step: float | None, width_ms: dict[int, float]) -> dict:
    steps = sum(r.get("steps") or 0 for r in mine)
    width = s.verify_width or 1
    fwd = 0 if s.drafter == "none" else draft_forwards(s)
    draft_step = _per_step(mine, "draft")
    target_step = _per_step(mine, "target_forward")
    d = draft_step / plain_step if draft_step and plain_step else 0.0  # in target steps
    nodes = sum(r.get("drafted") or 0 for r in mine) / steps if steps else 0.0
    # positions a verify forward really scored (one row a run): a fixed tree all N + 1 slots,
    # used or not (a dynamic tree at most that: fewer near the budget's end); a chain 1 + the
    # tokens it drafted (prompt lookup often finds fewer than K)
    scored = width if s.tree is not None else 1 + nodes
    w_probe = width_cost_at(width_ms, scored)
    acc = sum(r["tokens"] for r in mine) / steps if steps else None
    return {
        "engine": s.name, "drafter": s.drafter, "mode": mode, "group": group,
        "workloads": [r["workload"] for r in mine],
        "shape": "plain" if s.drafter == "none" else "tree" if s.tree else "chain",
        "tree": s.tree_json(), "k": s.k if s.tree is None else None,
        "siblings": s.siblings if s.tree is not None else None,
        "draft_nodes": s.draft_nodes or 0, "verify_width": width, "draft_forwards": fwd,
        "mean_acceptance_length": acc,
        "nodes_per_step": nodes if steps else None,
        "scored_width": scored if steps else None,
        "tokens_per_second": _geomean([r["tokens_per_second"] for r in mine]),
        "ratio_to_plain": _geomean([r.get("ratio_to_plain") for r in mine]),
        "width_cost_run": target_step / plain_step if target_step and plain_step else None,
        "width_cost": w_probe,  # w(scored width) = t / t(1), probed at a fixed context
        "c_per_forward": d / fwd if fwd else None,
        "draft_cost": d,  # draft seconds per step / plain's target step
        "predicted": acc / (w_probe + d) if acc and w_probe else None,
    }


def _pair_with_chains(rows: list[dict]) -> None:
    """A tree row gets its acceptance length and speed over the chain of as many draft tokens
    (same drafter, mode and group): the comparison at equal verify width."""
    chains = {(r["drafter"], r["mode"], r["group"], r["draft_nodes"]): r
              for r in rows if r["shape"] == "chain"}
    for r in rows:
        c = chains.get((r["drafter"], r["mode"], r["group"], r["draft_nodes"]))
        ok = r["shape"] == "tree" and c is not None
        r["equal_width_chain"] = c["engine"] if ok else None
        r["acc_over_chain"] = (r["mean_acceptance_length"] / c["mean_acceptance_length"]
                               if ok and c["mean_acceptance_length"] else None)
        r["speed_over_chain"] = (r["tokens_per_second"] / c["tokens_per_second"]
                                 if ok and c["tokens_per_second"] else None)
