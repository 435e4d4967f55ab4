"""A GGUF conversion parses the file's metadata once: transformers parses it per call
(config, tokenizer, weights), which made gemma3-270m's conversion 105 s instead of 62 s."""

from __future__ import annotations

import gguf

from exactspec.models.gguf_convert import one_gguf_parse


def _tiny_gguf(path):
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_block_count(1)
    writer.add_token_list(["a", "b", "c"])
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def test_one_reader_per_file_inside_the_block_and_the_real_class_after(tmp_path):
    first, second = _tiny_gguf(tmp_path / "a.gguf"), _tiny_gguf(tmp_path / "b.gguf")
    real = gguf.GGUFReader
    with one_gguf_parse():
        from gguf import GGUFReader  # as transformers imports it, inside its function

        a = GGUFReader(first)
        assert GGUFReader(str(first)) is a  # the same file: parsed once
        assert GGUFReader(second) is not a  # another file: its own reader
        field = a.fields["tokenizer.ggml.tokens"]
        assert [bytes(field.parts[i]).decode() for i in field.data] == ["a", "b", "c"]
    assert gguf.GGUFReader is real
    assert real(first) is not real(first)  # outside the block nothing is shared
