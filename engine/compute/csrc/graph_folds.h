// Reading through the views mlx-lm's models put around the step's ops.
//
// Attention in mlx-lm splits each projection into heads with
// reshape + transpose and merges the heads back with transpose + reshape:
// eight view nodes a layer, 240 of a default-model decode step's ~750. On
// MLX's CPU backend every node costs the step a few microseconds of graph
// walking and hand-off to the stream thread whatever it computes (measured:
// 244 extra views cost one-stream decode ~7%, ~4 us each). An op given a
// view that only rearranges an array it can read directly (RoPE reads any
// strides; the quantized matmul reads rows) takes that array instead, and
// the views drop out of the graph: nothing else uses them. The op computes
// the same elements in the same order, so no number changes.
//
// These look at the graph as it is being built (or traced by mx.compile):
// an array already evaluated has no primitive and is taken as it is.
#pragma once

#include <cstring>
#include <optional>
#include <vector>

#include "mlx/array.h"
#include "mlx/primitives.h"

namespace flashserve_fold {

namespace mx = mlx::core;

inline bool made_by(const mx::array& a, const char* op) {
  return a.has_primitive() && std::strcmp(a.primitive().name(), op) == 0;
}

inline bool swaps_axes_1_2(const mx::array& a) {
  return a.ndim() == 4 && made_by(a, "Transpose") &&
         static_cast<const mx::Transpose&>(a.primitive()).state() == std::vector<int>{0, 2, 1, 3};
}

// How RoPE's input relates to the (B, N, T, D) array it rotates.
enum class HeadsLayout : int {
  as_is = 0,     // the array itself: (B, N, T, D), or (B, T, D)
  by_token = 1,  // (B, T, N, D): x = transpose(it, (0, 2, 1, 3))
  packed = 2,    // (B, T, N * D): x = transpose(reshape(it, (B, T, N, D)), (0, 2, 1, 3))
};

struct HeadsSource {
  mx::array array;
  HeadsLayout layout;
};

// Element strides of a (B, N, T, D) array in `a` laid out as `layout` (a
// 3-D `as_is` array is (B, T, D): one head).
struct HeadStrides {
  int64_t b, n, t, d;
};

inline HeadStrides head_strides(const mx::array& a, HeadsLayout layout, int D) {
  const auto& s = a.strides();
  if (layout == HeadsLayout::by_token) return {s[0], s[2], s[1], s[3]};
  if (layout == HeadsLayout::packed) return {s[0], int64_t(D) * s[2], s[1], s[2]};
  if (a.ndim() == 3) return {s[0], 0, s[1], s[2]};
  return {s[0], s[1], s[2], s[3]};
}

// What x (B, N, T, D) is a view of, as far as it is only split into heads.
inline HeadsSource heads_source(const mx::array& x) {
  if (!swaps_axes_1_2(x)) return {x, HeadsLayout::as_is};
  const mx::array& y = x.inputs()[0];  // (B, T, N, D)
  if (made_by(y, "Reshape")) {
    const mx::array& b = y.inputs()[0];
    if (b.ndim() == 3 && b.shape(0) == y.shape(0) && b.shape(1) == y.shape(1)) {
      return {b, HeadsLayout::packed};
    }
  }
  return {y, HeadsLayout::by_token};
}

// For x (B, 1, N * D) = reshape(transpose(s, (0, 2, 1, 3))) with s
// (B, N, 1, D): s, whose elements are x's in the same order (one position,
// so the transpose moves nothing). Otherwise nothing.
inline std::optional<mx::array> merged_heads_source(const mx::array& x) {
  if (x.ndim() != 3 || x.shape(1) != 1 || !made_by(x, "Reshape")) return std::nullopt;
  const mx::array& t = x.inputs()[0];
  if (!swaps_axes_1_2(t)) return std::nullopt;
  const mx::array& s = t.inputs()[0];
  if (s.shape(0) != x.shape(0) || s.shape(2) != 1 || int64_t(s.shape(1)) * s.shape(3) != x.shape(2)) {
    return std::nullopt;
  }
  return s;
}

}  // namespace flashserve_fold
