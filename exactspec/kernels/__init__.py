"""Our own CPU operators, batch-invariant: every output element is reduced in one fixed order
that depends only on its own inputs, never on how many rows share the call or on the thread
count (see `csrc/isa.h`). Built for this machine's CPU (`python -m exactspec.kernels`,
run by `make run` / `make test`), registered with torch.library as `torch.ops.exactspec.*`.

`enabled()` says whether the lean forward runs on them (built, and not turned off with
`EXACTSPEC_KERNELS=0`); `EXACTSPEC_KERNEL_ISA=amx|avx512bf16|avx512vnni|avx512|avx2|portable`
forces an instruction set (`set_isa` does it at run time). avx512vnni, avx512, avx2 and portable
compute the same bits; amx (the first choice where the CPU has AMX tiles and the kernel lets a
process use them) runs bf16 weights on AMX tiles, avx512bf16 (the first choice where the CPU
has AVX512-BF16 and no usable AMX: AMD Zen 4 and later) on VDPBF16PS, both with x rounded to
bf16: other bits for bf16 weights (`rounds_bf16_inputs`; each unit its own), every unit's bits
for float32 and int8 weights.

ops.py      the Python side: the operators (linear, attention, ...) and the ISA switch
draft_step.py  a draft step's tail in one call: final norm, head, q, the draw (ops_draft.cpp)
build.py    compiling `csrc/` for this CPU (`__main__.py`: `python -m exactspec.kernels`)
csrc/       the C++: ops.cpp (registration, the threads' tasks), ops_layer.cpp (the decoder
            layers in one call; up to 64 rows in one parallel region), ops_quant.cpp (the int4
            draft's quantization), isa.h / impl.h (the fixed reduction order; the products),
            impl_attn.h (attention in query groups and runs of keys), impl_w8a16.h (int8),
            impl_w4.h (int4), impl_amx.h (bf16 weights on AMX tiles, the amx unit),
            impl_bf16dot.h (bf16 weights on VDPBF16PS, the avx512bf16 unit), impl_act.h,
            isa_*.cpp and vec_*.h per instruction set (amx, avx512bf16, avx512vnni, avx512,
            avx2, portable); threads.py chooses each forward's thread count
"""

from exactspec.kernels.ops import (
    BF16_INPUT_UNITS,
    UNITS,
    attention,
    available_isas,
    current_isa,
    decoder_stack,
    enabled,
    forced_isa_note,
    gelu_tanh_mul,
    int4_quantize,
    layer_stack,
    linear,
    linear_w4a8,
    linear_w8a16,
    pack_int4,
    pack_int8,
    rms_norm,
    rope_,
    rounds_bf16_inputs,
    set_isa,
    silu_mul,
    unpack_int4,
)

__all__ = ["BF16_INPUT_UNITS", "UNITS", "attention", "available_isas", "current_isa",
           "decoder_stack", "enabled", "forced_isa_note", "gelu_tanh_mul", "int4_quantize",
           "layer_stack", "linear", "linear_w4a8", "linear_w8a16", "pack_int4", "pack_int8",
           "rms_norm", "rope_", "rounds_bf16_inputs", "set_isa", "silu_mul", "unpack_int4"]
