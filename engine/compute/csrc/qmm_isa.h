// What qmm_kernels.cpp (AVX2, every width, the thread pool) shares with the
// AVX-512 kernel for 4 and 8 bits (qmm_avx512.cpp), which it picks at run
// time when the CPU has AVX-512.
#pragma once

#include <cstdint>
#include <vector>

#include "qmm_kernels.h"

namespace flashserve_qmm::detail {

// x's rows in the layout one kernel reads, prepared once per call.
struct Prepared {
  const float* xs;       // M rows, x_stride floats apart
  int64_t x_stride;
  const float* xsum;     // per row, the sum of x over each group (AVX-512 only)
  int64_t sum_stride;
  // The integer kernel (qmm_avx512_int.cpp): x rounded to int16, and per
  // 64-byte chunk of weights the scale of each lane's block of x.
  const int16_t* xq = nullptr;  // M rows, x_stride int16s apart
  const float* xlane = nullptr;  // M rows, lane_stride floats apart
  int64_t lane_stride = 0;
};

// Columns [n_begin, n_end) of every row.
using ColumnsFn = void (*)(const QmmProblem&, const Prepared&, int n_begin, int n_end);

// True when this CPU runs the AVX-512 kernel (F, BW, DQ, VL).
bool avx512_supported();

// The AVX-512 kernel for this width and scale type, or nullptr (then AVX2's).
ColumnsFn avx512_columns(int bits, ScaleType st);

// x in the AVX-512 kernel's layout for p.bits, into `buf`.
Prepared avx512_prepare(const QmmProblem& p, std::vector<float>& buf);

// The AVX-512 kernel with x rounded to int16 per block of 32 (4 and 8 bits),
// on vpdpwssd where the CPU has AVX-512 VNNI and `vnni` allows it, else on
// vpmaddwd: the same integers, so the same numbers. nullptr: not taken.
ColumnsFn avx512_int_columns(int bits, ScaleType st, bool vnni);
bool avx512_vnni_supported();

// The same kernel on 256-bit vectors for CPUs with AVX2 but not AVX-512
// (qmm_avx2_int.cpp): vpdpwssd where the CPU has AVX-VNNI and `vnni` allows it.
ColumnsFn avx2_int_columns(int bits, ScaleType st, bool vnni);
bool avxvnni_supported();

// x rounded per block of 32 and laid out for a load of `words` words of packed
// weights (16: AVX-512, 8: AVX2), into `buf` (qmm_int_prepare.cpp).
Prepared int_prepare(const QmmProblem& p, int words, std::vector<float>& buf);

}  // namespace flashserve_qmm::detail
