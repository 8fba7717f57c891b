// Attention for a decode step (few query rows) as one MLX primitive on the
// CPU stream; step_ops.cpp says why the step ops exist.
//
// Keys are taken in fixed chunks of KEY_CHUNK, counted from the newest key:
// each (sequence, kv head, chunk) is one part with its own softmax maximum,
// sum and weighted values, and the parts are combined in chunk order. Parts
// run on the kernel's threads (compute/csrc/qmm_kernels.h) once a context is
// long enough to be worth it. The chunks depend neither on the thread count
// nor on left padding, and every key's score and weight take the same
// arithmetic wherever it falls in a chunk, so a row's result is the same on
// any number of threads and alone or in a batch.
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

// out[t] = q . k_t for eight key rows `stride` floats apart (D a multiple of
// 8): one k load feeds one FMA, and the eight sums are reduced together.
__attribute__((target("avx2,fma"))) inline void scores8(const float* q, const float* k,
                                                        int64_t stride, int D, float* out) {
  __m256 a[8];
  for (int t = 0; t < 8; ++t) a[t] = _mm256_setzero_ps();
  for (int d = 0; d < D; d += 8) {
    const __m256 qv = _mm256_loadu_ps(q + d);
    for (int t = 0; t < 8; ++t) {
      a[t] = _mm256_fmadd_ps(_mm256_loadu_ps(k + t * stride + d), qv, a[t]);
    }
  }
  const __m256 s01 = _mm256_hadd_ps(a[0], a[1]), s23 = _mm256_hadd_ps(a[2], a[3]);
  const __m256 s45 = _mm256_hadd_ps(a[4], a[5]), s67 = _mm256_hadd_ps(a[6], a[7]);
  const __m256 s0123 = _mm256_hadd_ps(s01, s23), s4567 = _mm256_hadd_ps(s45, s67);
  _mm256_storeu_ps(out, _mm256_add_ps(_mm256_permute2f128_ps(s0123, s4567, 0x20),
                                      _mm256_permute2f128_ps(s0123, s4567, 0x31)));
}

// out[0..64) = sum_j p[j] * v_j[0..64), v rows `stride` floats apart: the
// sums stay in registers over the whole chunk.
__attribute__((target("avx2,fma"))) inline void weighted_sum64(const float* p, const float* v,
                                                               int64_t stride, int n, float* out) {
  __m256 acc[8];
  for (int t = 0; t < 8; ++t) acc[t] = _mm256_setzero_ps();
  for (int j = 0; j < n; ++j) {
    const __m256 pj = _mm256_set1_ps(p[j]);
    const float* vr = v + j * stride;
    for (int t = 0; t < 8; ++t) acc[t] = _mm256_fmadd_ps(pj, _mm256_loadu_ps(vr + 8 * t), acc[t]);
  }
  for (int t = 0; t < 8; ++t) _mm256_storeu_ps(out + 8 * t, acc[t]);
}

// Keys per part. Fixed (not derived from the thread count), so the parts and
// the order they are combined in are the same on any machine state.
constexpr int KEY_CHUNK = 256;
// Below this many key rows in all (sequences x kv heads x keys) the parts
// run on the calling thread: waking the pool costs more than they take. In a
// decode step the pool's thread is still spinning from the k/v projections
// just before, so even a short context is worth spreading once a batch has a
// few sequences: four streams at ~40 keys (480 rows) went from one thread to
// two at 1.05x tokens/s (2048 before); one stream (3 x 40) stays alone.
constexpr int64_t PARALLEL_MIN_KEYS = 256;

// What one part leaves for the combine, per query row: the largest score of
// its chunk, the sum of e^(score - max), and the values weighted by those.
struct Partial {
  std::vector<float> top, total, acc;  // R, R, R * Dv
};

struct SdpaArgs {
  const mx::array& q;
  const mx::array& k;
  const mx::array& v;
  const mx::array* mask;
  int mode;
  float scale;
  int Lk;  // keys taken: k's rows up to the last one a bool mask lets any query row see
};

// Part (b, hk, chunk c): one kv head's query rows (its `repeats` query heads
// times Lq) against the keys of chunk c, so each key and value row is read
// once for all of them.
__attribute__((target("avx2,fma"))) void sdpa_part(const SdpaArgs& a, int b, int hk, int c,
                                                   Partial& part) {
  const int Hq = a.q.shape(1), Lq = a.q.shape(2), D = a.q.shape(3);
  const int Hk = a.k.shape(1), Lk = a.Lk, Dv = a.v.shape(3);
  const int repeats = Hq / Hk;
  const int R = repeats * Lq;
  // Chunk 0 ends at the newest key: a sequence left-padded in a batch (its
  // keys end where the batch's do) has its keys in the same chunks, at the
  // same offsets, as alone, with only masked keys (exact zeros) added.
  const int j_end = Lk - c * KEY_CHUNK, j0 = std::max(0, j_end - KEY_CHUNK), n = j_end - j0;
  const auto qs = a.q.strides(), ks = a.k.strides(), vs = a.v.strides();
  const float* qp = a.q.data<float>();
  const float* kp = a.k.data<float>() + b * ks[0] + hk * ks[1];
  const float* vp = a.v.data<float>() + b * vs[0] + hk * vs[1];
  const float lowest = std::numeric_limits<float>::lowest();
  const float inf = std::numeric_limits<float>::infinity();
  std::vector<float> qrows(size_t(R) * D), scores(size_t(R) * n), tmp;
  // Row r is query head hk * repeats + r / Lq, position r % Lq. MLX's
  // fallback scales q first, then multiplies by k^T.
  for (int r = 0; r < R; ++r) {
    const int h = hk * repeats + r / Lq, i = r % Lq;
    const float* qr = qp + b * qs[0] + h * qs[1] + i * qs[2];
    for (int d = 0; d < D; ++d) qrows[size_t(r) * D + d] = a.scale * qr[d * qs[3]];
  }
  // Eight keys a pass; the last few through a zero-padded copy, so every
  // key's score takes the same arithmetic wherever it falls in a chunk.
  if (D % 8 == 0) {
    const int whole = n / 8 * 8;
    std::vector<float> rest;
    if (whole < n) {
      rest.assign(size_t(8) * D, 0.0f);
      for (int j = whole; j < n; ++j) {
        const float* kr = row(kp + (j0 + j) * ks[2], ks[3], D, tmp);
        std::copy(kr, kr + D, &rest[size_t(j - whole) * D]);
      }
    }
    std::vector<float> keys8;
    for (int j = 0; j < whole; j += 8) {
      const float* k8 = kp + (j0 + j) * ks[2];
      int64_t stride = ks[2];
      if (ks[3] != 1) {  // strided rows: contiguous copies first
        keys8.resize(size_t(8) * D);
        for (int t = 0; t < 8; ++t) {
          const float* kr = row(kp + (j0 + j + t) * ks[2], ks[3], D, tmp);
          std::copy(kr, kr + D, &keys8[size_t(t) * D]);
        }
        k8 = keys8.data();
        stride = D;
      }
      for (int r = 0; r < R; ++r) {
        scores8(&qrows[size_t(r) * D], k8, stride, D, &scores[size_t(r) * n + j]);
      }
    }
    if (whole < n) {
      float out[8];
      for (int r = 0; r < R; ++r) {
        scores8(&qrows[size_t(r) * D], rest.data(), D, D, out);
        std::copy(out, out + (n - whole), &scores[size_t(r) * n + whole]);
      }
    }
  } else {
    for (int j = 0; j < n; ++j) {
      const float* kr = row(kp + (j0 + j) * ks[2], ks[3], D, tmp);
      for (int r = 0; r < R; ++r) scores[size_t(r) * n + j] = dot(&qrows[size_t(r) * D], kr, D);
    }
  }
  std::vector<int64_t> ms;
  if (a.mask) ms = strides_as(*a.mask, 4);
  part.top.assign(R, -inf);
  part.total.assign(R, 0.0f);
  part.acc.assign(size_t(R) * Dv, 0.0f);
  for (int r = 0; r < R; ++r) {
    const int h = hk * repeats + r / Lq, i = r % Lq;
    float* sr = &scores[size_t(r) * n];
    // Masked scores become float32's lowest, as in MLX's fallback: a row
    // masked everywhere averages every value instead of dividing by zero.
    if (a.mode == kCausal) {
      for (int j = std::max(0, i + (Lk - Lq) + 1 - j0); j < n; ++j) sr[j] = lowest;
    } else if (a.mode == kBool) {
      const bool* m = a.mask->data<bool>() + b * ms[0] + h * ms[1] + i * ms[2] + j0 * ms[3];
      for (int j = 0; j < n; ++j) {
        if (!m[j * ms[3]]) sr[j] = lowest;
      }
    } else if (a.mode == kAdditive) {
      const float* m = a.mask->data<float>() + b * ms[0] + h * ms[1] + i * ms[2] + j0 * ms[3];
      for (int j = 0; j < n; ++j) sr[j] += m[j * ms[3]];
    }
    float top = -inf;
    for (int j = 0; j < n; ++j) top = std::max(top, sr[j]);
    part.top[r] = top;
    if (top == -inf) continue;  // only -inf (an additive mask): nothing from this chunk
    const __m256 m = _mm256_set1_ps(top);
    int j = 0;
    for (; j + 8 <= n; j += 8) {
      _mm256_storeu_ps(sr + j, exp8(_mm256_sub_ps(_mm256_loadu_ps(sr + j), m)));
    }
    if (j < n) {  // the same e^x for the last few
      float lanes[8] = {};
      std::copy(sr + j, sr + n, lanes);
      _mm256_storeu_ps(lanes, exp8(_mm256_sub_ps(_mm256_loadu_ps(lanes), m)));
      std::copy(lanes, lanes + (n - j), sr + j);
    }
    float total = 0.0f;
    for (j = 0; j < n; ++j) total += sr[j];
    part.total[r] = total;
  }
  if (vs[3] == 1 && Dv % 64 == 0) {
    const float* v0 = vp + int64_t(j0) * vs[2];
    for (int r = 0; r < R; ++r) {
      if (part.top[r] == -inf) continue;
      for (int d = 0; d < Dv; d += 64) {
        weighted_sum64(&scores[size_t(r) * n], v0 + d, vs[2], n, &part.acc[size_t(r) * Dv + d]);
      }
    }
    return;
  }
  for (int j = 0; j < n; ++j) {
    const float* vr = row(vp + (j0 + j) * vs[2], vs[3], Dv, tmp);
    for (int r = 0; r < R; ++r) {
      if (part.top[r] != -inf) {
        axpy(&part.acc[size_t(r) * Dv], scores[size_t(r) * n + j], vr, Dv);
      }
    }
  }
}

// Keys at the end that a bool mask hides from every query row are left out,
// as if k and v ended before them: a fixed-capacity cache's unused rows
// (generation/decode_step.py) then cost nothing, and the chunks (which end at
// the newest key taken) hold the same keys as for a cache of exact length, so
// the result is the same to the bit. A mask hiding everything keeps them all.
int keys_seen(const mx::array& k, const mx::array* mask, int mode) {
  const int Lk = k.shape(2);
  if (mode != kBool || mask == nullptr) return Lk;
  const auto ms = strides_as(*mask, 4);
  int sizes[4];
  for (int d = 0; d < 4; ++d) {
    const int off = 4 - int(mask->ndim());
    sizes[d] = d < off || ms[d] == 0 ? 1 : mask->shape(d - off);
  }
  const bool* m = mask->data<bool>();
  for (int j = Lk - 1; j >= 0; --j) {
    for (int b = 0; b < sizes[0]; ++b) {
      for (int h = 0; h < sizes[1]; ++h) {
        for (int i = 0; i < sizes[2]; ++i) {
          if (m[b * ms[0] + h * ms[1] + i * ms[2] + j * ms[3]]) return j + 1;
        }
      }
    }
  }
  return Lk;
}

void sdpa_compute(const mx::array& q, const mx::array& k, const mx::array& v,
                  const mx::array* mask, int mode, float scale, mx::array& out) {
  const int B = q.shape(0), Hq = q.shape(1), Lq = q.shape(2);
  const int Hk = k.shape(1), Lk = keys_seen(k, mask, mode), Dv = v.shape(3);
  const int repeats = Hq / Hk;
  const int R = repeats * Lq;
  const int chunks = std::max(1, (Lk + KEY_CHUNK - 1) / KEY_CHUNK);
  const int parts = B * Hk * chunks;
  std::vector<Partial> partials(parts);
  const SdpaArgs args{q, k, v, mask, mode, scale, Lk};
  const auto run = [&](int p) {
    if (Lk > 0) sdpa_part(args, p / (Hk * chunks), p / chunks % Hk, p % chunks, partials[p]);
  };
  if (int64_t(B) * Hk * Lk >= PARALLEL_MIN_KEYS) {
    flashserve_qmm::parallel_for(parts, run);
  } else {
    for (int p = 0; p < parts; ++p) run(p);
  }
  // Combine each row's chunks in order: e^(chunk max - row max) rescales a
  // chunk's sum and values to the row's largest score.
  float* op = out.data<float>();
  const float inf = std::numeric_limits<float>::infinity();
  std::vector<float> acc(Dv);
  for (int b = 0; b < B; ++b) {
    for (int hk = 0; hk < Hk; ++hk) {
      const Partial* first = &partials[(size_t(b) * Hk + hk) * chunks];
      for (int r = 0; r < R; ++r) {
        float top = -inf;
        for (int c = 0; c < chunks && Lk > 0; ++c) top = std::max(top, first[c].top[r]);
        std::fill(acc.begin(), acc.end(), 0.0f);
        float total = 0.0f;
        for (int c = 0; c < chunks && Lk > 0; ++c) {
          if (first[c].top[r] == -inf) continue;
          const float w = std::exp(first[c].top[r] - top);  // 1 for the top chunk
          total += w * first[c].total[r];
          axpy(acc.data(), w, &first[c].acc[size_t(r) * Dv], Dv);
        }
        const int h = hk * repeats + r / Lq, i = r % Lq;
        float* o = op + ((int64_t(b) * Hq + h) * Lq + i) * Dv;
        const float inv = 1.0f / total;  // 0 / 0: every score -inf, NaN as in MLX
        for (int d = 0; d < Dv; ++d) o[d] = acc[d] * inv;
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

}  // namespace

void add_sdpa(nb::module_& m) {
  m.def("sdpa", &sdpa, "q"_a, "k"_a, "v"_a, "mask"_a, "mask_mode"_a, "scale"_a,
        "softmax(scale * q k^T + mask) v as one op; mask: [] or [mask]");
}
