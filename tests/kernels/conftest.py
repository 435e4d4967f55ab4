"""The kernels' tests run on every instruction set this CPU offers (`isa` fixture); they are
skipped, with the reason, where the kernels could not be built (the torch path then runs)."""

from __future__ import annotations

import pytest
import torch

from exactspec import kernels

if not kernels.enabled():
    pytest.skip("the exactspec kernels are not built here (see the warning above)",
                allow_module_level=True)

ISAS = kernels.available_isas()  # e.g. ["avx512", "avx2", "portable"] on an AVX-512 machine


@pytest.fixture(params=ISAS)
def isa(request):
    """Run the test on one instruction set, then restore the automatic choice."""
    kernels.set_isa(request.param)
    yield request.param
    kernels.set_isa("auto")


@pytest.fixture
def threads():
    """Restore torch's thread count after a test that changes it."""
    n = torch.get_num_threads()
    yield
    torch.set_num_threads(n)
