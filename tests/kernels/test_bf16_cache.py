"""A target with a bf16 KV cache (`es.load(..., kv_cache="bfloat16")`, `set_kv_cache`): its keys
and values rounded to bf16 (to nearest even) as they are stored, and read widened exactly.

- attention over a bf16 cache is, bit for bit on every unit, attention over a float32 cache
  holding the same (rounded) values, at every shape the kernels tile differently;
- the fused stack (rows_stack, which rounds with c10::BFloat16) and the operator path (torch's
  copy) store and compute the same bits; a verify's rows equal the same tokens one at a time;
- the engine decodes the bf16-cache target exactly: greedy == plain with the int8 and int4
  self-drafts (which draft on the target's cache), and the law of the first tokens by
  chi-square (false alarm 1e-6 each), a wrong variant rejected;
- the option is refused where it does not run (torch's operators) and named when misspelled.
"""

from __future__ import annotations

import pytest
import torch

from exactspec import SamplingParams, kernels
from exactspec.drafters import QuantizedDraft
from exactspec.engine import generate
from exactspec.errors import InvalidValue
from exactspec.models import load, set_kv_cache
from exactspec.models.adapter import TargetAdapter

pytestmark = pytest.mark.skipif(not kernels.enabled(), reason="the kernels are not built here")


@pytest.fixture(params=kernels.available_isas() if kernels.enabled() else ["none"])
def unit(request):
    kernels.set_isa(request.param)
    yield request.param
    kernels.set_isa("auto")


# (keys, positions, d): one run and several (512 keys a run), d with and without a 16-tail
SHAPES = [(37, 1, 64), (700, 8, 64), (1100, 3, 80), (20, 5, 24), (16, 4, 64)]


@pytest.mark.parametrize("S,T,d", SHAPES)
def test_attention_on_a_bf16_cache_is_attention_on_its_widening(unit, S, T, d):
    g = torch.Generator().manual_seed(S + d)
    k = torch.randn(2, 3, S, d, generator=g).bfloat16()
    v = torch.randn(2, 3, S, d, generator=g).bfloat16()
    q = torch.randn(2, T, 9, d, generator=g)
    mask = (torch.arange(S)[None, :] <= torch.arange(S - T, S)[:, None])[None]
    mask = mask.expand(2, T, S).clone()
    mask[1, 0, S // 3] = False  # a masked row as well as dense ones
    scale = d ** -0.5
    got = kernels.attention(q, k, v, mask, scale)
    assert torch.equal(got, kernels.attention(q, k.float(), v.float(), mask, scale))
    assert torch.equal(kernels.attention(q, k, v, None, scale),
                       kernels.attention(q, k.float(), v.float(), None, scale))
    # the comparison sees one value one bf16 step off
    v2 = v.float()
    v2[0, 0, 0, 0] = v2[0, 0, 0, 0].bfloat16().view(torch.int16).add(1).view(torch.bfloat16)
    assert not torch.equal(got, kernels.attention(q, k.float(), v2, mask, scale))


def _tiny(name: str = "llama", vocab: int = 16, **kw):
    from tests.models.test_lean_architectures import model_of

    model = model_of(name, vocab=vocab, **kw)
    set_kv_cache(model, "bfloat16")
    return model


def _forward(model, tokens: torch.Tensor, stack: str, monkeypatch) -> tuple:
    """Logits of `tokens` [1, T] after a prompt, and the cache's buffers of layer 0."""
    monkeypatch.setenv("EXACTSPEC_ROWS_STACK", stack)
    ad = TargetAdapter(model)
    ad.prefill([[3, 1, 4, 1, 5, 9, 2, 6]], capacity=32)
    logits = ad.extend(tokens)
    return logits, ad.cache.keys[0].clone(), ad.cache.values[0].clone()


@pytest.mark.parametrize("threads", [1, 2])
def test_the_stack_and_the_operator_path_agree_on_a_bf16_cache(monkeypatch, threads):
    model = _tiny("qwen3")
    n = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        tokens = torch.tensor([[2, 7, 1, 8, 2, 8, 1, 8]])
        stacked = _forward(model, tokens, "1", monkeypatch)
        operator = _forward(model, tokens, "0", monkeypatch)
        assert stacked[1].dtype == torch.bfloat16
        for a, b in zip(stacked, operator, strict=True):
            assert torch.equal(a, b)
        # a verify's rows are the same tokens fed one at a time
        monkeypatch.setenv("EXACTSPEC_ROWS_STACK", "1")
        ad = TargetAdapter(model)
        ad.prefill([[3, 1, 4, 1, 5, 9, 2, 6]], capacity=32)
        for t in range(tokens.shape[1]):
            row = ad.extend(tokens[:, t:t + 1])
            ad.commit(torch.tensor([1]))
            assert torch.equal(row[0, 0], stacked[0][0, t])
    finally:
        torch.set_num_threads(n)


@pytest.mark.parametrize("bits", [8, 4])
def test_greedy_equals_plain_with_a_bf16_cache(bits):
    from tests.models.test_lean_architectures import GREEDY_PROMPTS

    model = _tiny(head_scale=3.0)
    greedy = SamplingParams(temperature=0)
    plain = generate(model, GREEDY_PROMPTS, params=greedy, max_new_tokens=20)
    spec = generate(model, GREEDY_PROMPTS, drafter=QuantizedDraft(bits, backend="torch"),
                    params=greedy, max_new_tokens=20, num_draft_tokens=3)
    for a, b in zip(spec, plain, strict=True):
        assert a.token_ids == b.token_ids and a.logprobs == b.logprobs
    assert sum(g.stats.accepted for g in spec) > 0
    # the option is in force: the target's logits are not the float32 cache's
    other = _tiny(head_scale=3.0)
    set_kv_cache(other, "float32")
    logits = []
    for m in (model, other):
        ad = TargetAdapter(m)
        ad.prefill([GREEDY_PROMPTS[1]], capacity=32)
        logits.append(ad.extend(torch.tensor([[1, 2, 3]])))
    assert not torch.equal(*logits)


def test_the_law_of_the_first_tokens_with_a_bf16_cache():
    """The bf16-cache target's own law (its lean forward's logits, exact enumeration) against
    the engine's counts, plain and with the int8 self-draft (chi-square, false alarm 1e-6
    each); the wrong variant (qwen3 without its q/k norms, the same cache) is rejected."""
    from tests.models.test_lean_architectures import assert_qwen3_law_kept

    n = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        assert_qwen3_law_kept(_tiny, seed=41)
    finally:
        torch.set_num_threads(n)


def test_the_option_is_named_and_refused_where_it_does_not_run():
    with pytest.raises(InvalidValue, match=r"kv_cache='fp8' must be one of \['float32', 'bfloat16'\]"):
        load("smollm2-135m", kv_cache="fp8")
    model = _tiny()
    with pytest.raises(InvalidValue, match="runs on exactspec's kernels"):
        TargetAdapter(model, lean=False)
    TargetAdapter(model, lean=False, strict=False)  # a drafter's own cache keeps the default
