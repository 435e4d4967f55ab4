// The avx512vnni unit: the avx512 unit (isa_avx512.cpp) with AVX-512 VNNI for the int8 x int16
// product (vpdpwssd, impl_w8a16.h): exact integer sums, so the same bits as every other unit.
// Everything lives in namespace exactspec::avx512vnni (see build.py for its compiler flags).
#include <immintrin.h>
#include <cstdint>
#include <cstring>

#include "isa.h"

namespace exactspec {
namespace avx512vnni {
#define ES_NAME "avx512vnni"
#define ES_VNNI 1
#include "vec_avx512.h"
#include "impl.h"
#include "impl_act.h"
}  // namespace avx512vnni
}  // namespace exactspec
