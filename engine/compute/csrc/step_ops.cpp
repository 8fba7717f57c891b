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
#include "graph_folds.h"
#include "step_common.h"

namespace nb = nanobind;
namespace mx = mlx::core;
using namespace nb::literals;
using namespace flashserve_step;

namespace {

// ---------------------------------------------------------------- RMSNorm

// x . x in 16 lanes, then the lanes in a fixed order: one sum at a time
// (the order a plain loop must keep) is a chain of 576 dependent adds, ~2.6
// us a row and ~1% of a four-stream step, on the thread the pool waits on.
__attribute__((target("avx2,fma"))) float sum_of_squares(const float* x, int n) {
  __m256 a0 = _mm256_setzero_ps(), a1 = _mm256_setzero_ps();
  int i = 0;
  for (; i + 16 <= n; i += 16) {
    const __m256 v0 = _mm256_loadu_ps(x + i), v1 = _mm256_loadu_ps(x + i + 8);
    a0 = _mm256_fmadd_ps(v0, v0, a0);
    a1 = _mm256_fmadd_ps(v1, v1, a1);
  }
  alignas(32) float lanes[16];
  _mm256_store_ps(lanes, a0);
  _mm256_store_ps(lanes + 8, a1);
  float sum = 0.0f;
  for (float lane : lanes) sum += lane;
  for (; i < n; ++i) sum += x[i] * x[i];
  return sum;
}

void rms_norm_compute(const mx::array& x, const mx::array* w, float* op, float eps) {
  const int D = x.shape(-1);
  const int64_t rows = x.size() / D;
  const int nd = x.ndim();
  const float* xp = x.data<float>();
  std::vector<float> xt, wt;
  const float* wr = w ? row(w->data<float>(), w->strides()[0], D, wt) : nullptr;
  for (int64_t r = 0; r < rows; ++r) {
    const float* xr = row(xp + row_offset(x, r), x.strides()[nd - 1], D, xt);
    const float n = 1.0f / std::sqrt(sum_of_squares(xr, D) / float(D) + eps);
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
               rms_norm_compute(in[0], in.size() > 1 ? &in[1] : nullptr, out.data<float>(), eps);
             });
  }
  void eval_gpu(const std::vector<mx::array>&, mx::array&) override {
    throw std::runtime_error("flashserve step ops run on the CPU stream only");
  }
  const char* name() const override { return "FlashserveRMSNorm"; }
  bool is_equivalent(const mx::Primitive& other) const override {
    return eps_ == static_cast<const FlashserveRMSNorm&>(other).eps_;
  }
  float eps() const { return eps_; }

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
  flashserve_fold::HeadsLayout layout;  // how x relates to out (graph_folds.h)
};

void rope_compute(const mx::array& x, const mx::array& offset, const mx::array* freqs,
                  mx::array& out, const RopeParams& p) {
  // out as (B, N, T, D): a 3-D one is (B, 1, T, D), as in MLX's fallback.
  const int nd = out.ndim();
  const int B = out.shape(0), T = out.shape(-2), D = out.shape(-1);
  const int N = nd == 4 ? out.shape(1) : 1;
  const auto [sb, sn, st, sd] = flashserve_fold::head_strides(x, p.layout, D);
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
           p_.scale == o.scale && p_.has_freqs == o.has_freqs && p_.layout == o.layout;
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
  // Attention's q and k arrive split into heads by views: read what they view.
  auto [source, layout] = flashserve_fold::heads_source(x);
  std::vector<mx::array> inputs{source, offset};
  const bool has_freqs = !freqs.empty();
  if (has_freqs) {
    check(freqs[0].dtype() == mx::float32 && freqs[0].ndim() == 1 &&
              freqs[0].shape(0) == dims / 2,
          "rope's freqs must be float32 with dims / 2 values");
    inputs.push_back(freqs[0]);
  }
  return mx::array(x.shape(), mx::float32,
                   std::make_shared<FlashserveRoPE>(
                       cpu_stream(), RopeParams{dims, traditional, base, scale, has_freqs, layout}),
                   std::move(inputs));
}

// ------------------------------------------------------------ log-sum-exp

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

void swiglu_compute(const mx::array& g, const mx::array& x, float* op) {
  const int D = g.shape(-1);
  const int64_t rows = D > 0 ? g.size() / D : 0;
  const int nd = g.ndim();
  std::vector<float> gt, xt;
  for (int64_t r = 0; r < rows; ++r) {
    const int64_t go = row_offset(g, r), xo = row_offset(x, r);
    const float* gr = row(g.data<float>() + go, g.strides()[nd - 1], D, gt);
    const float* xr = row(x.data<float>() + xo, x.strides()[nd - 1], D, xt);
    swiglu_row(gr, xr, op + r * D, D);
  }
}

class FlashserveSwiGLU : public mx::UnaryPrimitive {
 public:
  explicit FlashserveSwiGLU(mx::Stream s) : mx::UnaryPrimitive(s) {}

  void eval_cpu(const std::vector<mx::array>& inputs, mx::array& out) override {
    out.set_data(mx::allocator::malloc(out.nbytes()));
    dispatch(stream(), inputs, out,
             [in = weak(inputs), out = mx::array::unsafe_weak_copy(out)]() mutable {
               swiglu_compute(in[0], in[1], out.data<float>());
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

namespace flashserve_step {

Prologue prologue_of(const mx::array& x) {
  if (!x.has_primitive()) return {};
  if (const auto* norm = dynamic_cast<const FlashserveRMSNorm*>(&x.primitive())) {
    return {PrologueKind::rms_norm, x.inputs(), norm->eps()};
  }
  if (dynamic_cast<const FlashserveSwiGLU*>(&x.primitive()) != nullptr) {
    return {PrologueKind::swiglu, x.inputs(), 0.0f};
  }
  return {};
}

void swiglu_rows(const float* gate, const float* x, float* out, int64_t rows, int cols) {
  for (int64_t r = 0; r < rows; ++r) swiglu_row(gate + r * cols, x + r * cols, out + r * cols, cols);
}

void run_prologue(PrologueKind kind, float eps, const std::vector<mx::array>& in, float* out) {
  if (kind == PrologueKind::rms_norm) {
    rms_norm_compute(in[0], in.size() > 1 ? &in[1] : nullptr, out, eps);
  } else if (kind == PrologueKind::swiglu) {
    swiglu_compute(in[0], in[1], out);
  }
}

}  // namespace flashserve_step

void add_step_ops(nb::module_& m) {
  add_sdpa(m);
  add_cache_write(m);
  add_prompt_sdpa(m);
  add_prompt_dequant(m);
  add_expert_ops(m);
  m.def("rms_norm", &rms_norm, "x"_a, "weight"_a, "eps"_a,
        "x * rsqrt(mean(x^2, -1) + eps) * weight as one op (float32); weight: [] or [w]");
  m.def("rope", &rope, "x"_a, "offset"_a, "freqs"_a, "dims"_a, "traditional"_a, "base"_a,
        "scale"_a, "rotary position encoding as one op; freqs: [] or [freqs]");
  m.def("logsumexp", &logsumexp, "x"_a, "keepdims"_a,
        "log(sum(exp(x))) over the last axis, vectorized (float32)");
  m.def("swiglu", &swiglu, "gate"_a, "x"_a, "silu(gate) * x as one vectorized op (float32)");
}
