"""Through the lean forward on the kernels, on tiny random Llama models of several shapes
(GQA included): a position's logits are the same bits at width 1, inside a width-K+1 extend,
inside a tree extend, alone or inside a ragged batch of 8, with 1 or 2 threads; through
`es.generate`, T=1 logprobs of plain and speculative decoding agree bit for bit on their common
prefix. The torch fallback (EXACTSPEC_KERNELS=0) announces itself in one warning line and is
shown to lack the property, so the property is known to be the kernels'."""

from __future__ import annotations

import logging

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

import exactspec as es
from exactspec.kernels import ops
from exactspec.models.adapter import TargetAdapter
from exactspec.models.lean import LeanLlama
from exactspec.models.loading import Model
from exactspec.models.tree_attention import extend_at
from tests.engine.tiny import char_tokenizer

# (hidden, heads, kv heads, layers, intermediate, vocab): MHA, GQA 2:1 and 3:1, odd sizes
SHAPES = [(32, 4, 2, 2, 64, 49), (48, 6, 2, 3, 80, 61), (64, 4, 4, 2, 96, 200),
          (40, 4, 1, 2, 72, 53)]


def llama(shape, seed: int = 0, head_scale: float = 10.0) -> LlamaForCausalLM:
    hidden, heads, kv, layers, inter, vocab = shape
    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=inter,
                      num_hidden_layers=layers, num_attention_heads=heads,
                      num_key_value_heads=kv, max_position_embeddings=256, bos_token_id=None,
                      pad_token_id=None, eos_token_id=None, tie_word_embeddings=False)
    model = LlamaForCausalLM(cfg).eval()
    with torch.no_grad():
        model.lm_head.weight.mul_(head_scale)  # sharper logits than the default init
    return model


def _steps(model, prompt: list[int], tokens: list[int]) -> torch.Tensor:  # [T, V]
    """The logits of each of `tokens` fed one at a time after `prompt`."""
    ad = TargetAdapter(model)
    assert ad.lean is not None and ad.lean.kernels
    ad.prefill([prompt], capacity=64)
    out = []
    for tok in tokens:
        out.append(ad.extend(torch.tensor([[tok]]))[0, 0])
        ad.commit(torch.tensor([1]))
    return torch.stack(out)


@pytest.mark.parametrize("shape", SHAPES)
def test_position_same_bits_at_width_one_in_verify_and_in_tree(shape):
    model = llama(shape)
    vocab = shape[-1]
    g = torch.Generator().manual_seed(1)
    prompt = torch.randint(0, vocab, (9,), generator=g).tolist()
    chain = torch.randint(0, vocab, (5,), generator=g).tolist()
    one = _steps(model, prompt, chain)  # [5, V]

    ad = TargetAdapter(model)
    ad.prefill([prompt], capacity=64)
    wide = ad.extend(torch.tensor([chain]))[0]  # [5, V]: a verify of K = 4 plus its bonus
    assert torch.equal(wide, one)

    # a tree: root chain[0]; chain[1..4] is one branch, three other nodes beside it
    ad = TargetAdapter(model)
    ad.prefill([prompt], capacity=64)
    n_len = len(prompt)
    others = torch.randint(0, vocab, (3,), generator=g).tolist()
    #         node: 0=root 1=c1  2=o   3=c2  4=o   5=c3  6=c4  7=o
    toks = [chain[0], chain[1], others[0], chain[2], others[1], chain[3], chain[4], others[2]]
    parent = [-1, 0, 0, 1, 2, 3, 5, 6]
    depth = [0, 1, 1, 2, 2, 3, 4, 5]
    s_len = n_len + len(toks)
    visible = torch.zeros(1, len(toks), s_len, dtype=torch.bool)
    visible[0, :, :n_len] = True
    for i in range(len(toks)):
        j = i
        while j >= 0:
            visible[0, i, n_len + j] = True
            j = parent[j]
    positions = torch.tensor([[n_len + dd for dd in depth]])
    slots = torch.arange(n_len, s_len)[None]
    tree = extend_at(ad, torch.tensor([toks]), positions, slots, visible)[0]  # [8, V]
    assert torch.equal(tree[[0, 1, 3, 5, 6]], one)


@pytest.mark.parametrize("shape", SHAPES[:2])
def test_row_alone_equals_row_in_a_ragged_batch_of_eight_any_threads(shape, threads):
    model = llama(shape, seed=2)
    vocab = shape[-1]
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(0, vocab, (n,), generator=g).tolist()
               for n in (3, 11, 1, 7, 20, 5, 9, 14)]
    feed = torch.randint(0, vocab, (8, 4), generator=g)
    torch.set_num_threads(2)
    ad = TargetAdapter(model)
    ad.prefill(prompts, capacity=64)
    batch_wide = ad.extend(feed)  # [8, 4, V], ragged lengths: masked
    ad.commit(torch.tensor([4, 1, 3, 0, 2, 4, 1, 2]))
    batch_one = ad.extend(feed[:, :1])  # [8, 1, V]
    torch.set_num_threads(1)
    for r, p in enumerate(prompts):
        alone = TargetAdapter(model)
        alone.prefill([p], capacity=64)
        assert torch.equal(alone.extend(feed[r:r + 1]), batch_wide[r:r + 1]), r
        alone.commit(torch.tensor([[4, 1, 3, 0, 2, 4, 1, 2][r]]))
        assert torch.equal(alone.extend(feed[r:r + 1, :1]), batch_one[r:r + 1]), r


class Replay:
    """A point-mass drafter proposing a given continuation of each row (plain's own text)."""

    hidden_layers = None

    def __init__(self, sequences: list[list[int]]) -> None:
        self.sequences = sequences  # per row: prompt + plain's continuation
        self.rows = list(range(len(sequences)))

    def begin(self, context, target) -> None:
        self.rows = list(range(len(self.sequences)))

    def select(self, rows: torch.Tensor) -> None:
        self.rows = [self.rows[int(i)] for i in rows]

    def propose(self, context, num_tokens):
        k = int(num_tokens.max()) if num_tokens.numel() else 0
        out = torch.full((len(self.rows), k), -1, dtype=torch.long)
        for b, row in enumerate(self.rows):
            n = int(context.lengths[b])
            seq = self.sequences[row]
            if context.tokens[b, :n].tolist() == seq[:n]:
                nxt = seq[n: n + int(num_tokens[b])]
                out[b, : len(nxt)] = torch.tensor(nxt, dtype=torch.long)
        return out, None


def _common(a: list[int], b: list[int]) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


@pytest.mark.parametrize("shape", SHAPES[:3])
def test_generate_t1_logprobs_plain_equal_speculative_and_batched(shape):
    model = Model(model=llama(shape, seed=4, head_scale=60.0), tokenizer=char_tokenizer(),
                  name="tiny")
    vocab = shape[-1]
    g = torch.Generator().manual_seed(5)
    prompts = [torch.randint(1, vocab, (n,), generator=g).tolist()
               for n in (6, 2, 9, 4, 1, 12, 3, 7)]
    params = [es.SamplingParams(temperature=1.0, seed=11 + i) for i in range(8)]
    plain = es.generate(model, prompts, params=params, max_new_tokens=16, return_logprobs=True)
    seqs = [p + gen.token_ids for p, gen in zip(prompts, plain, strict=True)]
    spec = es.generate(model, prompts, drafter=Replay(seqs), params=params, max_new_tokens=16,
                       num_draft_tokens=4, return_logprobs=True)
    checked = 0
    for a, b in zip(plain, spec, strict=True):
        n = _common(a.token_ids, b.token_ids)  # 0 when the first draft is rejected
        assert a.logprobs[:n] == b.logprobs[:n]
        checked += n
    assert checked >= 8  # a draft is kept with probability p(x) (~0.45 here)
    for i, p in enumerate(prompts):  # each row alone, its own seed: the same row, same bits
        alone = es.generate(model, [p], params=[params[i]], max_new_tokens=16,
                            return_logprobs=True)[0]
        assert alone.token_ids == plain[i].token_ids
        assert alone.logprobs == plain[i].logprobs


def test_greedy_speculative_equals_plain_tokens():
    model = Model(model=llama(SHAPES[1], seed=6), tokenizer=char_tokenizer(), name="tiny")
    prompts = [[1, 2, 3], [4], [5, 6, 7, 8, 9, 10]]
    greedy = es.SamplingParams(temperature=0)
    plain = es.generate(model, prompts, params=greedy, max_new_tokens=20, return_logprobs=True)
    spec = es.generate(model, prompts, drafter=es.QuantizedDraft(8, backend="torch"),
                       params=greedy, max_new_tokens=20, num_draft_tokens=3,
                       return_logprobs=True)
    for a, b in zip(plain, spec, strict=True):
        assert a.token_ids == b.token_ids
        assert a.logprobs == b.logprobs


def test_torch_fallback_warns_once_and_lacks_bit_invariance(monkeypatch, caplog):
    monkeypatch.setenv("EXACTSPEC_KERNELS", "0")
    ops._WARNED.clear()
    models = [llama(shape, seed=7) for shape in SHAPES]
    with caplog.at_level(logging.WARNING, logger="exactspec.kernels.ops"):
        leans = [LeanLlama(m) for m in models]
    assert not any(lean.kernels for lean in leans)
    lines = [r for r in caplog.records if r.name == "exactspec.kernels.ops"]
    assert len(lines) == 1 and "EXACTSPEC_KERNELS=0" in lines[0].getMessage()
    differs = 0
    g = torch.Generator().manual_seed(8)
    for model, shape in zip(models, SHAPES, strict=True):
        vocab = shape[-1]
        prompt = torch.randint(0, vocab, (9,), generator=g).tolist()
        chain = torch.randint(0, vocab, (6,), generator=g).tolist()
        ad = TargetAdapter(model)
        assert not ad.lean.kernels
        ad.prefill([prompt], capacity=64)
        wide = ad.extend(torch.tensor([chain]))[0]  # [6, V]
        ad2 = TargetAdapter(model)
        ad2.prefill([prompt], capacity=64)
        for t, tok in enumerate(chain):
            one = ad2.extend(torch.tensor([[tok]]))[0, 0]
            ad2.commit(torch.tensor([1]))
            torch.testing.assert_close(one, wide[t], rtol=1e-4, atol=1e-4)  # close, ...
            differs += not torch.equal(one, wide[t])  # ... but not the same bits
    assert differs > 0
