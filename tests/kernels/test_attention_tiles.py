"""Attention's tiling (csrc/impl_attn.h, the tasks in csrc/ops.cpp) never changes a bit.

Past 512 keys a query's keys are taken in runs of 512 fixed by key index, each run's partial
(its largest score, sum and weighted values) computed apart and combined in key order
(`attend_finish`): with few tasks each run is a work item of its own, with many a task does its
runs in turn. A call groups the query heads of one key/value head at up to 24 / rep positions into one task
(keys in blocks of 16 against every query, then the values against ES_ATT_G queries x
ES_ATT_CW chunks of 16 of d in registers, 8 queries' sums side by side), or one head per task
when that leaves the threads too few tasks. Every query of a wide call is compared with
`torch.equal` against the same query computed alone (one position, its own mask row), on every
instruction set, with 1 and 2 threads, for shapes at every edge of those tiles: group sizes
1-8 heads (not multiples of 6), positions past a task, key counts around 16, d with tails of
the 16-lane and 64-wide chunks, causal (dense), random (masked) and absent masks, and unseen
slots holding NaN. The same check fails for torch's own scaled_dot_product_attention, whose
reductions depend on the call's shape (the wrong variant).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from exactspec import kernels

# (B, T, H, KV, S, d)
SHAPES = [
    (1, 1, 9, 3, 70, 64),  # a decode step: one head per task
    (1, 7, 9, 3, 33, 64),  # a verify: 8 positions per task, keys 16 + 16 + 1
    (2, 13, 12, 2, 41, 80),  # 6 heads a group: 4 positions a task, d = 64 + 16
    (1, 30, 7, 1, 45, 48),  # 7 heads (6 + 1 in the values), d a 48-wide part chunk
    (3, 5, 8, 8, 17, 8),  # no grouping, d shorter than one vector
    (1, 20, 4, 2, 16, 128),  # keys exactly one block, d two chunks
    (1, 3, 2, 1, 1, 20),  # one key
    (1, 1, 9, 3, 1500, 64),  # a one-token step past 512 keys: three runs, one per work item
    (2, 5, 6, 2, 1100, 48),  # a verify over runs of 512, 512 and a part
    (1, 40, 4, 2, 530, 16),  # a prefill whose queries have one run or two (runs in turn)
    (1, 2, 96, 1, 600, 16),  # 96 query heads on one key/value head: past a task's 24 queries
]


def _mask(kind: str, b: int, t: int, s: int, g: torch.Generator):
    if kind == "none":
        return None
    if kind == "causal":  # position i sees keys 0 .. s - t + i
        return torch.ones(b, t, s, dtype=torch.bool).tril(s - t)
    m = torch.rand(b, t, s, generator=g) < 0.7
    m[0, 0] = False  # a query that sees nothing: zeros
    return m


def _inputs(shape, kind, seed):
    b, t, h, kv, s, d = shape
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(b, t, h, d, generator=g)
    k = torch.randn(b, kv, s, d, generator=g)
    v = torch.randn(b, kv, s, d, generator=g)
    mask = _mask(kind, b, t, s, g)
    if mask is not None:  # what a query does not see must not reach it
        unseen = ~mask.any(1)[:, None, :, None].expand(b, kv, s, d)
        k = k.masked_fill(unseen, float("nan"))
        v = v.masked_fill(unseen, float("nan"))
    return q, k, v, mask


def _each_query_alone(attn, q, k, v, mask, scale):
    """[B, T, H, d]: every position of every row computed in a call of its own."""
    out = torch.empty_like(q)
    for r in range(q.shape[0]):
        for i in range(q.shape[1]):
            m = None if mask is None else mask[r:r + 1, i:i + 1]
            out[r, i] = attn(q[r:r + 1, i:i + 1], k[r:r + 1], v[r:r + 1], m, scale)[0, 0]
    return out


def _equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    return torch.equal(a.nan_to_num(7.0), b.nan_to_num(7.0)) and bool(
        (a.isnan() == b.isnan()).all())


@pytest.mark.parametrize("kind", ["causal", "masked", "none"])
@pytest.mark.parametrize("shape", SHAPES, ids=[str(s) for s in SHAPES])
def test_every_query_of_a_wide_call_equals_the_query_alone(isa, threads, shape, kind):
    q, k, v, mask = _inputs(shape, kind, seed=sum(shape))
    torch.set_num_threads(1)
    alone = _each_query_alone(kernels.attention, q, k, v, mask, 0.3)
    assert not alone.isnan().any()
    for nt in (1, 2):
        torch.set_num_threads(nt)
        assert _equal(kernels.attention(q, k, v, mask, 0.3), alone), nt


def _sdpa(q, k, v, mask, scale):  # torch's own attention, laid out as kernels.attention
    rep = q.shape[2] // k.shape[1]
    kk, vv = k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1)
    m = None if mask is None else mask[:, None]
    return F.scaled_dot_product_attention(q.transpose(1, 2), kk, vv, attn_mask=m,
                                          scale=scale).transpose(1, 2)


def test_the_check_fails_for_torchs_attention(threads):
    """The wrong variant: torch's attention over the same inputs (no NaN slots, no empty rows)
    gives a query other bits inside a wide call than alone, which the check above catches."""
    torch.set_num_threads(2)
    g = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(1, 64, 9, 64, generator=g), torch.randn(1, 3, 300, 64, generator=g),
               torch.randn(1, 3, 300, 64, generator=g))
    mask = torch.ones(1, 64, 300, dtype=torch.bool).tril(300 - 64)
    wide = _sdpa(q, k, v, mask, 0.125)
    alone = _each_query_alone(_sdpa, q, k, v, mask, 0.125)
    assert not _equal(wide, alone)
    assert _equal(kernels.attention(q, k, v, mask, 0.125),
                  _each_query_alone(kernels.attention, q, k, v, mask, 0.125))


def test_attention_over_several_runs_matches_float64(isa):
    """Past 512 keys (three runs of keys): within test_ops' bound with the runs' combine in it."""
    from tests.kernels.test_ops import attention_error_and_bound

    err, bound = attention_error_and_bound(11, (1, 4, 6, 2, 1300, 64), seen=0.8, runs=3)
    assert bool((err <= bound).all()), float(err.max())
