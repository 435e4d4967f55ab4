import pytest
import torch


@pytest.fixture(autouse=True, scope="package")
def _one_thread():
    """Tiny models run far faster single-threaded (thread hand-offs dominate their matmuls)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)
