"""A tiny random Llama and its character tokenizer saved as a model directory, for `es.load`.

Batch jobs name their model by path (Ray actors and subprocesses load it themselves), so the
tests write the tiny model once into a directory instead of passing the object.
"""

from __future__ import annotations

from pathlib import Path

from tests.engine.tiny import char_tokenizer, tiny_llama

# One user turn, then the assistant's turn; enough for `messages` rows.
CHAT_TEMPLATE = ("{% for m in messages %}{{ m['role'][0] }}- {{ m['content'] }}. {% endfor %}"
                 "{% if add_generation_prompt %}a- {% endif %}")


def save_tiny(directory: Path, seed: int = 0, *, eos: int | None = 0) -> Path:
    """Write tiny_llama(seed) (EOS = id 0 unless None) and the tokenizer into `directory`."""
    model = tiny_llama(seed, eos=eos)
    tok = char_tokenizer()
    tok.chat_template = CHAT_TEMPLATE
    model.save_pretrained(directory)
    tok.save_pretrained(directory)
    return Path(directory)
