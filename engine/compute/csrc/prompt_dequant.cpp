// A quantized weight as float32 for a prompt chunk's BLAS matmul
// (compute/prompt_matmul.py), as one MLX primitive on the CPU stream,
// vectorized and spread over the kernel's threads.
//
// mx.dequantize on MLX's CPU backend runs on one thread: on the default
// model it was 15% of a 1,066-token prefill, the part left on one core once
// the BLAS ran on all of them (issue 42). The numbers are MLX's exactly:
// w * scale rounded, then + bias rounded (no fused multiply-add: this
// function's target has no FMA), so a prompt gives the same tokens either way.
//
// Weights packed as MLX packs 2-, 4- and 8-bit values (affine mode): each
// uint32 holds 32 / bits values, the first in the lowest bits.
#include <nanobind/nanobind.h>

#include <immintrin.h>

#include <algorithm>
#include <cstdint>
#include <memory>
#include <vector>

#include "mlx/allocator.h"
#include "mlx/array.h"
#include "mlx/primitives.h"
#include "qmm_kernels.h"
#include "step_common.h"
#include "step_ops.h"

namespace nb = nanobind;
namespace mx = mlx::core;
using namespace nb::literals;
using namespace flashserve_step;

namespace {

constexpr int64_t VALUES_PER_PART = 256 * 1024;  // about 1 MB of float32 output per part

// Eight values starting at value j of a row of packed words, as int32 lanes.
__attribute__((target("avx2"))) inline __m256i unpack8(const uint32_t* row, int64_t j, int bits) {
  if (bits == 8) {
    const auto* bytes = reinterpret_cast<const uint8_t*>(row) + j;
    return _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(bytes)));
  }
  const int64_t bit = j * bits;  // 8 values of 2 or 4 bits lie in one word
  const uint32_t word = row[bit / 32] >> (bit % 32);
  const __m256i lane = _mm256_set_epi32(7, 6, 5, 4, 3, 2, 1, 0);
  const __m256i shifts = _mm256_mullo_epi32(lane, _mm256_set1_epi32(bits));
  const __m256i mask = _mm256_set1_epi32((1 << bits) - 1);
  return _mm256_and_si256(_mm256_srlv_epi32(_mm256_set1_epi32(int(word)), shifts), mask);
}

// Rows [begin, end) of the (N, K) output.
__attribute__((target("avx2"))) void dequant_rows(const uint32_t* w, const float* scales,
                                                  const float* biases, float* out, int64_t begin,
                                                  int64_t end, int64_t K, int group_size,
                                                  int bits) {
  const int64_t words = K * bits / 32, groups = K / group_size;
  for (int64_t r = begin; r < end; ++r) {
    const uint32_t* wr = w + r * words;
    float* o = out + r * K;
    for (int64_t g = 0; g < groups; ++g) {
      const __m256 s = _mm256_set1_ps(scales[r * groups + g]);
      const __m256 b = _mm256_set1_ps(biases[r * groups + g]);
      for (int64_t j = g * group_size; j < (g + 1) * group_size; j += 8) {
        const __m256 q = _mm256_cvtepi32_ps(unpack8(wr, j, bits));
        _mm256_storeu_ps(o + j, _mm256_add_ps(_mm256_mul_ps(q, s), b));
      }
    }
  }
}

class FlashservePromptDequant : public mx::UnaryPrimitive {
 public:
  FlashservePromptDequant(mx::Stream s, int group_size, int bits)
      : mx::UnaryPrimitive(s), group_size_(group_size), bits_(bits) {}

  void eval_cpu(const std::vector<mx::array>& inputs, mx::array& out) override {
    out.set_data(mx::allocator::malloc(out.nbytes()));
    dispatch(stream(), inputs, out,
             [in = weak(inputs), out = mx::array::unsafe_weak_copy(out), g = group_size_,
              bits = bits_]() mutable {
               const int64_t N = out.shape(0), K = out.shape(1);
               const int64_t rows_per_part = std::max<int64_t>(1, VALUES_PER_PART / K);
               const int parts = int((N + rows_per_part - 1) / rows_per_part);
               const auto* w = in[0].data<uint32_t>();
               const float* s = in[1].data<float>();
               const float* b = in[2].data<float>();
               float* o = out.data<float>();
               flashserve_qmm::parallel_for(parts, [&](int part) {
                 const int64_t begin = int64_t(part) * rows_per_part;
                 dequant_rows(w, s, b, o, begin, std::min(N, begin + rows_per_part), K, g, bits);
               });
             });
  }
  void eval_gpu(const std::vector<mx::array>&, mx::array&) override {
    throw std::runtime_error("flashserve step ops run on the CPU stream only");
  }
  const char* name() const override { return "FlashservePromptDequant"; }
  bool is_equivalent(const mx::Primitive& other) const override {
    const auto& o = static_cast<const FlashservePromptDequant&>(other);
    return group_size_ == o.group_size_ && bits_ == o.bits_;
  }

 private:
  int group_size_;
  int bits_;
};

mx::array dequantize(const mx::array& w, const mx::array& scales, const mx::array& biases,
                     int group_size, int bits) {
  check(bits == 2 || bits == 4 || bits == 8, "dequantize takes 2, 4 or 8 bits");
  check(group_size % 8 == 0 && group_size > 0, "dequantize: group size is a multiple of 8");
  check(w.dtype() == mx::uint32 && w.ndim() == 2, "dequantize: w is 2-D uint32");
  check(scales.dtype() == mx::float32 && biases.dtype() == mx::float32,
        "dequantize: float32 scales and biases");
  const int N = w.shape(0), K = w.shape(1) * 32 / bits;
  check(K % group_size == 0, "dequantize: row length is a multiple of the group size");
  check(scales.ndim() == 2 && scales.shape(0) == N && scales.shape(1) == K / group_size &&
            biases.shape() == scales.shape(),
        "dequantize: scales and biases are (rows, groups)");
  // Row-major inputs: the kernel walks them by pointer.
  std::vector<mx::array> inputs{mx::contiguous(w, false, cpu_stream()),
                                mx::contiguous(scales, false, cpu_stream()),
                                mx::contiguous(biases, false, cpu_stream())};
  return mx::array({N, K}, mx::float32,
                   std::make_shared<FlashservePromptDequant>(cpu_stream(), group_size, bits),
                   std::move(inputs));
}

}  // namespace

void add_prompt_dequant(nb::module_& m) {
  m.def("dequantize", &dequantize, "w"_a, "scales"_a, "biases"_a, "group_size"_a, "bits"_a,
        "dequantize(w) as float32 (MLX's affine mode, 2/4/8 bits, float32 scales and biases), "
        "vectorized, on the kernel's threads; MLX's numbers exactly");
}
