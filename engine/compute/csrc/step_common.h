// What the step ops' source files share: argument checks, row access over
// any strides, handing work to MLX's CPU stream, and a vectorized e^x.
#pragma once

#include <immintrin.h>

#include <cmath>
#include <cstdint>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

#include "mlx/array.h"
#include "mlx/backend/cpu/encoder.h"
#include "mlx/ops.h"

namespace flashserve_step {

namespace mx = mlx::core;

// How an attention op's mask is given (step_ops.py passes these numbers).
enum MaskMode : int { kNone = 0, kCausal = 1, kBool = 2, kAdditive = 3 };

inline mx::Stream cpu_stream() { return mx::default_stream(mx::Device(mx::Device::cpu)); }

inline void check(bool ok, const char* what) {
  if (!ok) throw std::invalid_argument(std::string("flashserve step op: ") + what);
}

// Element strides of `a` right-aligned to `nd` dimensions; a dimension of
// size one (or one `a` lacks) gets stride 0, so broadcasting is free.
inline std::vector<int64_t> strides_as(const mx::array& a, int nd) {
  std::vector<int64_t> out(nd, 0);
  const int off = nd - int(a.ndim());
  for (int d = 0; d < int(a.ndim()); ++d) {
    out[off + d] = a.shape(d) == 1 ? 0 : a.strides()[d];
  }
  return out;
}

// A row of n floats `stride` apart, contiguous: the row itself, or a copy.
inline const float* row(const float* p, int64_t stride, int n, std::vector<float>& tmp) {
  if (stride == 1) return p;
  tmp.resize(n);
  for (int i = 0; i < n; ++i) tmp[i] = p[i * stride];
  return tmp.data();
}

// Element offset of row r (an index over every dimension but the last) of a.
inline int64_t row_offset(const mx::array& a, int64_t r) {
  int64_t offset = 0;
  for (int d = int(a.ndim()) - 2; d >= 0; --d) {
    offset += (r % a.shape(d)) * a.strides()[d];
    r /= a.shape(d);
  }
  return offset;
}

// Hands `fn` (which owns weak copies of the arrays) to the stream's encoder,
// as every CPU primitive in MLX does. `out` has its buffer already: the weak
// copies are taken before this is called.
template <class F>
void dispatch(mx::Stream s, const std::vector<mx::array>& inputs, mx::array& out, F&& fn) {
  auto& encoder = mx::cpu::get_command_encoder(s);
  for (const auto& a : inputs) encoder.set_input_array(a);
  encoder.set_output_array(out);
  encoder.dispatch(std::forward<F>(fn));
}

inline std::vector<mx::array> weak(const std::vector<mx::array>& arrays) {
  std::vector<mx::array> out;
  for (const auto& a : arrays) out.push_back(mx::array::unsafe_weak_copy(a));
  return out;
}

// e^x for a vector, to about 2 ulp: x = n ln2 + r with |r| <= ln2 / 2 (ln2 in
// two parts, so r is exact), e^r by its degree-7 Taylor polynomial, 2^n into
// the exponent. Below -87 it gives 0 and above 88.7 infinity, as float32's
// underflow and overflow do.
__attribute__((target("avx2,fma"))) inline __m256 exp8(__m256 x) {
  const __m256 lo = _mm256_set1_ps(-87.0f);
  const __m256 hi = _mm256_set1_ps(88.72f);
  const __m256 too_small = _mm256_cmp_ps(x, lo, _CMP_LT_OQ);
  const __m256 too_large = _mm256_cmp_ps(x, hi, _CMP_GT_OQ);
  x = _mm256_min_ps(_mm256_max_ps(x, lo), hi);
  const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                                   _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);
  r = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), r);
  __m256 p = _mm256_set1_ps(1.0f / 5040.0f);
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f / 720.0f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f / 120.0f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f / 24.0f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f / 6.0f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(0.5f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f));
  // n <= 128 here: 2^n as two factors keeps the exponent field in range.
  const __m256i half = _mm256_srai_epi32(_mm256_cvtps_epi32(n), 1);
  const __m256i rest = _mm256_sub_epi32(_mm256_cvtps_epi32(n), half);
  const __m256 a = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(half, _mm256_set1_epi32(127)), 23));
  const __m256 b = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(rest, _mm256_set1_epi32(127)), 23));
  const __m256 y = _mm256_mul_ps(_mm256_mul_ps(p, a), b);
  return _mm256_blendv_ps(_mm256_andnot_ps(too_small, y), _mm256_set1_ps(INFINITY), too_large);
}

}  // namespace flashserve_step
