// The tail of a draft step as one operator (`exactspec::draft_step`): after the decoder layers
// (`decoder_stack`), the final RMSNorm, the head product, q's standardization and the draw of
// the draft token, so a drafted token costs no Python between those calls
// (exactspec/kernels/draft_step.py, exactspec/drafters/draft_model.py).
//
// q must be exactly the distribution the token is drawn from, and the same bits as the Python
// path's (`exactspec.sampling.probs_from_logits` then `DraftContext.draw`). So every step whose
// bits depend on a reduction order is the very ATen operator the Python path calls, with the
// same arguments in the same order (the temperature's division, top-k's topk, softmax, top-p's
// topk / cumsum, min-p's max): the same kernel on the same input gives the same bits. What is
// written out here is arithmetic with one defined order: the finiteness check, the one-hot
// of the argmax (the first logit equal to the maximum), the renormalization's sequential float64 sum (torch's CPU cumsum accumulates
// float64 in index order) and its float32 division, and the inverse-CDF draw
// (streams.sample_from_weights: float64 cumulative sums in token order, the first token whose
// sum exceeds u times the total). tests/kernels/test_draft_step.py holds tokens
// and q to the Python path's, bit for bit.
#include <ATen/ATen.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <tuple>
#include <vector>

#include "ops.h"

namespace exactspec {
namespace {

// Refuse NaN / inf logits as probs_from_logits does (a ValueError naming the count): min and
// max are finite exactly when every value is (both propagate NaN), one vectorized pass; the
// counting pass runs only to word the error.
void check_finite(const at::Tensor& logits) {  // [B, V] float32 contiguous
  const auto minmax = at::aminmax(logits);
  if (std::isfinite(std::get<0>(minmax).item<float>()) &&
      std::isfinite(std::get<1>(minmax).item<float>()))
    return;
  const float* p = logits.data_ptr<float>();
  const int64_t n = logits.numel();
  int64_t bad = 0, nan = 0;
  for (int64_t i = 0; i < n; ++i) {
    bad += std::isfinite(p[i]) ? 0 : 1;
    nan += std::isnan(p[i]) ? 1 : 0;
  }
  TORCH_CHECK_VALUE(false, "logits contain ", nan ? "NaN" : "inf", " values (", bad, " of ", n,
                    "); the model output is broken, check its dtype and inputs");
}

// _top_p_threshold of exactspec/sampling/standardize.py: the probability of the last token
// top-p keeps, trying the `partial` largest first (the same operators, the same bits).
at::Tensor top_p_threshold(const at::Tensor& probs, double top_p) {  // [N, V] -> [N, 1]
  const int64_t vocab = probs.size(-1), partial = 256;
  for (int64_t width : {std::min(partial, vocab), vocab}) {
    const at::Tensor sorted_p = std::get<0>(at::topk(probs, width, -1));  // descending
    const at::Tensor before = sorted_p.cumsum(-1) - sorted_p;
    const at::Tensor keep_count = (before < top_p).sum(at::IntArrayRef{-1}, /*keepdim=*/true).clamp_min(1);
    if (width == vocab || (keep_count < width).all().item<bool>())
      return sorted_p.gather(-1, keep_count - 1);
  }
  TORCH_CHECK(false, "unreachable");
}

}  // namespace

// x [B, H] float32: the last decoder layer's output at each row's draft position; norm_w [H]
// and eps: the final RMSNorm; head / head_scales: the head Matrix's kernel_args (as `product`
// takes them). temperature 0: greedy (q one-hot at the first argmax, the token its index);
// else temperature, top_k (0 = off), top_p (1 = off), min_p (0 = off) as SamplingParams
// defines them, and u [B] float64: each row's uniform for this draft position; head_rows: a
// reduced head's token ids ([N] int64, the head's rows) in a vocabulary of vocab_size. Returns
// the tokens [B] int64 and q [B, V] float32.
std::tuple<at::Tensor, at::Tensor> draft_step(const at::Tensor& x, const at::Tensor& norm_w,
                                              double eps, at::TensorList head,
                                              const c10::optional<at::Tensor>& head_scales,
                                              double temperature, int64_t top_k, double top_p,
                                              double min_p, const c10::optional<at::Tensor>& u,
                                              const c10::optional<at::Tensor>& head_rows,
                                              int64_t vocab_size) {
  TORCH_CHECK(x.device().is_cpu() && x.scalar_type() == at::kFloat && x.dim() == 2,
              "draft_step: x must be a float32 CPU [B, H] tensor, got ", x.scalar_type(), " ",
              x.sizes());
  TORCH_CHECK(temperature >= 0 && top_k >= 0 && top_p > 0 && top_p <= 1 && min_p >= 0 &&
                  min_p <= 1,
              "draft_step: sampling settings out of range (temperature ", temperature,
              ", top_k ", top_k, ", top_p ", top_p, ", min_p ", min_p, ")");
  const c10::optional<at::Tensor> none;
  at::Tensor logits = product(rms_norm(x, norm_w, eps), head, head_scales, none)
                          .contiguous();  // [B, V], or [B, N] of a reduced head
  if (head_rows.has_value()) {  // a reduced head's N logits at their ids, OFF_HEAD elsewhere
    TORCH_CHECK(head_rows->scalar_type() == at::kLong && head_rows->dim() == 1 &&
                    head_rows->size(0) == logits.size(1) && vocab_size >= logits.size(1),
                "draft_step: head_rows must be the [", logits.size(1), "] int64 ids of the "
                "head's rows in a vocabulary of vocab_size, got ", head_rows->sizes(), " and ",
                vocab_size);
    // (models/lean.py full_logits: the same constant, the same copy)
    logits = at::full({logits.size(0), vocab_size}, -1e30, logits.options())
                 .index_copy_(1, *head_rows, logits);
  }
  const int64_t b = logits.size(0), vocab = logits.size(1);
  TORCH_CHECK(vocab > 0, "draft_step: the head has no outputs");
  check_finite(logits);
  at::Tensor tokens = at::empty({b}, logits.options().dtype(at::kLong));
  int64_t* tok = tokens.data_ptr<int64_t>();

  if (temperature == 0) {  // greedy: one-hot at the argmax, ties to the lowest id
    // torch's argmax (the first maximum) as the first logit equal to the row's amax: the
    // same index (the logits are finite), at a fraction of argmax's time on CPU
    const at::Tensor top = at::amax(logits, -1).contiguous();  // [B]
    const float* td = top.data_ptr<float>();
    const float* l = logits.data_ptr<float>();
    at::Tensor q = at::zeros_like(logits);
    float* qd = q.data_ptr<float>();
    for (int64_t r = 0; r < b; ++r) {
      const float* row = l + r * vocab;
      const int64_t best = std::find(row, row + vocab, td[r]) - row;
      TORCH_CHECK(best < vocab, "draft_step: no logit equals the row's maximum");
      qd[r * vocab + best] = 1.0f;
      tok[r] = best;
    }
    return {tokens, q};
  }

  // probs_from_logits' steps 5-9, the same operators in the same order
  TORCH_CHECK(u.has_value() && u->scalar_type() == at::kDouble && u->dim() == 1 &&
                  u->size(0) == b,
              "draft_step: sampling needs u, a float64 [", b, "] tensor of uniforms");
  at::Tensor z = logits;
  if (temperature != 1.0) z = z / temperature;
  if (0 < top_k && top_k < vocab) {
    const at::Tensor kth = std::get<0>(at::topk(z, top_k, -1)).slice(1, top_k - 1);  // [B, 1]
    z = z.masked_fill(z < kth, -std::numeric_limits<double>::infinity());
  }
  at::Tensor probs = at::softmax(z, -1);  // [B, V]
  if (top_p < 1.0) probs = probs.masked_fill(probs < top_p_threshold(probs, top_p), 0.0);
  if (min_p > 0.0) {
    const at::Tensor top = std::get<0>(probs.max(-1, true));
    probs = probs.masked_fill(probs < top * min_p, 0.0);
  }
  probs = probs.contiguous();
  at::Tensor q = at::empty_like(probs);
  const float* p = probs.data_ptr<float>();
  float* qd = q.data_ptr<float>();
  const at::Tensor uc = u->contiguous();
  const double* ud = uc.data_ptr<double>();
  std::vector<double> cdf(vocab);
  for (int64_t r = 0; r < b; ++r) {
    const float* pr = p + r * vocab;
    float* qr = qd + r * vocab;
    double s = 0;  // the renormalization: cumsum(-1)[-1] in float64, then float32
    for (int64_t i = 0; i < vocab; ++i) s += static_cast<double>(pr[i]);
    const float total = static_cast<float>(s);
    TORCH_CHECK_VALUE(total > 0, "the sampling filters left no token with positive probability");
    for (int64_t i = 0; i < vocab; ++i) qr[i] = pr[i] / total;
    // the draw (sample_from_weights): q's float64 cumulative sums in token order, the first
    // token whose sum exceeds u times the last (searchsorted, right=True), clamped
    double run = 0;
    for (int64_t i = 0; i < vocab; ++i) cdf[i] = run += static_cast<double>(qr[i]);
    const double target = ud[r] * cdf[vocab - 1];
    const int64_t pick = std::min<int64_t>(
        std::upper_bound(cdf.begin(), cdf.end(), target) - cdf.begin(), vocab - 1);
    tok[r] = pick;
  }
  return {tokens, q};
}

TORCH_LIBRARY_FRAGMENT(exactspec, m) {
  m.def(
      "draft_step(Tensor x, Tensor norm_w, float eps, Tensor[] head, Tensor? head_scales, "
      "float temperature, int top_k, float top_p, float min_p, Tensor? u, Tensor? head_rows=None, "
      "int vocab_size=0) -> (Tensor, Tensor)");
}

TORCH_LIBRARY_IMPL(exactspec, CPU, m) {
  m.impl("draft_step", draft_step);
}

}  // namespace exactspec
