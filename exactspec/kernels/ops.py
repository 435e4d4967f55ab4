"""The Python side of the kernels: loading (building on first use if needed), the fallback
decision with its one warning line, fake implementations for torch.library, typed wrappers."""

from __future__ import annotations

import logging
import os
import subprocess

import torch

from exactspec.kernels.build import ISA_FLAGS, build, failure_path, library_path

log = logging.getLogger(__name__)

_STATE: dict[str, object] = {}  # "loaded": bool, "reason": why not, once tried
_WARNED: set[str] = set()  # reasons already warned about (one line per process each)


def _load() -> bool:
    if "loaded" not in _STATE:
        try:
            path = library_path()
            if path.is_file():
                torch.ops.load_library(str(path))
            elif failure_path().is_file():  # `python -m exactspec.kernels` retries
                raise RuntimeError(f"the build failed earlier, see {failure_path()}")
            else:
                log.info("building the exactspec kernels for this CPU (once)")
                build()
            _register_fakes()
            _register_act_fakes()
            _register_layer_fake()
            _STATE["loaded"] = True
            note = forced_isa_note(os.environ.get("EXACTSPEC_KERNEL_ISA"), current_isa(),
                                   available_isas())
            if note:
                log.warning(note)
        except (OSError, RuntimeError, ImportError, subprocess.CalledProcessError) as exc:
            _STATE["loaded"] = False
            _STATE["reason"] = f"{type(exc).__name__}: {str(exc).splitlines()[0][:200]}"
    return bool(_STATE["loaded"])


def forced_isa_note(forced: str | None, current: str, available: list[str]) -> str | None:
    """Why `EXACTSPEC_KERNEL_ISA=forced` was not taken (a name no unit has, or a unit this CPU,
    kernel or compiler does not give), the kernels then running on `current`; None where it
    was taken or not set."""
    if not forced or forced == "auto" or forced == current:
        return None
    why = "not a unit" if forced not in UNITS else "not a unit this CPU (or build) runs"
    return (f"EXACTSPEC_KERNEL_ISA={forced}: {why}; the kernels run on {current} (this machine "
            f"has {', '.join(available)}; unset it or name one of those)")


def enabled() -> bool:
    """Whether the kernels are usable here and not turned off (EXACTSPEC_KERNELS=0). When not,
    one warning line says why (once per process and reason) and callers use the torch path."""
    if os.environ.get("EXACTSPEC_KERNELS", "1") == "0":
        reason = "turned off by EXACTSPEC_KERNELS=0"
    elif _load():
        return True
    else:
        reason = f"not built ({_STATE['reason']})"
    if reason not in _WARNED:
        _WARNED.add(reason)
        log.warning("exactspec kernels %s: the lean forward runs on torch operators, which are "
                    "not batch-invariant", reason)
    return False


def _register_fakes() -> None:
    lib = "exactspec::"
    register = torch.library.register_fake

    @register(lib + "linear")
    def _linear(x, weights, scales=None, residual=None):
        return x.new_empty(x.shape[0], sum(w.shape[0] for w in weights))

    @register(lib + "linear_w8a16")
    def _linear_w8a16(x, w, scales, residual=None):
        return x.new_empty(x.shape[0], scales.shape[0])

    @register(lib + "linear_w4a8")
    def _linear_w4a8(x, w, scales, residual=None):
        return x.new_empty(x.shape[0], scales.shape[0])

    @register(lib + "rms_norm")
    def _rms_norm(x, weight, eps):
        return torch.empty_like(x)

    @register(lib + "silu_mul")
    def _silu_mul(gate_up):
        return gate_up.new_empty(gate_up.shape[0], gate_up.shape[1] // 2)

    @register(lib + "rope_")
    def _rope(x, cos, sin, heads):
        return None

    @register(lib + "attention")
    def _attention(q, k, v, mask, scale):
        return q.new_empty(q.shape)


def linear(x: torch.Tensor, weights: list[torch.Tensor],  # [M, K] -> [M, sum N_i] float32
           scales: torch.Tensor | None = None,
           residual: torch.Tensor | None = None) -> torch.Tensor:
    """x @ cat(weights)^T (each [N_i, K] float32, bfloat16 or int8), times `scales` ([N]
    float32, per output column) if given, plus `residual` ([M, N]) if given (the same bits as
    adding it afterwards); one call for fused q/k/v or gate/up parts."""
    return torch.ops.exactspec.linear(x, weights, scales, residual)


def pack_int8(w: torch.Tensor) -> torch.Tensor:  # [N, K] int8 -> [ceil(N / 32), Kp / 2, 32, 2]
    """int8 weights in the layout `linear_w8a16` reads: panels of 32 rows (N zero-padded), K
    zero-padded to Kp (a multiple of 32), each panel stored as Kp / 2 pairs of inputs in input
    order, a pair holding [32 rows][2 inputs]: a panel is one stream, and a vector lane is an
    output row (no horizontal sums, csrc/impl_w8a16.h)."""
    n, k = w.shape
    n32, kp = -(-n // 32) * 32, -(-k // 32) * 32
    padded = torch.zeros(n32, kp, dtype=torch.int8)
    padded[:n, :k] = w
    return padded.view(n32 // 32, 32, kp // 2, 2).permute(0, 2, 1, 3).contiguous()


def linear_w8a16(x: torch.Tensor, w: torch.Tensor, scales: torch.Tensor,  # -> [M, N] float32
                 residual: torch.Tensor | None = None) -> torch.Tensor:
    """x @ (scales * W)^T for int8 W [N, K] packed by `pack_int8` (w), with each row of x [M, K] rounded to int16
    (x_q = round(x * 32767 / amax(|row|)), clamped to +-32767): the sum of x_q * w is exact
    (integers), so every output is one rounding of it, (float(sum) * amax / 32767) * scales[n],
    identical on every ISA and whatever the other rows; plus `residual` ([M, N]) if given.
    The int8 self-draft's product (Matrix.kernel): per 32 weights one widening load and one
    multiply-add against the float path's two conversions and two FMAs."""
    return torch.ops.exactspec.linear_w8a16(x, w, scales, residual)


def pack_int4(q: torch.Tensor, d: torch.Tensor,  # [N, K] uint8 0..15, [N, G] bf16
              m: torch.Tensor) -> torch.Tensor:  # [N, G] bf16 -> [ceil(N / 16), G, 320] uint8
    """int4 weights in the layout `linear_w4a8` reads (csrc/impl_w4.h): panels of 16 rows (N
    zero-padded), K zero-padded to G = Kp / 32 groups; a panel is one stream of blocks of 320
    bytes, one per group: 4 x 64 bytes of nibbles (row i's 4 bytes at 4i: low nibbles inputs
    8c..8c+3 of the group, high nibbles 8c+4..8c+7), then the group's d[16] and m[16] as bf16."""
    n, k = q.shape
    g = -(-k // 32)
    if d.shape != (n, g) or m.shape != (n, g):
        raise ValueError(f"d and m must be [{n}, {g}] (one per group of 32), got "
                         f"{tuple(d.shape)} and {tuple(m.shape)}")
    n16 = -(-n // 16) * 16
    qp = torch.zeros(n16, g * 32, dtype=torch.uint8)
    qp[:n, :k] = q
    # [P, 16, G, 4 chunks, 2 halves, 4 bytes]: input 32 g + 8 c + 4 h + b
    qv = qp.view(n16 // 16, 16, g, 4, 2, 4)
    nib = qv[..., 0, :] | (qv[..., 1, :] << 4)  # [P, 16, G, 4, 4]: low half | high half << 4
    nib = nib.permute(0, 2, 3, 1, 4).reshape(n16 // 16, g, 256)  # [P, G, (c, row, byte)]
    scales = torch.zeros(2, n16, g, dtype=torch.bfloat16)
    scales[0, :n], scales[1, :n] = d, m
    sb = scales.view(2, n16 // 16, 16, g).permute(1, 3, 0, 2).contiguous()  # [P, G, 2, 16]
    sb = sb.view(torch.uint8).reshape(n16 // 16, g, 64)
    return torch.cat([nib, sb], dim=2).contiguous()


def unpack_int4(w: torch.Tensor, n: int, k: int,  # -> q [n, k] uint8, d, m [n, G] bf16
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The inverse of `pack_int4` for the first n rows and k inputs."""
    p, g = w.shape[0], w.shape[1]
    nib = w[..., :256].reshape(p, g, 4, 16, 4).permute(0, 3, 1, 2, 4)  # [P, 16, G, 4, 4]
    q = torch.stack([nib & 0xF, nib >> 4], dim=4)  # [P, 16, G, 4 chunks, 2 halves, 4 bytes]
    q = q.reshape(p * 16, g * 32)[:n, :k]
    sb = w[..., 256:].contiguous().view(torch.bfloat16).reshape(p, g, 2, 16)
    sb = sb.permute(2, 0, 3, 1).reshape(2, p * 16, g)[:, :n]
    return q.contiguous(), sb[0].contiguous(), sb[1].contiguous()


def int4_quantize(groups: torch.Tensor,  # [R, n] float32
                  ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:  # q [R, n] uint8, d, m [R] bf16
    """Each group's int4 q, d and m by models/quantize.py's search (`quantize_int4_kernel`'s
    torch path states it: the same bits; csrc/ops_quant.cpp)."""
    return torch.ops.exactspec.int4_quantize(groups)


def linear_w4a8(x: torch.Tensor, w: torch.Tensor, scales: torch.Tensor,  # -> [M, N] float32
                residual: torch.Tensor | None = None) -> torch.Tensor:
    """x @ W^T for int4 W = scales[n] * (d q + m) in groups of 32 inputs, packed by `pack_int4`
    (w), with each group of 32 inputs of a row of x rounded to int8 (x_q = round(x * 127 /
    amax_g)): each group's integer sum is exact and the groups are added in group order by the
    same float operations on every ISA, so the bits are identical on every unit and whatever
    the other rows; plus `residual` ([M, N]) if given. The int4 self-draft's product."""
    return torch.ops.exactspec.linear_w4a8(x, w, scales, residual)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:  # [M, H]
    """x / sqrt(mean(x^2) + eps) * weight, row by row."""
    return torch.ops.exactspec.rms_norm(x, weight, eps)


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:  # [M, 2I] -> [M, I]
    """silu(gate) * up for gate_up = [gate | up]."""
    return torch.ops.exactspec.silu_mul(gate_up)


def rope_(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, heads: int) -> None:
    """RoPE (rotate-half) in place on the first `heads` heads of each row of x [M, C];
    cos, sin: [M, d]."""
    torch.ops.exactspec.rope_(x, cos, sin, heads)


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,  # -> [B, T, h, d]
              mask: torch.Tensor | None, scale: float) -> torch.Tensor:
    """softmax(scale q k^T) v per query over its visible keys (GQA: head i reads kv head
    i // (h / kv)); q [B, T, h, d], k, v [B, kv, S, d], mask [B, 1, T, S] or [B, T, S] bool
    (True = visible) or None (all)."""
    return torch.ops.exactspec.attention(q, k, v, mask, scale)


def set_isa(name: str) -> str:
    """Force an instruction set ("amx", "avx512bf16", "avx512vnni", "avx512", "avx2",
    "portable", or "auto");
    returns the one used."""
    return torch.ops.exactspec.set_isa(name)


def current_isa() -> str:
    return torch.ops.exactspec.current_isa()


def available_isas() -> list[str]:
    """The instruction sets this CPU runs, best first."""
    return list(torch.ops.exactspec.available_isas())


def rounds_bf16_inputs(isa: str | None = None) -> bool:
    """Whether the unit `isa` (default: the one in use) rounds x to bf16 against bf16 weights:
    the amx unit (AMX tiles at every width, csrc/impl_amx.h) and the avx512bf16 unit
    (VDPBF16PS at every width, csrc/impl_bf16dot.h), whose bf16-weight products have other bits
    than the FMA units' and than each other's (still the same at every width, row and thread
    count); float32 and int8 weights give every unit's bits there."""
    return (isa or current_isa()) in BF16_INPUT_UNITS


BF16_INPUT_UNITS = ("amx", "avx512bf16")  # the units that round x to bf16 (above)
UNITS = tuple(ISA_FLAGS)  # every unit build.py compiles, the first choice first (csrc/ops.cpp)


# ---- the activations of csrc/impl_act.h (the Llama relatives: Gemma 3's GeGLU) ----

def _register_act_fakes() -> None:
    @torch.library.register_fake("exactspec::gelu_tanh_mul")
    def _gelu_tanh_mul(gate_up):
        return gate_up.new_empty(gate_up.shape[0], gate_up.shape[1] // 2)


def gelu_tanh_mul(gate_up: torch.Tensor) -> torch.Tensor:  # [M, 2I] -> [M, I]
    """gelu(gate, approximate="tanh") * up for gate_up = [gate | up] (GeGLU), computed as
    gate / (1 + exp(-2u)) with our exp, the same bits at any width and on every ISA."""
    return torch.ops.exactspec.gelu_tanh_mul(gate_up)


# ---- the decoder layers in one call (csrc/ops_layer.cpp) ----

def _register_layer_fake() -> None:
    # (shapes only; tracing it under torch.compile would also need a fake LayerStack class,
    # which holds the weights: the lean forward is not compiled)
    @torch.library.register_fake("exactspec::decoder_stack")
    def _decoder_stack(stack, x, *args):
        keep = args[-1]
        return [torch.empty_like(x) for _ in range(1 + len(keep))]


def layer_stack(layers: list[tuple]) -> torch.ScriptObject:
    """A LayerStack of decoder layers for `decoder_stack`; each entry is the arguments of
    LayerStack.add as `models/lean_layer.fused_args` gives them: (tensor field names, their
    tensors, setting names, their values), the fields of the layer's declaration in declared
    order; the operator refuses any other layout."""
    stack = torch.classes.exactspec.LayerStack()
    for args in layers:
        stack.add(*args)
    return stack


def decoder_stack(stack: torch.ScriptObject, x: torch.Tensor,  # -> [M, H], [inputs of keep]
                  rope: tuple[torch.Tensor, torch.Tensor],
                  rope_local: tuple[torch.Tensor, torch.Tensor] | None,
                  k_caches: list[torch.Tensor], v_caches: list[torch.Tensor], write_start: int,
                  write_index: torch.Tensor | None, view_len: int, mask: torch.Tensor | None,
                  mask_local: torch.Tensor | None, batch: int,
                  keep: list[int]) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """Every layer of `stack` on x [B * T, H] (rows by row, then token): the per-operator
    sequence of `lean_kernels.forward_kernels` in one call (the same functions, the same
    bits). rope: cos, sin [M, d] (rope_local: a sliding-window layer's, Gemma 3); layer i's
    SlotCache buffers [B, kv, C, d] are written at slots write_start.. (>= 0: every row alike)
    or `write_index` [B, T], and attended over their first `view_len` slots under `mask`
    (`mask_local` for sliding-window layers; [B, 1, T, S] bool, or None: all visible).
    Returns the last layer's output and the input of each layer in `keep` (increasing)."""
    cos_l, sin_l = rope_local if rope_local is not None else (None, None)
    out = torch.ops.exactspec.decoder_stack(stack, x, rope[0], rope[1], cos_l, sin_l, k_caches,
                                            v_caches, write_start, write_index, view_len, mask,
                                            mask_local, batch, keep)
    return out[0], out[1:]
