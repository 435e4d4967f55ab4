"""The thread count per forward (kernels/threads.py): the policy on measured costs, and that
changing the count between forwards changes no bit of the output."""

from __future__ import annotations

import pytest
import torch

import exactspec as es
from exactspec.kernels import threads
from exactspec.kernels.threads import FIRST_WAIT, MAX_WAIT, WARM, Governor, candidates
from exactspec.sampling import SamplingParams
from tests.engine.tiny import tiny_model

KEY = ("f", 1, 1)


@pytest.fixture
def threads_restored():
    n = torch.get_num_threads()
    yield
    torch.set_num_threads(n)


def _feed(gov: Governor, cost: dict[int, float], forwards: int, most: int = 2,
          key: tuple = KEY) -> list[int]:
    """Run `forwards` forwards whose seconds per count are `cost`; the counts chosen."""
    chosen = []
    for _ in range(forwards):
        n = gov.choose(key, most)
        gov.record(key, most, n, cost[n])
        chosen.append(n)
    return chosen


def test_candidates_halve_down_to_one():
    assert candidates(2) == [2, 1] and candidates(16) == [16, 8, 4, 2, 1]
    assert candidates(6) == [6, 3, 1] and candidates(1) == [1]


def test_each_count_is_measured_once_after_the_warm_up_then_the_cheapest_runs():
    gov = Governor()
    chosen = _feed(gov, {2: 1.0, 1: 1.8}, WARM + 5)
    assert chosen == [2] * WARM + [1, 2, 2, 2, 2]


def test_a_busy_core_is_given_up_within_a_few_forwards_and_taken_back_when_it_frees():
    gov = Governor()
    idle, busy = {2: 1.0, 1: 1.8}, {2: 10.0, 1: 1.9}
    _feed(gov, idle, WARM + 1 + 3 * FIRST_WAIT)
    chosen = _feed(gov, busy, 8)
    assert chosen[-4:] == [1, 1, 1, 1], chosen  # the smoothed cost of 2 passed 1's in a few
    back = _feed(gov, idle, MAX_WAIT + 2)
    assert back[-20:].count(2) >= 19, back  # re-measured within MAX_WAIT forwards, then kept


def test_a_new_kind_starts_from_what_the_measured_ones_found():
    """With a core taken (2 threads 20x dearer), a kind seen later runs at 1 thread from its
    first forward and tries 2 threads only after FIRST_WAIT forwards; on an idle machine (2
    threads the cheaper, by less than DEAR) a new kind still measures 1 thread once."""
    gov = Governor()
    busy = {2: 20.0, 1: 1.0}
    _feed(gov, busy, WARM + 2)
    later = _feed(gov, {2: 8.0, 1: 0.4}, FIRST_WAIT + 2, key=("g", 1, 8))
    assert later[:FIRST_WAIT] == [1] * FIRST_WAIT and 2 in later[FIRST_WAIT:], later
    idle = Governor()
    _feed(idle, {2: 1.0, 1: 1.8}, WARM + 2)
    assert _feed(idle, {2: 1.0, 1: 1.8}, WARM + 2, key=("g", 1, 8)) == [2] * WARM + [1, 2]


def test_the_re_measure_interval_doubles_while_it_confirms_and_resets_on_a_change():
    gov = Governor()
    _feed(gov, {2: 1.0, 1: 1.8}, WARM + 1)
    waits = []
    for _ in range(4):
        _feed(gov, {2: 1.0, 1: 1.8}, gov.kinds[KEY].wait + 1)
        waits.append(gov.kinds[KEY].wait)
    assert waits == [2 * FIRST_WAIT, 4 * FIRST_WAIT, 8 * FIRST_WAIT, 16 * FIRST_WAIT]
    for _ in range(10):  # busy: 1 takes over, and the others are watched closely again
        _feed(gov, {2: 9.0, 1: 1.8}, 1)
        if gov.kinds[KEY].best == 1:
            break
    assert gov.kinds[KEY].best == 1 and gov.kinds[KEY].wait == FIRST_WAIT


def test_one_thread_or_turned_off_is_left_alone(monkeypatch, threads_restored):
    gov = Governor()
    torch.set_num_threads(1)
    with gov.run(KEY) as n:
        assert n == 1
    torch.set_num_threads(2)
    monkeypatch.setenv(threads.ENV, "0")
    with gov.run(KEY) as n:
        assert n == 2 and torch.get_num_threads() == 2
    assert not gov.kinds


def test_changing_the_count_between_forwards_changes_no_bit(monkeypatch, threads_restored):
    """Greedy and sampled decoding with the count alternating 2, 1, 2, ... between forwards
    give the tokens and log p of decoding at a fixed count, bit for bit."""
    torch.set_num_threads(2)
    target = tiny_model(0, hidden=64, eos=0)
    prompts = [[5, 6, 7, 8, 5, 6, 7], [9, 10], [1, 2, 3, 1, 2, 3]]
    params = [SamplingParams(temperature=0), SamplingParams(temperature=1.0, seed=3)]
    drafter = es.QuantizedDraft(8, backend="torch")

    def run():
        return [es.generate(target, prompts, drafter=d, params=p, max_new_tokens=12,
                            num_draft_tokens=3, return_logprobs=True)
                for p in params for d in (None, drafter)]

    monkeypatch.setenv(threads.ENV, "0")
    fixed = run()
    monkeypatch.delenv(threads.ENV)
    counts = []

    def alternate(self, key, most):
        counts.append(1 if len(counts) % 2 else 2)
        return counts[-1]

    monkeypatch.setattr(Governor, "choose", alternate)
    varied = run()
    assert {1, 2} <= set(counts) and len(counts) > 20
    for a, b in zip(fixed, varied, strict=True):
        assert [g.token_ids for g in a] == [g.token_ids for g in b]
        for ga, gb in zip(a, b, strict=True):
            assert torch.equal(torch.tensor(ga.logprobs), torch.tensor(gb.logprobs))


def test_importing_exactspec_first_shortens_openmp_spinning():
    """`import exactspec` before torch sets libgomp's spin count (idle OpenMP threads that spin
    take a busy machine's free core); a user's own setting is kept."""
    import os
    import subprocess
    import sys

    code = "import exactspec, os; print(os.environ['GOMP_SPINCOUNT'])"
    env = {k: v for k, v in os.environ.items() if k != "GOMP_SPINCOUNT"}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                         check=True, timeout=120)
    assert out.stdout.strip() == "1000"
    out = subprocess.run([sys.executable, "-c", code], env={**env, "GOMP_SPINCOUNT": "7"},
                         capture_output=True, text=True, check=True, timeout=120)
    assert out.stdout.strip() == "7"
