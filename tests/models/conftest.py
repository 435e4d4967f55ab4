"""Tiny models, tokenizers and GGUF files built inside the tests (no downloads, no hub)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from tokenizers import Tokenizer, models, pre_tokenizers, processors
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

# A chat template in the ChatML style SmolLM2 uses, small enough to read.
CHAT_TEMPLATE = (
    "{% for m in messages %}<s>{{ m['role'] }} {{ m['content'] }}</s>{% endfor %}"
    "{% if add_generation_prompt %}<s>assistant{% endif %}"
)


@pytest.fixture
def single_thread() -> Iterator[None]:
    """Tiny models run far faster single-threaded (thread hand-offs dominate their matmuls)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture
def cache_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A private conversion cache, so fast tests never touch the user's real one."""
    root = tmp_path / "cache"
    monkeypatch.setenv("EXACTSPEC_CACHE", str(root))
    return root


def tiny_llama(seed: int = 0) -> LlamaForCausalLM:
    """A randomly initialised 2-layer Llama with a 16-token vocabulary."""
    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=16,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        bos_token_id=1,
        eos_token_id=2,
    )
    return LlamaForCausalLM(config).eval()


def word_tokenizer(chat_template: str | None = None) -> PreTrainedTokenizerFast:
    """A whitespace word-level tokenizer over a 16-word vocabulary that prepends <s>."""
    words = ["<unk>", "<s>", "</s>", "user", "assistant", "hello", "world", "the", "a", "cat"]
    vocab = {w: i for i, w in enumerate(words)}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 1)])
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, unk_token="<unk>", bos_token="<s>", eos_token="</s>"
    )
    fast.chat_template = chat_template
    return fast


def _byte_level_alphabet() -> list[str]:
    """GPT-2's printable stand-ins for the 256 bytes (the base vocabulary of a gpt2 GGUF)."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1)]
    printable += range(ord("®"), ord("ÿ") + 1)
    chars = {b: chr(b) for b in printable}
    extra = 0
    for b in range(256):
        if b not in chars:
            chars[b] = chr(256 + extra)
            extra += 1
    return [chars[b] for b in range(256)]


def write_tiny_gguf(path: Path, seed: int = 0) -> Path:
    """Write a float32 2-layer Llama GGUF with a byte-level BPE tokenizer; converts in < 1 s."""
    tokens = ["<unk>", "<s>", "</s>", *_byte_level_alphabet(), "he", "ll"]
    vocab, hidden, inter, layers, heads, kv_heads = len(tokens), 32, 64, 2, 4, 2
    head_dim = hidden // heads
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_name("tiny")
    w.add_context_length(128)
    w.add_embedding_length(hidden)
    w.add_block_count(layers)
    w.add_feed_forward_length(inter)
    w.add_head_count(heads)
    w.add_head_count_kv(kv_heads)
    w.add_rope_dimension_count(head_dim)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_rope_freq_base(10000.0)
    w.add_vocab_size(vocab)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("default")
    w.add_token_list(tokens)
    w.add_token_types([3, 3, 3] + [1] * (vocab - 3))  # 3 = control, 1 = normal
    w.add_token_merges(["h e", "l l"])
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.add_unk_token_id(0)
    w.add_add_bos_token(True)
    rng = np.random.default_rng(seed)

    def tensor(name: str, *shape: int) -> None:  # numpy (row-major) shapes
        w.add_tensor(name, (rng.standard_normal(shape) * 0.1).astype(np.float32))

    tensor("token_embd.weight", vocab, hidden)
    tensor("output_norm.weight", hidden)
    tensor("output.weight", vocab, hidden)
    for i in range(layers):
        tensor(f"blk.{i}.attn_norm.weight", hidden)
        tensor(f"blk.{i}.ffn_norm.weight", hidden)
        tensor(f"blk.{i}.attn_q.weight", hidden, hidden)
        tensor(f"blk.{i}.attn_k.weight", kv_heads * head_dim, hidden)
        tensor(f"blk.{i}.attn_v.weight", kv_heads * head_dim, hidden)
        tensor(f"blk.{i}.attn_output.weight", hidden, hidden)
        tensor(f"blk.{i}.ffn_gate.weight", inter, hidden)
        tensor(f"blk.{i}.ffn_up.weight", inter, hidden)
        tensor(f"blk.{i}.ffn_down.weight", hidden, inter)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


@pytest.fixture
def tiny_gguf(tmp_path: Path) -> Path:
    """Path to a freshly written tiny GGUF file."""
    return write_tiny_gguf(tmp_path / "tiny.gguf")
