// MLX arrays as the kernel's problems: rows of x, a weight's packed values,
// scales and biases as rows (qmm_kernels.h). Shared by the matmul ops
// (qmm_module.cpp) and the expert-major prefill's ops (expert_ops.cpp).
#pragma once

#include <cstdint>
#include <stdexcept>
#include <vector>

#include "mlx/array.h"
#include "qmm_kernels.h"

namespace flashserve_arrays {

namespace mx = mlx::core;
using flashserve_qmm::QmmProblem;
using flashserve_qmm::ScaleType;

inline ScaleType scale_type_of(const mx::array& a) {
  if (a.dtype() == mx::float32) return ScaleType::f32;
  if (a.dtype() == mx::float16) return ScaleType::f16;
  if (a.dtype() == mx::bfloat16) return ScaleType::bf16;
  throw std::invalid_argument("flashserve qmm: scales must be float32, float16 or bfloat16");
}

// An input as rows of contiguous elements: returns the first row and sets
// `stride`, the distance between rows in elements. Inputs whose rows are not
// evenly spaced with unit inner stride (rare: a transposed view) are copied
// into `keep`; so are all of them when `copy` is set.
template <class T>
inline const T* rows_of(const mx::array& a, int64_t rows, int64_t cols, int64_t& stride,
                 std::vector<char>& keep, bool copy = false) {
  const auto& shape = a.shape();
  const auto& strides = a.strides();
  const int nd = a.ndim();
  if (!copy && a.flags().row_contiguous) {
    stride = cols;
    return a.data<T>();
  }
  bool even = nd >= 1 && (strides[nd - 1] == 1 || shape[nd - 1] == 1);
  for (int d = nd - 2; d > 0 && even; --d) {
    even = shape[d - 1] == 1 || strides[d - 1] == strides[d] * shape[d];
  }
  if (!copy && even) {
    stride = nd >= 2 ? strides[nd - 2] : cols;
    return a.data<T>();
  }
  keep.resize(size_t(rows * cols) * sizeof(T));
  T* dst = reinterpret_cast<T*>(keep.data());
  const T* src = a.data<T>();
  std::vector<int64_t> index(nd, 0);
  for (int64_t i = 0; i < rows * cols; ++i) {
    int64_t offset = 0;
    for (int d = 0; d < nd; ++d) offset += index[d] * strides[d];
    dst[i] = src[offset];
    for (int d = nd - 1; d >= 0; --d) {
      if (++index[d] < shape[d]) break;
      index[d] = 0;
    }
  }
  stride = cols;
  return dst;
}

// x as M row pointers (rows of K contiguous floats): x's elements in order,
// K at a time (x's last dimension is K, or x is a view's source: graph_folds.h).
// Any layout whose last dimension is K and contiguous (slices, broadcasts)
// is used in place; otherwise the rows are copied into `keep`.
inline std::vector<const float*> x_rows(const mx::array& x, int64_t M, int K, std::vector<char>& keep) {
  std::vector<const float*> rows(M);
  const float* base = x.data<float>();
  const int nd = x.ndim();
  if (x.flags().row_contiguous) {
    for (int64_t m = 0; m < M; ++m) rows[m] = base + m * K;
    return rows;
  }
  if ((x.strides()[nd - 1] != 1 && K > 1) || x.shape(nd - 1) != K) {
    int64_t stride = 0;
    base = rows_of<float>(x, M, K, stride, keep, true);
    for (int64_t m = 0; m < M; ++m) rows[m] = base + m * K;
    return rows;
  }
  std::vector<int64_t> index(std::max(nd - 1, 0), 0);
  for (int64_t m = 0; m < M; ++m) {
    int64_t offset = 0;
    for (int d = 0; d < nd - 1; ++d) offset += index[d] * x.strides()[d];
    rows[m] = base + offset;
    for (int d = nd - 2; d >= 0; --d) {
      if (++index[d] < x.shape(d)) break;
      index[d] = 0;
    }
  }
  return rows;
}

// Whether `biases` stands for a multiple of the scales (a 0-d float32 array).
inline bool biases_of_scales(const mx::array& biases) {
  return biases.ndim() == 0 && biases.dtype() == mx::float32;
}

// A weight's packed values, scales and biases as rows (`rows` of them: N, or
// E * N for a stacked weight); scales and biases share one row stride. Biases
// given as a 0-d float32 array t stand for t x the scales (QmmProblem's
// bias_times): `b` then points at the scales.
struct Weights {
  const uint32_t* w;
  const char* s;
  const char* b;
  int64_t w_stride;
  int64_t s_stride;
  float times = 0.f;
  std::vector<char> keep_w, keep_s, keep_b;  // copies of inputs not laid out as rows

  Weights(const mx::array& w_, const mx::array& scales, const mx::array& biases, int64_t rows) {
    w = rows_of<uint32_t>(w_, rows, w_.shape(-1), w_stride, keep_w);
    if (scales.dtype() == mx::float32) {
      resolve<float>(scales, biases, rows);
    } else {
      resolve<uint16_t>(scales, biases, rows);
    }
  }

  template <class T>
  void resolve(const mx::array& scales, const mx::array& biases, int64_t rows) {
    const int64_t groups = scales.shape(-1);
    int64_t b_stride;
    s = reinterpret_cast<const char*>(rows_of<T>(scales, rows, groups, s_stride, keep_s));
    if (biases.ndim() == 0) {
      b = s;
      times = biases.data<float>()[0];
      return;
    }
    b = reinterpret_cast<const char*>(rows_of<T>(biases, rows, groups, b_stride, keep_b));
    if (s_stride != b_stride) {  // one layout for both: copy them
      s = reinterpret_cast<const char*>(rows_of<T>(scales, rows, groups, s_stride, keep_s, true));
      b = reinterpret_cast<const char*>(rows_of<T>(biases, rows, groups, b_stride, keep_b, true));
    }
  }
};

inline QmmProblem problem(int K, const mx::array& scales, int N, int gs, int bits) {
  QmmProblem p{};
  p.K = K;
  p.N = N;
  p.bits = bits;
  p.group_size = gs;
  p.scale_type = scale_type_of(scales);
  p.out_stride = N;
  return p;
}

// K: the values in a row of w.
inline int inner_size(const mx::array& w, int bits) { return int(int64_t(w.shape(-1)) * 32 / bits); }

}  // namespace flashserve_arrays
