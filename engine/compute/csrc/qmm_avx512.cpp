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
//   vector is value 8d + j, so x is permuted to match once per call. 8-bit
//   values the same way: byte j of word d, shifted down, is value 4d + j.
//   Each lane stays in one group for a whole 64-byte load, so the scales are
//   applied once per load (128 4-bit or 64 8-bit values), not once per group.
//
// Cycles, not bandwidth, bound it at 4 rows (4 FMAs per 16 weights, one 512-bit
// FMA a cycle on Zen 4); what it does besides the FMAs is kept small: full
// chunks load unmasked, a chunk's scales come as one 8-byte load, and x's rows
// start on 64-byte lines (a split load costs two, and at 4 rows the loads of x
// are as many as the FMAs). One model pass of matmuls on one core, before ->
// after these: 4 rows 20.9 -> 16.9 ms, 1 row 8.5 -> 8.0 ms.
//
// Most of the model's matrices are 576 deep: 4.5 chunks, so what a tile does
// besides its chunks weighed ~40% at 4 rows (perf). The call's shape is worked
// out once (Shape), a last chunk of 64 values runs on 256-bit vectors, and a
// tile's 8 sums are reduced as one tree (reduce8): a pass on two cores at 4
// rows 9.1 -> 7.35 ms, 1 row unchanged (4.3 ms).
//
// A (row, column) pair is computed in the same order whatever the tile, the
// number of rows or the thread count, as in the AVX2 kernel.
#include <immintrin.h>

#include <algorithm>
#include <cstring>

#include "qmm_avx512_parts.h"

namespace flashserve_qmm::detail {
namespace {

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

// A tile's weight rows (one per column), its rows of prepared x, and its sums at zero.
template <int MR, int NC>
QMM512 inline void start_tile(const QmmProblem& p, const Prepared& x, int m0, int n0,
                              const uint8_t* rows[NC], const float* xr[MR],
                              __m512 tot[MR][NC]) {
  for (int c = 0; c < NC; ++c) {
    rows[c] = reinterpret_cast<const uint8_t*>(p.w + int64_t(n0 + c) * p.w_stride);
  }
  for (int m = 0; m < MR; ++m) {
    xr[m] = x.xs + int64_t(m0 + m) * x.x_stride;
    for (int c = 0; c < NC; ++c) tot[m][c] = _mm512_setzero_ps();
  }
}

// tot += acc * the chunk's scales, each lane its group's.
template <int MR, int NC, ScaleType ST>
QMM512 inline void rescale(const QmmProblem& p, int n0, int g0, __mmask16 smask,
                           __m512i lane_group, __m512 acc[MR][NC], __m512 tot[MR][NC]) {
  constexpr int SB = ST == ScaleType::f32 ? 4 : 2;
  for (int c = 0; c < NC; ++c) {
    // The scales and biases stream too: prefetched, one core's pass over a 1.2B
    // model's 4-bit weights went from ~13.4 to ~19.5 GB/s (qmm_avx512_int.cpp).
    const int64_t at = (int64_t(n0 + c) * p.s_stride + g0) * SB + 1024;
    _mm_prefetch(static_cast<const char*>(p.scales) + at, _MM_HINT_T0);
    _mm_prefetch(static_cast<const char*>(p.biases) + at, _MM_HINT_T0);
    const __m512 s = _mm512_permutexvar_ps(
        lane_group, chunk_scales4<ST>(p.scales, int64_t(n0 + c) * p.s_stride + g0, __mmask8(smask)));
    for (int m = 0; m < MR; ++m) tot[m][c] = _mm512_fmadd_ps(acc[m][c], s, tot[m][c]);
  }
}

// MR rows against NC columns, 4 bits: 128 values (one 64-byte load) per chunk; full
// chunks load unmasked, the last, short one masked.
template <int MR, int NC, ScaleType ST, bool MASKED>
QMM512 inline void chunk4(const uint8_t* const rows[NC], const float* const xr[MR],
                          const QmmProblem& p, int n0, int k0, int g0,
                          __mmask16 wmask, __mmask16 smask, __m512i lane_group, __m512 lut,
                          __m512 tot[MR][NC]) {
  __m512i w[NC];
  __m512 acc[MR][NC];
  for (int c = 0; c < NC; ++c) {
    _mm_prefetch(reinterpret_cast<const char*>(rows[c] + k0 / 2 + PREFETCH), _MM_HINT_T0);
    if constexpr (MASKED) {
      w[c] = _mm512_maskz_loadu_epi32(wmask, rows[c] + k0 / 2);
    } else {
      w[c] = _mm512_loadu_si512(rows[c] + k0 / 2);
    }
  }
#pragma GCC unroll 8
  for (int j = 0; j < 8; ++j) {
    for (int c = 0; c < NC; ++c) {
      const __m512 q = _mm512_permutexvar_ps(_mm512_srli_epi32(w[c], 4 * j), lut);
      for (int m = 0; m < MR; ++m) {
        const __m512 xv = _mm512_load_ps(xr[m] + k0 + 16 * j);
        acc[m][c] = j == 0 ? _mm512_mul_ps(xv, q) : _mm512_fmadd_ps(xv, q, acc[m][c]);
      }
    }
  }
  rescale<MR, NC, ST>(p, n0, g0, smask, lane_group, acc, tot);
}

// A short last chunk of at most 64 values holds its weights in 8 lanes: the
// same arithmetic as chunk4 on the low half of the vectors (the high lanes
// would add 0 * 0), at half the FMAs. Bit for bit the masked chunk's result.
// One row stays on the masked chunk: its FMAs are not what bounds it, and the
// two-table lookup on 256 bits costs more than the 512-bit one.
template <int MR, int NC, ScaleType ST>
QMM512 inline void half_chunk4(const uint8_t* const rows[NC], const float* const xr[MR],
                               const QmmProblem& p, const Shape& s, int n0, int k0, int g0,
                               __m512 lut, __m512 tot[MR][NC]) {
  const __m256 lut_lo = _mm512_castps512_ps256(lut);
  const __m256 lut_hi = _mm512_extractf32x8_ps(lut, 1);
  __m256i w[NC];
  __m256 acc[MR][NC];
  for (int c = 0; c < NC; ++c) {
    w[c] = _mm256_maskz_loadu_epi32(__mmask8(s.tail_w), rows[c] + k0 / 2);
  }
#pragma GCC unroll 8
  for (int j = 0; j < 8; ++j) {
    for (int c = 0; c < NC; ++c) {
      const __m256i idx = _mm256_srli_epi32(w[c], 4 * j);
      const __m256 q = _mm256_permutex2var_ps(lut_lo, idx, lut_hi);
      for (int m = 0; m < MR; ++m) {
        const __m256 xv = _mm256_load_ps(xr[m] + k0 + 16 * j);
        acc[m][c] = j == 0 ? _mm256_mul_ps(xv, q) : _mm256_fmadd_ps(xv, q, acc[m][c]);
      }
    }
  }
  for (int c = 0; c < NC; ++c) {
    const __m256 sc = _mm512_castps512_ps256(_mm512_permutexvar_ps(
        s.lane_group,
        chunk_scales4<ST>(p.scales, int64_t(n0 + c) * p.s_stride + g0, __mmask8(s.tail_s))));
    for (int m = 0; m < MR; ++m) {
      const __m256 lo = _mm256_fmadd_ps(acc[m][c], sc, _mm512_castps512_ps256(tot[m][c]));
      tot[m][c] = _mm512_insertf32x8(tot[m][c], lo, 0);
    }
  }
}

template <int MR, int NC, ScaleType ST>
QMM512 void tile4(const QmmProblem& p, const Prepared& x, const Shape& s, int m0, int n0) {
  const __m512 lut = _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
  const uint8_t* rows[NC];
  const float* xr[MR];
  __m512 tot[MR][NC];
  start_tile<MR, NC>(p, x, m0, n0, rows, xr, tot);
  int k0 = 0, g0 = 0;
  for (int i = 0; i < s.full; ++i, k0 += CHUNK4, g0 += s.per_chunk) {
    chunk4<MR, NC, ST, false>(rows, xr, p, n0, k0, g0, 0xFFFF, s.smask, s.lane_group, lut, tot);
  }
  if (s.tail > CHUNK4 / 2 || (MR == 1 && s.tail > 0)) {
    chunk4<MR, NC, ST, true>(rows, xr, p, n0, k0, g0, s.tail_w, s.tail_s, s.lane_group, lut,
                             tot);
  } else if (s.tail > 0) {
    half_chunk4<MR, NC, ST>(rows, xr, p, s, n0, k0, g0, lut, tot);
  }
  add_bias_terms<MR, NC, ST>(p, x, s.groups, m0, n0, tot);
  store<MR, NC>(p, m0, n0, tot);
}

// MR rows against NC columns, 8 bits: 64 values (one 64-byte load) per chunk.
// Lane d of a load holds values 4d..4d+3; byte j of every lane, shifted down and
// masked, is vector j, so x is permuted to match (avx512_prepare) and each lane
// stays in one group: one rescaling per 64 values, not per group of 16.
template <int MR, int NC, ScaleType ST, bool MASKED>
QMM512 inline void chunk8(const uint8_t* const rows[NC], const float* const xr[MR],
                          const QmmProblem& p, int n0, int k0, int g0, __mmask16 wmask,
                          __mmask16 smask, __m512i lane_group, __m512 tot[MR][NC]) {
  const __m512i byte = _mm512_set1_epi32(0xFF);
  __m512i w[NC];
  __m512 acc[MR][NC];
  for (int c = 0; c < NC; ++c) {
    _mm_prefetch(reinterpret_cast<const char*>(rows[c] + k0 + PREFETCH), _MM_HINT_T0);
    if constexpr (MASKED) {
      w[c] = _mm512_maskz_loadu_epi32(wmask, rows[c] + k0);
    } else {
      w[c] = _mm512_loadu_si512(rows[c] + k0);
    }
  }
#pragma GCC unroll 4
  for (int j = 0; j < 4; ++j) {
    __m512 xv[MR];
    for (int m = 0; m < MR; ++m) {
      xv[m] = _mm512_load_ps(xr[m] + k0 + 16 * j);
      // Held in a register for every column: GCC would fold the load into each
      // column's FMA, and loads, not FMAs, then bound the 4-row tile (8.6 -> 7.6
      // cycles per 16 weights; the 4-bit tile is FMA-bound and gains nothing).
      if constexpr (NC > 1) __asm__("" : "+v"(xv[m]));
    }
    for (int c = 0; c < NC; ++c) {
      const __m512i v = j == 3 ? _mm512_srli_epi32(w[c], 24)
                               : _mm512_and_si512(_mm512_srli_epi32(w[c], 8 * j), byte);
      const __m512 q = _mm512_cvtepi32_ps(v);
      for (int m = 0; m < MR; ++m) {
        acc[m][c] = j == 0 ? _mm512_mul_ps(xv[m], q) : _mm512_fmadd_ps(xv[m], q, acc[m][c]);
      }
    }
  }
  rescale<MR, NC, ST>(p, n0, g0, smask, lane_group, acc, tot);
}

template <int MR, int NC, ScaleType ST>
QMM512 void tile8(const QmmProblem& p, const Prepared& x, const Shape& s, int m0, int n0) {
  const uint8_t* rows[NC];
  const float* xr[MR];
  __m512 tot[MR][NC];
  start_tile<MR, NC>(p, x, m0, n0, rows, xr, tot);
  int k0 = 0;
  for (int i = 0; i < s.full; ++i, k0 += CHUNK8) {
    chunk8<MR, NC, ST, false>(rows, xr, p, n0, k0, k0 >> s.gshift, 0xFFFF, s.smask,
                              s.lane_group, tot);
  }
  if (s.tail > 0) {  // half a chunk: K is a multiple of 32
    chunk8<MR, NC, ST, true>(rows, xr, p, n0, k0, k0 >> s.gshift, s.tail_w, s.tail_s,
                             s.lane_group, tot);
  }
  add_bias_terms<MR, NC, ST>(p, x, s.groups, m0, n0, tot);
  store<MR, NC>(p, m0, n0, tot);
}

template <int BITS, int MR, int NC, ScaleType ST>
QMM512 inline void tile(const QmmProblem& p, const Prepared& x, const Shape& s, int m0, int n0) {
  if constexpr (BITS == 4) {
    tile4<MR, NC, ST>(p, x, s, m0, n0);
  } else {
    tile8<MR, NC, ST>(p, x, s, m0, n0);
  }
}

// Columns in blocks whose packed weights stay in cache while every row tile
// uses them; up to 4 rows at a time.
template <int BITS, ScaleType ST>
QMM512 void columns(const QmmProblem& p, const Prepared& x, int n_begin, int n_end) {
  const int64_t row_bytes = int64_t(p.K) * BITS / 8;
  const int block = int(std::max<int64_t>(8, (48 * 1024) / std::max<int64_t>(1, row_bytes)));
  const Shape s = BITS == 4 ? shape_of(p, CHUNK4, 8) : shape_of(p, CHUNK8, 4);
  for (int nb = n_begin; nb < n_end; nb += block) {
    const int ne = std::min(n_end, nb + block);
    for (int m0 = 0; m0 < p.M;) {
      const int mr = std::min(4, p.M - m0);
      int n = nb;
      switch (mr) {
        case 1:
          for (; n + 4 <= ne; n += 4) tile<BITS, 1, 4, ST>(p, x, s, m0, n);
          for (; n < ne; ++n) tile<BITS, 1, 1, ST>(p, x, s, m0, n);
          break;
        case 2:
          for (; n + 4 <= ne; n += 4) tile<BITS, 2, 4, ST>(p, x, s, m0, n);
          for (; n < ne; ++n) tile<BITS, 2, 1, ST>(p, x, s, m0, n);
          break;
        case 3:
          for (; n + 2 <= ne; n += 2) tile<BITS, 3, 2, ST>(p, x, s, m0, n);
          for (; n < ne; ++n) tile<BITS, 3, 1, ST>(p, x, s, m0, n);
          break;
        default:
          for (; n + 2 <= ne; n += 2) tile<BITS, 4, 2, ST>(p, x, s, m0, n);
          for (; n < ne; ++n) tile<BITS, 4, 1, ST>(p, x, s, m0, n);
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
// and 0 * 0 keeps the sum exact). 8 bits: each chunk of 64 values as 4
// vectors, vector j lane d = x[4d + j], padded the same way. Both: the sum of
// x over each group, zero-padded to whole vectors of 16.
QMM512 Prepared avx512_prepare(const QmmProblem& p, std::vector<float>& buf) {
  const int chunk = p.bits == 4 ? CHUNK4 : CHUNK8;
  const int64_t stride = (int64_t(p.K) + chunk - 1) / chunk * chunk;
  const int groups = p.K / p.group_size;
  const int64_t sum_stride = (groups + 15) / 16 * 16;
  // 16 floats of slack: the rows start on a 64-byte line (the kernel's aligned loads).
  buf.resize(size_t(p.M) * (stride + sum_stride) + 16);
  const uintptr_t start = reinterpret_cast<uintptr_t>(buf.data());
  float* xs = reinterpret_cast<float*>((start + 63) & ~uintptr_t(63));
  float* sums = xs + int64_t(p.M) * stride;
  // Lane d of vector j is value per_word * d + j of the chunk.
  const int per_word = 32 / p.bits;
  const __m512i by_lane = _mm512_mullo_epi32(
      _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15),
      _mm512_set1_epi32(per_word));
  for (int m = 0; m < p.M; ++m) {
    const float* src = p.x[m];
    float* dst = xs + int64_t(m) * stride;
    for (int k0 = 0; k0 < p.K; k0 += chunk) {
      alignas(64) float tail[CHUNK4];
      const float* values = src + k0;
      if (p.K - k0 < chunk) {  // the last, short chunk: zero-padded
        std::memset(tail, 0, sizeof(tail));
        std::memcpy(tail, values, sizeof(float) * (p.K - k0));
        values = tail;
      }
      for (int j = 0; j < per_word; ++j) {
        const __m512i at = _mm512_add_epi32(by_lane, _mm512_set1_epi32(j));
        _mm512_store_ps(dst + k0 + 16 * j, _mm512_i32gather_ps(at, values, 4));
      }
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
