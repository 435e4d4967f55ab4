"""Package names imported on first use (PEP 562): `exactspec.drafters`, `exactspec.bench` and
`exactspec.engine` map each public name to the module defining it, so the command line reads
their light modules (the registry's table, the bench's words) without importing torch, and a
light module of the engine (results.py) comes without the decode loop."""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import Any


def lazy_names(package: str, table: dict[str, str],
               namespace: dict[str, Any]) -> tuple[Callable[[str], Any], Callable[[], list[str]]]:
    """The module-level `__getattr__` and `__dir__` of `package` over `table` (public name ->
    module defining it); a value, once imported, is cached in the package's `namespace`."""

    def __getattr__(name: str) -> Any:
        module = table.get(name)
        if module is None:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        value = getattr(importlib.import_module(module), name)
        namespace[name] = value
        return value

    def __dir__() -> list[str]:
        return sorted(set(namespace) | set(table))

    return __getattr__, __dir__
