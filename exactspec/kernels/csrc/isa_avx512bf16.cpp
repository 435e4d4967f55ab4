// The avx512bf16 unit: the avx512vnni unit (isa_avx512vnni.cpp) whose bf16-weight products run
// on AVX512-BF16's VDPBF16PS at every width (impl_bf16dot.h): x rounded to bf16, so other bits
// than every FMA unit's for bf16 weights (float32 and int8 weights: the same code and bits as
// avx512vnni). The first choice where the CPU has AVX512-BF16 and no usable AMX (AMD Zen 4 and
// later, Intel Cooper Lake). Built only where the compiler takes -mavx512bf16 (build.py);
// `built` says so. Everything lives in namespace exactspec::avx512bf16.
#include <immintrin.h>
#include <cstdint>
#include <cstring>

#include "isa.h"

namespace exactspec {
namespace avx512bf16 {
#define ES_NAME "avx512bf16"
#define ES_VNNI 1
#if defined(__AVX512BF16__)
#define ES_BF16DOT 1
extern const bool built = true;
#else
extern const bool built = false;
#endif
#include "vec_avx512.h"
#ifdef ES_BF16DOT
#include "impl_bf16dot.h"
#endif
#include "impl.h"
#include "impl_act.h"
}  // namespace avx512bf16
}  // namespace exactspec
