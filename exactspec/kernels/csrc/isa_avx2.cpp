// The avx2 unit: impl.h over vec_avx2.h (see build.py for its compiler flags). Everything,
// the 16-lane type included, lives in namespace exactspec::avx2, so no inline code is shared
// with the other units.
#include <immintrin.h>
#include <cstdint>
#include <cstring>

#include "isa.h"

namespace exactspec {
namespace avx2 {
#define ES_NAME "avx2"
#include "vec_avx2.h"
#include "impl.h"
#include "impl_act.h"
}  // namespace avx2
}  // namespace exactspec
