// The avx512 unit: impl.h over vec_avx512.h (see build.py for its compiler flags). Everything,
// the 16-lane type included, lives in namespace exactspec::avx512, so no inline code is shared
// with the other units.
#include <immintrin.h>
#include <cstdint>
#include <cstring>

#include "isa.h"

namespace exactspec {
namespace avx512 {
#define ES_NAME "avx512"
#include "vec_avx512.h"
#include "impl.h"
#include "impl_act.h"
}  // namespace avx512
}  // namespace exactspec
