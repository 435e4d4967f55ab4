// The amx unit: the avx512vnni unit (isa_avx512vnni.cpp) whose bf16-weight products run on AMX
// tiles at every width (impl_amx.h): x rounded to bf16, so other bits than every FMA unit's for
// bf16 weights (float32 and int8 weights: the same code and bits as avx512vnni). Built only
// where the compiler takes -mamx-tile -mamx-bf16 -mavx512bf16 (build.py); `built` says so.
// Everything lives in namespace exactspec::amx.
#include <immintrin.h>
#include <cstdint>
#include <cstring>

#include "isa.h"

namespace exactspec {
namespace amx {
#define ES_NAME "amx"
#define ES_VNNI 1
#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AVX512BF16__)
#define ES_AMX 1
extern const bool built = true;
#else
extern const bool built = false;
#endif
#include "vec_avx512.h"
#ifdef ES_AMX
#include "impl_amx.h"
#endif
#include "impl.h"
#include "impl_act.h"
}  // namespace amx
}  // namespace exactspec
