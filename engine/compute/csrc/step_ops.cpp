// A decode step's small ops as one MLX primitive each on the CPU stream.
//
// On MLX's CPU backend mx.fast.rms_norm, mx.fast.rope and
// mx.fast.scaled_dot_product_attention have no kernel: each is built from
// its composed fallback, 15, 31 and 18 graph nodes. A decode step of the
// default model had 3,380 nodes, and each node costs microseconds of graph
// walking, allocation and thread hand-off whatever its size (issue 22). Here
// each is one node, computed in one pass. MLX's log-sum-exp is one node but
// scalar (0.9 ms over the default model's 49k vocabulary, each step); this
// one is vectorized:
//
//   rms_norm(x, [w], eps)                    x * rsqrt(mean(x^2) + eps) * w
//       w may be left out ([]): no weight
//   rope(x, offset, freqs, dims, traditional, base, scale)
//       x (B, N, T, D) or (B, T, D), any strides; offset int32, one or B
//       values; freqs empty or dims / 2 values (then base is unused)
//   sdpa(q, k, v, mask, mask_mode, scale)
//       softmax(scale * q k^T + mask) v for few query rows, grouped heads;
//       mask_mode 0 none, 1 causal, 2 bool array, 3 additive float32 array
//   logsumexp(x, keepdims)                   over the last axis
//   swiglu(gate, x)                          silu(gate) * x (MLX's compiled
//       kernel for it calls a scalar exp per element)
//
// The arithmetic follows MLX's fallbacks step by step (the same products in
// the same order where it matters), so results agree to float32 rounding.
#include "step_ops.h"

#include <nanobind/nanobind.h>
#include <nanobind/stl/vector.h>

#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <stdexcept>
#include <vector>

#include "mlx/allocator.h"
#include "mlx/array.h"
#include "mlx/backend/cpu/encoder.h"
#include "mlx/ops.h"
#include "mlx/primitives.h"

namespace nb = nanobind;
namespace mx = mlx::core;
using namespace nb::literals;

namespace {

mx::Stream cpu_stream() { return mx::default_stream(mx::Device(mx::Device::cpu)); }

void check(bool ok, const char* what) {
  if (!ok) throw std::invalid_argument(std::string("flashserve step op: ") + what);
}

// Element strides of `a` right-aligned to `nd` dimensions; a dimension of
// size one (or one `a` lacks) gets stride 0, so broadcasting is free.
std::vector<int64_t> strides_as(const mx::array& a, int nd) {
  std::vector<int64_t> out(nd, 0);
  const int off = nd - int(a.ndim());
  for (int d = 0; d < int(a.ndim()); ++d) {
    out[off + d] = a.shape(d) == 1 ? 0 : a.strides()[d];
  }
  return out;
}

// A row of n floats `stride` apart, contiguous: the row itself, or a copy.
const float* row(const float* p, int64_t stride, int n, std::vector<float>& tmp) {
  if (stride == 1) return p;
  tmp.resize(n);
  for (int i = 0; i < n; ++i) tmp[i] = p[i * stride];
  return tmp.data();
}

// Element offset of row r (an index over every dimension but the last) of a.
int64_t row_offset(const mx::array& a, int64_t r) {
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

std::vector<mx::array> weak(const std::vector<mx::array>& arrays) {
  std::vector<mx::array> out;
  for (const auto& a : arrays) out.push_back(mx::array::unsafe_weak_copy(a));
  return out;
}

// ---------------------------------------------------------------- RMSNorm

void rms_norm_compute(const mx::array& x, const mx::array* w, mx::array& out, float eps) {
  const int D = x.shape(-1);
  const int64_t rows = x.size() / D;
  const int nd = x.ndim();
  const float* xp = x.data<float>();
  std::vector<float> xt, wt;
  const float* wr = w ? row(w->data<float>(), w->strides()[0], D, wt) : nullptr;
  float* op = out.data<float>();
  for (int64_t r = 0; r < rows; ++r) {
    const float* xr = row(xp + row_offset(x, r), x.strides()[nd - 1], D, xt);
    float sum = 0.0f;
    for (int i = 0; i < D; ++i) sum += xr[i] * xr[i];
    const float n = 1.0f / std::sqrt(sum / float(D) + eps);
    float* o = op + r * D;
    if (wr) {
      for (int i = 0; i < D; ++i) o[i] = (xr[i] * n) * wr[i];
    } else {
      for (int i = 0; i < D; ++i) o[i] = xr[i] * n;
    }
  }
}

class FlashserveRMSNorm : public mx::UnaryPrimitive {
 public:
  FlashserveRMSNorm(mx::Stream s, float eps) : mx::UnaryPrimitive(s), eps_(eps) {}

  void eval_cpu(const std::vector<mx::array>& inputs, mx::array& out) override {
    out.set_data(mx::allocator::malloc(out.nbytes()));
    dispatch(stream(), inputs, out,
             [in = weak(inputs), out = mx::array::unsafe_weak_copy(out), eps = eps_]() mutable {
               rms_norm_compute(in[0], in.size() > 1 ? &in[1] : nullptr, out, eps);
             });
  }
  void eval_gpu(const std::vector<mx::array>&, mx::array&) override {
    throw std::runtime_error("flashserve step ops run on the CPU stream only");
  }
  const char* name() const override { return "FlashserveRMSNorm"; }
  bool is_equivalent(const mx::Primitive& other) const override {
    return eps_ == static_cast<const FlashserveRMSNorm&>(other).eps_;
  }

 private:
  float eps_;
};

mx::array rms_norm(const mx::array& x, const std::vector<mx::array>& w, float eps) {
  check(x.dtype() == mx::float32 && x.ndim() >= 1, "rms_norm takes float32");
  std::vector<mx::array> inputs{x};
  if (!w.empty()) {
    check(w[0].dtype() == mx::float32 && w[0].ndim() == 1 && w[0].shape(0) == x.shape(-1),
          "rms_norm's weight must be float32 and match x's last dimension");
    inputs.push_back(w[0]);
  }
  return mx::array(x.shape(), mx::float32,
                   std::make_shared<FlashserveRMSNorm>(cpu_stream(), eps), std::move(inputs));
}

// ------------------------------------------------------------------- RoPE

struct RopeParams {
  int dims;
  bool traditional;
  float base;
  float scale;
  bool has_freqs;
};

void rope_compute(const mx::array& x, const mx::array& offset, const mx::array* freqs,
                  mx::array& out, const RopeParams& p) {
  // x as (B, N, T, D): a 3-D x is (B, 1, T, D), as in MLX's fallback.
  const int nd = x.ndim();
  const int B = x.shape(0), T = x.shape(-2), D = x.shape(-1);
  const int N = nd == 4 ? x.shape(1) : 1;
  const int64_t sb = x.strides()[0], st = x.strides()[nd - 2], sd = x.strides()[nd - 1];
  const int64_t sn = nd == 4 ? x.strides()[1] : 0;
  const int half = p.dims / 2;
  const int32_t* offs = offset.data<int32_t>();
  const bool per_batch = offset.size() > 1;

  std::vector<float> inv_freq(half);
  if (p.has_freqs) {
    const float* f = freqs->data<float>();
    const int64_t fs = freqs->strides()[0];
    for (int i = 0; i < half; ++i) inv_freq[i] = 1.0f / f[i * fs];
  } else {
    const float step = std::log(p.base) / float(half);
    for (int i = 0; i < half; ++i) inv_freq[i] = std::exp(float(-i) * step);
  }
  std::vector<float> cs(half), sn_(half), tmp;
  const float* xp = x.data<float>();
  float* op = out.data<float>();
  for (int b = 0; b < B; ++b) {
    const float off = float(offs[per_batch ? b : 0]);
    for (int t = 0; t < T; ++t) {
      const float pos = (float(t) + off) * p.scale;
      for (int i = 0; i < half; ++i) {
        const float theta = pos * inv_freq[i];
        cs[i] = std::cos(theta);
        sn_[i] = std::sin(theta);
      }
      for (int n = 0; n < N; ++n) {
        const float* xr = row(xp + b * sb + n * sn + t * st, sd, D, tmp);
        float* o = op + ((int64_t(b) * N + n) * T + t) * D;
        if (p.traditional) {
          for (int i = 0; i < half; ++i) {
            const float x1 = xr[2 * i], x2 = xr[2 * i + 1];
            o[2 * i] = x1 * cs[i] - x2 * sn_[i];
            o[2 * i + 1] = x1 * sn_[i] + x2 * cs[i];
          }
        } else {
          for (int i = 0; i < half; ++i) {
            const float x1 = xr[i], x2 = xr[i + half];
            o[i] = x1 * cs[i] - x2 * sn_[i];
            o[i + half] = x1 * sn_[i] + x2 * cs[i];
          }
        }
        for (int i = p.dims; i < D; ++i) o[i] = xr[i];
      }
    }
  }
}

class FlashserveRoPE : public mx::UnaryPrimitive {
 public:
  FlashserveRoPE(mx::Stream s, RopeParams p) : mx::UnaryPrimitive(s), p_(p) {}

  void eval_cpu(const std::vector<mx::array>& inputs, mx::array& out) override {
    out.set_data(mx::allocator::malloc(out.nbytes()));
    dispatch(stream(), inputs, out,
             [in = weak(inputs), out = mx::array::unsafe_weak_copy(out), p = p_]() mutable {
               rope_compute(in[0], in[1], p.has_freqs ? &in[2] : nullptr, out, p);
             });
  }
  void eval_gpu(const std::vector<mx::array>&, mx::array&) override {
    throw std::runtime_error("flashserve step ops run on the CPU stream only");
  }
  const char* name() const override { return "FlashserveRoPE"; }
  bool is_equivalent(const mx::Primitive& other) const override {
    const auto& o = static_cast<const FlashserveRoPE&>(other).p_;
    return p_.dims == o.dims && p_.traditional == o.traditional && p_.base == o.base &&
           p_.scale == o.scale && p_.has_freqs == o.has_freqs;
  }

 private:
  RopeParams p_;
};

mx::array rope(const mx::array& x, const mx::array& offset, const std::vector<mx::array>& freqs,
               int dims, bool traditional, float base, float scale) {
  check(x.dtype() == mx::float32, "rope takes float32");
  check(x.ndim() == 3 || x.ndim() == 4, "rope takes 3 or 4 dimensions");
  check(dims > 0 && dims % 2 == 0 && dims <= x.shape(-1), "rope's dims must be even and fit");
  check(offset.dtype() == mx::int32 && offset.ndim() <= 1, "rope's offset must be int32");
  check(offset.size() == 1 || int64_t(offset.size()) == x.shape(0),
        "rope's offset must have one value or one per batch row");
  std::vector<mx::array> inputs{x, offset};
  const bool has_freqs = !freqs.empty();
  if (has_freqs) {
    check(freqs[0].dtype() == mx::float32 && freqs[0].ndim() == 1 &&
              freqs[0].shape(0) == dims / 2,
          "rope's freqs must be float32 with dims / 2 values");
    inputs.push_back(freqs[0]);
  }
  return mx::array(
      x.shape(), mx::float32,
      std::make_shared<FlashserveRoPE>(cpu_stream(),
                                       RopeParams{dims, traditional, base, scale, has_freqs}),
      std::move(inputs));
}

// ---------------------------------------------------------- attention (SDPA)

enum MaskMode : int { kNone = 0, kCausal = 1, kBool = 2, kAdditive = 3 };

// The fast path runs only where the CPU has AVX2 and FMA (qmm.py checks
// before anything here is used), so these may use them unconditionally.
__attribute__((target("avx2,fma"))) inline float dot(const float* a, const float* b, int n) {
  __m256 s0 = _mm256_setzero_ps(), s1 = _mm256_setzero_ps();
  int i = 0;
  for (; i + 16 <= n; i += 16) {
    s0 = _mm256_fmadd_ps(_mm256_loadu_ps(a + i), _mm256_loadu_ps(b + i), s0);
    s1 = _mm256_fmadd_ps(_mm256_loadu_ps(a + i + 8), _mm256_loadu_ps(b + i + 8), s1);
  }
  for (; i + 8 <= n; i += 8) {
    s0 = _mm256_fmadd_ps(_mm256_loadu_ps(a + i), _mm256_loadu_ps(b + i), s0);
  }
  const __m256 s = _mm256_add_ps(s0, s1);
  __m128 h = _mm_add_ps(_mm256_castps256_ps128(s), _mm256_extractf128_ps(s, 1));
  h = _mm_add_ps(h, _mm_movehl_ps(h, h));
  h = _mm_add_ss(h, _mm_movehdup_ps(h));
  float total = _mm_cvtss_f32(h);
  for (; i < n; ++i) total += a[i] * b[i];
  return total;
}

// acc += p * v
__attribute__((target("avx2,fma"))) inline void axpy(float* acc, float p, const float* v, int n) {
  const __m256 pv = _mm256_set1_ps(p);
  int i = 0;
  for (; i + 8 <= n; i += 8) {
    _mm256_storeu_ps(acc + i, _mm256_fmadd_ps(pv, _mm256_loadu_ps(v + i), _mm256_loadu_ps(acc + i)));
  }
  for (; i < n; ++i) acc[i] += p * v[i];
}

// One kv head's query rows (its `repeats` query heads times Lq) at once, so
// each key and value row is read once for all of them.
__attribute__((target("avx2,fma"))) void sdpa_compute(const mx::array& q, const mx::array& k,
                                                      const mx::array& v, const mx::array* mask,
                                                      int mode, float scale, mx::array& out) {
  const int B = q.shape(0), Hq = q.shape(1), Lq = q.shape(2), D = q.shape(3);
  const int Hk = k.shape(1), Lk = k.shape(2), Dv = v.shape(3);
  const int repeats = Hq / Hk;
  const int R = repeats * Lq;  // query rows per kv head
  const auto qs = q.strides(), ks = k.strides(), vs = v.strides();
  std::vector<int64_t> ms;
  if (mask) ms = strides_as(*mask, 4);
  const float* qp = q.data<float>();
  const float* kp = k.data<float>();
  const float* vp = v.data<float>();
  float* op = out.data<float>();
  const float lowest = std::numeric_limits<float>::lowest();
  std::vector<float> qrows(size_t(R) * D), scores(size_t(R) * Lk), tmp;
  for (int b = 0; b < B; ++b) {
    for (int hk = 0; hk < Hk; ++hk) {
      // Row r is query head hk * repeats + r / Lq, position r % Lq. MLX's
      // fallback scales q first, then multiplies by k^T.
      for (int r = 0; r < R; ++r) {
        const int h = hk * repeats + r / Lq, i = r % Lq;
        const float* qr = qp + b * qs[0] + h * qs[1] + i * qs[2];
        for (int d = 0; d < D; ++d) qrows[size_t(r) * D + d] = scale * qr[d * qs[3]];
      }
      for (int j = 0; j < Lk; ++j) {
        const float* kr = row(kp + b * ks[0] + hk * ks[1] + j * ks[2], ks[3], D, tmp);
        for (int r = 0; r < R; ++r) scores[size_t(r) * Lk + j] = dot(&qrows[size_t(r) * D], kr, D);
      }
      for (int r = 0; r < R; ++r) {
        const int h = hk * repeats + r / Lq, i = r % Lq;
        float* sr = &scores[size_t(r) * Lk];
        if (mode == kCausal) {
          for (int j = std::max(0, i + (Lk - Lq) + 1); j < Lk; ++j) sr[j] = lowest;
        } else if (mode == kBool) {
          const bool* m = mask->data<bool>() + b * ms[0] + h * ms[1] + i * ms[2];
          for (int j = 0; j < Lk; ++j) {
            if (!m[j * ms[3]]) sr[j] = lowest;
          }
        } else if (mode == kAdditive) {
          const float* m = mask->data<float>() + b * ms[0] + h * ms[1] + i * ms[2];
          for (int j = 0; j < Lk; ++j) sr[j] += m[j * ms[3]];
        }
        float top = -std::numeric_limits<float>::infinity();
        for (int j = 0; j < Lk; ++j) top = std::max(top, sr[j]);
        float total = 0.0f;
        for (int j = 0; j < Lk; ++j) {
          sr[j] = std::exp(sr[j] - top);
          total += sr[j];
        }
        const float inv = 1.0f / total;
        for (int j = 0; j < Lk; ++j) sr[j] *= inv;
        float* o = op + ((int64_t(b) * Hq + h) * Lq + i) * Dv;
        std::fill(o, o + Dv, 0.0f);
      }
      for (int j = 0; j < Lk; ++j) {
        const float* vr = row(vp + b * vs[0] + hk * vs[1] + j * vs[2], vs[3], Dv, tmp);
        for (int r = 0; r < R; ++r) {
          const int h = hk * repeats + r / Lq, i = r % Lq;
          float* o = op + ((int64_t(b) * Hq + h) * Lq + i) * Dv;
          axpy(o, scores[size_t(r) * Lk + j], vr, Dv);
        }
      }
    }
  }
}

class FlashserveSDPA : public mx::UnaryPrimitive {
 public:
  FlashserveSDPA(mx::Stream s, int mode, float scale)
      : mx::UnaryPrimitive(s), mode_(mode), scale_(scale) {}

  void eval_cpu(const std::vector<mx::array>& inputs, mx::array& out) override {
    out.set_data(mx::allocator::malloc(out.nbytes()));
    dispatch(stream(), inputs, out,
             [in = weak(inputs), out = mx::array::unsafe_weak_copy(out), mode = mode_,
              scale = scale_]() mutable {
               sdpa_compute(in[0], in[1], in[2], in.size() > 3 ? &in[3] : nullptr, mode, scale,
                            out);
             });
  }
  void eval_gpu(const std::vector<mx::array>&, mx::array&) override {
    throw std::runtime_error("flashserve step ops run on the CPU stream only");
  }
  const char* name() const override { return "FlashserveSDPA"; }
  bool is_equivalent(const mx::Primitive& other) const override {
    const auto& o = static_cast<const FlashserveSDPA&>(other);
    return mode_ == o.mode_ && scale_ == o.scale_;
  }

 private:
  int mode_;
  float scale_;
};

mx::array sdpa(const mx::array& q, const mx::array& k, const mx::array& v,
               const std::vector<mx::array>& mask, int mode, float scale) {
  for (const auto* a : {&q, &k, &v}) {
    check(a->dtype() == mx::float32 && a->ndim() == 4, "sdpa takes 4-D float32 q, k, v");
  }
  check(k.shape(0) == q.shape(0) && v.shape(0) == q.shape(0), "sdpa: batch sizes differ");
  check(k.shape(3) == q.shape(3), "sdpa: q and k differ in head size");
  check(k.shape(1) == v.shape(1) && k.shape(2) == v.shape(2), "sdpa: k and v differ");
  check(q.shape(1) % k.shape(1) == 0, "sdpa: query heads must be a multiple of kv heads");
  check(mode >= kNone && mode <= kAdditive, "sdpa: unknown mask mode");
  std::vector<mx::array> inputs{q, k, v};
  if (mode == kBool || mode == kAdditive) {
    check(mask.size() == 1, "sdpa: this mask mode needs a mask");
    const auto& m = mask[0];
    check(m.dtype() == (mode == kBool ? mx::bool_ : mx::float32), "sdpa: mask dtype");
    check(m.ndim() <= 4, "sdpa: mask has more than 4 dimensions");
    const int want[4] = {q.shape(0), q.shape(1), q.shape(2), k.shape(2)};
    for (int d = 0; d < int(m.ndim()); ++d) {
      const int size = m.shape(d), w = want[4 - int(m.ndim()) + d];
      check(size == 1 || size == w, "sdpa: mask does not broadcast to the scores");
    }
    inputs.push_back(m);
  }
  return mx::array({q.shape(0), q.shape(1), q.shape(2), v.shape(3)}, mx::float32,
                   std::make_shared<FlashserveSDPA>(cpu_stream(), mode, scale),
                   std::move(inputs));
}

// ------------------------------------------------------------ log-sum-exp

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

__attribute__((target("avx2,fma"))) void logsumexp_compute(const mx::array& x, mx::array& out) {
  const int D = x.shape(-1);
  const int64_t rows = D > 0 ? x.size() / D : 0;
  const int nd = x.ndim();
  const float* xp = x.data<float>();
  float* op = out.data<float>();
  std::vector<float> tmp;
  const float inf = std::numeric_limits<float>::infinity();
  for (int64_t r = 0; r < rows; ++r) {
    const float* xr = row(xp + row_offset(x, r), x.strides()[nd - 1], D, tmp);
    float top = -inf;
    bool nan = false;
    for (int i = 0; i < D; ++i) {
      nan |= std::isnan(xr[i]);
      top = std::max(top, xr[i]);
    }
    if (nan || std::isinf(top)) {  // NaN in, NaN out; all -inf: -inf; any +inf: +inf
      op[r] = nan ? std::numeric_limits<float>::quiet_NaN() : top;
      continue;
    }
    const __m256 m = _mm256_set1_ps(top);
    __m256 acc = _mm256_setzero_ps();
    int i = 0;
    for (; i + 8 <= D; i += 8) acc = _mm256_add_ps(acc, exp8(_mm256_sub_ps(_mm256_loadu_ps(xr + i), m)));
    alignas(32) float lanes[8];
    _mm256_store_ps(lanes, acc);
    double total = 0.0;
    for (float lane : lanes) total += lane;
    for (; i < D; ++i) total += std::exp(xr[i] - top);
    op[r] = top + float(std::log(total));
  }
}

class FlashserveLogSumExp : public mx::UnaryPrimitive {
 public:
  explicit FlashserveLogSumExp(mx::Stream s) : mx::UnaryPrimitive(s) {}

  void eval_cpu(const std::vector<mx::array>& inputs, mx::array& out) override {
    out.set_data(mx::allocator::malloc(out.nbytes()));
    dispatch(stream(), inputs, out,
             [in = weak(inputs), out = mx::array::unsafe_weak_copy(out)]() mutable {
               logsumexp_compute(in[0], out);
             });
  }
  void eval_gpu(const std::vector<mx::array>&, mx::array&) override {
    throw std::runtime_error("flashserve step ops run on the CPU stream only");
  }
  const char* name() const override { return "FlashserveLogSumExp"; }
  bool is_equivalent(const mx::Primitive&) const override { return true; }
};

mx::array logsumexp(const mx::array& x, bool keepdims) {
  check(x.dtype() == mx::float32 && x.ndim() >= 1, "logsumexp takes float32");
  auto shape = x.shape();
  if (keepdims) {
    shape.back() = 1;
  } else {
    shape.pop_back();
  }
  return mx::array(std::move(shape), mx::float32,
                   std::make_shared<FlashserveLogSumExp>(cpu_stream()), {x});
}

// ------------------------------------------------------------- SwiGLU

// silu(gate) * x = gate * sigmoid(gate) * x, as MLX computes it:
// sigmoid(g) = 1 / (1 + e^-g).
__attribute__((target("avx2,fma"))) void swiglu_row(const float* g, const float* x, float* o,
                                                     int n) {
  const __m256 one = _mm256_set1_ps(1.0f);
  const __m256 zero = _mm256_setzero_ps();
  int i = 0;
  for (; i + 8 <= n; i += 8) {
    const __m256 gv = _mm256_loadu_ps(g + i);
    const __m256 sig = _mm256_div_ps(one, _mm256_add_ps(one, exp8(_mm256_sub_ps(zero, gv))));
    _mm256_storeu_ps(o + i, _mm256_mul_ps(_mm256_mul_ps(gv, sig), _mm256_loadu_ps(x + i)));
  }
  for (; i < n; ++i) o[i] = (g[i] * (1.0f / (1.0f + std::exp(-g[i])))) * x[i];
}

void swiglu_compute(const mx::array& g, const mx::array& x, mx::array& out) {
  const int D = g.shape(-1);
  const int64_t rows = D > 0 ? g.size() / D : 0;
  const int nd = g.ndim();
  std::vector<float> gt, xt;
  for (int64_t r = 0; r < rows; ++r) {
    const int64_t go = row_offset(g, r), xo = row_offset(x, r);
    const float* gr = row(g.data<float>() + go, g.strides()[nd - 1], D, gt);
    const float* xr = row(x.data<float>() + xo, x.strides()[nd - 1], D, xt);
    swiglu_row(gr, xr, out.data<float>() + r * D, D);
  }
}

class FlashserveSwiGLU : public mx::UnaryPrimitive {
 public:
  explicit FlashserveSwiGLU(mx::Stream s) : mx::UnaryPrimitive(s) {}

  void eval_cpu(const std::vector<mx::array>& inputs, mx::array& out) override {
    out.set_data(mx::allocator::malloc(out.nbytes()));
    dispatch(stream(), inputs, out,
             [in = weak(inputs), out = mx::array::unsafe_weak_copy(out)]() mutable {
               swiglu_compute(in[0], in[1], out);
             });
  }
  void eval_gpu(const std::vector<mx::array>&, mx::array&) override {
    throw std::runtime_error("flashserve step ops run on the CPU stream only");
  }
  const char* name() const override { return "FlashserveSwiGLU"; }
  bool is_equivalent(const mx::Primitive&) const override { return true; }
};

mx::array swiglu(const mx::array& gate, const mx::array& x) {
  check(gate.dtype() == mx::float32 && x.dtype() == mx::float32, "swiglu takes float32");
  check(gate.shape() == x.shape() && gate.ndim() >= 1, "swiglu's gate and x differ in shape");
  return mx::array(gate.shape(), mx::float32, std::make_shared<FlashserveSwiGLU>(cpu_stream()),
                   {gate, x});
}

}  // namespace

void add_step_ops(nb::module_& m) {
  m.def("rms_norm", &rms_norm, "x"_a, "weight"_a, "eps"_a,
        "x * rsqrt(mean(x^2, -1) + eps) * weight as one op (float32); weight: [] or [w]");
  m.def("rope", &rope, "x"_a, "offset"_a, "freqs"_a, "dims"_a, "traditional"_a, "base"_a,
        "scale"_a, "rotary position encoding as one op; freqs: [] or [freqs]");
  m.def("sdpa", &sdpa, "q"_a, "k"_a, "v"_a, "mask"_a, "mask_mode"_a, "scale"_a,
        "softmax(scale * q k^T + mask) v as one op; mask: [] or [mask]");
  m.def("logsumexp", &logsumexp, "x"_a, "keepdims"_a,
        "log(sum(exp(x))) over the last axis, vectorized (float32)");
  m.def("swiglu", &swiglu, "gate"_a, "x"_a, "silu(gate) * x as one vectorized op (float32)");
}
