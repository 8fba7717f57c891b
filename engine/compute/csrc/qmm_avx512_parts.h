// What the two AVX-512 kernels for 4- and 8-bit weights share: x as floats
// (qmm_avx512.cpp) and x rounded to int16 (qmm_avx512_int.cpp). Both keep a
// chunk's values in the lanes of one 64-byte load of packed words, so a
// chunk's scales are applied once per load, and both factor the groups' biases
// out of the sum (add_bias_terms). Included by those two files only.
#pragma once

#include <immintrin.h>

#include <algorithm>
#include <cstdint>

#include "qmm_isa.h"

#define QMM512 __attribute__((target("avx512f,avx512bw,avx512dq,avx512vl,fma,f16c")))

namespace flashserve_qmm::detail {
namespace {

constexpr int CHUNK4 = 128;  // 4-bit values in one 64-byte load: 16 words of 8 nibbles
constexpr int CHUNK8 = 64;   // 8-bit values in one 64-byte load: 16 words of 4 bytes

// `count` (<= 16) scales or biases starting at element `at`, as floats in the
// low lanes; masked loads never touch memory past the row.
template <ScaleType ST>
QMM512 inline __m512 load_scales(const void* base, int64_t at, __mmask16 mask) {
  if constexpr (ST == ScaleType::f32) {
    return _mm512_maskz_loadu_ps(mask, static_cast<const float*>(base) + at);
  } else {
    const __m256i h = _mm256_maskz_loadu_epi16(mask, static_cast<const uint16_t*>(base) + at);
    if constexpr (ST == ScaleType::f16) {
      return _mm512_cvtph_ps(h);
    } else {
      return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
    }
  }
}

// Up to 4 scales starting at element `at` (a chunk's groups), as floats in the low lanes.
template <ScaleType ST>
QMM512 inline __m512 chunk_scales4(const void* base, int64_t at, __mmask8 mask) {
  __m128 s;
  if constexpr (ST == ScaleType::f32) {
    s = _mm_maskz_loadu_ps(mask, static_cast<const float*>(base) + at);
  } else {
    const __m128i h = _mm_maskz_loadu_epi16(mask, static_cast<const uint16_t*>(base) + at);
    if constexpr (ST == ScaleType::f16) {
      s = _mm_cvtph_ps(h);
    } else {
      s = _mm_castsi128_ps(_mm_slli_epi32(_mm_cvtepu16_epi32(h), 16));
    }
  }
  return _mm512_castps128_ps512(s);
}

inline __mmask16 low_lanes(int n) { return n >= 16 ? __mmask16(0xFFFF) : __mmask16((1u << n) - 1); }

// tot[m][c] += sum_g bias[c][g] * xsum[m][g]: the factored-out bias term.
template <int MR, int NC, ScaleType ST>
QMM512 inline void add_bias_terms(const QmmProblem& p, const Prepared& x, int groups, int m0,
                                  int n0, __m512 tot[MR][NC]) {
  for (int g = 0; g < groups; g += 16) {
    const __mmask16 mask = low_lanes(groups - g);
    for (int c = 0; c < NC; ++c) {
      __m512 b = load_scales<ST>(p.biases, int64_t(n0 + c) * p.s_stride + g, mask);
      if (p.bias_times != 0.f) b = _mm512_mul_ps(b, _mm512_set1_ps(p.bias_times));
      for (int m = 0; m < MR; ++m) {
        const __m512 s = _mm512_maskz_loadu_ps(mask, x.xsum + int64_t(m0 + m) * x.sum_stride + g);
        tot[m][c] = _mm512_fmadd_ps(b, s, tot[m][c]);
      }
    }
  }
}

// The sums of 8 vectors, sum i in lane i: a transposing tree that adds the
// same pairs as _mm512_reduce_add_ps (lanes i and i + 8, then i and i + 4, i
// and i + 2, i and i + 1), so every tile shape rounds a column's sum alike,
// in 23 instructions instead of 8 x 11.
QMM512 inline __m256 reduce8(const __m512 v[8]) {
  __m512 h[4];  // h[k]: v[2k]'s 8 partial sums, then v[2k + 1]'s
  for (int k = 0; k < 4; ++k) {
    h[k] = _mm512_add_ps(_mm512_shuffle_f32x4(v[2 * k], v[2 * k + 1], 0x44),
                         _mm512_shuffle_f32x4(v[2 * k], v[2 * k + 1], 0xEE));
  }
  __m512 q[2];  // q[i]: 128-bit block k holds v[4i + k]'s 4 partial sums
  for (int i = 0; i < 2; ++i) {
    q[i] = _mm512_add_ps(_mm512_shuffle_f32x4(h[2 * i], h[2 * i + 1], 0x88),
                         _mm512_shuffle_f32x4(h[2 * i], h[2 * i + 1], 0xDD));
  }
  // Block k: v[k]'s 2 partial sums, then v[k + 4]'s.
  const __m512d lo = _mm512_unpacklo_pd(_mm512_castps_pd(q[0]), _mm512_castps_pd(q[1]));
  const __m512d hi = _mm512_unpackhi_pd(_mm512_castps_pd(q[0]), _mm512_castps_pd(q[1]));
  const __m512 u = _mm512_add_ps(_mm512_castpd_ps(lo), _mm512_castpd_ps(hi));
  const __m512 r = _mm512_add_ps(u, _mm512_permute_ps(u, 0xB1));
  const __m512i order = _mm512_setr_epi32(0, 4, 8, 12, 2, 6, 10, 14, 0, 0, 0, 0, 0, 0, 0, 0);
  return _mm512_castps512_ps256(_mm512_permutexvar_ps(order, r));
}

template <int MR, int NC>
QMM512 inline void store(const QmmProblem& p, int m0, int n0, __m512 tot[MR][NC]) {
  if constexpr (MR * NC == 1) {
    p.out[int64_t(m0) * p.out_stride + n0] = _mm512_reduce_add_ps(tot[0][0]);
  } else {
    static_assert(MR * NC <= 8);
    __m512 v[8];
    for (int i = 0; i < 8; ++i) v[i] = i < MR * NC ? tot[i / NC][i % NC] : _mm512_setzero_ps();
    alignas(32) float sums[8];
    _mm256_store_ps(sums, reduce8(v));
    for (int m = 0; m < MR; ++m) {
      for (int c = 0; c < NC; ++c) p.out[int64_t(m0 + m) * p.out_stride + n0 + c] = sums[m * NC + c];
    }
  }
}

// What every tile of one call shares, computed once per call (an integer
// division per tile showed in the profile of the 576-deep matrices).
struct Shape {
  int groups;          // groups in a row
  int full;            // whole 64-byte chunks in a row
  int tail;            // values in the last, short chunk (0: none)
  int per_chunk;       // groups in a whole chunk
  __mmask16 smask;     // a whole chunk's scales
  __mmask16 tail_w;    // the short chunk's words
  __mmask16 tail_s;    // the short chunk's scales
  int gshift;          // log2(group_size)
  __m512i lane_group;  // lane -> group within a chunk
};

QMM512 inline Shape shape_of(const QmmProblem& p, int chunk, int per_word) {
  Shape s;
  s.gshift = p.group_size == 32 ? 5 : p.group_size == 64 ? 6 : 7;
  s.groups = p.K >> s.gshift;
  s.full = p.K / chunk;
  s.tail = p.K - s.full * chunk;
  s.per_chunk = std::max(1, chunk >> s.gshift);
  s.smask = low_lanes(s.per_chunk);
  s.tail_w = low_lanes(s.tail / per_word);
  s.tail_s = low_lanes(std::max(1, s.tail >> s.gshift));
  // Lane d holds values per_word * d ..: group per_word * d / group_size.
  const int lane_shift = s.gshift - (per_word == 8 ? 3 : 2);
  s.lane_group = _mm512_srl_epi32(
      _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15),
      _mm_cvtsi32_si128(lane_shift));
  return s;
}

}  // namespace
}  // namespace flashserve_qmm::detail
