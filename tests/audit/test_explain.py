"""The explain walk-through: seed 000's cat/dog/fish numbers, exactly, and bad input."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from exactspec.audit import CAT_DOG_FISH, explain, format_explanation, money_diagram

EXACT = 1e-12


def test_cat_dog_fish_table():
    ex = explain(*CAT_DOG_FISH)
    rows = {r.label: r for r in ex.rows}
    assert abs(ex.p_accept - 0.8) < EXACT  # P(accept) = sum min(p, q)
    assert abs(ex.p_reject - 0.2) < EXACT  # Z = P(reject) = sum (p - q)+
    for label, a, both, excess, rec, p in [("cat", 1.0, 0.4, 0.2, 1.0, 0.6),
                                           ("dog", 0.6, 0.3, 0.0, 0.0, 0.3),
                                           ("fish", 1.0, 0.1, 0.0, 0.0, 0.1)]:
        row = rows[label]
        assert abs(row.accept - a) < EXACT
        assert abs(row.both - both) < EXACT
        assert abs(row.excess - excess) < EXACT
        assert abs(row.recovered - rec) < EXACT  # once rejected, always cat
        assert abs(row.output - p) < EXACT and row.matches  # P(output = x) == p(x)
    text = format_explanation(ex)
    assert "= 0.8" in text and "= 0.2" in text and "every row matches" in text


def test_draft_never_proposes_a_token_with_q_zero():
    ex = explain([0.5, 0.5, 0.0], [0.0, 0.2, 0.8], ["a", "b", "c"])
    assert ex.rows[0].accept is None  # never drafted: no acceptance probability
    assert ex.matches and abs(ex.p_reject - 0.8) < EXACT


def test_identical_distributions_never_reject():
    ex = explain([0.3, 0.7], [0.3, 0.7])
    assert ex.p_reject == 0.0 and all(r.recovered is None for r in ex.rows) and ex.matches


@settings(max_examples=50, deadline=None)
@given(st.integers(1, 6).flatmap(lambda v: st.tuples(
    st.lists(st.floats(0.0, 1.0), min_size=v, max_size=v),
    st.lists(st.floats(0.0, 1.0), min_size=v, max_size=v))))
def test_every_row_matches_for_any_p_q(pair):
    raw_p, raw_q = (torch.tensor(x, dtype=torch.float64) + 1e-3 for x in pair)
    p, q = (raw_p / raw_p.sum()).tolist(), (raw_q / raw_q.sum()).tolist()
    ex = explain(p, q)
    assert ex.matches
    assert abs(ex.p_accept + ex.p_reject - 1.0) < 1e-9


@pytest.mark.parametrize(("p", "q", "labels", "match"), [
    ([0.5, 0.5], [0.2, 0.3, 0.5], None, "one value per token"),
    ([-0.5, 1.5], [0.5, 0.5], None, "negative"),
    ([0.5, 0.6], [0.5, 0.5], None, "sums to 1.1"),
    ([0.5, 0.5], [0.5, float("nan")], None, "finite"),
    ([0.5, 0.5], [0.5, 0.5], ["a"], "one label per token"),
])
def test_bad_input(p, q, labels, match):
    with pytest.raises(ValueError, match=match):
        explain(p, q, labels)


def test_money_diagram_png(tmp_path):
    path = tmp_path / "money.png"
    money_diagram(explain(*CAT_DOG_FISH), str(path))
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
