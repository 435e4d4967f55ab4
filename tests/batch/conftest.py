"""Tiny-model tests run single-threaded; a tiny model saved once as a directory for es.load."""

import pytest

from tests.batch.tiny_dir import save_tiny
from tests.threads import one_thread as _one_thread  # noqa: F401  (autouse fixture)


@pytest.fixture(scope="session")
def tiny_dir(tmp_path_factory):
    """A tiny random Llama (EOS = id 0) with a character tokenizer and a chat template."""
    return save_tiny(tmp_path_factory.mktemp("tiny") / "model")
