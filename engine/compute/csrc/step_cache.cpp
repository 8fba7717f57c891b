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
//       mx.zeros and a slice_update over them run on one thread, bound by
//       faulting in the fresh buffer's pages; this is memsets and memcpys in
//       pieces on the kernel's threads (the 1.2B bench model's 756 cached
//       tokens: ~48 -> ~20 ms, inside a next turn's TTFT).
#include <nanobind/nanobind.h>
#include <nanobind/stl/vector.h>

#include <algorithm>
#include <cstring>
#include <memory>
#include <vector>

#include "graph_folds.h"
#include "qmm_kernels.h"
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

// Rows [r0, r1) of one head of rows_with_room's output: zeros, then the
// source's rows from `at`, then zeros.
void room_rows(const mx::array& x, int64_t h, int64_t at, int64_t r0, int64_t r1, char* head) {
  const int64_t D = x.shape(3), T = x.shape(2), item = x.itemsize();
  const auto& s = x.strides();
  const char* src = x.data<char>() + h * s[1] * item;
  const int64_t c0 = std::max(r0, at), c1 = std::min(r1, at + T);
  if (c0 >= c1) {
    std::memset(head + r0 * D * item, 0, (r1 - r0) * D * item);
    return;
  }
  std::memset(head + r0 * D * item, 0, (c0 - r0) * D * item);
  if (s[3] == 1 && s[2] == D) {
    std::memcpy(head + c0 * D * item, src + (c0 - at) * D * item, (c1 - c0) * D * item);
  } else {
    for (int64_t r = c0; r < c1; ++r) {
      const char* row = src + (r - at) * s[2] * item;
      char* o = head + r * D * item;
      if (s[3] == 1) {
        std::memcpy(o, row, D * item);
      } else {
        for (int64_t d = 0; d < D; ++d) std::memcpy(o + d * item, row + d * s[3] * item, item);
      }
    }
  }
  std::memset(head + c1 * D * item, 0, (r1 - c1) * D * item);
}

// Pieces of about this many bytes go to the kernel's threads: a fresh buffer's
// pages are faulted in by the thread that first writes them, and on two cores
// that takes about as long as the copy itself.
constexpr int64_t kRoomPieceBytes = 256 << 10;

class FlashserveRowsWithRoom : public mx::UnaryPrimitive {
 public:
  FlashserveRowsWithRoom(mx::Stream s, std::vector<int> at) : mx::UnaryPrimitive(s), at_(std::move(at)) {}

  void eval_cpu(const std::vector<mx::array>& inputs, mx::array& out) override {
    out.set_data(mx::allocator::malloc(out.nbytes()));
    dispatch(stream(), inputs, out,
             [in = weak(inputs), out = mx::array::unsafe_weak_copy(out), at = at_]() mutable {
               const int64_t N = out.shape(0), H = out.shape(1), size = out.shape(2);
               const int64_t row_bytes = out.shape(3) * out.itemsize();
               const int64_t rows = std::max<int64_t>(1, kRoomPieceBytes / row_bytes);
               const int64_t per_head = (size + rows - 1) / rows;
               char* dst = out.data<char>();
               flashserve_qmm::parallel_for(int(N * H * per_head), [&](int part) {
                 const int64_t head = part / per_head, piece = part % per_head;
                 const int64_t i = head / H, h = head % H;
                 const int64_t r0 = piece * rows, r1 = std::min(size, r0 + rows);
                 room_rows(in[i], h, at[i], r0, r1, dst + head * size * row_bytes);
               });
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
