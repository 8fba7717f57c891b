// x's rows for the int16 decode kernels (qmm_avx512_int.cpp, qmm_avx2_int.cpp):
// each block of 32 values rounded exactly as the prompt GEMM rounds it
// (csrc/prompt_qgemm.cpp: max|x| / 32767, to nearest), laid out to meet one
// load of packed weights, with each lane's block scale and the rounded x's sum
// per group (the factored-out bias term sees the same x, as in the prompt GEMM).
// AVX2 code, so both kernels' machines run it; the rounding is the same
// instruction on every path.
#include <immintrin.h>

#include <cstring>
#include <vector>

#include "qmm_isa.h"

namespace flashserve_qmm::detail {
namespace {

// Where value c of a chunk goes among the int16s of x's layout, for a load of
// `words` 32-bit words: 4 bits, word d = c / 8 holds values 8d..8d+7, and vector
// j pairs nibbles j and j + 4 in lane d; 8 bits, word d = c / 4, vector j pairs
// bytes j and j + 2.
inline int slot_of(int c, int bits, int words) {
  const int per_word = 32 / bits, half = per_word / 2;
  const int d = c / per_word, e = c % per_word;
  return (e % half) * 2 * words + 2 * d + e / half;
}

}  // namespace

// Each row: int16 values in whole chunks of `words` words of weights (zero
// past K), laid out by slot_of; per chunk `words` floats, lane d the scale of
// the block its values are in (0 past K); per group the rounded x's sum,
// zero-padded to whole vectors of 16.
__attribute__((target("avx2,fma"))) Prepared int_prepare(const QmmProblem& p, int words,
                                                         std::vector<float>& buf) {
  const int per_word = 32 / p.bits;
  const int chunk = words * per_word;
  const int chunks = (p.K + chunk - 1) / chunk;
  const int64_t q_stride = int64_t(chunks) * chunk;  // int16s
  const int64_t lane_stride = int64_t(chunks) * words;
  const int blocks = p.K / 32, groups = p.K / p.group_size, per_group = p.group_size / 32;
  const int64_t sum_stride = (groups + 15) / 16 * 16;
  // Floats: the int16 rows (two per float), the lane scales, the sums, and a
  // line of slack so the rows start on a 64-byte line (aligned loads).
  buf.resize(size_t(p.M) * (q_stride / 2 + lane_stride + sum_stride) + 16);
  const uintptr_t start = reinterpret_cast<uintptr_t>(buf.data());
  float* base = reinterpret_cast<float*>((start + 63) & ~uintptr_t(63));
  int16_t* xq = reinterpret_cast<int16_t*>(base);
  float* xlane = base + int64_t(p.M) * q_stride / 2;
  float* sums = xlane + int64_t(p.M) * lane_stride;
  const __m256 abs_mask = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff));
  thread_local std::vector<float> bscale;  // per block of a row
  bscale.resize(blocks);
  for (int m = 0; m < p.M; ++m) {
    const float* src = p.x[m];
    int16_t* q = xq + int64_t(m) * q_stride;
    float* lanes = xlane + int64_t(m) * lane_stride;
    float* gsum = sums + int64_t(m) * sum_stride;
    std::memset(q, 0, sizeof(int16_t) * q_stride);
    for (int b = 0; b < blocks; ++b) {
      __m256 v[4];
      for (int i = 0; i < 4; ++i) v[i] = _mm256_loadu_ps(src + 32 * b + 8 * i);
      __m256 mx = _mm256_max_ps(
          _mm256_max_ps(_mm256_and_ps(v[0], abs_mask), _mm256_and_ps(v[1], abs_mask)),
          _mm256_max_ps(_mm256_and_ps(v[2], abs_mask), _mm256_and_ps(v[3], abs_mask)));
      __m128 m4 = _mm_max_ps(_mm256_castps256_ps128(mx), _mm256_extractf128_ps(mx, 1));
      m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
      m4 = _mm_max_ss(m4, _mm_movehdup_ps(m4));
      const float d = _mm_cvtss_f32(m4) / 32767.0f;
      const __m256 inv = _mm256_set1_ps(d != 0.0f ? 1.0f / d : 0.0f);
      alignas(32) int32_t n[32];
      for (int i = 0; i < 4; ++i) {  // to nearest, as the prompt GEMM
        _mm256_store_si256(reinterpret_cast<__m256i*>(n + 8 * i),
                           _mm256_cvtps_epi32(_mm256_mul_ps(v[i], inv)));
      }
      int32_t total = 0;
      for (int i = 0; i < 32; ++i) {
        const int c = 32 * b + i;
        q[int64_t(c / chunk) * chunk + slot_of(c % chunk, p.bits, words)] = int16_t(n[i]);
        total += n[i];
      }
      bscale[b] = d;
      const float sum = d * float(total);
      if (b % per_group == 0) {
        gsum[b / per_group] = sum;
      } else {
        gsum[b / per_group] += sum;
      }
    }
    for (int g = groups; g < sum_stride; ++g) gsum[g] = 0.0f;
    for (int ci = 0; ci < chunks; ++ci) {
      for (int d = 0; d < words; ++d) {
        const int block = (ci * chunk + d * per_word) / 32;
        lanes[int64_t(words) * ci + d] = block < blocks ? bscale[block] : 0.0f;
      }
    }
  }
  return Prepared{nullptr, q_stride, sums, sum_stride, xq, xlane, lane_stride};
}

}  // namespace flashserve_qmm::detail
