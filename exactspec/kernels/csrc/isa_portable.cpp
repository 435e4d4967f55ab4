// The portable unit: impl.h over vec_portable.h (see build.py for its compiler flags). Everything,
// the 16-lane type included, lives in namespace exactspec::portable, so no inline code is shared
// with the other units.
#include <cstdint>
#include <cstring>

#include "isa.h"

namespace exactspec {
namespace portable {
#define ES_NAME "portable"
#include "vec_portable.h"
#include "impl.h"
#include "impl_act.h"
}  // namespace portable
}  // namespace exactspec
