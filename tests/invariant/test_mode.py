"""The mode itself: transformers' own forward under es.batch_invariant() is batch-invariant
(torch.equal), equal across eager / SDPA and train / eval, differentiable with the ordinary
gradients, and everything it swapped is restored when it ends."""

from __future__ import annotations

import copy

import pytest
import torch
import transformers.models.llama.modeling_llama as llama
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

import exactspec as es
from tests.engine.tiny import tiny_llama


@pytest.fixture(scope="module")
def model():
    return tiny_llama(0, hidden=64, head_scale=5.0)


def ids(n: int, seed: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(1, 49, (n,), generator=g).tolist()


def test_the_mode_restores_everything(model):
    a, w = torch.randn(7, 64), torch.randn(33, 64)
    before = (torch.mm(a, w.t()), torch.nn.functional.silu(a))
    saved = (llama.LlamaRMSNorm.forward, llama.LlamaRotaryEmbedding.forward,
             dict(ALL_ATTENTION_FUNCTIONS._local_mapping))
    with es.batch_invariant():
        with es.batch_invariant():  # nested: the inner exit leaves the mode on
            pass
        assert es.is_batch_invariant()
        assert llama.LlamaRMSNorm.forward is not saved[0]
        inside = torch.mm(a, w.t())
    assert not es.is_batch_invariant()
    assert torch.equal(inside, es.kernels.linear(a, [w]))  # the override ran inside
    assert not torch.equal(inside, before[0])  # ... and differs from torch's bits here
    assert torch.equal(torch.mm(a, w.t()), before[0])
    assert torch.equal(torch.nn.functional.silu(a), before[1])
    assert (llama.LlamaRMSNorm.forward, llama.LlamaRotaryEmbedding.forward,
            dict(ALL_ATTENTION_FUNCTIONS._local_mapping)) == saved
    with pytest.raises(TypeError):
        es.set_batch_invariant(1)


def test_other_dtypes_and_layouts_fall_back(model):
    a, b = torch.randn(5, 6, dtype=torch.float64), torch.randn(6, 4, dtype=torch.float64)
    c, d = torch.randn(5, 6), torch.randn(6, 4)  # not a weight seen through .t()
    ref = (a @ b, c @ d, torch.addmm(d[0], c, d, beta=0.5))
    with es.batch_invariant():
        got = (a @ b, c @ d, torch.addmm(d[0], c, d, beta=0.5))
    assert all(torch.equal(x, y) for x, y in zip(got, ref, strict=True))


def forward(model, rows: list[list[int]], left: bool = False) -> list[torch.Tensor]:
    """Per row its logits [n_i, V] from one padded forward (right or left padding)."""
    width = max(map(len, rows))
    inp = torch.zeros(len(rows), width, dtype=torch.long)
    mask = torch.zeros(len(rows), width, dtype=torch.long)
    pos = torch.zeros(len(rows), width, dtype=torch.long)
    for i, r in enumerate(rows):
        sl = slice(width - len(r), width) if left else slice(0, len(r))
        inp[i, sl], mask[i, sl] = torch.tensor(r), 1
        pos[i, sl] = torch.arange(len(r))
    with torch.no_grad():
        logits = model(input_ids=inp, attention_mask=mask, position_ids=pos).logits
    return [logits[i, width - len(r):] if left else logits[i, : len(r)]
            for i, r in enumerate(rows)]


@pytest.mark.parametrize("attn", ["sdpa", "eager"])
def test_transformers_forward_is_batch_invariant(model, attn):
    m = copy.deepcopy(model)
    m.config._attn_implementation = attn
    rows = [ids(n, s) for s, n in enumerate((5, 17, 40, 1, 90))]
    with es.batch_invariant():
        alone = [forward(m, [r])[0] for r in rows]
        together = forward(m, rows)
        left = forward(m, rows, left=True)
        prefixes = [forward(m, [r[: len(r) // 2 + 1]])[0] for r in rows]
        assert all(torch.equal(a, b) for a, b in zip(alone, together, strict=True))
        assert all(torch.equal(a, b) for a, b in zip(alone, left, strict=True))
        assert all(torch.equal(a[: len(p)], p) for a, p in zip(alone, prefixes, strict=True))
        ref = [forward(model, [r])[0] for r in rows]  # the other attention implementation
        assert all(torch.equal(a, b) for a, b in zip(alone, ref, strict=True))


def test_train_mode_and_dropout(model):
    m = copy.deepcopy(model).train()
    row = [ids(30, 3)]
    with es.batch_invariant():
        assert torch.equal(forward(m, row)[0], forward(model, row)[0])
        m.config.attention_dropout = 0.1
        for layer in m.model.layers:
            layer.self_attn.attention_dropout = 0.1
        with pytest.raises(ValueError, match="attention dropout"):
            forward(m, row)


def test_softmax_reduces_each_row_alone():
    """Why softmax / log-softmax need no override: torch's CPU kernels over the last
    dimension give a row the same bits alone as in any batch."""
    g = torch.Generator().manual_seed(0)
    for v in (7, 49, 1000, 49152):
        x = torch.randn(37, v, generator=g) * 4
        for fn in (torch.softmax, torch.log_softmax):
            batch = fn(x, dim=-1)
            assert all(torch.equal(fn(x[i:i + 1], dim=-1)[0], batch[i]) for i in range(37))
            assert torch.equal(fn(x[None, 3:20], dim=-1)[0], batch[3:20])


def _loss(model, seqs, plens, params):
    return es.token_logprobs(model, seqs, plens, params).sum()


def test_gradients_match_ordinary_autograd(model):
    """Training forward + backward under the mode: the gradients of token_logprobs equal
    ordinary autograd's to float32 tolerance, and a central finite difference of the float64
    model along a random direction."""
    params = es.SamplingParams(temperature=0.8, top_p=0.95, seed=1)
    prompts = [ids(5, 1), ids(3, 2), ids(20, 3)]  # rollouts: every token has p > 0 under top-p
    gens = es.generate(model, prompts, params=params, max_new_tokens=12)
    seqs = [p + g.token_ids for p, g in zip(prompts, gens, strict=True)]
    plens = [len(p) for p in prompts]
    m = copy.deepcopy(model).train()
    with es.batch_invariant():
        m.zero_grad()
        _loss(m, seqs, plens, params).backward()
    mode = {n: p.grad.clone() for n, p in m.named_parameters()}
    m.zero_grad()
    _loss(m, seqs, plens, params).backward()
    plain = {n: p.grad.clone() for n, p in m.named_parameters()}
    for n in mode:
        assert torch.allclose(mode[n], plain[n], rtol=1e-3, atol=1e-5), n
    assert sum(g.abs().sum() for g in mode.values()) > 1.0  # gradients that say something
    # directional derivative vs a central difference on the float64 model (ordinary forward)
    g = torch.Generator().manual_seed(0)
    direction = {n: torch.randn(p.shape, generator=g) for n, p in m.named_parameters()}
    analytic = sum((mode[n].double() * direction[n].double()).sum() for n in mode)
    m64 = copy.deepcopy(m).double()
    eps = 1e-6

    def at(sign: float) -> float:
        moved = copy.deepcopy(m64)
        with torch.no_grad():
            for n, p in moved.named_parameters():
                p.add_(sign * eps * direction[n].double())
        return float(_loss(moved, seqs, plens, params).detach())

    numeric = (at(1.0) - at(-1.0)) / (2 * eps)
    assert abs(numeric - float(analytic)) <= 1e-3 * abs(numeric) + 1e-3, (numeric, analytic)


def test_engine_refuses_what_the_mode_cannot_match(model):
    with pytest.raises(ValueError, match="float32 Llama"):
        es.Engine(copy.deepcopy(model).to(torch.bfloat16), batch_invariant=True)
    with pytest.raises(TypeError, match="batch_invariant"):
        es.Engine(model, batch_invariant="yes")


def test_a_linear_with_bias_runs_on_the_kernel():
    """nn.Linear with a bias (aten::addmm on 2-d input) is the kernel's product plus the bias,
    the same bits for a row alone and in a batch."""
    lin = torch.nn.Linear(40, 24)
    x = torch.randn(9, 40)
    with es.batch_invariant(), torch.no_grad():
        batch, alone = lin(x), lin(x[4:5])
    expect = es.kernels.linear(x, [lin.weight.detach()]) + lin.bias.detach()
    assert torch.equal(batch, expect) and torch.equal(alone[0], batch[4])


def test_blocks_in_threads_keep_the_mode_until_the_last_ends():
    import threading

    inside, release = threading.Event(), threading.Event()

    def worker():
        with es.batch_invariant():
            inside.set()
            release.wait(10)

    t = threading.Thread(target=worker)
    t.start()
    inside.wait(10)
    with es.batch_invariant():
        pass
    assert es.is_batch_invariant()  # the other thread's block is still open
    release.set()
    t.join()
    assert not es.is_batch_invariant()
    es.set_batch_invariant(True)
    with es.batch_invariant():
        pass
    assert es.is_batch_invariant()
    es.set_batch_invariant(False)
    assert not es.is_batch_invariant()


def test_an_uncovered_model_is_named_once(model, caplog, monkeypatch):
    from exactspec.invariant import mode

    monkeypatch.setattr(mode, "_WARNED", set())  # once per process: start this test afresh
    half = copy.deepcopy(model).to(torch.bfloat16)
    seqs, plens = [[1, 2, 3, 4]], [2]
    with es.batch_invariant(), caplog.at_level("WARNING", logger="exactspec.invariant.mode"):
        es.token_logprobs(half, seqs, plens, es.SamplingParams())
        es.generate(half, [[1, 2]], max_new_tokens=2)
    lines = [r.message for r in caplog.records if "covers float32 Llama" in r.message]
    assert len(lines) == 1 and "torch.bfloat16" in lines[0]
