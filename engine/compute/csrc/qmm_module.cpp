// flashserve's quantized matmul as an MLX primitive (MLX's documented
// extension mechanism): an array op that stays in MLX's lazy graph and runs
// on MLX's CPU stream, bound to Python with nanobind in MLX's nanobind
// domain so mx.array objects pass through unchanged.
//
//   qmm(x, w, scales, biases, group_size, bits) -> x @ dequantize(w).T
//   qmm_multi(x, [w], [scales], [biases], [group_size], [bits]) -> [x @ dequantize(w[i]).T]
//       weights that share an input (q/k/v, gate/up) as one op, one output each
//   gather_qmm(x, w, scales, biases, rows_expert, group_size, bits)
//       row r of x (flattened to rows) against expert rows_expert[r] of a
//       stacked (E, N, K * bits / 32) weight
//   gather_qmm_list(x, [w], [scales], [biases], rows_expert, group_size, bits)
//       the same with the experts as separate 2-D weights (the expert cache's)
//
// x is float32; w uint32; scales and biases float32, float16 or bfloat16.
#include <nanobind/nanobind.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/vector.h>

#include <algorithm>
#include <memory>
#include <cstring>
#include <numeric>
#include <sstream>
#include <stdexcept>
#include <vector>

#include "mlx/allocator.h"
#include "mlx/array.h"
#include "mlx/backend/cpu/encoder.h"
#include "mlx/ops.h"
#include "mlx/primitives.h"
#include "mlx/stream.h"
#include "mlx/utils.h"
#include "mlx/version.h"
#include "graph_folds.h"
#include "prompt_qgemm.h"
#include "qmm_arrays.h"
#include "qmm_kernels.h"
#include "step_ops.h"

namespace nb = nanobind;
namespace mx = mlx::core;
using namespace nb::literals;

namespace {

using flashserve_qmm::QmmProblem;
using flashserve_qmm::ScaleType;

using flashserve_arrays::inner_size;
using flashserve_arrays::problem;
using flashserve_arrays::scale_type_of;
using flashserve_arrays::Weights;
using flashserve_arrays::x_rows;

// Each row of x against its expert's matrix: `expert(e, p)` points p at
// expert e's weights. Rows are grouped by expert and each expert runs once on
// its rows; a row's arithmetic is the same as in the plain op (rows are
// independent), so a gathered call never changes a number.
template <class Expert>
void gather_rows(const std::vector<const float*>& xr, const uint32_t* idx, int64_t experts,
                 QmmProblem p, float* op, Expert expert) {
  const int64_t M = int64_t(xr.size());
  const int N = p.N;
  std::vector<int64_t> order(M);
  std::iota(order.begin(), order.end(), 0);
  std::stable_sort(order.begin(), order.end(),
                   [&](int64_t a, int64_t b) { return idx[a] < idx[b]; });
  std::vector<const float*> xg;
  std::vector<float> yg;
  for (int64_t start = 0; start < M;) {
    const uint32_t e = idx[order[start]];
    int64_t end = start;
    while (end < M && idx[order[end]] == e) ++end;
    if (e >= uint64_t(experts)) throw std::out_of_range("flashserve gather_qmm: expert index");
    const int64_t rows = end - start;
    xg.resize(rows);
    yg.resize(size_t(rows) * N);
    for (int64_t r = 0; r < rows; ++r) xg[r] = xr[order[start + r]];
    p.x = xg.data();
    p.M = int(rows);
    p.out = yg.data();
    expert(e, p);
    flashserve_qmm::qmm(p);
    for (int64_t r = 0; r < rows; ++r) {
      std::memcpy(op + order[start + r] * N, yg.data() + r * N, sizeof(float) * N);
    }
    start = end;
  }
}

// What a matmul op reads as x: the leading `count` inputs, either x itself
// (or the array x views: graph_folds.h) or the inputs of the step op that
// made x, which the op then computes first (step_ops.h: Prologue).
struct XInput {
  flashserve_step::PrologueKind kind = flashserve_step::PrologueKind::none;
  float eps = 0.0f;
  int count = 1;

  bool operator==(const XInput& o) const {
    return kind == o.kind && eps == o.eps && count == o.count;
  }

  // x's M rows of K floats; `keep` holds any copy or prologue result.
  std::vector<const float*> rows(const std::vector<mx::array>& ins, int K,
                                 std::vector<char>& keep) const {
    const int64_t M = ins[0].size() / K;
    if (kind == flashserve_step::PrologueKind::none) return x_rows(ins[0], M, K, keep);
    keep.resize(size_t(M) * K * sizeof(float));
    float* x = reinterpret_cast<float*>(keep.data());
    flashserve_step::run_prologue(kind, eps, {ins.begin(), ins.begin() + count}, x);
    std::vector<const float*> out(M);
    for (int64_t m = 0; m < M; ++m) out[m] = x + m * K;
    return out;
  }
};

// x's leading inputs for a matmul op, and how to read them.
std::pair<std::vector<mx::array>, XInput> x_input(const mx::array& x) {
  auto pro = flashserve_step::prologue_of(x);
  if (pro.kind != flashserve_step::PrologueKind::none) {
    const int count = int(pro.inputs.size());
    return {std::move(pro.inputs), XInput{pro.kind, pro.eps, count}};
  }
  // Attention's output projection gets its heads merged by views: read the heads.
  return {{flashserve_fold::merged_heads_source(x).value_or(x)}, XInput{}};
}

// The problem out = x @ dequantize(w).T, x as rows; wt holds w's pointers.
QmmProblem plain(const std::vector<const float*>& xr, const Weights& wt, const mx::array& w,
                 const mx::array& scales, mx::array& out, int gs, int bits) {
  QmmProblem p = problem(inner_size(w, bits), scales, w.shape(-2), gs, bits);
  p.w_stride = wt.w_stride, p.s_stride = wt.s_stride;
  p.x = xr.data(), p.M = int(xr.size());
  p.w = wt.w;
  p.scales = wt.s;
  p.biases = wt.b;
  p.bias_times = wt.times;
  p.out = out.data<float>();
  return p;
}

// One problem: out = x @ dequantize(w).T (x as rows), or with `index` each
// row against its expert's matrix in a stacked weight.
void compute(const std::vector<const float*>& xr, const mx::array& w, const mx::array& scales,
             const mx::array& biases, const mx::array* index, mx::array& out, int gs, int bits) {
  const int N = w.shape(-2);
  const int64_t experts = index ? w.shape(0) : 1;
  const Weights wt(w, scales, biases, experts * N);
  const QmmProblem p = plain(xr, wt, w, scales, out, gs, bits);  // gathering re-points it
  if (index == nullptr) return flashserve_qmm::qmm(p);
  const size_t esize = scales.itemsize();
  gather_rows(xr, index->data<uint32_t>(), experts, p, out.data<float>(),
              [&](uint32_t e, QmmProblem& q) {
                q.w = wt.w + int64_t(e) * N * wt.w_stride;
                q.scales = wt.s + int64_t(e) * N * wt.s_stride * esize;
                q.biases = wt.b + int64_t(e) * N * wt.s_stride * esize;
              });
}

// Each row of x against its expert's matrix, the experts given as separate
// arrays (experts[3e .. 3e + 2]: w, scales, biases of expert e): the expert
// cache's experts used where they lie, no stacked copy.
void compute_list(const mx::array& x, const mx::array& rows_expert,
                  const std::vector<mx::array>& experts, mx::array& out, int gs, int bits) {
  const int K = x.shape(-1);
  const int N = experts[0].shape(0);
  const int64_t M = x.size() / K;
  const int64_t count = int64_t(experts.size()) / 3;
  std::vector<char> keep_x;
  const std::vector<const float*> xr = x_rows(x, M, K, keep_x);
  // Resolved on first use: a call touches only the experts its rows route to.
  std::vector<std::unique_ptr<Weights>> wts(count);
  const QmmProblem p = problem(K, experts[1], N, gs, bits);
  gather_rows(xr, rows_expert.data<uint32_t>(), count, p, out.data<float>(),
              [&](uint32_t e, QmmProblem& q) {
                auto& wt = wts[e];
                if (!wt) {
                  wt = std::make_unique<Weights>(experts[3 * e], experts[3 * e + 1],
                                                 experts[3 * e + 2], N);
                }
                q.w = wt->w;
                q.scales = wt->s;
                q.biases = wt->b;
                q.bias_times = wt->times;
                q.w_stride = wt->w_stride;
                q.s_stride = wt->s_stride;
              });
}

class FlashserveQMM : public mx::UnaryPrimitive {
 public:
  FlashserveQMM(mx::Stream stream, int group_size, int bits, bool gather, XInput x)
      : mx::UnaryPrimitive(stream), group_size_(group_size), bits_(bits), gather_(gather), x_(x) {}

  // Inputs: x's (x_.count), w, scales, biases, then the row experts if gathering.
  void eval_cpu(const std::vector<mx::array>& inputs, mx::array& out) override {
    out.set_data(mx::allocator::malloc(out.nbytes()));
    auto& encoder = mx::cpu::get_command_encoder(stream());
    std::vector<mx::array> ins;
    for (const auto& a : inputs) {
      encoder.set_input_array(a);
      ins.push_back(mx::array::unsafe_weak_copy(a));
    }
    encoder.set_output_array(out);
    encoder.dispatch([ins = std::move(ins), out = mx::array::unsafe_weak_copy(out),
                      gs = group_size_, bits = bits_, gather = gather_, xi = x_]() mutable {
      const int n = xi.count;
      std::vector<char> keep;
      const auto xr = xi.rows(ins, inner_size(ins[n], bits), keep);
      compute(xr, ins[n], ins[n + 1], ins[n + 2], gather ? &ins[n + 3] : nullptr, out, gs, bits);
    });
  }

  void eval_gpu(const std::vector<mx::array>&, mx::array&) override {
    throw std::runtime_error("flashserve qmm runs on the CPU stream only");
  }

  const char* name() const override { return "FlashserveQMM"; }

  bool is_equivalent(const mx::Primitive& other) const override {
    const auto& o = static_cast<const FlashserveQMM&>(other);
    return group_size_ == o.group_size_ && bits_ == o.bits_ && gather_ == o.gather_ &&
           x_ == o.x_;
  }

 private:
  int group_size_;
  int bits_;
  bool gather_;
  XInput x_;
};

// gather_qmm over a list of per-expert weights: inputs x, rows_expert, then
// (w, scales, biases) per expert, or, when every expert's arrays were already
// evaluated (the expert cache's always are), those held by the primitive
// instead of as inputs: a list over every expert of a layer (experts/compute.py:
// built_ahead) is ~200 arrays, and each graph input costs MLX's eval time.
class FlashserveGatherList : public mx::UnaryPrimitive {
 public:
  using Experts = std::shared_ptr<const std::vector<mx::array>>;

  FlashserveGatherList(mx::Stream stream, int group_size, int bits, Experts held)
      : mx::UnaryPrimitive(stream), group_size_(group_size), bits_(bits), held_(std::move(held)) {}

  void eval_cpu(const std::vector<mx::array>& inputs, mx::array& out) override {
    out.set_data(mx::allocator::malloc(out.nbytes()));
    auto& encoder = mx::cpu::get_command_encoder(stream());
    std::vector<mx::array> ins;
    for (const auto& a : inputs) {
      encoder.set_input_array(a);
      ins.push_back(mx::array::unsafe_weak_copy(a));
    }
    encoder.set_output_array(out);
    encoder.dispatch([ins = std::move(ins), held = held_, out = mx::array::unsafe_weak_copy(out),
                      gs = group_size_, bits = bits_]() mutable {
      if (held) {
        compute_list(ins[0], ins[1], *held, out, gs, bits);
      } else {
        const std::vector<mx::array> experts(ins.begin() + 2, ins.end());
        compute_list(ins[0], ins[1], experts, out, gs, bits);
      }
    });
  }

  void eval_gpu(const std::vector<mx::array>&, mx::array&) override {
    throw std::runtime_error("flashserve qmm runs on the CPU stream only");
  }

  const char* name() const override { return "FlashserveGatherList"; }

  bool is_equivalent(const mx::Primitive& other) const override {
    const auto& o = static_cast<const FlashserveGatherList&>(other);
    return group_size_ == o.group_size_ && bits_ == o.bits_ && held_ == o.held_;
  }

 private:
  int group_size_;
  int bits_;
  Experts held_;
};

// Several weights that share one input (an attention block's q, k and v
// projections; an MLP's gate and up): one op in the graph instead of one per
// weight, with one output each, computed together (qmm_shared_x) and each
// exactly as the single op computes it, so fusing never changes a number.
class FlashserveQMMMulti : public mx::Primitive {
 public:
  FlashserveQMMMulti(mx::Stream stream, std::vector<int> group_sizes, std::vector<int> bits,
                     XInput x)
      : mx::Primitive(stream),
        group_sizes_(std::move(group_sizes)),
        bits_(std::move(bits)),
        x_(x) {}

  // Inputs: x's (x_.count), then w, scales, biases of each weight.
  void eval_cpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) override {
    auto& encoder = mx::cpu::get_command_encoder(stream());
    std::vector<mx::array> ins, outs;
    for (const auto& a : inputs) {
      encoder.set_input_array(a);
      ins.push_back(mx::array::unsafe_weak_copy(a));
    }
    for (auto& o : outputs) {
      o.set_data(mx::allocator::malloc(o.nbytes()));
      encoder.set_output_array(o);
      outs.push_back(mx::array::unsafe_weak_copy(o));
    }
    encoder.dispatch([ins = std::move(ins), outs = std::move(outs), gs = group_sizes_,
                      bits = bits_, xi = x_]() mutable {
      const int n = xi.count;
      std::vector<char> keep;
      const auto xr = xi.rows(ins, inner_size(ins[n], bits[0]), keep);
      std::vector<Weights> wts;  // reserved: ps points into their copies, if any
      std::vector<QmmProblem> ps;
      wts.reserve(outs.size());
      for (size_t i = 0; i < outs.size(); ++i) {
        const auto &w = ins[n + 3 * i], &scales = ins[n + 1 + 3 * i];
        wts.emplace_back(w, scales, ins[n + 2 + 3 * i], w.shape(-2));
        ps.push_back(plain(xr, wts.back(), w, scales, outs[i], gs[i], bits[i]));
      }
      flashserve_qmm::qmm_shared_x(ps.data(), int(ps.size()));
    });
  }

  void eval_gpu(const std::vector<mx::array>&, std::vector<mx::array>&) override {
    throw std::runtime_error("flashserve qmm runs on the CPU stream only");
  }

  const char* name() const override { return "FlashserveQMMMulti"; }

  bool is_equivalent(const mx::Primitive& other) const override {
    const auto& o = static_cast<const FlashserveQMMMulti&>(other);
    return group_sizes_ == o.group_sizes_ && bits_ == o.bits_ && x_ == o.x_;
  }

 private:
  std::vector<int> group_sizes_;
  std::vector<int> bits_;
  XInput x_;
};

void check(bool ok, const char* what) {
  if (!ok) throw std::invalid_argument(std::string("flashserve qmm: ") + what);
}

void check_weights(const mx::array& x, const mx::array& w, const mx::array& scales,
                   const mx::array& biases, int group_size, int bits, int weight_ndim) {
  check(x.dtype() == mx::float32, "x must be float32");
  check(x.ndim() >= 1, "x must have at least one dimension");
  check(w.dtype() == mx::uint32, "w must be uint32");
  check(w.ndim() == weight_ndim, "w has the wrong number of dimensions");
  if (!flashserve_arrays::biases_of_scales(biases)) {  // else: a multiple of the scales
    check(scales.shape() == biases.shape(), "scales and biases differ in shape");
    check(scales.dtype() == biases.dtype(), "scales and biases differ in dtype");
  }
  scale_type_of(scales);
  const int K = x.shape(-1);
  check(flashserve_qmm::shape_supported(bits, group_size, K), "unsupported bits or group size");
  check(int64_t(w.shape(-1)) * 32 == int64_t(K) * bits, "w does not match x's last dimension");
  check(scales.ndim() == w.ndim() && scales.shape(-2) == w.shape(-2) &&
            scales.shape(-1) == K / group_size,
        "scales do not match w");
  for (int d = 0; d + 2 < w.ndim(); ++d) check(scales.shape(d) == w.shape(d), "scales do not match w");
}

mx::Stream cpu_stream() { return mx::default_stream(mx::Device(mx::Device::cpu)); }

mx::array qmm(const mx::array& x, const mx::array& w, const mx::array& scales,
              const mx::array& biases, int group_size, int bits) {
  check_weights(x, w, scales, biases, group_size, bits, 2);
  auto shape = x.shape();
  shape.back() = w.shape(0);
  auto [inputs, how] = x_input(x);
  inputs.insert(inputs.end(), {w, scales, biases});
  return mx::array(shape, mx::float32,
                   std::make_shared<FlashserveQMM>(cpu_stream(), group_size, bits, false, how),
                   std::move(inputs));
}

std::vector<mx::array> qmm_multi(const mx::array& x, const std::vector<mx::array>& ws,
                                 const std::vector<mx::array>& scales,
                                 const std::vector<mx::array>& biases,
                                 const std::vector<int>& group_sizes,
                                 const std::vector<int>& bits) {
  const size_t n = ws.size();
  check(n > 0 && scales.size() == n && biases.size() == n && group_sizes.size() == n &&
            bits.size() == n,
        "qmm_multi takes one scales, biases, group size and width per weight");
  auto [inputs, how] = x_input(x);
  std::vector<mx::Shape> shapes;
  for (size_t i = 0; i < n; ++i) {
    check_weights(x, ws[i], scales[i], biases[i], group_sizes[i], bits[i], 2);
    auto shape = x.shape();
    shape.back() = ws[i].shape(0);
    shapes.push_back(shape);
    inputs.insert(inputs.end(), {ws[i], scales[i], biases[i]});
  }
  return mx::array::make_arrays(
      std::move(shapes), std::vector<mx::Dtype>(n, mx::float32),
      std::make_shared<FlashserveQMMMulti>(cpu_stream(), group_sizes, bits, how), inputs);
}

mx::array gather_qmm(const mx::array& x, const mx::array& w, const mx::array& scales,
                     const mx::array& biases, const mx::array& rows_expert, int group_size,
                     int bits) {
  check_weights(x, w, scales, biases, group_size, bits, 3);
  check(rows_expert.dtype() == mx::uint32, "rows_expert must be uint32");
  check(rows_expert.size() * x.shape(-1) == x.size(), "rows_expert must have one entry per row");
  auto shape = x.shape();
  shape.back() = w.shape(1);
  auto s = cpu_stream();
  auto index = mx::contiguous(mx::flatten(rows_expert, s), false, s);
  return mx::array(shape, mx::float32,
                   std::make_shared<FlashserveQMM>(s, group_size, bits, true, XInput{}),
                   {x, w, scales, biases, index});
}

mx::array gather_qmm_list(const mx::array& x, const std::vector<mx::array>& ws,
                          const std::vector<mx::array>& scales,
                          const std::vector<mx::array>& biases, const mx::array& rows_expert,
                          int group_size, int bits) {
  const size_t n = ws.size();
  check(n > 0 && scales.size() == n && biases.size() == n,
        "gather_qmm_list takes one scales and biases per expert weight");
  check(rows_expert.dtype() == mx::uint32, "rows_expert must be uint32");
  check(rows_expert.size() * x.shape(-1) == x.size(), "rows_expert must have one entry per row");
  auto s = cpu_stream();
  std::vector<mx::array> experts;
  bool evaluated = true;
  for (size_t e = 0; e < n; ++e) {
    check_weights(x, ws[e], scales[e], biases[e], group_size, bits, 2);
    check(ws[e].shape() == ws[0].shape() && scales[e].dtype() == scales[0].dtype(),
          "gather_qmm_list: experts differ in shape or scale dtype");
    experts.insert(experts.end(), {ws[e], scales[e], biases[e]});
    evaluated = evaluated && ws[e].is_available() && scales[e].is_available() &&
                biases[e].is_available();
  }
  std::vector<mx::array> inputs{x, mx::contiguous(mx::flatten(rows_expert, s), false, s)};
  FlashserveGatherList::Experts held;
  if (evaluated) {
    held = std::make_shared<const std::vector<mx::array>>(std::move(experts));
  } else {
    inputs.insert(inputs.end(), experts.begin(), experts.end());
  }
  auto shape = x.shape();
  shape.back() = ws[0].shape(0);
  return mx::array(shape, mx::float32,
                   std::make_shared<FlashserveGatherList>(s, group_size, bits, std::move(held)),
                   std::move(inputs));
}

std::string compiled_mlx_version() {
  std::ostringstream out;
  out << MLX_VERSION_MAJOR << "." << MLX_VERSION_MINOR << "." << MLX_VERSION_PATCH;
  return out.str();
}

}  // namespace

NB_MODULE(_qmm, m) {
  m.doc() = "flashserve's CPU quantized matmul for few rows, as an MLX primitive";
  m.def("qmm", &qmm, "x"_a, "w"_a, "scales"_a, "biases"_a, "group_size"_a, "bits"_a,
        "x @ dequantize(w, scales, biases).T on the CPU stream (x float32, rows flattened)");
  // qmm, qmm_multi, gather_qmm and prompt_qgemm take biases as a 0-d float32 t
  // standing for t x the scales (a symmetric quant's biases, none in memory).
  m.attr("biases_of_scales") = true;
  m.def("qmm_multi", &qmm_multi, "x"_a, "w"_a, "scales"_a, "biases"_a, "group_sizes"_a,
        "bits"_a,
        "[x @ dequantize(w[i]).T for each i] as one op: weights that share an input");
  m.def("gather_qmm", &gather_qmm, "x"_a, "w"_a, "scales"_a, "biases"_a, "rows_expert"_a,
        "group_size"_a, "bits"_a,
        "each row of x against its expert's weight in a stacked (E, N, K') weight");
  m.def("gather_qmm_list", &gather_qmm_list, "x"_a, "w"_a, "scales"_a, "biases"_a,
        "rows_expert"_a, "group_size"_a, "bits"_a,
        "each row of x against its expert's weight, the experts a list of 2-D weights");
  m.def("cpu_supported", &flashserve_qmm::cpu_supported,
        "whether this CPU has AVX2, FMA and F16C (the kernel's instructions)");
  m.def("set_threads", &flashserve_qmm::set_threads, "n"_a,
        "threads the kernel uses, the calling one included; 0: one per core");
  m.def("threads", &flashserve_qmm::threads);
  m.def("set_avx512", &flashserve_qmm::set_avx512, "allowed"_a,
        "whether 4- and 8-bit problems may take the AVX-512 kernel (default: allowed)");
  m.def("avx512_active", &flashserve_qmm::avx512_active,
        "whether 4- and 8-bit problems take the AVX-512 kernel now");
  m.def("set_x_bits", &flashserve_qmm::set_x_bits, "bits"_a,
        "16: 4- and 8-bit problems on the AVX-512 kernel round x to int16 per block of 32 "
        "(integer dot products); 0: x stays float32");
  m.def("x_bits", &flashserve_qmm::x_bits, "16 or 0: what set_x_bits chose");
  m.def("set_vnni", &flashserve_qmm::set_vnni, "allowed"_a,
        "whether the int16 kernel may use AVX-512 VNNI (else vpmaddwd: the same numbers)");
  m.def("vnni_active", &flashserve_qmm::vnni_active,
        "whether the int16 kernel uses AVX-512 VNNI now");
  m.def("compiled_mlx_version", &compiled_mlx_version,
        "the MLX version whose headers this module was compiled against");
  m.def("runtime_mlx_version", [] { return std::string(mx::version()); },
        "the version of the libmlx this module is linked to at run time");
  add_step_ops(m);
  add_prompt_qgemm(m);
  add_sdpa_quant(m);
}
