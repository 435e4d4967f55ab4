"""The decoder layer is declared once (`models/lean_layer.py`) and its three ways of running read
that declaration:

- every field of `LeanLayer` is read by the torch path, the per-operator kernel path and the
  fused C++ operator (changing one field of one layer changes the logits of all three, and
  the two kernel paths still agree bit for bit), and so are the shared settings of
  `LayerShape` that a model can change (the score scale, the activation);
- the fused operator receives the fields with their names, in declared order, and refuses a
  layout other than its own (a field removed, added, moved or renamed, a choice reordered, a
  field added to the declaration itself), loudly, when the layer stack is built;
- one RoPE table function fills the lean forward's table and the batch-invariant mode's.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from exactspec import kernels
from exactspec.invariant import mode
from exactspec.models import lean_kernels, rope_table
from exactspec.models.adapter import TargetAdapter
from exactspec.models.lean import LeanLlama
from exactspec.models.lean_layer import KINDS, OPTIONAL, LayerShape, LeanLayer, fused_args
from tests.models.test_lean_architectures import model_of

needs_kernels = pytest.mark.skipif(not kernels.enabled(), reason="the kernels are not built here")
REFUSED = "declaration and the C\\+\\+ operator differ"


def _logits(model, lean: LeanLlama) -> torch.Tensor:  # [1, 8, V]
    """Logits of 8 tokens fed at once after a 3-token prompt (past the 4-position window)."""
    g = torch.Generator().manual_seed(7)
    ad = TargetAdapter(model, forward=lean)
    ad.prefill([torch.randint(0, 40, (3,), generator=g).tolist()], capacity=16)
    return ad.extend(torch.randint(0, 40, (1, 8), generator=g))


def _paths(model, alter, monkeypatch) -> dict[str, torch.Tensor]:
    """The logits of each path on a fresh LeanLlama of `model` altered by `alter`."""
    out = {}
    for path in ("torch", "per-operator", "fused"):
        with monkeypatch.context() as m:
            if path == "torch":
                m.setenv("EXACTSPEC_KERNELS", "0")
            m.setattr(lean_kernels, "FUSED", path == "fused")
            lean = LeanLlama(model)
            assert lean.kernels == (path != "torch")
            alter(lean)
            if path == "fused":
                assert lean_kernels.layer_stack(lean) is not None
            out[path] = _logits(model, lean)
    return out


def _other(lean: LeanLlama, name: str):
    """Layer 0's field `name` changed: layer 1's value (weights differ: perturbed), the other
    attention kind, another epsilon, a q / k / v bias where the model has none."""
    if name == "kind":
        return KINDS[1 - KINDS.index(lean.layers[0].kind)]
    if name == "eps":
        return 0.5
    if name == "qkv_bias" and lean.layers[1].qkv_bias is None:  # a bias where there is none
        s = lean.shape
        return torch.full(((s.heads + 2 * s.kv_heads) * s.head_dim,), 0.25)
    return getattr(lean.layers[1], name)


@needs_kernels
def test_every_declared_field_is_read_by_every_path(monkeypatch):
    model = model_of("gemma3_text", seed=3, vocab=40)  # every optional field, both kinds
    ref = _paths(model, lambda lean: None, monkeypatch)
    assert torch.equal(ref["per-operator"], ref["fused"])
    alters = {f.name: (lambda lean, n=f.name: setattr(lean.layers[0], n, _other(lean, n)))
              for f in dataclasses.fields(LeanLayer)}
    alters["scale"] = lambda lean: setattr(lean, "scaling", 2 * lean.scaling)
    alters["act"] = lambda lean: setattr(lean, "arch", dataclasses.replace(lean.arch, act="silu"))
    assert set(alters) >= {f.name for f in dataclasses.fields(LayerShape)} - {
        "heads", "kv_heads", "head_dim"}  # (the shapes of the weights)
    for name, alter in alters.items():
        got = _paths(model, alter, monkeypatch)
        for path in got:
            assert not torch.equal(got[path], ref[path]), (name, path)
        assert torch.equal(got["per-operator"], got["fused"]), name


def _stack(args) -> None:
    kernels.layer_stack([args])


@needs_kernels
@pytest.mark.parametrize("name", ["llama", "gemma3_text"])
def test_the_operator_takes_the_declared_layout(name):
    lean = LeanLlama(model_of(name, vocab=40))
    args = lean_kernels.layer_args(lean)
    settings, tensors = [], []  # the names the declaration gives, in its order
    for f in [*dataclasses.fields(LayerShape), *dataclasses.fields(LeanLayer)]:
        role = f.metadata["role"]
        if role == "number":
            settings.append(f.name)
        elif role == "choice":
            settings.append(f"{f.name}:{','.join(f.metadata['choices'])}")
        elif role == "product":
            tensors += [f.name, f"{f.name}_scales"]
        else:
            tensors.append(f.name)
    assert len(args) == len(lean.layers)
    for tensor_names, values, setting_names, numbers in args:
        assert (tensor_names, setting_names) == (tensors, settings)
        assert len(values) == len(tensors) and len(numbers) == len(settings)
    assert lean_kernels.layer_stack(lean).size() == len(lean.layers)


def _without(names: list, values: list, name: str) -> tuple[list, list]:
    i = names.index(name)
    return names[:i] + names[i + 1:], values[:i] + values[i + 1:]


def _swapped(names: list, values: list, a: str, b: str) -> tuple[list, list]:
    names, values = list(names), list(values)
    i, j = names.index(a), names.index(b)
    names[i], names[j], values[i], values[j] = names[j], names[i], values[j], values[i]
    return names, values


@needs_kernels
def test_the_operator_refuses_another_layout():
    lean = LeanLlama(model_of("qwen3", vocab=40))
    tn, tv, sn, sv = lean_kernels.layer_args(lean)[0]
    _stack((tn, tv, sn, sv))  # the declared layout: accepted
    norm = tv[tn.index("norm_in")]
    wrong = {
        "a tensor field removed": (*_without(tn, tv, "norm_mlp_out"), sn, sv),
        "a tensor field added": ([*tn, "norm_extra"], [*tv, norm], sn, sv),
        "two tensor fields moved": (*_swapped(tn, tv, "q_norm", "k_norm"), sn, sv),
        "a tensor field renamed": ([n.replace("norm_in", "input_norm") for n in tn], tv, sn, sv),
        "a setting removed": (tn, tv, *_without(sn, sv, "eps")),
        "two settings moved": (tn, tv, *_swapped(sn, sv, "heads", "kv_heads")),
        "a choice reordered": (tn, tv, [n.replace("silu,gelu_tanh", "gelu_tanh,silu")
                                        for n in sn], sv),
    }
    for what, args in wrong.items():
        with pytest.raises(RuntimeError, match=REFUSED):
            _stack(args)
        assert what
    # the right names with a wrong value: a required tensor missing, a fractional head count
    missing = [[] if n == "norm_in" else t for n, t in zip(tn, tv, strict=True)]
    with pytest.raises(RuntimeError, match="norm_in takes one tensor"):
        _stack((tn, missing, sn, sv))
    with pytest.raises(RuntimeError, match="heads must be a non-negative integer"):
        _stack((tn, tv, sn, [v + 0.5 if n == "heads" else v for n, v in zip(sn, sv,
                                                                           strict=True)]))


@needs_kernels
def test_a_field_added_to_the_declaration_reaches_the_operator():
    """A new field declared (here in a subclass) is handed to the operator by `fused_args`,
    which refuses it until ops_layer.cpp reads it: no silent shift of the fields after it."""

    @dataclasses.dataclass
    class Wider(LeanLayer):
        norm_extra: torch.Tensor | None = dataclasses.field(metadata=OPTIONAL)

    lean = LeanLlama(model_of("llama", vocab=40))
    layer = lean.layers[0]
    wider = Wider(**{f.name: getattr(layer, f.name) for f in dataclasses.fields(layer)},
                  norm_extra=None)
    args = fused_args(lean.shape, wider)
    assert args[0][-1] == "norm_extra" and args[0][:-1] == fused_args(lean.shape, layer)[0]
    with pytest.raises(RuntimeError, match=REFUSED):
        _stack(args)


def test_one_rope_table_fills_the_lean_forward_and_the_mode(monkeypatch):
    """Both tables come from `rope_table.rope_table`: with its chunk set to 16, the lean
    forward's table and the mode's call the rotary module on 16 positions at a time, and
    hold the same bits past several chunks."""
    monkeypatch.setattr(rope_table, "ROPE_CHUNK", 16)
    model = model_of("llama", vocab=40)
    lean = LeanLlama(model)
    calls = []
    rotary = lean.rotary
    forward = type(rotary).forward

    def counted(self, x, pos):
        calls.append(pos.shape[-1])
        return forward(self, x, pos)

    monkeypatch.setattr(type(rotary), "forward", counted)
    monkeypatch.setitem(mode._ORIG, "rotary", counted)  # what the mode fills its table with
    positions = torch.arange(40)[None]  # [1, 40]: 3 chunks
    cos, sin = lean_kernels.rope_rows(lean, positions)  # [40, d]
    assert calls == [16] * 3
    calls.clear()
    table = mode.rotary_table(rotary, 40, positions.device)
    assert calls == [16] * 3 and table[0].shape[0] == 48
    assert torch.equal(table[0][:40], cos) and torch.equal(table[1][:40], sin)
