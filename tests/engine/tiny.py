"""Tiny randomly initialised Llama models and a character tokenizer, built in the test (no downloads)."""

from __future__ import annotations

import copy
import string

import pytest
import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

from exactspec.models.loading import Model
from exactspec.sampling import SamplingParams

ALPHABET = string.ascii_lowercase + " .,!?'-" + "0123456789" + "ABCDEFGHIJKLMN"  # 48 symbols
VOCAB = len(ALPHABET) + 1  # + "<eos>" at id 0


def tiny_llama(seed: int = 0, *, vocab: int = VOCAB, layers: int = 2, hidden: int = 32,
               eos: int | None = None, attn: str = "sdpa", max_pos: int = 512,
               head_scale: float = 20.0) -> LlamaForCausalLM:
    """A 2-layer Llama with random weights, float32, eval mode; the LM head is scaled by
    `head_scale` (sharper logits than the default init)."""
    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=2 * hidden,
                      num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2,
                      max_position_embeddings=max_pos, bos_token_id=None, pad_token_id=None,
                      eos_token_id=eos, tie_word_embeddings=False)
    cfg._attn_implementation = attn
    model = LlamaForCausalLM(cfg).eval()
    with torch.no_grad():  # sharper logits than the default init, so text is not uniform noise
        model.lm_head.weight.mul_(head_scale)
    model.generation_config.eos_token_id = eos
    return model


def perturbed(model: LlamaForCausalLM, scale: float, seed: int = 1) -> LlamaForCausalLM:
    """A copy of `model` with Gaussian noise of `scale` times each weight's std added."""
    other = copy.deepcopy(model)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for w in other.parameters():
            w.add_(torch.randn(w.shape, generator=g) * w.std() * scale)
    return other


def contrarian(model: LlamaForCausalLM) -> LlamaForCausalLM:
    """A copy whose logits are the target's negated: its argmax is never the target's."""
    other = copy.deepcopy(model)
    with torch.no_grad():
        other.lm_head.weight.neg_()
    return other


def char_tokenizer(alphabet: str = ALPHABET) -> PreTrainedTokenizerFast:
    """One token per character of `alphabet` (ALPHABET by default); id 0 is <eos>."""
    vocab = {"<eos>": 0, **{c: i + 1 for i, c in enumerate(alphabet)}}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<eos>"))
    tok.pre_tokenizer = pre_tokenizers.Split("", "isolated")
    tok.decoder = decoders.Fuse()
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<eos>")


def tiny_model(seed: int = 0, **kw) -> Model:
    """tiny_llama with the character tokenizer, as an exactspec Model."""
    return Model(model=tiny_llama(seed, **kw), tokenizer=char_tokenizer(), name=f"tiny-{seed}")


GREEDY = SamplingParams(temperature=0)
# the greedy-equals-plain tests' prompts: repeats (drafts agree), one token, a long cycle
GREEDY_PROMPTS = [[5, 6, 7, 8, 5, 6, 7], [9], [1, 2, 3, 1, 2, 3, 1, 2, 3, 1, 2],
                  [30, 31, 30, 31, 30]]


@pytest.fixture(scope="module", name="target")
def greedy_target() -> LlamaForCausalLM:
    """A greedy test module's target, tiny_llama(0) (import this fixture to use it)."""
    return tiny_llama(0)


@pytest.fixture(scope="module", name="plain")
def greedy_plain(target) -> list[list[int]]:
    """Plain greedy decoding of GREEDY_PROMPTS by the module's `target`, 40 tokens each."""
    from exactspec.engine import generate

    return [g.token_ids for g in generate(target, GREEDY_PROMPTS, params=GREEDY,
                                          max_new_tokens=40)]
