// A quantized GEMM for prompt rows (compute/prompt_matmul.py): activations
// quantized per row to int8, times MLX's 4- or 8-bit affine weights as they
// lie in memory, with integer dot products (vpdpbusd: u8 weights x s8
// activations), as llama.cpp multiplies Q8_0 activations by its weights.
//
// Per weight group g of a row of W (w = s_w * q + b_w) and a row of x whose
// blocks b of 32 values are x ~ s_x[b] * xq:
//   y += sum_b (s_w * s_x[b]) * idot(q, xq)_b  +  b_w * sum_b s_x[b] * sum(xq)_b
// the integer dot exact: x rounded once, the same x in both terms.
//
// What prompt_qgemm.cpp (the op, activation quantization, thread split) shares
// with the instruction-set kernels (prompt_qgemm_avx512.cpp, _avxvnni.cpp,
// _avx2.cpp: one tile body, prompt_qgemm_tile.inc, compiled three times).
#pragma once

#include <nanobind/nanobind.h>

#include <cstdint>

namespace flashserve_qgemm {

// Best first. Each element's arithmetic is the same on every path (the integer
// dot is exact, the float steps are the same FMAs), so they agree bit for bit.
enum class Isa : int { none = 0, avx2 = 1, avxvnni = 2, avx512vnni = 3 };

// x's rows, quantized (prompt_qgemm.cpp: quantize_rows).
struct Acts {
  const uint8_t* q;     // M rows of K int8 or int16 (xbits), each block in the kernel's order
  const float* scale;   // M rows of K / 32: each block's scale
  const float* gsum;    // M rows of K / group_size: the rounded x's sum over each group
  int M;
  int K;
  int xbits;            // 8 or 16
};

// One weight: N rows of K values packed as MLX packs them (affine mode).
struct Weight {
  const uint32_t* w;
  int64_t w_stride;     // words between rows
  int N;
  int K;
  int bits;             // 4 or 8
  int group_size;       // 32, 64 or 128
  float* out;           // M rows of N floats, out_stride apart
  int64_t out_stride;
};

// Columns [tile * width, +width) of every row of `a` against `w` into w.out.
// `sbuf`: the tile's scales then biases as float32, [group][width] each.
// Scratch: `wbuf` width * CHUNK * 2 bytes (a chunk's unpacked weights), `ybuf`
// M * width floats (the tile's sums between chunks).
using TileFn = void (*)(const Weight& w, const Acts& a, int tile, const float* sbuf,
                        uint8_t* wbuf, float* ybuf);

// Values of K unpacked at a time: the chunk's weights stay in L1 while every
// row tile of the prompt uses them. A multiple of every group size.
constexpr int CHUNK = 256;

// The tile kernels, one per instruction set, and their tile widths (columns).
void tile_avx512vnni(const Weight&, const Acts&, int, const float*, uint8_t*, float*);
void tile_avxvnni(const Weight&, const Acts&, int, const float*, uint8_t*, float*);
void tile_avx2(const Weight&, const Acts&, int, const float*, uint8_t*, float*);
extern const int kWidthAvx512vnni;
extern const int kWidthAvxvnni;
extern const int kWidthAvx2;

}  // namespace flashserve_qgemm

// Adds prompt_qgemm, prompt_qgemm_isa, set_prompt_qgemm_isa (prompt_qgemm.cpp).
void add_prompt_qgemm(nanobind::module_& m);
