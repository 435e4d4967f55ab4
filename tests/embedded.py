"""Whether the PyPI packages carrying an embedded model are installed (tests that need the real
model skip with the pip command otherwise)."""

from __future__ import annotations

import importlib.metadata

from exactspec.models import registry


def installed(name: str) -> bool:
    """Whether every package carrying embedded model `name` is installed."""
    try:
        for chunk in registry.EMBEDDED[name].chunks:
            importlib.metadata.distribution(chunk.distribution)
    except importlib.metadata.PackageNotFoundError:
        return False
    return True
