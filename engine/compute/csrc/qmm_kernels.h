// Quantized matmul for a few rows on x86-64 CPUs (AVX2 + FMA + F16C; AVX-512
// for 4 and 8 bits where the CPU has it, picked at run time).
//
// y[m, n] = sum_k x[m, k] * (scale[n, g] * q[n, k] + bias[n, g]), g = k / group_size,
// on MLX's affine-quantized weights as they lie in memory: each row of W is a
// little-endian bit stream of `bits`-bit values packed into uint32 words, one
// scale and one bias per group (float32, float16 or bfloat16). No float copy of
// W is made: each chunk of 32 values is unpacked into registers and used at
// once by every row of x.
//
// A row's result does not depend on how many rows are computed with it, nor on
// the thread count: the order of its arithmetic is fixed per column. So a
// request decodes the same numbers alone and in a batch.
#pragma once

#include <cstddef>
#include <cstdint>
#include <functional>

namespace flashserve_qmm {

enum class ScaleType : int { f32 = 0, f16 = 1, bf16 = 2 };

struct QmmProblem {
  const float* const* x;    // M rows of K contiguous floats
  int M;
  int K;
  int N;
  const uint32_t* w;        // N rows, w_stride words apart
  int64_t w_stride;
  const void* scales;       // N rows of K / group_size, s_stride elements apart
  const void* biases;       // same layout as scales
  // Nonzero: every bias is this times its scale, and `biases` points at the
  // scales (a symmetric quant: Q4_0's bias is -8 x its scale), so no biases
  // array sits in memory. A power of two there, so each product is exact and
  // the numbers are those of the biases it stands for.
  float bias_times;
  int64_t s_stride;
  ScaleType scale_type;
  int bits;
  int group_size;
  float* out;               // M rows of N floats, out_stride apart
  int64_t out_stride;
};

// True when this CPU runs the vectorized kernel (AVX2, FMA and F16C).
bool cpu_supported();

// Which bit widths and group sizes the kernel takes.
bool shape_supported(int bits, int group_size, int K);

// Whether 4- and 8-bit problems take the AVX-512 kernel: allowed by default,
// and used where the CPU has AVX-512 (tests turn it off to check AVX2's).
void set_avx512(bool allowed);
bool avx512_active();

// Whether 4- and 8-bit problems round x to int16 per block of 32 and use
// integer dot products (16: the AVX-512 or the AVX2 int16 kernel), or keep x
// in float32 (0, the default here; the `decode_matmul` setting chooses). With
// 16, VNNI (AVX-512 VNNI, or AVX-VNNI on the AVX2 kernel) is used where the CPU
// has it and `set_vnni` allows it (tests turn it off to check vpmaddwd's path,
// which gives the same numbers).
void set_x_bits(int bits);
int x_bits();
void set_vnni(bool allowed);
bool vnni_active();

// Computes the problem, spread over the pool's threads when it is large.
void qmm(const QmmProblem& p);

// Several problems on the same rows of x (same x, M, K, bits, group size and
// scale type: an attention block's q, k and v, an MLP's gate and up). x is
// prepared once and all their columns are spread over the threads together,
// so a small one (k, v) is split too and the pool is woken once. Each column
// is computed exactly as qmm() computes it. Other problems run one by one.
void qmm_shared_x(const QmmProblem* problems, int count);

// fn(0), ..., fn(parts - 1) on the kernel's threads, the caller's included
// (alone when the pool is busy with another problem). Parts may run in any
// order and on any thread: results must not depend on it.
void parallel_for(int parts, const std::function<void(int)>& fn);

// Threads the kernel uses (the calling thread included); 0 means one per core.
void set_threads(int n);
int threads();

}  // namespace flashserve_qmm
