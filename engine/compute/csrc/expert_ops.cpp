// The expert-major prefill's ops (experts/prefill.py, issue 46), as MLX
// primitives on the CPU stream:
//
//   expert_glu(x, rows, gate (w, scales, biases), up (...), down (...), group sizes, bits)
//     = down(swiglu(gate(x[rows]), up(x[rows]))): one expert's whole SwitchGLU
//   slot_rows(outs, positions, slots)
//     the experts' outputs back in token-slot order: row i of concat(outs)
//     at row positions[i] of the result
//   uninitialized_bytes(n): a record buffer for the expert store to read into
//
// expert_glu:
// mlx-lm's SwitchGLU makes that ten graph nodes per expert: a gather of the
// rows, a sort and its gather (it sorts any call of 64 slots or more, though
// one expert's slots need none), the two projections, SwiGLU, the third one
// and the unsort. Each node ran on one MLX stream thread, the matmuls on the
// kernel's pool, the copies on one core, and every copy was a fresh block:
// a prefill of the cap bench's MoE kept ~1.5 of 2 cores busy in its expert
// calls. Here the rows are read where they lie (the kernel takes row
// pointers), gate and up share one prepared x and one pool job, the
// intermediates live in this thread's reused buffers, and only the output is
// allocated.
//
// The numbers are the template's: the same kernel computes each (row,
// column) the same way whatever the rows around it (qmm_kernels.h), and
// SwiGLU is the swiglu op's own function, row by row (step_ops.h).
#include <nanobind/nanobind.h>
#include <nanobind/stl/vector.h>

#include <cstring>
#include <limits>
#include <memory>
#include <stdexcept>
#include <vector>

#include "mlx/allocator.h"
#include "mlx/array.h"
#include "mlx/primitives.h"
#include "qmm_arrays.h"
#include "qmm_kernels.h"
#include "step_common.h"
#include "step_ops.h"

namespace nb = nanobind;
namespace mx = mlx::core;
using namespace nb::literals;
using flashserve_arrays::QmmProblem;
using flashserve_arrays::Weights;
using flashserve_step::check;
using flashserve_step::cpu_stream;
using flashserve_step::dispatch;
using flashserve_step::weak;

namespace {

// Intermediates up to this size stay allocated for the next call (a prefill's
// experts at a few hundred rows); larger ones are given back after it.
constexpr size_t KEEP_BYTES = 8 << 20;

// Inputs: x, rows, then w, scales, biases of gate, up and down.
void expert_glu_compute(const std::vector<mx::array>& in, mx::array& out, const int gs[3],
                        const int bits[3]) {
  const mx::array& x = in[0];
  const int K = x.shape(-1);
  const int64_t T = x.size() / K;
  const int64_t M = in[1].size();
  const uint32_t* rows = in[1].data<uint32_t>();
  std::vector<char> keep_x;
  const std::vector<const float*> all = flashserve_arrays::x_rows(x, T, K, keep_x);
  std::vector<const float*> xr(M);
  for (int64_t m = 0; m < M; ++m) {
    if (rows[m] >= uint64_t(T)) throw std::out_of_range("flashserve expert_glu: row index");
    xr[m] = all[rows[m]];
  }
  const mx::array &gw = in[2], &gsc = in[3], &uw = in[5], &usc = in[6];
  const mx::array &dw = in[8], &dsc = in[9];
  const int I = gw.shape(0);
  const Weights gate(gw, gsc, in[4], I), up(uw, usc, in[7], I), down(dw, dsc, in[10], dw.shape(0));

  // The intermediates: reused by this stream's thread call after call.
  thread_local std::vector<float> g_buf, u_buf, a_buf;
  g_buf.resize(size_t(M) * I);
  u_buf.resize(size_t(M) * I);
  a_buf.resize(size_t(M) * I);

  // Projection `which` (0 gate, 1 up, 2 down) of the rows `xs` into `o`.
  auto make = [&](const Weights& wt, const mx::array& scales, int N, int which,
                  const std::vector<const float*>& xs, float* o) {
    QmmProblem p =
        flashserve_arrays::problem(which == 2 ? I : K, scales, N, gs[which], bits[which]);
    p.x = xs.data();
    p.M = int(M);
    p.w = wt.w;
    p.w_stride = wt.w_stride;
    p.scales = wt.s;
    p.biases = wt.b;
    p.bias_times = wt.times;
    p.s_stride = wt.s_stride;
    p.out = o;
    p.out_stride = N;
    return p;
  };
  QmmProblem gate_up[2] = {make(gate, gsc, I, 0, xr, g_buf.data()),
                           make(up, usc, I, 1, xr, u_buf.data())};
  flashserve_qmm::qmm_shared_x(gate_up, 2);
  flashserve_step::swiglu_rows(g_buf.data(), u_buf.data(), a_buf.data(), M, I);
  std::vector<const float*> ar(M);
  for (int64_t m = 0; m < M; ++m) ar[m] = a_buf.data() + m * I;
  flashserve_qmm::qmm(make(down, dsc, dw.shape(0), 2, ar, out.data<float>()));
  if (g_buf.capacity() * sizeof(float) > KEEP_BYTES) {  // a long prompt's: not kept for good
    g_buf = {};
    u_buf = {};
    a_buf = {};
  }
}

class FlashserveExpertGLU : public mx::UnaryPrimitive {
 public:
  FlashserveExpertGLU(mx::Stream s, std::vector<int> gs, std::vector<int> bits)
      : mx::UnaryPrimitive(s), gs_(std::move(gs)), bits_(std::move(bits)) {}

  void eval_cpu(const std::vector<mx::array>& inputs, mx::array& out) override {
    out.set_data(mx::allocator::malloc(out.nbytes()));
    dispatch(stream(), inputs, out,
             [in = weak(inputs), out = mx::array::unsafe_weak_copy(out), gs = gs_,
              bits = bits_]() mutable { expert_glu_compute(in, out, gs.data(), bits.data()); });
  }
  void eval_gpu(const std::vector<mx::array>&, mx::array&) override {
    throw std::runtime_error("flashserve expert_glu runs on the CPU stream only");
  }
  const char* name() const override { return "FlashserveExpertGLU"; }
  bool is_equivalent(const mx::Primitive& other) const override {
    const auto& o = static_cast<const FlashserveExpertGLU&>(other);
    return gs_ == o.gs_ && bits_ == o.bits_;
  }

 private:
  std::vector<int> gs_;
  std::vector<int> bits_;
};

void check_projection(const mx::array& w, const mx::array& scales, const mx::array& biases,
                      int K, int gs, int bits) {
  check(w.dtype() == mx::uint32 && w.ndim() == 2, "expert_glu: weights are 2-D uint32");
  check(scales.shape() == biases.shape() && scales.dtype() == biases.dtype(),
        "expert_glu: scales and biases differ");
  flashserve_arrays::scale_type_of(scales);
  check(flashserve_qmm::shape_supported(bits, gs, K), "expert_glu: unsupported bits or group size");
  check(int64_t(w.shape(1)) * 32 == int64_t(K) * bits, "expert_glu: a weight does not match its input");
  check(scales.ndim() == 2 && scales.shape(0) == w.shape(0) && scales.shape(1) == K / gs,
        "expert_glu: scales do not match their weight");
}

mx::array expert_glu(const mx::array& x, const mx::array& rows, const std::vector<mx::array>& gate,
                     const std::vector<mx::array>& up, const std::vector<mx::array>& down,
                     const std::vector<int>& group_sizes, const std::vector<int>& bits) {
  check(x.dtype() == mx::float32 && x.ndim() >= 1, "expert_glu: x must be float32");
  check(rows.dtype() == mx::uint32 && rows.ndim() == 1, "expert_glu: rows must be 1-D uint32");
  check(gate.size() == 3 && up.size() == 3 && down.size() == 3,
        "expert_glu: each projection is (w, scales, biases)");
  check(group_sizes.size() == 3 && bits.size() == 3, "expert_glu: a group size and width each");
  const int K = x.shape(-1);
  const int I = gate[0].shape(0);
  check_projection(gate[0], gate[1], gate[2], K, group_sizes[0], bits[0]);
  check_projection(up[0], up[1], up[2], K, group_sizes[1], bits[1]);
  check(up[0].shape(0) == I, "expert_glu: gate and up differ in width");
  check_projection(down[0], down[1], down[2], I, group_sizes[2], bits[2]);
  std::vector<mx::array> inputs{x, rows};
  for (const auto* p : {&gate, &up, &down}) inputs.insert(inputs.end(), p->begin(), p->end());
  return mx::array({rows.shape(0), down[0].shape(0)}, mx::float32,
                   std::make_shared<FlashserveExpertGLU>(cpu_stream(), group_sizes, bits),
                   std::move(inputs));
}

// slot_rows: inputs positions, then the outputs in order. A copy, so the same
// numbers; mx.concatenate and a gather did it in two passes on one core, each
// into a fresh block the size of the call's output (50 ms a layer in the cap
// bench's 632-token prefill).
class FlashserveSlotRows : public mx::UnaryPrimitive {
 public:
  explicit FlashserveSlotRows(mx::Stream s) : mx::UnaryPrimitive(s) {}

  void eval_cpu(const std::vector<mx::array>& inputs, mx::array& out) override {
    out.set_data(mx::allocator::malloc(out.nbytes()));
    dispatch(stream(), inputs, out, [in = weak(inputs), out = mx::array::unsafe_weak_copy(out)]() mutable {
      const int64_t slots = out.shape(0), H = out.shape(1);
      const uint32_t* pos = in[0].data<uint32_t>();
      std::vector<int64_t> first(in.size(), 0);  // each output's first row in positions
      for (size_t j = 1; j + 1 < in.size(); ++j) first[j + 1] = first[j] + in[j].size() / H;
      float* o = out.data<float>();
      flashserve_qmm::parallel_for(int(in.size()) - 1, [&](int part) {
        const mx::array& src = in[part + 1];
        const int64_t rows = src.size() / H;
        std::vector<char> keep;
        const auto xr = flashserve_arrays::x_rows(src, rows, int(H), keep);
        for (int64_t r = 0; r < rows; ++r) {
          const uint32_t at = pos[first[part + 1] + r];
          if (at >= uint64_t(slots)) throw std::out_of_range("flashserve slot_rows: position");
          std::memcpy(o + int64_t(at) * H, xr[r], sizeof(float) * H);
        }
      });
    });
  }
  void eval_gpu(const std::vector<mx::array>&, mx::array&) override {
    throw std::runtime_error("flashserve slot_rows runs on the CPU stream only");
  }
  const char* name() const override { return "FlashserveSlotRows"; }
  bool is_equivalent(const mx::Primitive&) const override { return true; }
};

mx::array slot_rows(const std::vector<mx::array>& outs, const mx::array& positions, int slots) {
  check(!outs.empty(), "slot_rows: no outputs");
  check(positions.dtype() == mx::uint32 && positions.ndim() == 1,
        "slot_rows: positions must be 1-D uint32");
  const int H = outs[0].shape(-1);
  int64_t rows = 0;
  for (const auto& o : outs) {
    check(o.dtype() == mx::float32 && o.ndim() == 2 && o.shape(1) == H,
          "slot_rows: outputs are 2-D float32 of one width");
    rows += o.shape(0);
  }
  check(rows == positions.size() && rows == slots, "slot_rows: one position per row, every slot once");
  std::vector<mx::array> inputs{mx::contiguous(positions, false, cpu_stream())};
  inputs.insert(inputs.end(), outs.begin(), outs.end());
  return mx::array({slots, H}, mx::float32, std::make_shared<FlashserveSlotRows>(cpu_stream()),
                   std::move(inputs));
}

}  // namespace

// A uint8 array of n bytes that nothing has written: the buffer the expert
// store reads a record into. mx.zeros would fill it on the MLX stream, so the
// caller would wait behind every op queued there (a prefill's experts) before
// its read could start, and the stream thread would fault in every page; here
// the read faults them in, on its I/O thread. The array is evaluated already.
mx::array uninitialized_bytes(int64_t n) {
  if (n <= 0 || n > std::numeric_limits<int32_t>::max()) {
    throw std::invalid_argument("uninitialized_bytes: n must be in 1..2^31-1");
  }
  return mx::array(mx::allocator::malloc(static_cast<size_t>(n)), mx::Shape{static_cast<int32_t>(n)},
                   mx::uint8);
}

void add_expert_ops(nb::module_& m) {
  m.def("uninitialized_bytes", &uninitialized_bytes, "n"_a,
        "an evaluated uint8 array of n bytes, not written (a record buffer to read into)");
  m.def("slot_rows", &slot_rows, "outs"_a, "positions"_a, "slots"_a,
        "row i of concatenate(outs) at row positions[i] of a (slots, width) result, "
        "on the kernel's threads");
  m.def("expert_glu", &expert_glu, "x"_a, "rows"_a, "gate"_a, "up"_a, "down"_a,
        "group_sizes"_a, "bits"_a,
        "down(swiglu(gate(x[rows]), up(x[rows]))) for one expert as one op; each projection "
        "(w, scales, biases); the template's numbers exactly");
}
