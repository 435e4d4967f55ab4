"""One torch thread for packages of tests on tiny models (thread hand-offs dominate their matmuls).

A package's conftest.py opts in with `from tests.threads import one_thread as _one_thread`.
"""

import pytest
import torch


@pytest.fixture(autouse=True, scope="package")
def one_thread():
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)
