"""GenerationStats merges itself: the one place per-position counts are summed (a request's
choices in the server, a rollout's samples, a bench run's rows)."""

from __future__ import annotations

from exactspec.engine.results import GenerationStats, add_counts


def _row(steps):
    """A row's statistics after `steps`, each (drafted, accepted)."""
    st = GenerationStats()
    for i, (drafted, accepted) in enumerate(steps, 1):
        st.record_step(drafted, accepted, i * 2, 0.5, 1.0, 0.25, float(i))
    return st


def test_merge_sums_every_count_by_position():
    a = _row([(3, 3), (3, 1)])  # drafted at 0, 1, 2 twice; kept 0, 1, 2 once and 0 once more
    b = _row([(1, 0), (4, 4), (4, 2)])
    total = a.merge(b)
    assert total.steps == 5 and total.drafted == 15 and total.accepted == 10
    assert total.drafted_per_position == [5, 4, 4, 2]
    assert total.accepted_per_position == [4, 3, 2, 1]
    assert total.emitted == a.emitted + b.emitted == 10
    assert total.target_seconds == 5.0 and total.seconds == a.seconds + b.seconds
    assert a.drafted_per_position == [2, 2, 2]  # the operands are left as they were
    assert GenerationStats.total([a, b]) == total
    assert GenerationStats.total([]) == GenerationStats()


def test_add_counts_reads_a_shorter_list_as_zeros():
    assert add_counts([1, 2], [3, 4, 5]) == [4, 6, 5]
    assert add_counts([], [7]) == [7] and add_counts([7], []) == [7]
