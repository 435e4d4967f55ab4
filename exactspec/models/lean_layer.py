"""A decoder layer of the lean forward, declared once: `LayerShape` (what every layer of a model
shares) and `LeanLayer` (one layer's settings and weights).

The three ways of running a layer read these declarations: the torch path
(`LeanLlama.forward`) and the per-operator kernel path (`lean_kernels.forward_kernels`) by
attribute, and the fused C++ operator (`csrc/ops_layer.cpp`, `exactspec::decoder_stack`)
through `fused_args`, which walks the declared fields in order and hands the operator their
names beside their values. The operator compares those names with its own list and refuses a
layer whose layout differs (a field added, removed, renamed or moved, a choice reordered), so
the declaration and the C++ cannot drift apart silently: a mismatch fails when the layer stack
is built (tests/models/test_lean_layer.py).

Each field's metadata says how the operator takes it:
- "number": an int or float setting, passed as a float (exact: head counts are small ints);
- "choice": one of the declared strings, passed as its index; its name for the operator lists
  the choices (`act:silu,gelu_tanh`), so reordering them is a layout change too;
- "tensor" / "optional": a list of one tensor (of none, for an absent optional one);
- "product": a `Matrix`, passed as its kernel's weights and, under `<name>_scales`, its
  per-column scales (none or one tensor); a product without a kernel of ours (int4) means
  no fused layer (`fused_args` returns None).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

import torch

from exactspec.models.formats import Matrix

ACTS = ("silu", "gelu_tanh")  # the MLP's gate activations (lean_arch.LeanArch.act)
KINDS = ("full_attention", "sliding_attention")  # the attention kinds (AttentionLayout keys)


# the field metadata of the declarations below: how the fused operator takes each field
NUMBER = {"role": "number"}
TENSOR = {"role": "tensor"}
OPTIONAL = {"role": "optional"}
PRODUCT = {"role": "product"}


def choice(*choices: str) -> dict:
    return {"role": "choice", "choices": choices}


@dataclass(frozen=True)
class LayerShape:
    """What every decoder layer of one model shares (`LeanLlama.shape`)."""

    heads: int = field(metadata=NUMBER)  # query heads h
    kv_heads: int = field(metadata=NUMBER)  # key / value heads kv (h is a multiple: GQA)
    head_dim: int = field(metadata=NUMBER)  # d, of every head
    scale: float = field(metadata=NUMBER)  # the attention scores' scale
    act: str = field(metadata=choice(*ACTS))  # the MLP's gate activation


@dataclass
class LeanLayer:
    """One decoder layer's settings and weights as the lean forward uses them, in the order
    the layer applies them."""

    kind: str = field(metadata=choice(*KINDS))  # the mask and RoPE table it takes
    eps: float = field(metadata=NUMBER)  # its norms' epsilon
    # [H] input RMSNorm weight (1 + w for unit-offset norms)
    norm_in: torch.Tensor = field(metadata=TENSOR)
    qkv: Matrix = field(metadata=PRODUCT)  # fused q / k / v product
    # [(h + 2 kv) d] added after the product, or None
    qkv_bias: torch.Tensor | None = field(metadata=OPTIONAL)
    q_norm: torch.Tensor | None = field(metadata=OPTIONAL)  # [d] RMSNorm of each q head, or None
    k_norm: torch.Tensor | None = field(metadata=OPTIONAL)  # [d] of each k head (with q_norm)
    o: Matrix = field(metadata=PRODUCT)  # attention output product
    # [H] norm of the attention output (sandwich), or None
    norm_attn_out: torch.Tensor | None = field(metadata=OPTIONAL)
    # [H] pre-MLP norm (Llama's post_attention_layernorm)
    norm_mlp_in: torch.Tensor = field(metadata=TENSOR)
    gate_up: Matrix = field(metadata=PRODUCT)  # fused gate / up product
    down: Matrix = field(metadata=PRODUCT)  # MLP output product
    # [H] norm of the MLP output (sandwich), or None
    norm_mlp_out: torch.Tensor | None = field(metadata=OPTIONAL)

    @property
    def matrices(self) -> tuple[Matrix, ...]:
        return tuple(getattr(self, f.name) for f in dataclasses.fields(self)
                     if f.metadata["role"] == "product")


FusedArgs = tuple[list[str], list[list[torch.Tensor]], list[str], list[float]]


def fused_args(shape: LayerShape, layer: LeanLayer) -> FusedArgs | None:
    """The arguments of the fused operator's `LayerStack.add` for `layer` of a model of
    `shape`: (tensor field names, their tensors, setting names, their values), every field of
    the two declarations in declared order; None when a product has no kernel of ours."""
    tensor_names: list[str] = []
    tensors: list[list[torch.Tensor]] = []
    setting_names: list[str] = []
    settings: list[float] = []
    for part in (shape, layer):
        for f in dataclasses.fields(part):
            role, value = f.metadata["role"], getattr(part, f.name)
            if role == "number":
                setting_names.append(f.name)
                settings.append(float(value))
            elif role == "choice":
                choices = f.metadata["choices"]
                setting_names.append(f"{f.name}:{','.join(choices)}")
                settings.append(float(choices.index(value)))
            elif role == "product":
                product = value.kernel_args()
                if product is None:
                    return None
                weights, scales = product
                tensor_names += [f.name, f"{f.name}_scales"]
                tensors += [list(weights), [] if scales is None else [scales]]
            elif role in ("tensor", "optional"):
                tensor_names.append(f.name)
                tensors.append([] if value is None else [value])
            else:
                raise AssertionError(f"field {f.name} has an unknown role {role!r}")
    return tensor_names, tensors, setting_names, settings
