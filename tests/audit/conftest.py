import pytest

from exactspec.audit.report import one_thread


@pytest.fixture(autouse=True)
def _one_torch_thread():
    """Small tensors: one intra-op thread is faster, and far faster on a busy machine."""
    with one_thread():
        yield
