"""Tiny-model tests run single-threaded."""

from tests.threads import one_thread as _one_thread  # noqa: F401  (autouse fixture)
