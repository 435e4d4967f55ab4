"""Weight formats for the lean forward: one matrix product per format, its kernel chosen per CPU.

A `Matrix` holds one linear layer's weight `W` ([out, in], y = x W^T) in a storage format and
computes `y` for activations of any leading shape:

| format     | storage                                   | activations | kernel                            |
|------------|-------------------------------------------|-------------|-----------------------------------|
| `float32`  | the model's own [out, in] + an [in, out]  | float32     | x @ W^T via the [in, out] copy for |
|            | copy made on the first one-row product    |             | one row, W @ x^T for 2..8 rows,   |
|            |                                           |             | `linear` beyond                   |
| `bfloat16` | [out, in] bf16                            | bfloat16    | `linear`                          |
| `int8`     | int8 per output channel + bf16 scales     | bfloat16    | `torch._weight_int8pack_mm`       |
| `int4`     | min-max groups along `in`, packed         | bfloat16    | `torch._weight_int4pack_mm_for_cpu`|

On the CPU, where our own kernels are built (`exactspec/kernels`), the lean forward calls
`Matrix.kernel` instead: one batch-invariant product for float32 (the model's own parts, no
copy), bfloat16, int8 (float32 scales; int16 activations) and int4 weights (our own format,
`models/quantize.py quantize_int4_kernel`: asymmetric groups of 32 with bf16 d and m, 0.625
bytes a weight, int8 activations per group; `kernels.linear_w4a8`), float32 activations in and
out.

Every quantized format also has a reference path, `Matrix.reference(x)`: the dequantized
weight in float32, used by the tests and as the fallback where the packed kernel is slower than
the reference (measured once per process, `kernel_choice`) or refuses the shape (int4 needs
`out` divisible by 16 and `in` by the group size; such a matrix is stored as int8 instead,
logged). The draft's q is computed from whatever its forward computes, so every path is exact;
the choice only moves speed and acceptance.

Measured on this project's 2-core AMD EPYC (AVX2, no AVX-512), 2 threads, the 49152 x 576 LM
head, one row: float32 `linear` 7.5 ms, float32 x @ W^T ([in, out] copy) 4.0 ms, bf16 `linear`
3.1 ms, int8pack (bf16 activations) 2.1 ms, int4pack (bf16) 2.3 ms; with float32 activations
int8pack takes 13.5 ms and int4pack 27.6 ms, so the packed kernels always get bf16 activations.
Thirty layers of SmolLM2 matrices (weights not in cache, float32): one row 25.8 ms through the
[in, out] copy against 34.1 ms through W @ x^T on [out, in]; 2 / 3 / 5 / 7 rows 43 / 50 / 67 /
51 ms through [in, out] against 26 / 29 / 41 / 45 ms through W @ x^T (`/tmp`-free reproduction:
`python -m exactspec.bench.products`).
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from exactspec.errors import InvalidValue
from exactspec.kernels import linear as kernel_linear
from exactspec.kernels import linear_w4a8, linear_w8a16, pack_int4, pack_int8, unpack_int4
from exactspec.models.quantize import (
    int4_dequantize,
    quantize_int4,
    quantize_int4_kernel,
    quantize_int8,
)

log = logging.getLogger(__name__)

FORMATS = ("float32", "bfloat16", "int8", "int4")
MATVEC_ROWS = (2, 8)  # row counts where the float32 product is W @ x^T on [out, in] (and one
# row without the copy)


@dataclass
class Matrix:
    """One linear layer's weight in a storage format; `m(x)` is x @ W^T ([..., in] -> [..., out]).

    The product returns x's dtype; quantized and bf16 kernels take their input cast to bf16.
    """

    fmt: str  # one of FORMATS (the format actually stored, after any int4 -> int8 fallback)
    out_features: int  # rows of W
    in_features: int  # columns of W
    weight: torch.Tensor | None = None  # [out, in] bfloat16 (a copy)
    parts: list[torch.Tensor] | None = None  # float32: the model's own [out_i, in] tensors,
    # stacked along `out` (q, k, v or gate, up), never copied
    weight_t: torch.Tensor | None = None  # [in, out] float32 copy for one-row products
    qweight: torch.Tensor | None = None  # int8 [out, in], or int4 packed [out, in / 2] uint8
    scales: torch.Tensor | None = None  # int8: [out] bf16; int4: [in / group, out, 2] bf16
    group_size: int = 0  # int4 group along `in`
    packed: bool = True  # use the packed kernel (False: the dequantized reference, measured)
    ref_weight: torch.Tensor | None = None  # [out, in] float32 dequantized, when not packed
    kernel_scales: torch.Tensor | None = None  # int8 for our kernels: [out] float32 (= scales)
    kernel_qweight: torch.Tensor | None = None  # int8 for our kernels: qweight packed by
    # kernels.pack_int8 (panels of 32 rows, one stream each), for linear_w8a16

    def __call__(self, x: torch.Tensor,  # [..., in] -> [..., out], x's dtype
                 one_row_copy: bool = True) -> torch.Tensor:
        """x @ W^T. `one_row_copy`: a float32 one-row product may build (once) and use the
        fused [in, out] copy; False (a speculative run's rare one-row step) uses the model's
        own matrices unless the copy already exists."""
        lead, dtype = x.shape[:-1], x.dtype
        x2 = x.reshape(-1, self.in_features)  # [M, in]
        m = x2.shape[0]
        if self.fmt == "float32":
            if m == 1 and (one_row_copy or self.weight_t is not None):
                if self.weight_t is None:  # built on first use: speculative steps never need it
                    self.weight_t = torch.cat(self.parts).t().contiguous()  # [in, out]
                y = x2 @ self.weight_t
            elif m <= MATVEC_ROWS[1]:
                # x2 must be row-major: W @ x^T on a column-major x took 32 instead of 9 ms
                # for 30 down projections of 5 rows
                xt = x2.contiguous().t()  # [in, M]
                y = torch.cat([w @ xt for w in self.parts]).t().contiguous()
            else:
                y = torch.cat([F.linear(x2, w) for w in self.parts], dim=-1)
        elif not self.packed:
            y = F.linear(x2.float(), self.ref_weight)
        elif self.fmt == "int4" and self.kernel_qweight is not None:  # our own int4 kernel
            y = self.kernel(x2.float())
        else:
            xb = x2.to(torch.bfloat16)  # the packed kernels are fast with bf16 activations only
            if self.fmt == "bfloat16":
                y = F.linear(xb, self.weight)
            elif self.fmt == "int8":
                y = torch._weight_int8pack_mm(xb, self.qweight, self.scales)
            else:
                y = torch._weight_int4pack_mm_for_cpu(xb, self.qweight, self.group_size,
                                                      self.scales)
        return y.to(dtype).reshape(*lead, self.out_features)

    def kernel(self, x: torch.Tensor,  # [M, in] float32 -> [M, out] float32
               residual: torch.Tensor | None = None) -> torch.Tensor:
        """(residual +) x @ W^T on our own batch-invariant kernel (exactspec.kernels.linear):
        each output element's value depends on its row of x and column of W only. int4 (no
        kernel of ours) runs its torch product, not batch-invariant."""
        args = self.kernel_args()
        if args is not None:
            weights, scales = args
            if weights[0].dim() == 3:
                # int4 packed: int8 activations per group of 32, exact integer group sums
                # (kernels.linear_w4a8)
                return linear_w4a8(x, weights[0], scales, residual)
            if weights[0].dim() == 4:
                # int8 packed: int16 activations, exact integer sums (kernels.linear_w8a16):
                # 2-2.5x the float activation product's speed at one row (the self-draft's step)
                return linear_w8a16(x, weights[0], scales, residual)
            return kernel_linear(x, weights, scales, residual)
        y = self(x).float()
        return y if residual is None else residual + y

    def kernel_args(self) -> tuple[list[torch.Tensor], torch.Tensor | None] | None:
        """(weights, scales) of the product `kernel` runs, as the fused decoder-layer operator
        takes them (kernels.decoder_layer: a 4-dim int8 weight is linear_w8a16's packing), or
        None where `kernel` has no kernel of ours (int4 not built for the kernels: torch's
        product)."""
        if self.parts is not None:
            return self.parts, None
        if self.fmt == "bfloat16" and self.packed:
            return [self.weight], None
        if self.fmt in ("int8", "int4") and self.kernel_qweight is not None:
            return [self.kernel_qweight], self.kernel_scales
        if self.fmt == "int8" and self.qweight is not None and self.kernel_scales is not None:
            return [self.qweight], self.kernel_scales
        if self.ref_weight is not None:
            return [self.ref_weight], None
        return None

    def dequantized(self) -> torch.Tensor:  # [out, in] float32
        """The weight this matrix multiplies by, in float32 (the reference for every kernel)."""
        if self.ref_weight is not None:
            return self.ref_weight
        if self.fmt == "float32":
            return torch.cat(self.parts).float()
        if self.fmt == "bfloat16":
            return self.weight.float()
        if self.fmt == "int8":
            return self.qweight.float() * self.scales.float()[:, None]
        if self.kernel_qweight is not None:  # int4 for our kernel
            q, d, m = unpack_int4(self.kernel_qweight, self.out_features, self.in_features)
            gs = 32
            w = d.float().repeat_interleave(gs, 1) * q.float() + m.float().repeat_interleave(gs, 1)
            return w * self.kernel_scales[:, None]
        return int4_dequantize(self.qweight, self.scales, self.group_size, self.in_features)

    def reference(self, x: torch.Tensor) -> torch.Tensor:  # [..., in] -> [..., out] float32
        """x @ W^T in float32 with the dequantized weight."""
        return F.linear(x.float(), self.dequantized())

    @property
    def nbytes(self) -> int:
        """Bytes a product reads from this matrix's weights (the copy the kernel uses)."""
        if self.parts is not None:
            tensors = self.parts
        elif self.ref_weight is not None:
            tensors = [self.ref_weight]
        elif self.fmt == "int4" and self.kernel_qweight is not None:
            tensors = [self.kernel_qweight, self.kernel_scales]
        elif self.qweight is not None:
            tensors = [self.qweight, self.scales]
        else:
            tensors = [self.weight]
        return sum(t.numel() * t.element_size() for t in tensors)

    @classmethod
    def float32_parts(cls, parts: list[torch.Tensor]) -> Matrix:
        """The model's own float32 matrices ([out_i, in] each) as one product, without a copy."""
        parts = [p.detach() for p in parts]
        assert all(p.dtype == torch.float32 and p.shape[1] == parts[0].shape[1] for p in parts)
        return cls("float32", sum(p.shape[0] for p in parts), parts[0].shape[1], parts=parts)


def make_matrix(weight: torch.Tensor, fmt: str, *, group_size: int = 32,
                for_kernels: bool = False) -> Matrix:
    """`weight` ([out, in], float32) stored as `fmt`; float32 keeps the tensor itself (no copy),
    bfloat16 keeps a bfloat16 weight itself. `for_kernels`: int8 is kept for our own kernel
    (`Matrix.kernel`), with no packed-vs-reference measurement."""
    if fmt not in FORMATS:
        raise InvalidValue(f"weight format {fmt!r} must be one of {list(FORMATS)}")
    out_f, in_f = weight.shape
    w = weight.detach()
    if fmt == "float32":
        return Matrix.float32_parts([w.float()])
    if fmt == "bfloat16":
        return Matrix("bfloat16", out_f, in_f, weight=w.to(torch.bfloat16).contiguous())
    if fmt == "int4" and for_kernels and in_f % group_size == 0:
        q, d, m = quantize_int4_kernel(w.float().cpu(), group_size)
        return Matrix("int4", out_f, in_f, group_size=group_size,
                      kernel_qweight=pack_int4(q, d, m),
                      kernel_scales=torch.ones(out_f, dtype=torch.float32))
    if fmt == "int4" and (out_f % 16 or in_f % group_size):
        log.info("int4 refuses a [%d, %d] matrix (out %% 16, in %% %d); storing it as int8",
                 out_f, in_f, group_size)
        fmt = "int8"
    if fmt == "int8":
        q, s = quantize_int8(w.float())
        m = Matrix("int8", out_f, in_f, qweight=q.contiguous(), scales=s.to(torch.bfloat16))
        if for_kernels:  # the same scales (bf16-rounded) as the packed kernel and the reference
            m.kernel_scales = m.scales.float()
            m.kernel_qweight = pack_int8(m.qweight)
            return m
    else:  # the int4 pack is a CPU layout: quantized there, moved back below if not packed
        q, sz = quantize_int4(w.float().cpu(), group_size)
        m = Matrix("int4", out_f, in_f, qweight=q, scales=sz, group_size=group_size)
    if not kernel_choice(m.fmt, w.device):
        m.ref_weight = m.dequantized().to(w.device)
        m.packed = False
        m.qweight = None
    return m


_KERNEL_OK: dict[str | tuple[str, str], bool] = {}  # fmt (CPU) or (fmt, device) -> packed?


def kernel_choice(fmt: str, device: torch.device | str = "cpu") -> bool:
    """Whether the packed kernel for `fmt` beats the dequantized float32 reference here.

    Measured once per process and device on a [4096, 576] product of one row (median of 7
    each); the result and the CPU capability are logged. bf16 is always taken (it has no packed
    form). On other devices int4 (a CPU pack) always takes the reference, and int8 the packed
    kernel if the device runs it at all (untested here: no GPU was lent to this project).
    """
    if fmt == "bfloat16":
        return True
    device = torch.device(device)
    if device.type != "cpu":
        key = (fmt, str(device))
        if key not in _KERNEL_OK:
            _KERNEL_OK[key] = fmt == "int8" and _runs_int8pack(device)
        return _KERNEL_OK[key]
    if fmt not in _KERNEL_OK:
        w = torch.randn(4096, 576) * 0.02
        x = torch.randn(1, 576, dtype=torch.bfloat16)
        if fmt == "int8":
            q, s = quantize_int8(w)
            sb = s.to(torch.bfloat16)
            packed = lambda: torch._weight_int8pack_mm(x, q, sb)  # noqa: E731
        else:
            q, sz = quantize_int4(w, 32)
            packed = lambda: torch._weight_int4pack_mm_for_cpu(x, q, 32, sz)  # noqa: E731
        xf = x.float()
        ref = lambda: F.linear(xf, w)  # noqa: E731
        t_packed, t_ref = _median_time(packed), _median_time(ref)
        _KERNEL_OK[fmt] = t_packed <= t_ref
        log.info("%s kernel on %s: packed %.3f ms, float32 reference %.3f ms -> %s", fmt,
                 torch.backends.cpu.get_cpu_capability(), t_packed * 1e3, t_ref * 1e3,
                 "packed" if _KERNEL_OK[fmt] else "reference")
    return _KERNEL_OK[fmt]


def _runs_int8pack(device: torch.device) -> bool:
    try:
        q = torch.ones(16, 32, dtype=torch.int8, device=device)
        s = torch.ones(16, dtype=torch.bfloat16, device=device)
        torch._weight_int8pack_mm(torch.ones(1, 32, dtype=torch.bfloat16, device=device), q, s)
    except (RuntimeError, NotImplementedError) as exc:
        log.info("int8 packed kernel unavailable on %s (%s): dequantized reference", device, exc)
        return False
    return True


def _median_time(fn, n: int = 7) -> float:
    fn()
    times = []
    for _ in range(n):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return sorted(times)[n // 2]
