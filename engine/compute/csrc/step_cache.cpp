// The compiled decode step's key/value cache writes as MLX primitives.
//
// Per layer, mlx.core.slice_update writes the new keys and the new values
// into the cache's buffers, and the values reach it through the two views
// that split their projection into heads (graph_folds.h). This op reads
// through those views and writes in place when the buffer can be donated, as
// slice_update does: two nodes a layer instead of four, the same bytes. (One
// op for both buffers would be one node, but MLX gives each output of a
// multi-output primitive its own reference to every input, so neither buffer
// could ever be donated: each step would copy the whole cache.)
//
//   cache_write(buffer, x, at) -> buffer with x (B, H, T, D) written at
//       position at[0] (int32) of axis 2, clamped into the buffer
//   rows_with_room(sources, at, size) -> (len(sources), H, size, D): source i
//       (1, H, T_i, D) written at position at[i] of axis 2 of row i, zeros
//       elsewhere (kv/room.py: a restored prompt state merged into the batch).
//       mx.zeros and a slice_update over them run at ~2.5 GB/s on the CPU
//       (MLX fills and copies element by element through its general
//       strided path); this is one memset and a memcpy per head and row.
#include <nanobind/nanobind.h>
#include <nanobind/stl/vector.h>

#include <algorithm>
#include <cstring>
#include <memory>
#include <vector>

#include "graph_folds.h"
#include "mlx/allocator.h"
#include "mlx/array.h"
#include "mlx/primitives.h"
#include "step_common.h"
#include "step_ops.h"

namespace nb = nanobind;
namespace mx = mlx::core;
using namespace nb::literals;
using namespace flashserve_step;

namespace {

using flashserve_fold::HeadsLayout;

// `out`'s buffer from `in`: shared when `in` may be donated, else a copy.
void take_buffer(const mx::array& in, mx::array& out, bool& copy) {
  copy = !(in.is_donatable() && in.flags().row_contiguous);
  if (copy) {
    out.set_data(mx::allocator::malloc(out.nbytes()));
  } else {
    out.copy_shared_buffer(in);
  }
}

void copy_rows(const mx::array& in, mx::array& out) {
  const int B = in.shape(0), N = in.shape(1), C = in.shape(2), D = in.shape(3);
  const auto& s = in.strides();
  const float* src = in.data<float>();
  float* dst = out.data<float>();
  for (int b = 0; b < B; ++b) {
    for (int n = 0; n < N; ++n) {
      for (int c = 0; c < C; ++c) {
        const float* r = src + b * s[0] + n * s[1] + c * s[2];
        float* o = dst + ((int64_t(b) * N + n) * C + c) * D;
        for (int d = 0; d < D; ++d) o[d] = r[d * s[3]];
      }
    }
  }
}

void write_rows(const mx::array& x, HeadsLayout layout, int at, mx::array& out) {
  const int B = out.shape(0), N = out.shape(1), C = out.shape(2), D = out.shape(3);
  const int T = int(x.size() / (int64_t(B) * N * D));
  const auto s = flashserve_fold::head_strides(x, layout, D);
  const float* src = x.data<float>();
  float* dst = out.data<float>();
  for (int b = 0; b < B; ++b) {
    for (int n = 0; n < N; ++n) {
      for (int t = 0; t < T; ++t) {
        const float* r = src + b * s.b + n * s.n + t * s.t;
        float* o = dst + ((int64_t(b) * N + n) * C + at + t) * D;
        if (s.d == 1) {
          std::memcpy(o, r, sizeof(float) * D);
        } else {
          for (int d = 0; d < D; ++d) o[d] = r[d * s.d];
        }
      }
    }
  }
}

class FlashserveCacheWrite : public mx::UnaryPrimitive {
 public:
  FlashserveCacheWrite(mx::Stream s, HeadsLayout layout) : mx::UnaryPrimitive(s), layout_(layout) {}

  // Inputs: buffer, x, at.
  void eval_cpu(const std::vector<mx::array>& inputs, mx::array& out) override {
    bool copy;
    take_buffer(inputs[0], out, copy);
    dispatch(stream(), inputs, out,
             [in = weak(inputs), out = mx::array::unsafe_weak_copy(out), layout = layout_,
              copy]() mutable {
               const auto& buffer = out.shape();  // (B, N, capacity, D)
               const int T = int(in[1].size() / (int64_t(buffer[0]) * buffer[1] * buffer[3]));
               const int at = std::clamp(in[2].data<int32_t>()[0], 0, std::max(0, buffer[2] - T));
               if (copy) copy_rows(in[0], out);
               write_rows(in[1], layout, at, out);
             });
  }
  void eval_gpu(const std::vector<mx::array>&, mx::array&) override {
    throw std::runtime_error("flashserve step ops run on the CPU stream only");
  }
  const char* name() const override { return "FlashserveCacheWrite"; }
  bool is_equivalent(const mx::Primitive& other) const override {
    return layout_ == static_cast<const FlashserveCacheWrite&>(other).layout_;
  }

 private:
  HeadsLayout layout_;
};

mx::array cache_write(const mx::array& buffer, const mx::array& x, const mx::array& at) {
  check(buffer.dtype() == mx::float32 && x.dtype() == mx::float32 && buffer.ndim() == 4 &&
            x.ndim() == 4,
        "cache_write takes 4-D float32 arrays");
  check(x.shape(0) == buffer.shape(0) && x.shape(1) == buffer.shape(1) &&
            x.shape(3) == buffer.shape(3) && x.shape(2) <= buffer.shape(2),
        "cache_write: x does not fit the buffer");
  check(at.dtype() == mx::int32 && at.size() == 1, "cache_write: at must be one int32");
  auto [source, layout] = flashserve_fold::heads_source(x);
  return mx::array(buffer.shape(), mx::float32,
                   std::make_shared<FlashserveCacheWrite>(cpu_stream(), layout),
                   {buffer, source, at});
}

class FlashserveRowsWithRoom : public mx::UnaryPrimitive {
 public:
  FlashserveRowsWithRoom(mx::Stream s, std::vector<int> at) : mx::UnaryPrimitive(s), at_(std::move(at)) {}

  void eval_cpu(const std::vector<mx::array>& inputs, mx::array& out) override {
    out.set_data(mx::allocator::malloc(out.nbytes()));
    dispatch(stream(), inputs, out,
             [in = weak(inputs), out = mx::array::unsafe_weak_copy(out), at = at_]() mutable {
               const int64_t H = out.shape(1), size = out.shape(2), D = out.shape(3);
               const int64_t item = out.itemsize();
               char* dst = out.data<char>();
               for (size_t i = 0; i < in.size(); ++i) {
                 const auto& x = in[i];
                 const int64_t T = x.shape(2);
                 const auto& s = x.strides();
                 const char* src = x.data<char>();
                 for (int64_t h = 0; h < H; ++h) {
                   char* head = dst + ((int64_t(i) * H + h) * size) * D * item;
                   std::memset(head, 0, at[i] * D * item);
                   char* o = head + at[i] * D * item;
                   const char* r = src + h * s[1] * item;
                   if (s[3] == 1 && s[2] == D) {
                     std::memcpy(o, r, T * D * item);
                   } else {
                     for (int64_t t = 0; t < T; ++t) {
                       for (int64_t d = 0; d < D; ++d) {
                         std::memcpy(o + (t * D + d) * item, r + (t * s[2] + d * s[3]) * item, item);
                       }
                     }
                   }
                   std::memset(o + T * D * item, 0, (size - at[i] - T) * D * item);
                 }
               }
             });
  }
  void eval_gpu(const std::vector<mx::array>&, mx::array&) override {
    throw std::runtime_error("flashserve step ops run on the CPU stream only");
  }
  const char* name() const override { return "FlashserveRowsWithRoom"; }
  bool is_equivalent(const mx::Primitive& other) const override {
    return at_ == static_cast<const FlashserveRowsWithRoom&>(other).at_;
  }

 private:
  std::vector<int> at_;
};

mx::array rows_with_room(const std::vector<mx::array>& sources, const std::vector<int>& at,
                         int size) {
  check(!sources.empty() && sources.size() == at.size(),
        "rows_with_room: one position per source");
  const auto& first = sources[0];
  check(first.ndim() == 4, "rows_with_room takes (1, H, T, D) sources");
  for (size_t i = 0; i < sources.size(); ++i) {
    const auto& x = sources[i];
    check(x.ndim() == 4 && x.shape(0) == 1 && x.shape(1) == first.shape(1) &&
              x.shape(3) == first.shape(3) && x.dtype() == first.dtype(),
          "rows_with_room: sources differ in heads, width or dtype");
    check(at[i] >= 0 && int64_t(at[i]) + x.shape(2) <= size,
          "rows_with_room: a source does not fit the size");
  }
  return mx::array({int(sources.size()), first.shape(1), size, first.shape(3)}, first.dtype(),
                   std::make_shared<FlashserveRowsWithRoom>(cpu_stream(), at), sources);
}

}  // namespace

void add_cache_write(nb::module_& m) {
  m.def("cache_write", &cache_write, "buffer"_a, "x"_a, "at"_a,
        "x (B, H, T, D) written into the buffer at position at[0] of axis 2, in place if donated");
  m.def("rows_with_room", &rows_with_room, "sources"_a, "at"_a, "size"_a,
        "(len(sources), H, size, D): source i (1, H, T, D) at position at[i] of axis 2, zeros "
        "elsewhere");
}
