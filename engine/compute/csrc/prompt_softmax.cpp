// Attention's softmax for prompt chunks (more query rows than step_sdpa.cpp
// takes) as one MLX primitive on the CPU stream, vectorized and spread over
// the kernel's threads.
//
// A prompt chunk's attention is q k^T and p v (BLAS matmuls, fast) around a
// softmax. MLX's CPU softmax calls a scalar exp per score: for 200 new
// tokens over a 4,200-token context it took 92 of the 125 ms each layer's
// attention cost, so prefill on top of a long cached prefix ran at a few
// times what its arithmetic says (issue 42). Here the mask is applied and
// the softmax computed in one pass per row, with exp8 (step_common.h).
//
// A row's result depends only on its scores and which keys it may see, not
// on how many keys the chunk has: the sum runs over 8-wide lanes fixed by
// the key's position (keys past the end count as hidden, adding zeros), so
// a prompt prefilled in other chunks (cold, or on top of a cached prefix)
// gets the same weights.
#include <nanobind/nanobind.h>
#include <nanobind/stl/vector.h>

#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <memory>
#include <vector>

#include "mlx/allocator.h"
#include "mlx/array.h"
#include "mlx/primitives.h"
#include "qmm_kernels.h"
#include "step_common.h"
#include "step_ops.h"

namespace nb = nanobind;
namespace mx = mlx::core;
using namespace nb::literals;
using namespace flashserve_step;

namespace {

constexpr int ROWS_PER_PART = 16;  // rows handed to a thread at a time

// One row: t holds the scores with hidden keys at -inf, padded with -inf to
// a multiple of 8; the weights go to o (K of them).
__attribute__((target("avx2,fma"))) void softmax_row(float* t, int K, int padded, float* o,
                                                      bool nan_if_hidden) {
  const float inf = std::numeric_limits<float>::infinity();
  __m256 top8 = _mm256_set1_ps(-inf);
  for (int i = 0; i < padded; i += 8) top8 = _mm256_max_ps(top8, _mm256_loadu_ps(t + i));
  alignas(32) float lanes[8];
  _mm256_store_ps(lanes, top8);
  float top = -inf;
  for (float lane : lanes) top = std::max(top, lane);
  if (top == -inf) {
    // Every key hidden: a bool mask in MLX's fallback leaves the lowest
    // float there, so the weights come out uniform; an additive -inf, NaN.
    const float w = nan_if_hidden ? std::numeric_limits<float>::quiet_NaN() : 1.0f / float(K);
    std::fill(o, o + K, w);
    return;
  }
  const __m256 m = _mm256_set1_ps(top);
  __m256 acc = _mm256_setzero_ps();
  for (int i = 0; i < padded; i += 8) {
    const __m256 e = exp8(_mm256_sub_ps(_mm256_loadu_ps(t + i), m));
    _mm256_storeu_ps(t + i, e);
    acc = _mm256_add_ps(acc, e);
  }
  _mm256_store_ps(lanes, acc);
  double total = 0.0;
  for (float lane : lanes) total += lane;
  const __m256 inv = _mm256_set1_ps(float(1.0 / total));
  int i = 0;
  for (; i + 8 <= K; i += 8) _mm256_storeu_ps(o + i, _mm256_mul_ps(_mm256_loadu_ps(t + i), inv));
  for (; i < K; ++i) o[i] = t[i] * float(1.0 / total);
}

// scores (B, Hk, R, L, K): R query heads per kv head, L query rows per head.
void softmax_compute(const mx::array& s, const mx::array* mask, int mode, mx::array& out) {
  const int nd = s.ndim();
  const int L = s.shape(nd - 2), K = s.shape(nd - 1);
  const int64_t rows = K > 0 ? s.size() / K : 0;
  const int padded = (K + 7) / 8 * 8;
  const float inf = std::numeric_limits<float>::infinity();
  const float* sp = s.data<float>();
  float* op = out.data<float>();
  std::vector<int64_t> ms;
  if (mask != nullptr) ms = strides_as(*mask, nd);
  const auto run = [&](int part) {
    std::vector<float> t(padded), tmp;
    const int64_t end = std::min(rows, int64_t(part + 1) * ROWS_PER_PART);
    for (int64_t r = int64_t(part) * ROWS_PER_PART; r < end; ++r) {
      const float* sr = row(sp + row_offset(s, r), s.strides()[nd - 1], K, tmp);
      int visible = K;  // keys [0, visible) may be seen (causal: K - L + the row's index)
      if (mode == kCausal) visible = std::clamp(K - L + int(r % L) + 1, 0, K);
      std::copy(sr, sr + visible, t.begin());
      std::fill(t.begin() + visible, t.end(), -inf);
      if (mask != nullptr) {
        int64_t mo = 0, rest = r;  // the mask's offset for this row, over broadcast dims
        for (int d = nd - 2; d >= 0; --d) {
          mo += (rest % s.shape(d)) * ms[d];
          rest /= s.shape(d);
        }
        const int64_t step = ms[nd - 1];
        if (mode == kBool) {
          const bool* mp = mask->data<bool>() + mo;
          for (int j = 0; j < K; ++j) {
            if (!mp[j * step]) t[j] = -inf;
          }
        } else {
          const float* mp = mask->data<float>() + mo;
          for (int j = 0; j < K; ++j) t[j] += mp[j * step];
        }
      }
      softmax_row(t.data(), K, padded, op + r * K, mode == kAdditive);
    }
  };
  const int parts = int((rows + ROWS_PER_PART - 1) / ROWS_PER_PART);
  flashserve_qmm::parallel_for(parts, run);
}

class FlashservePromptSoftmax : public mx::UnaryPrimitive {
 public:
  FlashservePromptSoftmax(mx::Stream s, int mode) : mx::UnaryPrimitive(s), mode_(mode) {}

  void eval_cpu(const std::vector<mx::array>& inputs, mx::array& out) override {
    // The weights take the scores' buffer where nothing else holds it (as MLX's
    // own softmax does): each row is copied out before its weights are written.
    // A prompt chunk's scores are heads x rows x keys floats (20 MB a chunk in
    // the cap bench), else a fresh block faulted in page by page.
    const mx::array& scores = inputs[0];
    if (scores.is_donatable() && scores.flags().row_contiguous) {
      out.copy_shared_buffer(scores);
    } else {
      out.set_data(mx::allocator::malloc(out.nbytes()));
    }
    dispatch(stream(), inputs, out,
             [in = weak(inputs), out = mx::array::unsafe_weak_copy(out), mode = mode_]() mutable {
               softmax_compute(in[0], in.size() > 1 ? &in[1] : nullptr, mode, out);
             });
  }
  void eval_gpu(const std::vector<mx::array>&, mx::array&) override {
    throw std::runtime_error("flashserve step ops run on the CPU stream only");
  }
  const char* name() const override { return "FlashservePromptSoftmax"; }
  bool is_equivalent(const mx::Primitive& other) const override {
    return mode_ == static_cast<const FlashservePromptSoftmax&>(other).mode_;
  }

 private:
  int mode_;
};

mx::array masked_softmax(const mx::array& scores, const std::vector<mx::array>& mask, int mode) {
  check(scores.dtype() == mx::float32 && scores.ndim() >= 2, "masked_softmax takes float32");
  check(mode >= kNone && mode <= kAdditive, "masked_softmax: unknown mask mode");
  std::vector<mx::array> inputs{scores};
  if (mode == kBool || mode == kAdditive) {
    check(mask.size() == 1, "masked_softmax: this mask mode needs a mask");
    const auto& m = mask[0];
    check(m.dtype() == (mode == kBool ? mx::bool_ : mx::float32), "masked_softmax: mask dtype");
    check(m.ndim() <= scores.ndim(), "masked_softmax: mask has too many dimensions");
    const int off = int(scores.ndim() - m.ndim());
    for (int d = 0; d < int(m.ndim()); ++d) {
      check(m.shape(d) == 1 || m.shape(d) == scores.shape(off + d),
            "masked_softmax: mask does not broadcast to the scores");
    }
    inputs.push_back(m);
  }
  return mx::array(scores.shape(), mx::float32,
                   std::make_shared<FlashservePromptSoftmax>(cpu_stream(), mode),
                   std::move(inputs));
}

}  // namespace

void add_prompt_softmax(nb::module_& m) {
  m.def("masked_softmax", &masked_softmax, "scores"_a, "mask"_a, "mask_mode"_a,
        "softmax over the last axis of scores with a mask ([] or [mask]; causal: the "
        "last L keys against the L rows of axis -2), vectorized, on the kernel's threads");
}
