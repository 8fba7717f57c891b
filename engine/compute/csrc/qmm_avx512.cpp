// The AVX-512 kernel for 4- and 8-bit weights (the widths of GGUF Q4/Q8 models
// and of mlx-lm's default quantization). qmm_kernels.cpp picks it at run time
// when the CPU has AVX-512; the AVX2 kernel stays for every other case.
//
// Two changes from the AVX2 kernel, both to do less work per weight:
//
// - The group's scale and bias are factored out of the sum:
//     sum_k x_k (s q_k + b) = s * sum_k x_k q_k + b * sum_k x_k
//   so a weight costs one FMA (x * q), not two; the sums of x over each group
//   are computed once per call (prepare), the bias term once per column.
//
// - 4-bit values become floats through a 16-entry table: vpermps reads only
//   the low 4 bits of each 32-bit index, so shifting the packed words right by
//   4 * j and looking them up yields nibble j of all 16 words in one
//   instruction, with no masking or int-to-float conversion. Lane d of that
//   vector is value 8d + j, so x is permuted to match once per call.
//
// A (row, column) pair is computed in the same order whatever the tile, the
// number of rows or the thread count, as in the AVX2 kernel.
#include <immintrin.h>

#include <algorithm>
#include <cstring>

#include "qmm_isa.h"

#define QMM512 __attribute__((target("avx512f,avx512bw,avx512dq,avx512vl,fma,f16c")))

namespace flashserve_qmm::detail {
namespace {

constexpr int CHUNK4 = 128;  // 4-bit values in one 64-byte load: 16 words of 8 nibbles

// Bytes ahead of each weight row's read to prefetch. A tile reads a few short
// rows (288 bytes for 576 4-bit values) before moving on, too little for the
// hardware prefetcher to ramp up; asking ahead (the next tiles' rows, which
// follow in memory) took a full 4-bit model pass from ~13 to ~10.5 ms on one
// core at 1 KB. At 3 KB the one-stream decode of the default model ran ~1.1x
// faster again (interleaved rounds in one process), mostly in the 8-bit head,
// which reads twice the bytes per value and so ran out of 1 KB of lead twice
// as fast; 2 KB was between, 4-8 KB no better, non-temporal hints no better,
// and 4 streams were unchanged. Prefetches never fault, so reading past the
// matrix is harmless.
constexpr int PREFETCH = 3072;

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

template <ScaleType ST>
QMM512 inline float scale_at(const void* p, int64_t i) {
  if constexpr (ST == ScaleType::f32) {
    return static_cast<const float*>(p)[i];
  } else if constexpr (ST == ScaleType::f16) {
    return _cvtsh_ss(static_cast<const uint16_t*>(p)[i]);
  } else {
    uint32_t u = uint32_t(static_cast<const uint16_t*>(p)[i]) << 16;
    float f;
    std::memcpy(&f, &u, sizeof(f));
    return f;
  }
}

inline __mmask16 low_lanes(int n) { return n >= 16 ? __mmask16(0xFFFF) : __mmask16((1u << n) - 1); }

// tot[m][c] += sum_g bias[c][g] * xsum[m][g]: the factored-out bias term.
template <int MR, int NC, ScaleType ST>
QMM512 inline void add_bias_terms(const QmmProblem& p, const Prepared& x, int m0, int n0,
                                  __m512 tot[MR][NC]) {
  const int groups = p.K / p.group_size;
  for (int g = 0; g < groups; g += 16) {
    const __mmask16 mask = low_lanes(groups - g);
    for (int c = 0; c < NC; ++c) {
      const __m512 b = load_scales<ST>(p.biases, int64_t(n0 + c) * p.s_stride + g, mask);
      for (int m = 0; m < MR; ++m) {
        const __m512 s = _mm512_maskz_loadu_ps(mask, x.xsum + int64_t(m0 + m) * x.sum_stride + g);
        tot[m][c] = _mm512_fmadd_ps(b, s, tot[m][c]);
      }
    }
  }
}

template <int MR, int NC>
QMM512 inline void store(const QmmProblem& p, int m0, int n0, __m512 tot[MR][NC]) {
  for (int m = 0; m < MR; ++m) {
    for (int c = 0; c < NC; ++c) {
      p.out[int64_t(m0 + m) * p.out_stride + n0 + c] = _mm512_reduce_add_ps(tot[m][c]);
    }
  }
}

// MR rows against NC columns, 4 bits: 128 values (one 64-byte load) per step.
template <int MR, int NC, ScaleType ST>
QMM512 void tile4(const QmmProblem& p, const Prepared& x, int m0, int n0) {
  const __m512 lut = _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
  const int groups = p.K / p.group_size;
  const int per_chunk = CHUNK4 / p.group_size;
  // Lane d holds values 8d..8d+7 of the chunk: group 8d / group_size in it.
  const int shift = p.group_size == 32 ? 2 : p.group_size == 64 ? 3 : 4;
  const __m512i lane_group = _mm512_srl_epi32(
      _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15),
      _mm_cvtsi32_si128(shift));
  const uint8_t* rows[NC];
  for (int c = 0; c < NC; ++c) {
    rows[c] = reinterpret_cast<const uint8_t*>(p.w + int64_t(n0 + c) * p.w_stride);
  }
  __m512 tot[MR][NC];
  for (int m = 0; m < MR; ++m) {
    for (int c = 0; c < NC; ++c) tot[m][c] = _mm512_setzero_ps();
  }
  for (int k0 = 0, g0 = 0; k0 < p.K; k0 += CHUNK4, g0 += per_chunk) {
    const __mmask16 wmask = low_lanes((p.K - k0) / 8);
    const __mmask16 smask = low_lanes(std::min(per_chunk, groups - g0));
    __m512i w[NC];
    __m512 s[NC];
    __m512 acc[MR][NC];
    for (int c = 0; c < NC; ++c) {
      _mm_prefetch(reinterpret_cast<const char*>(rows[c] + k0 / 2 + PREFETCH), _MM_HINT_T0);
      w[c] = _mm512_maskz_loadu_epi32(wmask, rows[c] + k0 / 2);
      s[c] = _mm512_permutexvar_ps(
          lane_group, load_scales<ST>(p.scales, int64_t(n0 + c) * p.s_stride + g0, smask));
      for (int m = 0; m < MR; ++m) acc[m][c] = _mm512_setzero_ps();
    }
#pragma GCC unroll 8
    for (int j = 0; j < 8; ++j) {
      for (int c = 0; c < NC; ++c) {
        const __m512 q = _mm512_permutexvar_ps(_mm512_srli_epi32(w[c], 4 * j), lut);
        for (int m = 0; m < MR; ++m) {
          const float* xr = x.xs + int64_t(m0 + m) * x.x_stride + k0 + 16 * j;
          acc[m][c] = _mm512_fmadd_ps(_mm512_loadu_ps(xr), q, acc[m][c]);
        }
      }
    }
    for (int m = 0; m < MR; ++m) {
      for (int c = 0; c < NC; ++c) tot[m][c] = _mm512_fmadd_ps(acc[m][c], s[c], tot[m][c]);
    }
  }
  add_bias_terms<MR, NC, ST>(p, x, m0, n0, tot);
  store<MR, NC>(p, m0, n0, tot);
}

// MR rows against NC columns, 8 bits: a group at a time, 16 values per vector.
template <int MR, int NC, ScaleType ST>
QMM512 void tile8(const QmmProblem& p, const Prepared& x, int m0, int n0) {
  const int groups = p.K / p.group_size;
  const uint8_t* rows[NC];
  for (int c = 0; c < NC; ++c) {
    rows[c] = reinterpret_cast<const uint8_t*>(p.w + int64_t(n0 + c) * p.w_stride);
  }
  __m512 tot[MR][NC];
  for (int m = 0; m < MR; ++m) {
    for (int c = 0; c < NC; ++c) tot[m][c] = _mm512_setzero_ps();
  }
  for (int g = 0; g < groups; ++g) {
    __m512 acc[MR][NC];
    for (int m = 0; m < MR; ++m) {
      for (int c = 0; c < NC; ++c) acc[m][c] = _mm512_setzero_ps();
    }
    const int k_end = (g + 1) * p.group_size;
    for (int k0 = g * p.group_size; k0 < k_end; k0 += 16) {
      for (int c = 0; c < NC; ++c) {
        if ((k0 & 63) == 0) {
          _mm_prefetch(reinterpret_cast<const char*>(rows[c] + k0 + PREFETCH), _MM_HINT_T0);
        }
        const __m512 q = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(
            _mm_loadu_si128(reinterpret_cast<const __m128i*>(rows[c] + k0))));
        for (int m = 0; m < MR; ++m) {
          const float* xr = x.xs + int64_t(m0 + m) * x.x_stride + k0;
          acc[m][c] = _mm512_fmadd_ps(_mm512_loadu_ps(xr), q, acc[m][c]);
        }
      }
    }
    for (int c = 0; c < NC; ++c) {
      const __m512 s = _mm512_set1_ps(scale_at<ST>(p.scales, int64_t(n0 + c) * p.s_stride + g));
      for (int m = 0; m < MR; ++m) tot[m][c] = _mm512_fmadd_ps(acc[m][c], s, tot[m][c]);
    }
  }
  add_bias_terms<MR, NC, ST>(p, x, m0, n0, tot);
  store<MR, NC>(p, m0, n0, tot);
}

template <int BITS, int MR, int NC, ScaleType ST>
QMM512 inline void tile(const QmmProblem& p, const Prepared& x, int m0, int n0) {
  if constexpr (BITS == 4) {
    tile4<MR, NC, ST>(p, x, m0, n0);
  } else {
    tile8<MR, NC, ST>(p, x, m0, n0);
  }
}

// Columns in blocks whose packed weights stay in cache while every row tile
// uses them; up to 4 rows at a time.
template <int BITS, ScaleType ST>
QMM512 void columns(const QmmProblem& p, const Prepared& x, int n_begin, int n_end) {
  const int64_t row_bytes = int64_t(p.K) * BITS / 8;
  const int block = int(std::max<int64_t>(8, (48 * 1024) / std::max<int64_t>(1, row_bytes)));
  for (int nb = n_begin; nb < n_end; nb += block) {
    const int ne = std::min(n_end, nb + block);
    for (int m0 = 0; m0 < p.M;) {
      const int mr = std::min(4, p.M - m0);
      int n = nb;
      switch (mr) {
        case 1:
          for (; n + 4 <= ne; n += 4) tile<BITS, 1, 4, ST>(p, x, m0, n);
          for (; n < ne; ++n) tile<BITS, 1, 1, ST>(p, x, m0, n);
          break;
        case 2:
          for (; n + 4 <= ne; n += 4) tile<BITS, 2, 4, ST>(p, x, m0, n);
          for (; n < ne; ++n) tile<BITS, 2, 1, ST>(p, x, m0, n);
          break;
        case 3:
          for (; n + 2 <= ne; n += 2) tile<BITS, 3, 2, ST>(p, x, m0, n);
          for (; n < ne; ++n) tile<BITS, 3, 1, ST>(p, x, m0, n);
          break;
        default:
          for (; n + 2 <= ne; n += 2) tile<BITS, 4, 2, ST>(p, x, m0, n);
          for (; n < ne; ++n) tile<BITS, 4, 1, ST>(p, x, m0, n);
          break;
      }
      m0 += mr;
    }
  }
}

template <int BITS>
ColumnsFn pick_scales(ScaleType st) {
  switch (st) {
    case ScaleType::f32: return columns<BITS, ScaleType::f32>;
    case ScaleType::f16: return columns<BITS, ScaleType::f16>;
    default: return columns<BITS, ScaleType::bf16>;
  }
}

}  // namespace

bool avx512_supported() {
  __builtin_cpu_init();
  return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
         __builtin_cpu_supports("avx512dq") && __builtin_cpu_supports("avx512vl") &&
         __builtin_cpu_supports("fma") && __builtin_cpu_supports("f16c");
}

ColumnsFn avx512_columns(int bits, ScaleType st) {
  if (bits == 4) return pick_scales<4>(st);
  if (bits == 8) return pick_scales<8>(st);
  return nullptr;
}

// 4 bits: each chunk of 128 values as 8 vectors, vector j lane d = x[8d + j],
// zero-padded to whole chunks (the weights' tail lanes are masked to zero,
// and 0 * 0 keeps the sum exact). 8 bits: the rows as they are. Both: the
// sum of x over each group, zero-padded to whole vectors of 16.
QMM512 Prepared avx512_prepare(const QmmProblem& p, std::vector<float>& buf) {
  const int64_t stride = p.bits == 4 ? (int64_t(p.K) + CHUNK4 - 1) / CHUNK4 * CHUNK4 : p.K;
  const int groups = p.K / p.group_size;
  const int64_t sum_stride = (groups + 15) / 16 * 16;
  buf.resize(size_t(p.M) * (stride + sum_stride));
  float* xs = buf.data();
  float* sums = xs + int64_t(p.M) * stride;
  // Lane d of vector j is value 8d + j of the chunk.
  const __m512i by_lane = _mm512_setr_epi32(0, 8, 16, 24, 32, 40, 48, 56, 64, 72, 80, 88, 96, 104,
                                            112, 120);
  for (int m = 0; m < p.M; ++m) {
    const float* src = p.x[m];
    float* dst = xs + int64_t(m) * stride;
    if (p.bits == 4) {
      for (int k0 = 0; k0 < p.K; k0 += CHUNK4) {
        alignas(64) float tail[CHUNK4];
        const float* chunk = src + k0;
        if (p.K - k0 < CHUNK4) {  // the last, short chunk: zero-padded
          std::memset(tail, 0, sizeof(tail));
          std::memcpy(tail, chunk, sizeof(float) * (p.K - k0));
          chunk = tail;
        }
        for (int j = 0; j < 8; ++j) {
          const __m512i at = _mm512_add_epi32(by_lane, _mm512_set1_epi32(j));
          _mm512_storeu_ps(dst + k0 + 16 * j, _mm512_i32gather_ps(at, chunk, 4));
        }
      }
    } else {
      std::memcpy(dst, src, sizeof(float) * p.K);
    }
    float* row_sums = sums + int64_t(m) * sum_stride;
    for (int g = 0; g < groups; ++g) {
      // 16 lanes of partial sums, then the lanes in a fixed order.
      __m512 acc = _mm512_setzero_ps();
      for (int k = g * p.group_size; k < (g + 1) * p.group_size; k += 16) {
        acc = _mm512_add_ps(acc, _mm512_loadu_ps(src + k));
      }
      row_sums[g] = _mm512_reduce_add_ps(acc);
    }
    for (int g = groups; g < sum_stride; ++g) row_sums[g] = 0.0f;
  }
  return Prepared{xs, stride, sums, sum_stride};
}

}  // namespace flashserve_qmm::detail
