// The AVX-512 decode kernel with x rounded to int16 (the `decode_matmul`
// setting's "int16", the default): x's rows are rounded per block of 32
// exactly as the prompt GEMM rounds them (csrc/prompt_qgemm.cpp: max|x| /
// 32767, to nearest; the bias term on the rounded x's group sums), and each
// 64-byte load of 4- or 8-bit weights meets them in integer dot products.
//
// Why: the float kernel (qmm_avx512.cpp) spends three vector instructions per
// 16 weights (shift, table lookup, FMA) and streamed 10.3 GB/s on one core of
// a machine whose core reads 30 GB/s; a 1.2B Q4_0 model decoded at 0.5x
// llama.cpp's speed (issue 57). Here 4-bit weights cost an AND (after a shift)
// and a vpdpwssd per 32, and the kernel reads one column's row at a time: a
// single stream the prefetcher follows, where the float kernel's four
// interleaved rows lost a third of its speed for the prefetch distance it had.
// One core then streams ~28-30 GB/s over a 755 MB set of the model's shapes.
//
// A (row, column) pair's arithmetic is fixed (the integer dots are exact; the
// float steps per chunk, the bias term and the final sum are the same for any
// number of rows, threads, or instruction set), so a request decodes the same
// numbers alone and in a batch, with VNNI or without it.
#include <immintrin.h>

#include <cstring>

#include "qmm_avx512_parts.h"

namespace flashserve_qmm::detail {
namespace {

// Bytes ahead of a column's read to prefetch: with one stream a tile (288
// bytes for 576 4-bit values), the next columns' rows follow in memory. On
// the 755 MB set one core streamed 7.0 GB/s with no prefetch, 8.8 at 1 KB,
// 12.2 at 3 KB (the float kernel's distance), 27.6 at 8 KB, 28.9 at 12 KB.
constexpr int PREFETCH_INT = 8192;
// And ahead of a chunk's scales and biases (see ichunk).
constexpr int PREFETCH_SCALES = 1024;

// Where value c of a chunk goes among the int16s of x's layout: 4 bits, word
// d = c / 8 holds values 8d..8d+7, and vector j pairs nibbles j and j + 4 in
// lane d; 8 bits, word d = c / 4, vector j pairs bytes j and j + 2.
inline int slot_of(int c, int bits) {
  const int per_word = 32 / bits, half = per_word / 2;
  const int d = c / per_word, e = c % per_word;
  return (e % half) * 32 + 2 * d + e / half;
}

}  // namespace

#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512dq,avx512vl,fma,f16c")
namespace int_madd {
inline __m512i idot(__m512i acc, __m512i w, __m512i x) {
  return _mm512_add_epi32(acc, _mm512_madd_epi16(w, x));
}
#include "qmm_int_tile.inc"
}  // namespace int_madd
#pragma GCC pop_options

#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512dq,avx512vl,avx512vnni,fma,f16c")
namespace int_vnni {
inline __m512i idot(__m512i acc, __m512i w, __m512i x) { return _mm512_dpwssd_epi32(acc, w, x); }
#include "qmm_int_tile.inc"
}  // namespace int_vnni
#pragma GCC pop_options

bool avx512_vnni_supported() {
  __builtin_cpu_init();
  return avx512_supported() && __builtin_cpu_supports("avx512vnni");
}

ColumnsFn avx512_int_columns(int bits, ScaleType st, bool vnni) {
  if (vnni && avx512_vnni_supported()) return int_vnni::pick(bits, st);
  return int_madd::pick(bits, st);
}

// Each row: int16 values in whole chunks (zero past K), laid out by slot_of;
// per chunk 16 floats, lane d the scale of the block its values are in (0
// past K); per group the rounded x's sum, zero-padded to whole vectors of 16.
QMM512 Prepared avx512_int_prepare(const QmmProblem& p, std::vector<float>& buf) {
  const int chunk = p.bits == 4 ? CHUNK4 : CHUNK8;
  const int per_word = 32 / p.bits;
  const int chunks = (p.K + chunk - 1) / chunk;
  const int64_t q_stride = int64_t(chunks) * chunk;  // int16s
  const int64_t lane_stride = int64_t(chunks) * 16;
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
  const __m512 abs_mask = _mm512_castsi512_ps(_mm512_set1_epi32(0x7fffffff));
  thread_local std::vector<float> bscale;  // per block of a row
  bscale.resize(blocks);
  for (int m = 0; m < p.M; ++m) {
    const float* src = p.x[m];
    int16_t* q = xq + int64_t(m) * q_stride;
    float* lanes = xlane + int64_t(m) * lane_stride;
    float* gsum = sums + int64_t(m) * sum_stride;
    std::memset(q, 0, sizeof(int16_t) * q_stride);
    for (int b = 0; b < blocks; ++b) {
      const __m512 v0 = _mm512_loadu_ps(src + 32 * b), v1 = _mm512_loadu_ps(src + 32 * b + 16);
      const float amax = _mm512_reduce_max_ps(
          _mm512_max_ps(_mm512_and_ps(v0, abs_mask), _mm512_and_ps(v1, abs_mask)));
      const float d = amax / 32767.0f;
      const __m512 inv = _mm512_set1_ps(d != 0.0f ? 1.0f / d : 0.0f);
      alignas(64) int32_t n[32];
      _mm512_store_si512(n, _mm512_cvtps_epi32(_mm512_mul_ps(v0, inv)));  // to nearest
      _mm512_store_si512(n + 16, _mm512_cvtps_epi32(_mm512_mul_ps(v1, inv)));
      int32_t total = 0;
      for (int i = 0; i < 32; ++i) {
        const int c = 32 * b + i;
        q[int64_t(c / chunk) * chunk + slot_of(c % chunk, p.bits)] = int16_t(n[i]);
        total += n[i];
      }
      bscale[b] = d;
      // As the prompt GEMM: the rounded values' sum, so the bias term sees the same x.
      const float sum = d * float(total);
      if (b % per_group == 0) {
        gsum[b / per_group] = sum;
      } else {
        gsum[b / per_group] += sum;
      }
    }
    for (int g = groups; g < sum_stride; ++g) gsum[g] = 0.0f;
    for (int ci = 0; ci < chunks; ++ci) {
      for (int d = 0; d < 16; ++d) {
        const int block = (ci * chunk + d * per_word) / 32;
        lanes[16 * ci + d] = block < blocks ? bscale[block] : 0.0f;
      }
    }
  }
  return Prepared{nullptr, q_stride, sums, sum_stride, xq, xlane, lane_stride};
}

}  // namespace flashserve_qmm::detail
