// torch operators for the activations of impl_act.h (the Llama relatives), registered as a
// fragment of the `exactspec` library of ops.cpp; threads split over rows, never over a
// reduction, so a result does not depend on the thread count.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include "isa.h"
#include "ops.h"

namespace exactspec {
namespace {

constexpr int64_t kParallelWork = 1 << 16;  // as ops.cpp: enough work to wake a second thread

}  // namespace

at::Tensor gelu_tanh_mul(const at::Tensor& g_) {
  TORCH_CHECK(g_.device().is_cpu() && g_.scalar_type() == at::kFloat && g_.dim() == 2,
              "gate_up must be a float32 CPU [M, 2I] tensor, got ", g_.scalar_type(), " ",
              g_.sizes(), " on ", g_.device());
  const at::Tensor g = g_.contiguous();
  TORCH_CHECK(g.size(1) % 2 == 0, "gate_up must have an even number of columns");
  const int64_t M = g.size(0), I = g.size(1) / 2;
  at::Tensor y = at::empty({M, I}, g.options());
  const Isa& k = current_unit();
  auto run = [&](int64_t b, int64_t e) {
    k.gelu_tanh_mul(g.data_ptr<float>(), I, y.data_ptr<float>(), b, e);
  };
  if (M > 1 && M * 16 * I >= kParallelWork) at::parallel_for(0, M, 1, run);
  else run(0, M);
  return y;
}

TORCH_LIBRARY_FRAGMENT(exactspec, m) {
  m.def("gelu_tanh_mul(Tensor gate_up) -> Tensor");
}

TORCH_LIBRARY_IMPL(exactspec, CPU, m) {
  m.impl("gelu_tanh_mul", gelu_tanh_mul);
}

}  // namespace exactspec
