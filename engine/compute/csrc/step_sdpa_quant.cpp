// Decode attention over kv_bits' packed cache (kv/cache.py) as one MLX
// primitive on the CPU stream: scores and the weighted sum straight from
// MLX's affine-quantized keys and values (per group of `group` values along a
// head: uint32-packed integers, a float32 scale and bias), no float copy of
// the cache. Dequantizing the whole cache every step and running the float
// kernel made decode 0.38x (8 bits) / 0.29x (4 bits) of a float cache: each
// step wrote, then read, four times the cache's bytes.
//
// Two loops, the AVX-512 one picked with the quantized matmul's (qmm.py's
// set_avx512 switches both): it takes head sizes 64 and 128 (rows read in
// place, integers made floats with integer instructions; below); the AVX2 one
// takes every head size that is a multiple of 8, widening a chunk's integers
// into a per-thread buffer first. Both use q . k over a group =
// s (q . kq) + b sum(q) and sum_j p_j v_j = sum_j (p_j s_j) vq_j + sum_j p_j b_j:
// the scale and bias apply once per group and key. Chunks, masks, the softmax
// and the combine are step_sdpa.cpp's (sdpa_parts.h), so a row's result is the
// same on any thread count and alone or in a batch. The numbers differ from
// dequantize + float attention by float32 rounding only (the sums are grouped
// differently): tests/test_sdpa_quant.py states the bound.
#include <nanobind/nanobind.h>
#include <nanobind/stl/vector.h>

#include <immintrin.h>

#include <algorithm>
#include <cstdint>
#include <limits>
#include <memory>
#include <vector>

#include "mlx/allocator.h"
#include "mlx/array.h"
#include "mlx/primitives.h"
#include "qmm_kernels.h"
#include "sdpa_parts.h"
#include "step_common.h"
#include "step_ops.h"

namespace nb = nanobind;
namespace mx = mlx::core;
using namespace nb::literals;
using namespace flashserve_step;
using namespace flashserve_sdpa;

namespace {

// dst[0..D) = the D integers of a packed row (bits 4 or 8, the first value in
// the lowest bits of the first word), as floats.
__attribute__((target("avx2,fma"))) void widen(const uint32_t* w, int bits, int D,
                                                    float* dst) {
  if (bits == 8) {
    const uint8_t* p = reinterpret_cast<const uint8_t*>(w);
    for (int i = 0; i < D; i += 8) {
      const __m128i b = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(p + i));
      _mm256_storeu_ps(dst + i, _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(b)));
    }
    return;
  }
  const __m256i shifts = _mm256_setr_epi32(0, 4, 8, 12, 16, 20, 24, 28);
  const __m256i low4 = _mm256_set1_epi32(0xF);
  for (int i = 0; i < D; i += 8) {
    const __m256i x = _mm256_srlv_epi32(_mm256_set1_epi32(int(w[i / 8])), shifts);
    _mm256_storeu_ps(dst + i, _mm256_cvtepi32_ps(_mm256_and_si256(x, low4)));
  }
}

// sum_j a[j] b[j] added in j's order, as the values' sums are: a key's place in
// its chunk (which left padding moves) then cannot change how it is rounded,
// and the masked keys before it add exact zeros. Out of line: inlined into
// the AVX-512 loop, GCC evaluated it so that a left-padded sequence's row
// differed from its row alone in the last bit.
__attribute__((noinline)) float in_order_dot(const float* a, const float* b, int n) {
  float total = 0.0f;
  for (int j = 0; j < n; ++j) total += a[j] * b[j];
  return total;
}

// One of the cache's three parts (packed integers, scales, biases) for one
// sequence and kv head: row j at p + j * rs, elements es apart.
template <class T>
struct Rows {
  const T* p;
  int64_t rs, es;
  Rows(const mx::array& a, int b, int hk)
      : p(a.data<T>() + b * a.strides()[0] + hk * a.strides()[1]),
        rs(a.strides()[2]),
        es(a.strides()[3]) {}
  const T* row(int j, int width, std::vector<T>& tmp) const {
    const T* r = p + j * rs;
    if (es == 1) return r;
    tmp.resize(width);
    for (int i = 0; i < width; ++i) tmp[i] = r[i * es];
    return tmp.data();
  }
};

struct Packed {
  Rows<uint32_t> w;
  Rows<float> s, b;
  Packed(const mx::array* parts, int b_, int hk)
      : w(parts[0], b_, hk), s(parts[1], b_, hk), b(parts[2], b_, hk) {}
};

// What a part reuses from one call to the next on the same thread.
struct Scratch {
  std::vector<float> ints;          // a chunk's integers as floats, rows of D (or Dv)
  std::vector<float> scale, bias;   // a chunk's scales and biases, group-major
  std::vector<float> qrows, qsum, scores, weights;
  std::vector<uint32_t> wtmp;
};

// Widens rows [j0, j0 + n) of `src` into sc.ints (rows of D floats; rows n..pad
// zero) and copies their scales and biases group-major (groups x pad).
void load_chunk(const Packed& src, int j0, int n, int pad, int D, int bits, int group,
                Scratch& sc) {
  const int words = D * bits / 32, groups = D / group;
  sc.ints.resize(size_t(pad) * D);
  sc.scale.assign(size_t(groups) * pad, 0.0f);
  sc.bias.assign(size_t(groups) * pad, 0.0f);
  std::fill(sc.ints.begin() + size_t(n) * D, sc.ints.end(), 0.0f);
  for (int j = 0; j < n; ++j) {
    const uint32_t* w = src.w.row(j0 + j, words, sc.wtmp);
    widen(w, bits, D, &sc.ints[size_t(j) * D]);
    const float* s = src.s.p + (j0 + j) * src.s.rs;
    const float* b = src.b.p + (j0 + j) * src.b.rs;
    for (int g = 0; g < groups; ++g) {
      sc.scale[size_t(g) * pad + j] = s[g * src.s.es];
      sc.bias[size_t(g) * pad + j] = b[g * src.b.es];
    }
  }
}

struct QuantArgs {
  const mx::array& q;
  const mx::array* k;  // packed, scales, biases
  const mx::array* v;
  const mx::array* mask;
  int mode;
  float scale;
  int group, bits, Lk;
};

// Part (b, hk, chunk c), as step_sdpa.cpp's: one kv head's query rows against
// the keys of chunk c, each key and value row widened once for all of them.
__attribute__((target("avx2,fma"))) void quant_part(const QuantArgs& a, int b, int hk, int c,
                                                    Partial& part) {
  static thread_local Scratch sc;
  const int Hq = a.q.shape(1), Lq = a.q.shape(2), D = a.q.shape(3);
  const int Hk = a.k[0].shape(1), Lk = a.Lk, Dv = a.v[0].shape(3) * 32 / a.bits;
  const int repeats = Hq / Hk, R = repeats * Lq, G = a.group;
  const int kgroups = D / G, vgroups = Dv / G;
  int j0, n;
  chunk_rows(Lk, c, j0, n);
  const int pad = (n + 7) / 8 * 8;
  const auto qs = a.q.strides();
  const float* qp = a.q.data<float>();
  const float inf = std::numeric_limits<float>::infinity();
  // Query rows scaled first (as the float kernel does) and each group's sum.
  sc.qrows.resize(size_t(R) * D);
  sc.qsum.resize(size_t(R) * kgroups);
  for (int r = 0; r < R; ++r) {
    const int h = hk * repeats + r / Lq, i = r % Lq;
    const float* qr = qp + b * qs[0] + h * qs[1] + i * qs[2];
    float* dst = &sc.qrows[size_t(r) * D];
    for (int d = 0; d < D; ++d) dst[d] = a.scale * qr[d * qs[3]];
    for (int g = 0; g < kgroups; ++g) {
      float total = 0.0f;
      for (int d = g * G; d < (g + 1) * G; ++d) total += dst[d];
      sc.qsum[size_t(r) * kgroups + g] = total;
    }
  }
  // Scores, eight keys a pass (zero rows pad the last pass, so every key takes
  // the same arithmetic wherever it falls in a chunk): per group the integer
  // dot, then scale * dot + bias * sum(q) accumulated over the groups.
  load_chunk(Packed(a.k, b, hk), j0, n, pad, D, a.bits, G, sc);
  sc.scores.resize(size_t(R) * n);
  for (int r = 0; r < R; ++r) {
    const float* qr = &sc.qrows[size_t(r) * D];
    for (int j = 0; j < pad; j += 8) {
      __m256 acc = _mm256_setzero_ps();
      for (int g = 0; g < kgroups; ++g) {
        float dots[8];
        scores8(qr + g * G, &sc.ints[size_t(j) * D + g * G], D, G, dots);
        const __m256 qsum = _mm256_set1_ps(sc.qsum[size_t(r) * kgroups + g]);
        acc = _mm256_fmadd_ps(_mm256_loadu_ps(&sc.scale[size_t(g) * pad + j]),
                              _mm256_loadu_ps(dots), acc);
        acc = _mm256_fmadd_ps(_mm256_loadu_ps(&sc.bias[size_t(g) * pad + j]), qsum, acc);
      }
      float out[8];
      _mm256_storeu_ps(out, acc);
      std::copy(out, out + std::min(8, n - j), &sc.scores[size_t(r) * n + j]);
    }
  }
  softmax_part(sc.scores.data(), R, n, j0, Lk, Lq, repeats, b, hk, a.mask, a.mode, Dv, part);
  // Values: per group, the weights p_j * scale_j over the integers, and
  // sum_j p_j * bias_j added to each of the group's values.
  load_chunk(Packed(a.v, b, hk), j0, n, pad, Dv, a.bits, G, sc);
  const int W = std::min(G, 64);  // values a weighted_sum keeps in registers
  sc.weights.resize(pad);
  for (int r = 0; r < R; ++r) {
    if (part.top[r] == -inf) continue;
    const float* p = &sc.scores[size_t(r) * n];
    float* acc = &part.acc[size_t(r) * Dv];
    for (int g = 0; g < vgroups; ++g) {
      const float* s = &sc.scale[size_t(g) * pad];
      for (int j = 0; j < n; ++j) sc.weights[j] = p[j] * s[j];
      const float bsum = in_order_dot(p, &sc.bias[size_t(g) * pad], n);
      for (int d = g * G; d < (g + 1) * G; d += W) {
        if (W == 64) {
          weighted_sum<64>(sc.weights.data(), &sc.ints[d], Dv, n, acc + d);
        } else {
          weighted_sum<32>(sc.weights.data(), &sc.ints[d], Dv, n, acc + d);
        }
      }
      for (int d = g * G; d < (g + 1) * G; ++d) acc[d] += bsum;
    }
  }
}

// The AVX-512 part. A row's integers x become floats with integer
// instructions only: x shifted into the mantissa of 1.0 is f = 1 + x / F
// (F = 2^bits, exact), and with k = s x + b = (F s) f + (b - F s) the float
// pipes do nothing but the float kernel's dot products and weighted sums, over
// a quarter (8 bits) or an eighth (4 bits) of its bytes; the scale and bias
// apply once per group and key. At 4 bits each 32 values are taken as [the 16
// even ones, the 16 odd ones] (the same 16 bytes, shifted two ways); q is
// permuted alike, and the values' sums are put back in order at the end.

// Register i (16 values) of a packed row as 1 + x / 2^BITS.
template <int BITS>
__attribute__((target("avx512f"))) inline __m512 unit_floats(const uint8_t* bytes, int i) {
  const __m512i one = _mm512_set1_epi32(0x3F800000);
  if constexpr (BITS == 8) {
    const __m512i x =
        _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(bytes + 16 * i)));
    return _mm512_castsi512_ps(_mm512_or_si512(_mm512_slli_epi32(x, 15), one));
  } else {
    const __m512i x = _mm512_cvtepu8_epi32(
        _mm_loadu_si128(reinterpret_cast<const __m128i*>(bytes + 16 * (i / 2))));
    // Low nibbles (even values) or high ones (odd) into mantissa bits 19-22:
    // (x << shift) & 0x780000 | one, the last two as one ternary-logic op.
    const __m512i moved = i % 2 == 0 ? _mm512_slli_epi32(x, 19) : _mm512_slli_epi32(x, 15);
    return _mm512_castsi512_ps(
        _mm512_ternarylogic_epi32(moved, _mm512_set1_epi32(0x780000), one, 0xEA));
  }
}

// dst = src (D floats) in the registers' order at BITS (a permutation at 4 bits).
template <int BITS>
void to_lane_order(const float* src, int D, float* dst) {
  if (BITS == 8) {
    std::copy(src, src + D, dst);
    return;
  }
  for (int m = 0; m < D; m += 32) {
    for (int l = 0; l < 16; ++l) {
      dst[m + l] = src[m + 2 * l];
      dst[m + 16 + l] = src[m + 2 * l + 1];
    }
  }
}

// Rows are read PREFETCH_ROWS ahead of their use: a part's chunk (16 KB of
// 8-bit keys of 64) is too short a stream for the hardware's prefetcher to
// ramp up, and the cache of every layer is far larger than the L3.
constexpr int PREFETCH_ROWS = 16;

__attribute__((target("avx2"))) inline void prefetch_row(const Packed& src, int j, int end,
                                                         int bytes) {
  if (j >= end) return;
  const char* p = reinterpret_cast<const char*>(src.w.p + j * src.w.rs);
  for (int o = 0; o < bytes; o += 64) _mm_prefetch(p + o, _MM_HINT_T0);
}

// For keys [j0, j0 + n): F * scale and bias - F * scale, group-major (groups x n).
// Their rows are `stride` = n rounded up to 16 long, zero past n (the last
// pass of sixteen keys reads them whole); the stride is returned.
__attribute__((target("avx2,fma"))) int unit_terms(const Packed& src, int j0, int n, int groups,
                                                    int bits, Scratch& sc) {
  const float F = float(1 << bits);
  const int stride = (n + 15) / 16 * 16;
  sc.scale.assign(size_t(groups) * stride, 0.0f);
  sc.bias.assign(size_t(groups) * stride, 0.0f);
  for (int g = 0; g < groups; ++g) {
    const float* s = src.s.p + j0 * src.s.rs + g * src.s.es;
    const float* b = src.b.p + j0 * src.b.rs + g * src.b.es;
    float* __restrict fs = &sc.scale[size_t(g) * stride];
    float* __restrict c = &sc.bias[size_t(g) * stride];
    if (src.s.rs == 1 && src.b.rs == 1) {  // one group a row: contiguous, vectorized
      for (int j = 0; j < n; ++j) {
        fs[j] = F * s[j];  // exact: a power of two
        c[j] = b[j] - fs[j];
      }
    } else {
      for (int j = 0; j < n; ++j) {
        fs[j] = F * s[j * src.s.rs];
        c[j] = b[j * src.b.rs] - fs[j];
      }
    }
  }
  return stride;
}

// scores[r * n + j] = q_r . k_j for the chunk's n keys: q rows in lane order,
// qsum[r * groups + g] the sum of row r's group g.
template <int NV, int G, int BITS>
__attribute__((target("avx512f,avx2,fma"))) void scores_avx512(const Packed& src, int j0, int n,
                                                               const float* q,
                                                               const float* qsum, int R,
                                                               float* scores, Scratch& sc) {
  constexpr int D = NV * 16, PER_GROUP = G / 16, GROUPS = NV / PER_GROUP;
  const int stride = unit_terms(src, j0, n, GROUPS, BITS, sc);
  // Each (row, group, key)'s dot as sixteen lanes, sixteen keys at a time.
  sc.weights.resize(size_t(R) * GROUPS * 256);
  float* lanes = sc.weights.data();
  for (int j = 0; j < n; j += 16) {
    for (int t = 0; t < 16; ++t) {
      __m512 f[NV];
      const uint8_t* bytes = reinterpret_cast<const uint8_t*>(src.w.p + (j0 + j + t) * src.w.rs);
      prefetch_row(src, j0 + j + t + PREFETCH_ROWS, j0 + n, NV * 2 * BITS);
      for (int i = 0; i < NV; ++i) {
        // The last pass's rows past the chunk: zeros, so every key's score
        // takes the same arithmetic wherever it falls in a chunk.
        f[i] = j + t < n ? unit_floats<BITS>(bytes, i) : _mm512_setzero_ps();
      }
      for (int r = 0; r < R; ++r) {
        const float* qr = q + size_t(r) * D;
        for (int g = 0; g < GROUPS; ++g) {
          const int i0 = g * PER_GROUP;
          __m512 a = _mm512_mul_ps(f[i0], _mm512_loadu_ps(qr + 16 * i0));
          for (int i = i0 + 1; i < i0 + PER_GROUP; ++i) {
            a = _mm512_fmadd_ps(f[i], _mm512_loadu_ps(qr + 16 * i), a);
          }
          _mm512_storeu_ps(lanes + ((r * GROUPS + g) * 16 + t) * 16, a);
        }
      }
    }
    for (int r = 0; r < R; ++r) {
      __m512 acc = _mm512_setzero_ps();
      for (int g = 0; g < GROUPS; ++g) {
        const __m512 dots = sum16(lanes + (r * GROUPS + g) * 256);
        const __m512 qs = _mm512_set1_ps(qsum[r * GROUPS + g]);
        acc = _mm512_fmadd_ps(_mm512_loadu_ps(&sc.scale[size_t(g) * stride + j]), dots, acc);
        acc = _mm512_fmadd_ps(_mm512_loadu_ps(&sc.bias[size_t(g) * stride + j]), qs, acc);
      }
      float out[16];
      _mm512_storeu_ps(out, acc);
      std::copy_n(out, std::min(16, n - j), scores + size_t(r) * n + j);
    }
  }
}

// acc[r] = sum_j p[r][j] v_j for the chunk's n values (p: zero where a row
// takes nothing); RB query rows at a time keep their sums in registers.
template <int NV, int G, int BITS>
__attribute__((target("avx512f,avx2,fma"))) void values_avx512(const Packed& src, int j0, int n,
                                                               const float* p, int R,
                                                               float* acc, Scratch& sc) {
  constexpr int RB = 16 / NV, Dv = NV * 16, PER_GROUP = G / 16, GROUPS = NV / PER_GROUP;
  const int stride = unit_terms(src, j0, n, GROUPS, BITS, sc);
  // w[(r * GROUPS + g) * n + j] = p_rj * F s_jg; the bias terms once per row and group.
  sc.weights.resize(size_t(R) * GROUPS * n);
  std::vector<float>& bias_sums = sc.qsum;
  bias_sums.resize(size_t(R) * GROUPS);
  for (int r = 0; r < R; ++r) {
    for (int g = 0; g < GROUPS; ++g) {
      const float* pr = p + size_t(r) * n;
      float* w = &sc.weights[(size_t(r) * GROUPS + g) * n];
      for (int j = 0; j < n; ++j) w[j] = pr[j] * sc.scale[size_t(g) * stride + j];
      bias_sums[r * GROUPS + g] = in_order_dot(pr, &sc.bias[size_t(g) * stride], n);
    }
  }
  for (int r0 = 0; r0 < R; r0 += RB) {
    __m512 a[RB][NV];
    for (int rb = 0; rb < RB; ++rb) {
      for (int i = 0; i < NV; ++i) a[rb][i] = _mm512_setzero_ps();
    }
    const int rows = std::min(RB, R - r0);
    for (int j = 0; j < n; ++j) {
      __m512 f[NV];
      const uint8_t* bytes = reinterpret_cast<const uint8_t*>(src.w.p + (j0 + j) * src.w.rs);
      prefetch_row(src, j0 + j + PREFETCH_ROWS, j0 + n, NV * 2 * BITS);
      for (int i = 0; i < NV; ++i) f[i] = unit_floats<BITS>(bytes, i);
      for (int rb = 0; rb < RB; ++rb) {
        if (rb >= rows) break;
        for (int g = 0; g < GROUPS; ++g) {
          const __m512 w = _mm512_set1_ps(sc.weights[(size_t(r0 + rb) * GROUPS + g) * n + j]);
          for (int i = g * PER_GROUP; i < (g + 1) * PER_GROUP; ++i) {
            a[rb][i] = _mm512_fmadd_ps(w, f[i], a[rb][i]);
          }
        }
      }
    }
    for (int rb = 0; rb < rows; ++rb) {
      for (int g = 0; g < GROUPS; ++g) {
        const __m512 bias = _mm512_set1_ps(bias_sums[(r0 + rb) * GROUPS + g]);
        for (int i = g * PER_GROUP; i < (g + 1) * PER_GROUP; ++i) {
          a[rb][i] = _mm512_add_ps(a[rb][i], bias);
        }
      }
      float* out = acc + size_t(r0 + rb) * Dv;
      if constexpr (BITS == 8) {
        for (int i = 0; i < NV; ++i) _mm512_storeu_ps(out + 16 * i, a[rb][i]);
      } else {  // [even, odd] back to natural order
        const __m512i lo = _mm512_setr_epi32(0, 16, 1, 17, 2, 18, 3, 19, 4, 20, 5, 21, 6, 22, 7, 23);
        const __m512i hi =
            _mm512_setr_epi32(8, 24, 9, 25, 10, 26, 11, 27, 12, 28, 13, 29, 14, 30, 15, 31);
        for (int i = 0; i < NV; i += 2) {
          _mm512_storeu_ps(out + 16 * i, _mm512_permutex2var_ps(a[rb][i], lo, a[rb][i + 1]));
          _mm512_storeu_ps(out + 16 * i + 16,
                           _mm512_permutex2var_ps(a[rb][i], hi, a[rb][i + 1]));
        }
      }
    }
  }
}

// The AVX-512 loops for one head size, group size and width, or null.
using ScoresFn = void (*)(const Packed&, int, int, const float*, const float*, int, float*,
                          Scratch&);
using ValuesFn = void (*)(const Packed&, int, int, const float*, int, float*, Scratch&);

template <int NV, int BITS>
ScoresFn scores_for(int G) {
  if (G == 32) return scores_avx512<NV, 32, BITS>;
  if (G == 64) return scores_avx512<NV, 64, BITS>;
  if constexpr (NV * 16 >= 128) return scores_avx512<NV, 128, BITS>;
  return nullptr;  // a group wider than the head (refused before)
}

template <int NV, int BITS>
ValuesFn values_for(int G) {
  if (G == 32) return values_avx512<NV, 32, BITS>;
  if (G == 64) return values_avx512<NV, 64, BITS>;
  if constexpr (NV * 16 >= 128) return values_avx512<NV, 128, BITS>;
  return nullptr;
}

ScoresFn pick_scores(int D, int G, int bits) {
  if (D == 64) return bits == 8 ? scores_for<4, 8>(G) : scores_for<4, 4>(G);
  if (D == 128) return bits == 8 ? scores_for<8, 8>(G) : scores_for<8, 4>(G);
  return nullptr;
}

ValuesFn pick_values(int Dv, int G, int bits) {
  if (Dv == 64) return bits == 8 ? values_for<4, 8>(G) : values_for<4, 4>(G);
  if (Dv == 128) return bits == 8 ? values_for<8, 8>(G) : values_for<8, 4>(G);
  return nullptr;
}

// Part (b, hk, chunk c) on the AVX-512 loops (head sizes 64 and 128).
void quant_part_avx512(const QuantArgs& a, int b, int hk, int c, Partial& part) {
  static thread_local Scratch sc;
  const int Hq = a.q.shape(1), Lq = a.q.shape(2), D = a.q.shape(3);
  const int Hk = a.k[0].shape(1), Lk = a.Lk, Dv = a.v[0].shape(3) * 32 / a.bits;
  const int repeats = Hq / Hk, R = repeats * Lq, groups = D / a.group;
  int j0, n;
  chunk_rows(Lk, c, j0, n);
  const auto qs = a.q.strides();
  std::vector<float> row(D), qsum(size_t(R) * groups);
  sc.qrows.resize(size_t(R) * D);
  for (int r = 0; r < R; ++r) {  // scaled first, as the float kernel does
    const int h = hk * repeats + r / Lq, i = r % Lq;
    const float* qr = a.q.data<float>() + b * qs[0] + h * qs[1] + i * qs[2];
    for (int d = 0; d < D; ++d) row[d] = a.scale * qr[d * qs[3]];
    for (int g = 0; g < groups; ++g) {
      float total = 0.0f;
      for (int d = g * a.group; d < (g + 1) * a.group; ++d) total += row[d];
      qsum[size_t(r) * groups + g] = total;
    }
    if (a.bits == 8) {
      to_lane_order<8>(row.data(), D, &sc.qrows[size_t(r) * D]);
    } else {
      to_lane_order<4>(row.data(), D, &sc.qrows[size_t(r) * D]);
    }
  }
  const Packed keys(a.k, b, hk), values(a.v, b, hk);
  std::vector<float> scores(size_t(R) * n);
  pick_scores(D, a.group, a.bits)(keys, j0, n, sc.qrows.data(), qsum.data(), R,
                                  scores.data(), sc);
  softmax_part(scores.data(), R, n, j0, Lk, Lq, repeats, b, hk, a.mask, a.mode, Dv, part);
  const float inf = std::numeric_limits<float>::infinity();
  for (int r = 0; r < R; ++r) {  // a row that takes nothing from this chunk: weights 0
    if (part.top[r] == -inf) std::fill_n(&scores[size_t(r) * n], n, 0.0f);
  }
  pick_values(Dv, a.group, a.bits)(values, j0, n, scores.data(), R, part.acc.data(),
                                   sc);
}

void quant_compute(const std::vector<mx::array>& in, int mode, float scale, int group, int bits,
                   mx::array& out) {
  const mx::array& q = in[0];
  const mx::array* mask = in.size() > 7 ? &in[7] : nullptr;
  const int B = q.shape(0), Hq = q.shape(1), Lq = q.shape(2);
  const int Hk = in[1].shape(1), Dv = in[4].shape(3) * 32 / bits;
  const int Lk = keys_seen(in[1].shape(2), mask, mode);
  const QuantArgs args{q, &in[1], &in[4], mask, mode, scale, group, bits, Lk};
  bool rows_contiguous = true;  // the AVX-512 loops read rows in place
  for (int i = 1; i < 7; ++i) rows_contiguous = rows_contiguous && in[i].strides()[3] == 1;
  const bool wide = flashserve_qmm::avx512_active() && rows_contiguous &&
                    pick_scores(q.shape(3), group, bits) && pick_values(Dv, group, bits);
  run_parts(B, Hq, Hk, Lq, Dv, Lk, out.data<float>(), [&](int b, int hk, int c, Partial& part) {
    if (wide) {
      quant_part_avx512(args, b, hk, c, part);
    } else {
      quant_part(args, b, hk, c, part);
    }
  });
}

class FlashserveQuantSDPA : public mx::UnaryPrimitive {
 public:
  FlashserveQuantSDPA(mx::Stream s, int mode, float scale, int group, int bits)
      : mx::UnaryPrimitive(s), mode_(mode), scale_(scale), group_(group), bits_(bits) {}

  void eval_cpu(const std::vector<mx::array>& inputs, mx::array& out) override {
    out.set_data(mx::allocator::malloc(out.nbytes()));
    dispatch(stream(), inputs, out,
             [in = weak(inputs), out = mx::array::unsafe_weak_copy(out), mode = mode_,
              scale = scale_, group = group_, bits = bits_]() mutable {
               quant_compute(in, mode, scale, group, bits, out);
             });
  }
  void eval_gpu(const std::vector<mx::array>&, mx::array&) override {
    throw std::runtime_error("flashserve step ops run on the CPU stream only");
  }
  const char* name() const override { return "FlashserveQuantSDPA"; }
  bool is_equivalent(const mx::Primitive& other) const override {
    const auto& o = static_cast<const FlashserveQuantSDPA&>(other);
    return mode_ == o.mode_ && scale_ == o.scale_ && group_ == o.group_ && bits_ == o.bits_;
  }

 private:
  int mode_;
  float scale_;
  int group_, bits_;
};

// Checks one packed part triple against (B, Hk, L, dim) at `bits`, `group`.
void check_packed(const std::vector<mx::array>& p, int B, int Hk, int L, int dim, int bits,
                  int group) {
  check(p.size() == 3, "sdpa_quant: keys and values are (packed, scales, biases)");
  check(p[0].dtype() == mx::uint32, "sdpa_quant: packed values are uint32");
  check(p[1].dtype() == mx::float32 && p[2].dtype() == mx::float32,
        "sdpa_quant: scales and biases are float32");
  for (const auto& a : p) {
    check(a.ndim() == 4 && a.shape(0) == B && a.shape(1) == Hk && a.shape(2) == L,
          "sdpa_quant: keys and values differ from q in batch, kv heads or length");
  }
  check(p[0].shape(3) * 32 / bits == dim, "sdpa_quant: packed width does not match");
  check(p[1].shape(3) == dim / group && p[2].shape(3) == dim / group,
        "sdpa_quant: one scale and bias per group");
}

mx::array sdpa_quant(const mx::array& q, const std::vector<mx::array>& k,
                     const std::vector<mx::array>& v, const std::vector<mx::array>& mask,
                     int mode, float scale, int group, int bits) {
  check(q.dtype() == mx::float32 && q.ndim() == 4, "sdpa_quant takes 4-D float32 q");
  check(bits == 4 || bits == 8, "sdpa_quant: bits must be 4 or 8");
  check(group == 32 || group == 64 || group == 128, "sdpa_quant: group size 32, 64 or 128");
  check(k.size() == 3 && v.size() == 3 && k[0].ndim() == 4 && v[0].ndim() == 4,
        "sdpa_quant: keys and values are 4-D (packed, scales, biases)");
  const int B = q.shape(0), Hk = k[0].shape(1), L = k[0].shape(2), D = q.shape(3);
  const int Dv = v[0].shape(3) * 32 / bits;
  check(D % group == 0 && Dv % group == 0, "sdpa_quant: the group size must divide the heads");
  check(q.shape(1) % Hk == 0, "sdpa_quant: query heads must be a multiple of kv heads");
  check_packed(k, B, Hk, L, D, bits, group);
  check_packed(v, B, Hk, L, Dv, bits, group);
  check(mode >= kNone && mode <= kAdditive, "sdpa_quant: unknown mask mode");
  std::vector<mx::array> inputs{q, k[0], k[1], k[2], v[0], v[1], v[2]};
  if (mode == kBool || mode == kAdditive) {
    check(mask.size() == 1, "sdpa_quant: this mask mode needs a mask");
    check_mask(mask[0], mode, B, q.shape(1), q.shape(2), L);
    inputs.push_back(mask[0]);
  }
  return mx::array({B, q.shape(1), q.shape(2), Dv}, mx::float32,
                   std::make_shared<FlashserveQuantSDPA>(cpu_stream(), mode, scale, group, bits),
                   std::move(inputs));
}

}  // namespace

void add_sdpa_quant(nb::module_& m) {
  m.def("sdpa_quant", &sdpa_quant, "q"_a, "k"_a, "v"_a, "mask"_a, "mask_mode"_a, "scale"_a,
        "group_size"_a, "bits"_a,
        "softmax(scale * q k^T + mask) v over MLX-quantized k and v, each (packed, scales, "
        "biases), as one op; mask: [] or [mask]");
}
