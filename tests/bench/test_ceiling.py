"""The scripted drafter sets the acceptance length by hand, with or without a head's cost."""

from __future__ import annotations

from exactspec.bench.ceiling import measure, table
from exactspec.drafters.eagle import EagleDrafter
from tests.drafters.test_eagle import make_head
from tests.engine.tiny import tiny_llama

PROMPTS = [[3, 7, 9, 11], [5, 6, 2, 30, 8]]


def test_acceptance_length_is_exactly_right_plus_one():
    target = tiny_llama(4)
    head = EagleDrafter(make_head(target), target)
    rows = measure(target, PROMPTS, k=3, max_new_tokens=12, head=head)  # 12 = a multiple of 1..4
    assert rows[0]["speedup"] == 1.0 and rows[0]["right"] is None
    got = {(r["drafter_cost"], r["right"]): r["acceptance_length"] for r in rows[1:]}
    assert got == {(c, a): float(a + 1) for c in ("free", "head") for a in range(4)}
    assert all(r["tok_s"] > 0 for r in rows)
    assert table(rows, 3).count("\n") == len(rows) + 1
