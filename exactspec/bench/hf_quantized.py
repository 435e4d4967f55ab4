"""The quantized self-draft as a transformers model, for transformers' assisted generation.

`quantized_copy(model, "int8")` is `model` with every decoder and head `nn.Linear` replaced by a
module that runs exactspec's own quantized product (`exactspec/models/formats.py`) on the same
quantized weights `QuantizedDraft` drafts with, so `generate(assistant_model=...)` and
exactspec's engine compare with the same draft (apples to apples). Embeddings and norms are
shared with `model` (no copy).
"""

from __future__ import annotations

import copy

import torch
from torch import nn

from exactspec.models.formats import Matrix, make_matrix


class MatrixLinear(nn.Module):
    """An `nn.Linear` (no bias) whose product is a `Matrix` in a quantized format."""

    def __init__(self, matrix: Matrix) -> None:
        super().__init__()
        self.matrix = matrix  # the stored weight and its kernel
        self.in_features, self.out_features = matrix.in_features, matrix.out_features

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [..., in] -> [..., out]
        return self.matrix(x)


def quantized_copy(model: nn.Module, fmt: str, *, group_size: int = 32) -> nn.Module:
    """A shallow copy of `model` whose decoder layers and LM head multiply in `fmt`."""
    draft = copy.copy(model)
    draft._modules = dict(model._modules)
    inner = copy.copy(model.model)
    inner._modules = dict(model.model._modules)
    layers = []
    with torch.no_grad():
        for layer in model.model.layers:
            new = copy.copy(layer)
            new._modules = dict(layer._modules)
            for part in ("self_attn", "mlp"):
                sub = copy.copy(getattr(layer, part))
                sub._modules = {
                    name: MatrixLinear(make_matrix(m.weight.float(), fmt, group_size=group_size))
                    if isinstance(m, nn.Linear) else m
                    for name, m in getattr(layer, part)._modules.items()
                }
                new._modules[part] = sub
            layers.append(new)
        inner._modules["layers"] = nn.ModuleList(layers)
        draft._modules["model"] = inner
        draft._modules["lm_head"] = MatrixLinear(
            make_matrix(model.lm_head.weight.float(), fmt, group_size=group_size))
    draft.generation_config = copy.deepcopy(model.generation_config)
    return draft
