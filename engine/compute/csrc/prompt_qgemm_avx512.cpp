// The prompt GEMM's tile (prompt_qgemm_tile.inc) on AVX-512 VNNI: 512-bit
// vpdpbusd / vpdpwssd, tiles of 5 rows x 32 columns (10 integer and 10 float
// accumulators of the 32 registers; 16-bit rows of a 2048 x 6144 weight, one
// core: 4 rows 171, 5 rows 183, 6 rows 168 GMAC/s, the sixth spilling). Picked
// at run time (prompt_qgemm.cpp) where the CPU has AVX-512 F, BW, VL and VNNI.
//
// Every header is included before the target pragma: inline functions they
// define must not be compiled for this instruction set (the linker may keep
// any one copy of them, and other callers would get AVX-512 code).
#include <immintrin.h>

#include <cstdint>

#include "prompt_qgemm.h"

#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512vnni,fma")

namespace flashserve_qgemm {
namespace isa_avx512 {
namespace {

using vi = __m512i;
using vf = __m512;
constexpr int L = 16;
constexpr int V = 2;
constexpr int MR = 5;

inline vi vzero() { return _mm512_setzero_si512(); }
inline vi vload(const uint8_t* p) { return _mm512_loadu_si512(p); }
inline void vstore(uint8_t* p, vi v) { _mm512_storeu_si512(p, v); }
inline vi vbcast4(const uint8_t* p) {
  int32_t word;
  __builtin_memcpy(&word, p, 4);
  return _mm512_set1_epi32(word);
}
// In asm, accumulating in place. With the intrinsics GCC copied every
// accumulator out and back around each dot (two register moves per vpdpwssd
// in the inner loop): one core ran 137 GMAC/s of the 264 its two dots a cycle
// allow (16-bit rows), 175 with the same tile in asm.
template <int BITS, int XB>
inline vi vdot(vi acc, vi w, vi x) {
  if constexpr (XB == 8) {
    __asm__("vpdpbusd %2, %1, %0" : "+v"(acc) : "v"(w), "v"(x));  // u8 w, s8 x
  } else {
    __asm__("vpdpwssd %2, %1, %0" : "+v"(acc) : "v"(w), "v"(x));
  }
  return acc;
}
inline vf vcvt(vi v) { return _mm512_cvtepi32_ps(v); }
inline vf vmul(vf a, vf b) { return _mm512_mul_ps(a, b); }
inline vf vfmadd(vf a, vf b, vf c) { return _mm512_fmadd_ps(a, b, c); }
inline vf vset1(float x) { return _mm512_set1_ps(x); }
inline vf vloadf(const float* p) { return _mm512_loadu_ps(p); }
inline void vstoref(float* p, vf v, int count) {
  _mm512_mask_storeu_ps(p, __mmask16((1u << count) - 1), v);
}
inline vi vand(vi a, vi b) { return _mm512_and_si512(a, b); }
inline vi vsrl4(vi a) { return _mm512_srli_epi32(a, 4); }
inline vi vnibble_mask() { return _mm512_set1_epi8(0x0F); }
inline vi vlow_bytes() { return _mm512_set1_epi16(0x00FF); }
inline vi vsrl8(vi a) { return _mm512_srli_epi16(a, 8); }

inline __m128i load16(const uint8_t* p) { return _mm_loadu_si128(reinterpret_cast<const __m128i*>(p)); }

inline void load_cols(const uint8_t* const* cols, int64_t off, vi* A) {
  for (int i = 0; i < 4; ++i) {
    vi a = _mm512_castsi128_si512(load16(cols[i] + off));
    a = _mm512_inserti32x4(a, load16(cols[i + 4] + off), 1);
    a = _mm512_inserti32x4(a, load16(cols[i + 8] + off), 2);
    A[i] = _mm512_inserti32x4(a, load16(cols[i + 12] + off), 3);
  }
}

inline void transpose4(const vi* A, vi* T) {
  const vi t0 = _mm512_unpacklo_epi32(A[0], A[1]), t1 = _mm512_unpackhi_epi32(A[0], A[1]);
  const vi t2 = _mm512_unpacklo_epi32(A[2], A[3]), t3 = _mm512_unpackhi_epi32(A[2], A[3]);
  T[0] = _mm512_unpacklo_epi64(t0, t2);
  T[1] = _mm512_unpackhi_epi64(t0, t2);
  T[2] = _mm512_unpacklo_epi64(t1, t3);
  T[3] = _mm512_unpackhi_epi64(t1, t3);
}

}  // namespace

#include "prompt_qgemm_tile.inc"

}  // namespace isa_avx512

void tile_avx512vnni(const Weight& wt, const Acts& a, int tile, const float* sbuf, uint8_t* wbuf,
                     float* ybuf) {
  isa_avx512::tile_run(wt, a, tile, sbuf, wbuf, ybuf);
}
const int kWidthAvx512vnni = isa_avx512::NC;

}  // namespace flashserve_qgemm

#pragma GCC pop_options
