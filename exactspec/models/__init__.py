"""Target and draft models: load embedded, local or GGUF models; wrap transformers models."""

from exactspec.models.loading import Model, as_model, cache_root, load
from exactspec.models.registry import known_names

__all__ = ["Model", "as_model", "cache_root", "known_names", "load"]
