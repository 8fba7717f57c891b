// What the two decode attention kernels share: step_sdpa.cpp (float keys and
// values) and step_sdpa_quant.cpp (kv_bits' packed ones). Both cut the keys
// into the same chunks, score and weigh them with the same vector kernels,
// apply masks and the softmax the same way, and combine the chunks in the same
// order, so their properties (a row's result independent of thread count,
// left padding and batch neighbours) come from one place.
#pragma once

#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <memory>
#include <string>
#include <vector>

#include "mlx/allocator.h"
#include "mlx/array.h"
#include "mlx/primitives.h"
#include "qmm_kernels.h"
#include "step_common.h"

namespace flashserve_sdpa {

namespace mx = mlx::core;
using flashserve_step::exp8;
using flashserve_step::kBool;
using flashserve_step::kCausal;
using flashserve_step::kAdditive;
using flashserve_step::strides_as;

// Fills out (B, Hq, Lq, Dv) for q, k, v, the mask (or null) and its mode.
using AttentionCompute = void (*)(const mx::array& q, const mx::array& k, const mx::array& v,
                                  const mx::array* mask, int mode, float scale, mx::array& out);

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

// out[t] = the sum of a[t]'s eight lanes, the eight reduced together.
__attribute__((target("avx2,fma"))) inline void sum8(const __m256* a, float* out) {
  const __m256 s01 = _mm256_hadd_ps(a[0], a[1]), s23 = _mm256_hadd_ps(a[2], a[3]);
  const __m256 s45 = _mm256_hadd_ps(a[4], a[5]), s67 = _mm256_hadd_ps(a[6], a[7]);
  const __m256 s0123 = _mm256_hadd_ps(s01, s23), s4567 = _mm256_hadd_ps(s45, s67);
  _mm256_storeu_ps(out, _mm256_add_ps(_mm256_permute2f128_ps(s0123, s4567, 0x20),
                                      _mm256_permute2f128_ps(s0123, s4567, 0x31)));
}

// out[t] = the sum of row t's sixteen lanes (rows: 16 x 16 floats), by the same
// tree for every row: within each 128-bit block (l0 + l2) + (l1 + l3), then
// (b0 + b1) + (b2 + b3) over the blocks.
__attribute__((target("avx512f"))) inline __m512 sum16(const float* rows) {
  __m512 c[8], d[4];
  for (int i = 0; i < 8; ++i) {
    const __m512 a = _mm512_loadu_ps(rows + 32 * i), b = _mm512_loadu_ps(rows + 32 * i + 16);
    c[i] = _mm512_add_ps(_mm512_unpacklo_ps(a, b), _mm512_unpackhi_ps(a, b));
  }
  for (int i = 0; i < 4; ++i) {
    const __m512d a = _mm512_castps_pd(c[2 * i]), b = _mm512_castps_pd(c[2 * i + 1]);
    d[i] = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(a, b)),
                         _mm512_castpd_ps(_mm512_unpackhi_pd(a, b)));
  }
  const __m512 f01 = _mm512_add_ps(_mm512_shuffle_f32x4(d[0], d[1], _MM_SHUFFLE(2, 0, 2, 0)),
                                   _mm512_shuffle_f32x4(d[0], d[1], _MM_SHUFFLE(3, 1, 3, 1)));
  const __m512 f23 = _mm512_add_ps(_mm512_shuffle_f32x4(d[2], d[3], _MM_SHUFFLE(2, 0, 2, 0)),
                                   _mm512_shuffle_f32x4(d[2], d[3], _MM_SHUFFLE(3, 1, 3, 1)));
  return _mm512_add_ps(_mm512_shuffle_f32x4(f01, f23, _MM_SHUFFLE(2, 0, 2, 0)),
                       _mm512_shuffle_f32x4(f01, f23, _MM_SHUFFLE(3, 1, 3, 1)));
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
  sum8(a, out);
}

// out[0..W) = sum_j p[j] * v_j[0..W), v rows `stride` floats apart: the
// sums stay in registers over the whole chunk (W: 32 or 64).
template <int W>
__attribute__((target("avx2,fma"))) inline void weighted_sum(const float* p, const float* v,
                                                             int64_t stride, int n, float* out) {
  __m256 acc[W / 8];
  for (int t = 0; t < W / 8; ++t) acc[t] = _mm256_setzero_ps();
  for (int j = 0; j < n; ++j) {
    const __m256 pj = _mm256_set1_ps(p[j]);
    const float* vr = v + j * stride;
    for (int t = 0; t < W / 8; ++t) {
      acc[t] = _mm256_fmadd_ps(pj, _mm256_loadu_ps(vr + 8 * t), acc[t]);
    }
  }
  for (int t = 0; t < W / 8; ++t) _mm256_storeu_ps(out + 8 * t, acc[t]);
}

// A prompt row's softmax (prompt_sdpa.cpp): t holds the scores with hidden
// keys at -inf, padded with -inf to a multiple of 8; the weights go to o (K
// of them; o may be t). The sum runs over 8-wide lanes fixed by the key's
// position, so a row's weights do not depend on how many keys follow.
__attribute__((target("avx2,fma"))) inline void softmax_row(float* t, int K, int padded, float* o,
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

// The key rows [j0, j0 + n) of chunk c of Lk keys. Chunk 0 ends at the newest
// key: a sequence left-padded in a batch (its keys end where the batch's do)
// has its keys in the same chunks, at the same offsets, as alone, with only
// masked keys (exact zeros) added.
inline void chunk_rows(int Lk, int c, int& j0, int& n) {
  const int j_end = Lk - c * KEY_CHUNK;
  j0 = std::max(0, j_end - KEY_CHUNK);
  n = j_end - j0;
}

// Masks each of part (b, kv head hk)'s R rows of n scores (keys j0..j0+n of
// Lk; row r is query head hk * repeats + r / Lq, position r % Lq) and turns
// them into e^(score - the row's max), leaving the max and the sum in `part`
// (sized here; its acc zeroed for Dv values a row).
__attribute__((target("avx2,fma"))) inline void softmax_part(float* scores, int R, int n, int j0,
                                                             int Lk, int Lq, int repeats, int b,
                                                             int hk, const mx::array* mask,
                                                             int mode, int Dv, Partial& part) {
  const float lowest = std::numeric_limits<float>::lowest();
  const float inf = std::numeric_limits<float>::infinity();
  std::vector<int64_t> ms;
  if (mask) ms = strides_as(*mask, 4);
  part.top.assign(R, -inf);
  part.total.assign(R, 0.0f);
  part.acc.assign(size_t(R) * Dv, 0.0f);
  for (int r = 0; r < R; ++r) {
    const int h = hk * repeats + r / Lq, i = r % Lq;
    float* sr = &scores[size_t(r) * n];
    // Masked scores become float32's lowest, as in MLX's fallback: a row
    // masked everywhere averages every value instead of dividing by zero.
    if (mode == kCausal) {
      for (int j = std::max(0, i + (Lk - Lq) + 1 - j0); j < n; ++j) sr[j] = lowest;
    } else if (mode == kBool) {
      const bool* m = mask->data<bool>() + b * ms[0] + h * ms[1] + i * ms[2] + j0 * ms[3];
      for (int j = 0; j < n; ++j) {
        if (!m[j * ms[3]]) sr[j] = lowest;
      }
    } else if (mode == kAdditive) {
      const float* m = mask->data<float>() + b * ms[0] + h * ms[1] + i * ms[2] + j0 * ms[3];
      for (int j = 0; j < n; ++j) sr[j] += m[j * ms[3]];
    }
    // The largest score, eight lanes at a time (a maximum is the same in any order).
    __m256 tops = _mm256_set1_ps(-inf);
    int k = 0;
    for (; k + 8 <= n; k += 8) tops = _mm256_max_ps(tops, _mm256_loadu_ps(sr + k));
    float lane_tops[8];
    _mm256_storeu_ps(lane_tops, tops);
    float top = -inf;
    for (float t : lane_tops) top = std::max(top, t);
    for (; k < n; ++k) top = std::max(top, sr[k]);
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
}

// Keys at the end that a bool mask hides from every query row are left out,
// as if k and v ended before them: a fixed-capacity cache's unused rows
// (generation/decode_step.py) then cost nothing, and the chunks (which end at
// the newest key taken) hold the same keys as for a cache of exact length, so
// the result is the same to the bit. A mask hiding everything keeps them all.
inline int keys_seen(int Lk, const mx::array* mask, int mode) {
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

// Combines each row's chunks in order into out (B, Hq, Lq, Dv): e^(chunk max
// - row max) rescales a chunk's sum and values to the row's largest score.
// partials are by (b, hk, chunk), chunk fastest.
__attribute__((target("avx2,fma"))) inline void combine(const std::vector<Partial>& partials,
                                                        int B, int Hq, int Hk, int Lq, int Dv,
                                                        int Lk, int chunks, float* op) {
  const int repeats = Hq / Hk, R = repeats * Lq;
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

// Runs part(b, hk, chunk, partial) for every sequence, kv head and chunk of
// Lk keys (on the kernel's threads from PARALLEL_MIN_KEYS key rows), then
// combines the chunks into out (B, Hq, Lq, Dv).
template <class Part>
void run_parts(int B, int Hq, int Hk, int Lq, int Dv, int Lk, float* out, const Part& part) {
  const int chunks = std::max(1, (Lk + KEY_CHUNK - 1) / KEY_CHUNK);
  const int parts = B * Hk * chunks;
  std::vector<Partial> partials(parts);
  const auto run = [&](int p) {
    if (Lk > 0) part(p / (Hk * chunks), p / chunks % Hk, p % chunks, partials[p]);
  };
  if (int64_t(B) * Hk * Lk >= PARALLEL_MIN_KEYS) {
    flashserve_qmm::parallel_for(parts, run);
  } else {
    for (int p = 0; p < parts; ++p) run(p);
  }
  combine(partials, B, Hq, Hk, Lq, Dv, Lk, chunks, out);
}

// Checks an attention mask against scores (B, Hq, Lq, Lk): dtype by mode,
// and every dimension 1 or the scores'.
inline void check_mask(const mx::array& m, int mode, int B, int Hq, int Lq, int Lk) {
  using flashserve_step::check;
  check(m.dtype() == (mode == kBool ? mx::bool_ : mx::float32), "sdpa: mask dtype");
  check(m.ndim() <= 4, "sdpa: mask has more than 4 dimensions");
  const int want[4] = {B, Hq, Lq, Lk};
  for (int d = 0; d < int(m.ndim()); ++d) {
    const int size = m.shape(d), w = want[4 - int(m.ndim()) + d];
    check(size == 1 || size == w, "sdpa: mask does not broadcast to the scores");
  }
}

// An attention op (step_sdpa.cpp, prompt_sdpa.cpp) as an MLX primitive on the
// CPU stream.
template <AttentionCompute Compute>
class AttentionPrimitive : public mx::UnaryPrimitive {
 public:
  AttentionPrimitive(mx::Stream s, const char* name, int mode, float scale)
      : mx::UnaryPrimitive(s), name_(name), mode_(mode), scale_(scale) {}

  void eval_cpu(const std::vector<mx::array>& inputs, mx::array& out) override {
    out.set_data(mx::allocator::malloc(out.nbytes()));
    flashserve_step::dispatch(
        stream(), inputs, out,
        [in = flashserve_step::weak(inputs), out = mx::array::unsafe_weak_copy(out), mode = mode_,
         scale = scale_]() mutable {
          Compute(in[0], in[1], in[2], in.size() > 3 ? &in[3] : nullptr, mode, scale, out);
        });
  }
  void eval_gpu(const std::vector<mx::array>&, mx::array&) override {
    throw std::runtime_error("flashserve step ops run on the CPU stream only");
  }
  const char* name() const override { return name_; }
  bool is_equivalent(const mx::Primitive& other) const override {
    const auto& o = static_cast<const AttentionPrimitive&>(other);
    return mode_ == o.mode_ && scale_ == o.scale_;
  }

 private:
  const char* name_;
  int mode_;
  float scale_;
};

// The op's array for 4-D float32 q (B, Hq, Lq, D), k (B, Hk, Lk, D), v (B, Hk,
// Lk, Dv) and mask ([] or [mask] by mode), after checking them (`op` names it
// in the messages).
template <AttentionCompute Compute>
mx::array attention_op(const char* op, const char* primitive, const mx::array& q,
                       const mx::array& k, const mx::array& v,
                       const std::vector<mx::array>& mask, int mode, float scale) {
  using flashserve_step::check;
  const auto says = [op](const char* what) { return std::string(op) + what; };
  for (const auto* a : {&q, &k, &v}) {
    check(a->dtype() == mx::float32 && a->ndim() == 4, says(" takes 4-D float32 q, k, v").c_str());
  }
  check(k.shape(0) == q.shape(0) && v.shape(0) == q.shape(0), says(": batch sizes differ").c_str());
  check(k.shape(3) == q.shape(3), says(": q and k differ in head size").c_str());
  check(k.shape(1) == v.shape(1) && k.shape(2) == v.shape(2), says(": k and v differ").c_str());
  check(q.shape(1) % k.shape(1) == 0,
        says(": query heads must be a multiple of kv heads").c_str());
  check(mode >= flashserve_step::kNone && mode <= kAdditive, says(": unknown mask mode").c_str());
  std::vector<mx::array> inputs{q, k, v};
  if (mode == kBool || mode == kAdditive) {
    check(mask.size() == 1, says(": this mask mode needs a mask").c_str());
    check_mask(mask[0], mode, q.shape(0), q.shape(1), q.shape(2), k.shape(2));
    inputs.push_back(mask[0]);
  }
  return mx::array({q.shape(0), q.shape(1), q.shape(2), v.shape(3)}, mx::float32,
                   std::make_shared<AttentionPrimitive<Compute>>(flashserve_step::cpu_stream(),
                                                                 primitive, mode, scale),
                   std::move(inputs));
}

}  // namespace flashserve_sdpa
