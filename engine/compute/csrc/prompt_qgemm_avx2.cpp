// The prompt GEMM's tile (prompt_qgemm_tile.inc) on 256-bit vectors, twice:
// with AVX-VNNI's vpdpbusd (CPUs that have it without AVX-512), and on plain
// AVX2 where a dot of 4 bytes is vpmaddubsw + vpmaddwd. Both give the same
// integers as vpdpbusd, so every path computes the same numbers.
//
// Headers first, before any target pragma (see prompt_qgemm_avx512.cpp).
#include <immintrin.h>

#include <cstdint>

#include "prompt_qgemm.h"

#pragma GCC push_options
#pragma GCC target("avx2,fma,avxvnni")

namespace flashserve_qgemm {
namespace isa_avxvnni {
namespace {

#include "prompt_qgemm_ymm.inc"
constexpr int MR = 3;  // 6 integer and 6 float accumulators of the 16 registers

// In asm, accumulating in place (prompt_qgemm_avx512.cpp says why; here one core
// ran 16-bit rows at 70 GMAC/s with the intrinsics, 86 in asm).
template <int BITS, int XB>
inline vi vdot(vi acc, vi w, vi x) {
  if constexpr (XB == 8) {
    __asm__("%{vex%} vpdpbusd %2, %1, %0" : "+x"(acc) : "x"(w), "x"(x));  // u8 w, s8 x
  } else {
    __asm__("%{vex%} vpdpwssd %2, %1, %0" : "+x"(acc) : "x"(w), "x"(x));
  }
  return acc;
}

}  // namespace

#include "prompt_qgemm_tile.inc"

}  // namespace isa_avxvnni

void tile_avxvnni(const Weight& wt, const Acts& a, int tile, const float* sbuf, uint8_t* wbuf,
                  float* ybuf) {
  isa_avxvnni::tile_run(wt, a, tile, sbuf, wbuf, ybuf);
}
const int kWidthAvxvnni = isa_avxvnni::NC;

}  // namespace flashserve_qgemm

#pragma GCC pop_options

#pragma GCC push_options
#pragma GCC target("avx2,fma")

namespace flashserve_qgemm {
namespace isa_avx2 {
namespace {

#include "prompt_qgemm_ymm.inc"
constexpr int MR = 2;  // room for the dot's temporaries

// vpmaddubsw adds pairs of u8 x s8 products into int16 and saturates: 4-bit
// weights (<= 15 * 127 * 2) never reach it; 8-bit ones are split into
// nibbles, each dot exact, the high one shifted back.
// 16-bit x: vpmaddwd is vpdpwssd without the add, exact.
template <int BITS, int XB>
inline vi vdot(vi acc, vi w, vi x) {
  const vi ones = _mm256_set1_epi16(1);
  if constexpr (XB == 16) {
    return _mm256_add_epi32(acc, _mm256_madd_epi16(w, x));
  } else if constexpr (BITS == 4) {
    return _mm256_add_epi32(acc, _mm256_madd_epi16(_mm256_maddubs_epi16(w, x), ones));
  } else {
    const vi lo = vand(w, vnibble_mask()), hi = vand(vsrl4(w), vnibble_mask());
    const vi dlo = _mm256_madd_epi16(_mm256_maddubs_epi16(lo, x), ones);
    const vi dhi = _mm256_madd_epi16(_mm256_maddubs_epi16(hi, x), ones);
    return _mm256_add_epi32(acc, _mm256_add_epi32(dlo, _mm256_slli_epi32(dhi, 4)));
  }
}

}  // namespace

#include "prompt_qgemm_tile.inc"

}  // namespace isa_avx2

void tile_avx2(const Weight& wt, const Acts& a, int tile, const float* sbuf, uint8_t* wbuf,
               float* ybuf) {
  isa_avx2::tile_run(wt, a, tile, sbuf, wbuf, ybuf);
}
const int kWidthAvx2 = isa_avx2::NC;

}  // namespace flashserve_qgemm

#pragma GCC pop_options
