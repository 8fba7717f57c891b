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

}  // namespace flashserve_qmm::detail
