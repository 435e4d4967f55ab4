"""The mode needs our kernels; its tests are skipped, with the reason, where they are not built."""

from __future__ import annotations

import pytest

from exactspec import kernels

if not kernels.enabled():
    pytest.skip("the exactspec kernels are not built here (the batch-invariant mode needs them)",
                allow_module_level=True)
