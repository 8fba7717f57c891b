// The int16 decode kernel (qmm_avx512_int.cpp) on 256-bit vectors, for CPUs
// with AVX2 but not AVX-512 (most laptops' x86 CPUs): the same rounding of x,
// the same pairing of nibbles or bytes with x's int16s, one column's weights
// read as one prefetched stream. The float AVX2 kernel (qmm_kernels.cpp)
// unpacks every value to a float and dequantizes it before its FMA, which
// bounds it at ~9.5 GB/s on one core; here 64 4-bit weights cost a few ANDs
// and shifts and four integer dot products.
//
// As in the AVX-512 kernel, a (row, column) pair's arithmetic is fixed: the
// same numbers alone and in a batch, on any thread count, with AVX-VNNI or
// without it.
#include <immintrin.h>

#include <algorithm>
#include <cstring>

#include "qmm_isa.h"

namespace flashserve_qmm::detail {
namespace {

constexpr int PREFETCH_INT = 8192;    // bytes ahead of a column's weights (qmm_avx512_int.cpp)
constexpr int PREFETCH_SCALES = 1024;  // and of its scales and biases

// What every tile of one call shares (a load is 8 words).
struct Shape8 {
  int groups;          // groups in a row
  int full;            // whole 32-byte chunks in a row
  int tail;            // values in the last, short chunk (4 bits: 0 or 32)
  int per_chunk;       // groups in a whole chunk (1 or 2)
  int gshift;          // log2(group_size)
  __m256i lane_group;  // lane -> group within a chunk
  __m256i tail_mask;   // the short chunk's words
};

__attribute__((target("avx2"))) inline Shape8 shape8(const QmmProblem& p) {
  Shape8 s;
  const int per_word = 32 / p.bits, chunk = 8 * per_word;
  s.gshift = p.group_size == 32 ? 5 : p.group_size == 64 ? 6 : 7;
  s.groups = p.K >> s.gshift;
  s.full = p.K / chunk;
  s.tail = p.K - s.full * chunk;
  s.per_chunk = std::max(1, chunk >> s.gshift);
  alignas(32) int32_t lg[8], tm[8];
  for (int d = 0; d < 8; ++d) {
    lg[d] = (per_word * d) >> s.gshift;
    tm[d] = d < s.tail / per_word ? -1 : 0;
  }
  s.lane_group = _mm256_load_si256(reinterpret_cast<const __m256i*>(lg));
  s.tail_mask = _mm256_load_si256(reinterpret_cast<const __m256i*>(tm));
  return s;
}

// Up to 8 biases from element `at` (`left` of them in the row), zero past it: one
// vector load where 8 remain (single stores read back as a vector stalled the
// kernel on store forwarding).
template <ScaleType ST>
__attribute__((target("avx2,f16c"))) inline __m256 biases8(const void* base, int64_t at,
                                                            int left) {
  if constexpr (ST == ScaleType::f32) {
    const float* p = static_cast<const float*>(base) + at;
    if (left >= 8) return _mm256_loadu_ps(p);
    alignas(32) float tail[8] = {};
    std::memcpy(tail, p, sizeof(float) * left);
    return _mm256_load_ps(tail);
  } else {
    const uint16_t* p = static_cast<const uint16_t*>(base) + at;
    __m128i h;
    if (left >= 8) {
      h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
    } else {
      alignas(16) uint16_t tail[8] = {};
      std::memcpy(tail, p, sizeof(uint16_t) * left);
      h = _mm_load_si128(reinterpret_cast<const __m128i*>(tail));
    }
    if constexpr (ST == ScaleType::f16) return _mm256_cvtph_ps(h);
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
  }
}

// COUNT (1 or 2) scales from element `at`, as floats in the low lanes: one
// small load and a conversion, not a scalar conversion each.
template <ScaleType ST, int COUNT>
__attribute__((target("avx2,f16c"))) inline __m128 scales_at(const void* base, int64_t at) {
  if constexpr (ST == ScaleType::f32) {
    uint64_t bits = 0;
    std::memcpy(&bits, static_cast<const float*>(base) + at, 4 * COUNT);
    return _mm_castsi128_ps(_mm_cvtsi64_si128(int64_t(bits)));
  } else {
    uint32_t bits = 0;
    std::memcpy(&bits, static_cast<const uint16_t*>(base) + at, 2 * COUNT);
    const __m128i h = _mm_cvtsi32_si128(int32_t(bits));
    if constexpr (ST == ScaleType::f16) {
      return _mm_cvtph_ps(h);
    } else {
      return _mm_castsi128_ps(_mm_unpacklo_epi16(_mm_setzero_si128(), h));
    }
  }
}

// The lanes' sum in a fixed order: halves, then pairs, then the last two.
__attribute__((target("avx2"))) inline float sum8(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

}  // namespace

#pragma GCC push_options
#pragma GCC target("avx2,fma,f16c")
namespace ymm_madd {
inline __m256i idot(__m256i acc, __m256i w, __m256i x) {
  return _mm256_add_epi32(acc, _mm256_madd_epi16(w, x));
}
#include "qmm_int_tile_ymm.inc"
}  // namespace ymm_madd
#pragma GCC pop_options

#pragma GCC push_options
#pragma GCC target("avx2,fma,f16c,avxvnni")
namespace ymm_vnni {
inline __m256i idot(__m256i acc, __m256i w, __m256i x) {
  return _mm256_dpwssd_avx_epi32(acc, w, x);
}
#include "qmm_int_tile_ymm.inc"
}  // namespace ymm_vnni
#pragma GCC pop_options

bool avxvnni_supported() {
  __builtin_cpu_init();
  return __builtin_cpu_supports("avxvnni") && __builtin_cpu_supports("avx2") &&
         __builtin_cpu_supports("fma") && __builtin_cpu_supports("f16c");
}

ColumnsFn avx2_int_columns(int bits, ScaleType st, bool vnni) {
  if (vnni && avxvnni_supported()) return ymm_vnni::pick(bits, st);
  return ymm_madd::pick(bits, st);
}

}  // namespace flashserve_qmm::detail
