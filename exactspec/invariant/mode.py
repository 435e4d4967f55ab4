"""The batch-invariant mode: transformers' own Llama forward on our invariant CPU operators.

Under `with batch_invariant():` (or after `set_batch_invariant(True)`) a float32 transformers
Llama-family model's own forward on the CPU (any length, eager or SDPA attention, training mode
with autograd) computes every output element in one fixed order of its own inputs, and
reproduces the engine's lean forward (`models/lean_kernels.py`) bit for bit: same operators,
same order (RMSNorm, RoPE, attention, SiLU, products, final norm, head, float32 logits).

How, and why that way. Two mechanisms, each where it is the only one that gives those bits:
- `torch.library` overrides of aten operators on the CPU key (a `Library("aten", "IMPL")` that
  exists only while the mode is on, as Thinking Machines' batch_invariant_ops does on CUDA):
  `aten::mm` / `aten::addmm` (every nn.Linear, the LM head) run on `kernels.linear` when the
  second operand is a weight seen through `.t()` (the forward's layout; anything else, e.g.
  the backward's products, runs torch's own kernel through the `.out` overload), and
  `aten::silu` on the kernel's exp. These sit below autograd, so autograd is untouched.
- Function swaps, restored on exit: RMSNorm, RoPE's cos / sin and attention. No aten override
  can give the lean forward's bits there: its RMSNorm sums x*x with fused multiply-adds in one
  kernel (aten's pow + mean round each square), its attention normalises after the weighted
  sum of values (aten's softmax then matmul before), and torch's cos / sin of a position
  depend on where it falls in the tensor (a vectorised body and a scalar tail), so the
  lean forward reads them from a table filled in fixed chunks; the swapped rotary reads a
  table filled by the same function (`models/rope_table.py`). The swaps:
  `LlamaRMSNorm.forward`, `LlamaRotaryEmbedding.forward`, and the "eager" / "sdpa" entries
  of transformers' attention interface (the mask transformers built is turned into the
  kernel's visible-key mask). RMSNorm and attention are autograd Functions
  whose backward is torch's math (`invariant/ops.py`).
Softmax / log-softmax need no override: torch's CPU kernels over the last dimension reduce
each row alone in a fixed order (tested: a row alone equals the row in a batch, bit for bit),
and the standardization's other reductions (cumsum for top-p, sort) are row-local too.

Bit-equality holds on the same machine and build (the same ISA unit of our kernels, the same
torch); a float32 model is required (other dtypes fall back to torch's operators).
"""

from __future__ import annotations

import contextlib
import logging
import threading
import warnings
import weakref
from collections.abc import Iterator

import torch

from exactspec import kernels
from exactspec.errors import InvalidValue
from exactspec.invariant import ops
from exactspec.models.lean import LeanLlama
from exactspec.models.rope_table import STATIC_ROPE, rope_table

log = logging.getLogger(__name__)
_LOCK = threading.RLock()
_WARNED: set[str] = set()  # model kinds warned about by warn_if_uncovered (once each)
# "on": the overrides are installed; "manual": set_batch_invariant's setting; "depth": open
# `batch_invariant()` blocks (any thread); while on, "lib" and "saved_attn" (what to restore)
_STATE: dict[str, object] = {"on": False, "manual": False, "depth": 0}
_ROPE: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # rotary -> (key, (cos, sin))
_ORIG: dict[str, object] = {}  # name -> the original function a swap replaced


def is_batch_invariant() -> bool:
    """Whether the batch-invariant mode is on."""
    return bool(_STATE["on"])


def set_batch_invariant(on: bool) -> None:
    """Turn the batch-invariant mode on or off for the whole process (see the module doc);
    `batch_invariant()` blocks still open keep it on until they end."""
    if not isinstance(on, bool):
        raise TypeError(f"set_batch_invariant takes a bool, got {on!r}")
    with _LOCK:
        _STATE["manual"] = on
        _apply()


@contextlib.contextmanager
def batch_invariant() -> Iterator[None]:
    """`with es.batch_invariant(): ...`: the mode on inside the block. Blocks nest and may be
    open in several threads at once: the mode stays on until the last one ends (or for good
    after `set_batch_invariant(True)`). The mode is process-wide: other threads' CPU forwards
    run on the invariant operators meanwhile too."""
    with _LOCK:
        _STATE["depth"] += 1
        try:
            _apply()
        except BaseException:
            _STATE["depth"] -= 1
            raise
    try:
        yield
    finally:
        with _LOCK:
            _STATE["depth"] -= 1
            _apply()


def _apply() -> None:
    """Install or remove the overrides to match "manual" and "depth"."""
    want = bool(_STATE["manual"]) or _STATE["depth"] > 0
    if want == _STATE["on"]:
        return
    if want:
        if not kernels.enabled():
            _STATE["manual"] = False
            raise InvalidValue(
                "the batch-invariant mode needs the exactspec kernels, which are off or not "
                "built here: build them with `python -m exactspec.kernels` (and unset "
                "EXACTSPEC_KERNELS=0)")
        _enable()
    else:
        _disable()
    _STATE["on"] = want


# ---- aten overrides (CPU key) ----

def _is_weight_view(b: torch.Tensor) -> bool:
    return b.dim() == 2 and b.t().is_contiguous()


def _mm(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:  # [M, K] @ [K, N]
    if (a.dtype == b.dtype == torch.float32 and a.dim() == 2 and _is_weight_view(b)
            and a.numel() and b.numel()):
        return kernels.linear(a, [b.t()])
    out = a.new_empty((a.shape[0], b.shape[1]), dtype=torch.promote_types(a.dtype, b.dtype))
    return torch.ops.aten.mm.out(a, b, out=out)


def _addmm(bias: torch.Tensor, a: torch.Tensor, b: torch.Tensor, *, beta=1, alpha=1):
    if (beta == 1 and alpha == 1 and bias.dtype == a.dtype == b.dtype == torch.float32
            and a.dim() == 2 and _is_weight_view(b) and a.numel() and b.numel()):
        return kernels.linear(a, [b.t()]) + bias
    out = a.new_empty((a.shape[0], b.shape[1]))
    return torch.ops.aten.addmm.out(bias, a, b, beta=beta, alpha=alpha, out=out)


def _silu(x: torch.Tensor) -> torch.Tensor:
    if x.dtype == torch.float32 and x.numel():
        return ops.silu(x)
    return torch.ops.aten.silu.out(x, out=torch.empty_like(x))


# ---- function swaps ----

def _rms_norm_forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
    if (hidden_states.dtype == torch.float32 and self.weight.dtype == torch.float32
            and hidden_states.device.type == "cpu"):
        return ops.rms_norm(hidden_states, self.weight, self.variance_epsilon)
    return _ORIG["rms_norm"](self, hidden_states)


def rotary_table(rotary, need: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin ([P >= need, d] float32) of the model's own rotary module: the lean forward's
    table (`models/rope_table.py`, the same calls, the same bits), kept per rotary module."""
    key = (rotary.inv_freq.data_ptr(), rotary.inv_freq._version, device)
    entry = _ROPE.get(rotary)
    table = entry[1] if entry is not None and entry[0] == key else None
    forward = _ORIG.get("rotary", type(rotary).forward)
    table = rope_table(lambda x, pos: forward(rotary, x, pos), need, device, table)
    _ROPE[rotary] = (key, table)
    return table


def _rotary_forward(self, x: torch.Tensor, position_ids: torch.Tensor):
    if getattr(self, "rope_type", "default") not in STATIC_ROPE or position_ids.numel() == 0:
        return _ORIG["rotary"](self, x, position_ids)
    cos, sin = rotary_table(self, int(position_ids.max()) + 1, position_ids.device)
    return cos[position_ids].to(x.dtype), sin[position_ids].to(x.dtype)  # [B, T, d]


def visible_keys(attention_mask: torch.Tensor | None, b: int, t: int, s: int,
                 causal: bool) -> torch.Tensor:  # [B, T, S] bool
    """The keys each query sees, from the mask transformers built (bool: True = visible;
    float: 0 = visible, an additive large negative = hidden; None: causal, queries last)."""
    if attention_mask is None:
        if not causal or t == 1:
            return torch.ones(b, t, s, dtype=torch.bool)
        q = torch.arange(t)[:, None] + (s - t)
        return (torch.arange(s)[None, :] <= q).expand(b, t, s)
    m = attention_mask[..., :s]
    m = m if m.dtype == torch.bool else m == 0
    if m.dim() == 4:
        m = m[:, 0]
    return m.expand(b, t, s)


def _attention_forward(module, query, key, value, attention_mask, dropout=0.0, scaling=None,
                       **kwargs):
    # query [B, h, T, d]; key, value [B, kv, S, d] -> ([B, T, h, d], None)
    if not (query.dtype == key.dtype == value.dtype == torch.float32
            and query.device.type == "cpu") or kwargs.get("softcap") is not None:
        impl = getattr(getattr(module, "config", None), "_attn_implementation", "sdpa")
        original = _ORIG["eager"] if impl == "eager" else _ORIG["sdpa"]
        return original(module, query, key, value, attention_mask, dropout=dropout,
                        scaling=scaling, **kwargs)
    if dropout:
        raise InvalidValue(f"attention dropout {dropout} in the batch-invariant mode: set the "
                           "model's attention_dropout to 0 (or call model.eval())")
    b, _, t, d = query.shape
    scale = scaling if scaling is not None else d ** -0.5
    visible = visible_keys(attention_mask, b, t, key.shape[2],
                           bool(kwargs.get("is_causal", getattr(module, "is_causal", True))))
    out = ops.attention(query.transpose(1, 2), key, value, visible, scale)  # [B, T, h, d]
    return out, None


def _enable() -> None:
    import transformers.models.llama.modeling_llama as llama
    from transformers.integrations.sdpa_attention import sdpa_attention_forward
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    lib = torch.library.Library("aten", "IMPL")
    with warnings.catch_warnings():  # "overriding a previously registered kernel": intended
        warnings.simplefilter("ignore", UserWarning)
        lib.impl("mm", _mm, "CPU")
        lib.impl("addmm", _addmm, "CPU")
        lib.impl("silu", _silu, "CPU")
    _ORIG.update(rms_norm=llama.LlamaRMSNorm.forward, rotary=llama.LlamaRotaryEmbedding.forward,
                 sdpa=sdpa_attention_forward, eager=llama.eager_attention_forward)
    local = ALL_ATTENTION_FUNCTIONS._local_mapping
    saved_attn = {k: local[k] for k in ("eager", "sdpa") if k in local}
    llama.LlamaRMSNorm.forward = _rms_norm_forward
    llama.LlamaRotaryEmbedding.forward = _rotary_forward
    ALL_ATTENTION_FUNCTIONS["eager"] = _attention_forward
    ALL_ATTENTION_FUNCTIONS["sdpa"] = _attention_forward
    _STATE.update(lib=lib, saved_attn=saved_attn)


def _disable() -> None:
    import transformers.models.llama.modeling_llama as llama
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    llama.LlamaRMSNorm.forward = _ORIG["rms_norm"]
    llama.LlamaRotaryEmbedding.forward = _ORIG["rotary"]
    saved = _STATE.pop("saved_attn")
    for k in ("eager", "sdpa"):
        if k in saved:
            ALL_ATTENTION_FUNCTIONS[k] = saved[k]
        else:
            del ALL_ATTENTION_FUNCTIONS[k]
    _STATE.pop("lib")._destroy()


def check_invariant_target(model, on: bool) -> bool:
    """`on`, after checking that `model` is one the mode makes bit-equal between the engine
    and the trainer: a float32 Llama-architecture model on the CPU, with the kernels built."""
    if not isinstance(on, bool):
        raise TypeError(f"batch_invariant={on!r} must be a bool")
    if not on:
        return False
    param = next(model.parameters())
    if not covered(model):
        raise InvalidValue(
            f"batch_invariant=True needs a float32 Llama-architecture target on the CPU (got "
            f"{getattr(model.config, 'model_type', type(model).__name__)} in {param.dtype} on "
            f"{param.device}); load it with dtype='float32', or leave batch_invariant off")
    if not kernels.enabled():
        raise InvalidValue("batch_invariant=True needs the exactspec kernels: build them with "
                           "`python -m exactspec.kernels` (and unset EXACTSPEC_KERNELS=0)")
    return True


def covered(model) -> bool:
    """Whether the mode promises the engine's bits for `model`: float32 Llama on the CPU."""
    param = next(model.parameters())
    # Llama only: the swaps above are Llama's classes (the lean forward's other architectures,
    # models/lean_arch.py, have their own norms, activations and rotary modules)
    return (LeanLlama.supports(model) and model.config.model_type == "llama"
            and param.dtype == torch.float32
            and param.device.type == "cpu")


def warn_if_uncovered(model) -> None:
    """One warning line (per model kind and process) when the mode is used with a model it
    does not cover: its forward then runs partly on ordinary operators."""
    if covered(model):
        return
    param = next(model.parameters())
    kind = (f"{getattr(model.config, 'model_type', type(model).__name__)} in {param.dtype} "
            f"on {param.device}")
    if kind not in _WARNED:
        _WARNED.add(kind)
        log.warning("es.batch_invariant() covers float32 Llama-architecture models on the CPU; "
                    "a %s model's forward is not guaranteed batch-invariant nor equal to the "
                    "engine's bits", kind)
