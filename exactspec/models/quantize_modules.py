"""Weight-only quantized copies of any transformers model: the generic self-draft path.

The lean forward (`models/lean.py`) runs the Llama family of `models/lean_arch.py`. For every
other target, `quantized_copy_for(model, "int8")` builds a copy of the model's own module tree whose linear
layers (`nn.Linear`, transformers' `Conv1D`, the LM head included; a head tied to the
embeddings is untied in the copy only) are `QuantLinear`s: the same `Matrix` storage and
per-process, per-device kernel choice as the lean forward (`models/formats.py`). Everything
else (embeddings, norms, rotary buffers) is shared with the target, not copied; the copy runs
through transformers' forward, so it computes whatever the architecture computes, quantized
products aside. One copy per (model, format, group size), rebuilt when the model's weights
change in place (their version counters).
"""

from __future__ import annotations

import copy
import weakref

import torch
from torch import nn
from transformers import PreTrainedModel
from transformers.pytorch_utils import Conv1D

from exactspec.errors import InvalidValue
from exactspec.models.formats import FORMATS, Matrix, make_matrix


class QuantLinear(nn.Module):
    """A linear layer y = x W^T + b whose W is stored in a `Matrix` format (int8, int4, bf16).

    `weight` is a meta tensor of W's shape [out, in] (for code reading the head's shape, e.g.
    the adapter's vocabulary size); the product uses `matrix` only.
    """

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, fmt: str, *,
                 group_size: int = 32) -> None:  # weight [out, in]; bias [out] or None
        super().__init__()
        w = weight.detach().contiguous()  # a Conv1D weight comes transposed; the int8 pack
        # kernel needs a row-major [out, in]
        self.matrix: Matrix = make_matrix(w.float() if fmt != "bfloat16" else w, fmt,
                                          group_size=group_size)
        self.in_features, self.out_features = weight.shape[1], weight.shape[0]
        self.weight = torch.empty(weight.shape, device="meta")  # shape only, never computed
        self.bias = None if bias is None else bias.detach().clone()  # [out], model's dtype

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [..., in] -> [..., out], x's dtype
        y = self.matrix(x)
        return y if self.bias is None else y + self.bias.to(y.dtype)

    def reference(self, x: torch.Tensor) -> torch.Tensor:  # [..., in] -> [..., out] float32
        """The same product in float32 with the dequantized weight (the tests' reference)."""
        y = self.matrix.reference(x)
        return y if self.bias is None else y + self.bias.float()

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, "
                f"fmt={self.matrix.fmt}, packed={self.matrix.packed}")


def quantized_copy(model: PreTrainedModel, fmt: str = "int8", *,
                   group_size: int = 32) -> PreTrainedModel:
    """A copy of `model` with every linear layer a `QuantLinear` in `fmt`; other parameters
    are the model's own tensors (shared, not copied). Refuses a model without linear layers."""
    if fmt not in FORMATS or fmt == "float32":
        raise InvalidValue(f"weight format {fmt!r} must be one of int8, int4, bfloat16")
    memo = {id(p): p for p in model.parameters()}  # share every parameter: no float copy
    clone = copy.deepcopy(model, memo)
    swapped = 0
    with torch.no_grad():
        for name, module in list(clone.named_modules()):
            if isinstance(module, nn.Linear):
                new = QuantLinear(module.weight, module.bias, fmt, group_size=group_size)
            elif isinstance(module, Conv1D):  # GPT-2 style: weight [in, out]
                new = QuantLinear(module.weight.t(), module.bias, fmt, group_size=group_size)
            else:
                continue
            parent, _, attr = name.rpartition(".")
            setattr(clone.get_submodule(parent), attr, new)
            swapped += 1
    if not swapped:
        raise InvalidValue(f"{type(model).__name__} has no nn.Linear or Conv1D layers to "
                           "quantize; use DraftModel or PromptLookup instead")
    clone.eval()
    return clone


def _versions(model) -> tuple[int, ...]:
    return tuple(p._version for p in model.parameters())


# per model: {(fmt, group_size): (the model's weight versions, its quantized copy)}
_COPIES: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def quantized_copy_for(model: PreTrainedModel, fmt: str = "int8", *,
                       group_size: int = 32) -> PreTrainedModel:
    """The cached `quantized_copy` of `model`, rebuilt when its weights changed in place."""
    per_model = _COPIES.setdefault(model, {})
    key, versions = (fmt, group_size), _versions(model)
    hit = per_model.get(key)
    if hit is None or hit[0] != versions:
        per_model[key] = hit = (versions, quantized_copy(model, fmt, group_size=group_size))
    return hit[1]
