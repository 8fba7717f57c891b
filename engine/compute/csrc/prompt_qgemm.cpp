// The prompt GEMM (prompt_qgemm.h) as an MLX primitive on the CPU stream:
// x's rows quantized once per call, then every column tile of every weight
// given (q/k/v, gate/up share one x) spread over the kernel's thread pool,
// each tile on the best instruction set this CPU has (or the one a test caps
// it at). No float copy of a weight is made: each tile unpacks its columns'
// packed values a chunk at a time.
//
// Why integers: a prompt chunk's quantized linears ran either as dequantize +
// float GEMM (a float copy of every weight, per chunk or per layer) or, for
// large weights, on the few-row decode kernel whose cost grows with the rows
// (issue 57: prefill at 0.58x llama.cpp's on a 1.2B Q4_0 model). vpdpbusd
// does 64 multiply-adds of bytes per instruction.
#include "prompt_qgemm.h"

#include <immintrin.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/vector.h>

#include <algorithm>
#include <atomic>
#include <cstring>
#include <memory>
#include <string>
#include <vector>

#include "mlx/allocator.h"
#include "mlx/array.h"
#include "mlx/backend/cpu/encoder.h"
#include "mlx/ops.h"
#include "mlx/primitives.h"
#include "qmm_arrays.h"
#include "qmm_kernels.h"

namespace nb = nanobind;
namespace mx = mlx::core;
using namespace nb::literals;

namespace flashserve_qgemm {
namespace {

const char* const kIsaNames[] = {"none", "avx2", "avxvnni", "avx512vnni"};

bool has(Isa isa) {
  __builtin_cpu_init();
  switch (isa) {
    case Isa::avx512vnni:
      return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
             __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512vnni") &&
             __builtin_cpu_supports("fma");
    case Isa::avxvnni:
      return __builtin_cpu_supports("avxvnni") && __builtin_cpu_supports("avx2") &&
             __builtin_cpu_supports("fma");
    case Isa::avx2:
      return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") &&
             __builtin_cpu_supports("f16c");
    default:
      return false;
  }
}

// The best path allowed: tests cap it to check each one the CPU has.
std::atomic<int> g_cap{int(Isa::avx512vnni)};

Isa active() {
  if (!has(Isa::avx2)) return Isa::none;  // quantize_rows and the scale reads need AVX2 + F16C
  for (int i = g_cap.load(); i > 0; --i) {
    if (has(Isa(i))) return Isa(i);
  }
  return Isa::none;
}

// Kernel order of a 4-bit block's values inside each 16 (prompt_qgemm_tile.inc):
// step 2j holds values 8j, +2, +4, +6; step 2j + 1 values 8j + 1, +3, +5, +7.
constexpr char kOrder4[16] = {0, 2, 4, 6, 1, 3, 5, 7, 8, 10, 12, 14, 9, 11, 13, 15};

// 16-bit x: position 2 * (2s + h) + e of a block holds the 8-bit order's value
// 4s + h + 2e (the tile splits each 4-byte step into bytes 0, 2 and 1, 3).
struct Order16 {
  uint8_t at[2][32];  // [bits == 4][position] -> index into the natural block
  Order16() {
    for (int p = 0; p < 32; ++p) {
      const int pair = p / 2, e = p % 2, s = pair / 2, h = pair % 2;
      const int i = 4 * s + h + 2 * e;  // in the 8-bit kernel's order
      at[0][p] = uint8_t(i);
      at[1][p] = uint8_t(kOrder4[i % 16] + 16 * (i / 16));
    }
  }
};
const Order16 kOrder16;

// One row of x, each block of 32 values rounded to integers of `xbits` bits
// (8: llama.cpp's Q8_0, scale max|x| / 127; 16: max|x| / 32767), to nearest,
// stored in the kernel's order; the scale in float32, and the sum of the
// rounded x over each group. The same numbers on every instruction-set path.
//
// Why 16 bits is the default (compute/prompt_matmul.py): on SmolLM2-135M the
// 8-bit rows moved a top-5 next-token probability by up to 0.20 over 400
// positions (0.004 on average), the 16-bit ones by 0.0006, for half the
// integer rate, which is still several times what a prompt needs.
__attribute__((target("avx2,fma"))) void quantize_row(const float* x, int K, int group_size,
                                                      int bits, int xbits, uint8_t* q,
                                                      float* scale, float* gsum) {
  const __m256 abs_mask = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff));
  const __m256i pack_order = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);
  const __m256i order4 = _mm256_broadcastsi128_si256(
      _mm_loadu_si128(reinterpret_cast<const __m128i*>(kOrder4)));
  const float top = xbits == 8 ? 127.0f : 32767.0f;
  const uint8_t* order16 = kOrder16.at[bits == 4 ? 1 : 0];
  const int per_group = group_size / 32;
  for (int b = 0; b < K / 32; ++b) {
    __m256 v[4];
    for (int i = 0; i < 4; ++i) v[i] = _mm256_loadu_ps(x + 32 * b + 8 * i);
    __m256 m = _mm256_max_ps(_mm256_max_ps(_mm256_and_ps(v[0], abs_mask), _mm256_and_ps(v[1], abs_mask)),
                             _mm256_max_ps(_mm256_and_ps(v[2], abs_mask), _mm256_and_ps(v[3], abs_mask)));
    __m128 m4 = _mm_max_ps(_mm256_castps256_ps128(m), _mm256_extractf128_ps(m, 1));
    m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
    m4 = _mm_max_ss(m4, _mm_movehdup_ps(m4));
    const float amax = _mm_cvtss_f32(m4);
    const float d = amax / top;
    const __m256 inv = _mm256_set1_ps(d != 0.0f ? 1.0f / d : 0.0f);
    __m256i n[4];
    for (int i = 0; i < 4; ++i) n[i] = _mm256_cvtps_epi32(_mm256_mul_ps(v[i], inv));  // to nearest
    if (xbits == 8) {
      __m256i packed = _mm256_packs_epi16(_mm256_packs_epi32(n[0], n[1]), _mm256_packs_epi32(n[2], n[3]));
      packed = _mm256_permutevar8x32_epi32(packed, pack_order);  // undo the packs' lane interleave
      if (bits == 4) packed = _mm256_shuffle_epi8(packed, order4);
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(q + 32 * b), packed);
    } else {
      alignas(32) int16_t natural[32];
      for (int h = 0; h < 2; ++h) {  // packs interleaves 128-bit lanes: put them back
        const __m256i p16 = _mm256_permute4x64_epi64(_mm256_packs_epi32(n[2 * h], n[2 * h + 1]), 0xD8);
        _mm256_store_si256(reinterpret_cast<__m256i*>(natural + 16 * h), p16);
      }
      int16_t* out = reinterpret_cast<int16_t*>(q) + 32 * b;
      for (int p = 0; p < 32; ++p) out[p] = natural[order16[p]];
    }
    scale[b] = d;
    // The sum of the rounded values, not of x: the integer dot uses q in
    // [0, 2^bits), not centred, so its share of x's rounding error is large,
    // and the bias term cancels it only if it sees the same rounded x (as
    // llama.cpp's Q8_1 sums). With x's exact sums the error was 3-5x larger.
    const __m256i s8 = _mm256_add_epi32(_mm256_add_epi32(n[0], n[1]), _mm256_add_epi32(n[2], n[3]));
    __m128i s4 = _mm_add_epi32(_mm256_castsi256_si128(s8), _mm256_extracti128_si256(s8, 1));
    s4 = _mm_add_epi32(s4, _mm_unpackhi_epi64(s4, s4));
    s4 = _mm_add_epi32(s4, _mm_shuffle_epi32(s4, 1));
    const float sum = d * float(_mm_cvtsi128_si32(s4));
    if (b % per_group == 0) {
      gsum[b / per_group] = sum;
    } else {
      gsum[b / per_group] += sum;
    }
  }
}

__attribute__((target("f16c"))) inline float scale_at(const char* base, int64_t i,
                                                      flashserve_qmm::ScaleType st) {
  if (st == flashserve_qmm::ScaleType::f32) return reinterpret_cast<const float*>(base)[i];
  const uint16_t h = reinterpret_cast<const uint16_t*>(base)[i];
  if (st == flashserve_qmm::ScaleType::f16) return _cvtsh_ss(h);
  const uint32_t bits = uint32_t(h) << 16;
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
}

struct Problem {
  Weight w;
  const char* scales;
  const char* biases;
  int64_t s_stride;
  flashserve_qmm::ScaleType st;
  int tiles;
  float bias_times;  // nonzero: biases are this x the scales (flashserve_qmm::QmmProblem)
};

// Each thread's scratch, kept between calls (a prompt runs hundreds of them).
thread_local std::vector<float> t_sbuf, t_ybuf;
thread_local std::vector<uint8_t> t_wbuf;

// Eight of a row's scales (groups g..g+7) as float32: the same conversions as scale_at.
__attribute__((target("avx2,f16c"))) inline __m256 eight_at(const char* row, int g,
                                                           flashserve_qmm::ScaleType st) {
  if (st == flashserve_qmm::ScaleType::f32) {
    return _mm256_loadu_ps(reinterpret_cast<const float*>(row) + g);
  }
  const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(
      reinterpret_cast<const uint16_t*>(row) + g));
  if (st == flashserve_qmm::ScaleType::f16) return _mm256_cvtph_ps(h);
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}

// out[g * width + c] = the scale of column n0 + c (the last column past N) at group g,
// for `width` columns and `groups` groups: rows of the weight's scales turned into
// the tile's [group][column] order eight by eight (a scalar loop over them was most
// of a call's fixed cost: 1.2 of 1.8 ms for a 2048 x 12288 weight, a next turn's
// 36 rows 5.0 ms in all).
__attribute__((target("avx2,f16c"))) void fill_scales(const char* base, int64_t stride,
                                                     flashserve_qmm::ScaleType st, int n0, int N,
                                                     int width, int groups, float* out) {
  const int64_t item = st == flashserve_qmm::ScaleType::f32 ? 4 : 2;
  const auto row_of = [&](int c) { return base + int64_t(std::min(n0 + c, N - 1)) * stride * item; };
  int c0 = 0;
  for (; c0 + 8 <= width; c0 += 8) {
    const char* rows[8];
    for (int j = 0; j < 8; ++j) rows[j] = row_of(c0 + j);
    int g = 0;
    for (; g + 8 <= groups; g += 8) {
      __m256 r[8], t[8], u[8];
      for (int j = 0; j < 8; ++j) r[j] = eight_at(rows[j], g, st);  // column j, groups g..g+7
      for (int j = 0; j < 8; j += 2) {
        t[j] = _mm256_unpacklo_ps(r[j], r[j + 1]);
        t[j + 1] = _mm256_unpackhi_ps(r[j], r[j + 1]);
      }
      for (int j = 0; j < 8; j += 4) {
        u[j] = _mm256_shuffle_ps(t[j], t[j + 2], _MM_SHUFFLE(1, 0, 1, 0));
        u[j + 1] = _mm256_shuffle_ps(t[j], t[j + 2], _MM_SHUFFLE(3, 2, 3, 2));
        u[j + 2] = _mm256_shuffle_ps(t[j + 1], t[j + 3], _MM_SHUFFLE(1, 0, 1, 0));
        u[j + 3] = _mm256_shuffle_ps(t[j + 1], t[j + 3], _MM_SHUFFLE(3, 2, 3, 2));
      }
      for (int i = 0; i < 4; ++i) {  // group g + i from lanes 0-3, g + 4 + i from 4-7
        _mm256_storeu_ps(out + int64_t(g + i) * width + c0, _mm256_permute2f128_ps(u[i], u[4 + i], 0x20));
        _mm256_storeu_ps(out + int64_t(g + 4 + i) * width + c0, _mm256_permute2f128_ps(u[i], u[4 + i], 0x31));
      }
    }
    for (; g < groups; ++g) {
      for (int j = 0; j < 8; ++j) {
        out[int64_t(g) * width + c0 + j] = scale_at(rows[j], g, st);
      }
    }
  }
  for (; c0 < width; ++c0) {
    const char* row = row_of(c0);
    for (int g = 0; g < groups; ++g) out[int64_t(g) * width + c0] = scale_at(row, g, st);
  }
}

// Sixteen of a row's scales (groups g..g+15) as float32, as scale_at converts them.
__attribute__((target("avx512f,avx512bw,f16c"))) inline __m512 sixteen_at(
    const char* row, int g, flashserve_qmm::ScaleType st) {
  if (st == flashserve_qmm::ScaleType::f32) {
    return _mm512_loadu_ps(reinterpret_cast<const float*>(row) + g);
  }
  const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(
      reinterpret_cast<const uint16_t*>(row) + g));
  if (st == flashserve_qmm::ScaleType::f16) return _mm512_cvtph_ps(h);
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}

// fill_scales in blocks of 16 columns x 16 groups where the CPU has AVX-512
// (`width` a multiple of 16): half the instructions per value of the 8 x 8
// blocks, which were 5.6% of a 57-token prompt's time on the 1.2B model (every
// scale is converted once per call, whatever the rows).
__attribute__((target("avx512f,avx512bw,f16c"))) void fill_scales16(
    const char* base, int64_t stride, flashserve_qmm::ScaleType st, int n0, int N, int width,
    int groups, float* out) {
  const int64_t item = st == flashserve_qmm::ScaleType::f32 ? 4 : 2;
  for (int c0 = 0; c0 < width; c0 += 16) {
    const char* rows[16];
    for (int j = 0; j < 16; ++j) rows[j] = base + int64_t(std::min(n0 + c0 + j, N - 1)) * stride * item;
    int g = 0;
    for (; g + 16 <= groups; g += 16) {
      __m512 r[16], t[16], u[16];
      for (int j = 0; j < 16; ++j) {
        __builtin_prefetch(rows[j] + (g + 64) * item);  // four lines on: 16 streams from memory
        r[j] = sixteen_at(rows[j], g, st);  // column j
      }
      for (int j = 0; j < 16; j += 2) {
        t[j] = _mm512_unpacklo_ps(r[j], r[j + 1]);
        t[j + 1] = _mm512_unpackhi_ps(r[j], r[j + 1]);
      }
      for (int j = 0; j < 16; j += 4) {  // u[j + m]: in 128-bit lane l, group 4l + m of 4 columns
        u[j] = _mm512_shuffle_ps(t[j], t[j + 2], 0x44);
        u[j + 1] = _mm512_shuffle_ps(t[j], t[j + 2], 0xEE);
        u[j + 2] = _mm512_shuffle_ps(t[j + 1], t[j + 3], 0x44);
        u[j + 3] = _mm512_shuffle_ps(t[j + 1], t[j + 3], 0xEE);
      }
      for (int m = 0; m < 4; ++m) {
        const __m512 v0 = _mm512_shuffle_f32x4(u[m], u[4 + m], 0x44);
        const __m512 v1 = _mm512_shuffle_f32x4(u[m], u[4 + m], 0xEE);
        const __m512 w0 = _mm512_shuffle_f32x4(u[8 + m], u[12 + m], 0x44);
        const __m512 w1 = _mm512_shuffle_f32x4(u[8 + m], u[12 + m], 0xEE);
        float* o = out + int64_t(g + m) * width + c0;
        _mm512_storeu_ps(o, _mm512_shuffle_f32x4(v0, w0, 0x88));
        _mm512_storeu_ps(o + 4 * width, _mm512_shuffle_f32x4(v0, w0, 0xDD));
        _mm512_storeu_ps(o + 8 * width, _mm512_shuffle_f32x4(v1, w1, 0x88));
        _mm512_storeu_ps(o + 12 * width, _mm512_shuffle_f32x4(v1, w1, 0xDD));
      }
    }
    for (; g < groups; ++g) {
      for (int j = 0; j < 16; ++j) out[int64_t(g) * width + c0 + j] = scale_at(rows[j], g, st);
    }
  }
}

// Tile `tile` of `p`: its columns' scales and biases as float32, then the kernel.
void run_tile(const Problem& p, const Acts& a, int tile, Isa isa, int width) {
  const int groups = p.w.K / p.w.group_size;
  t_sbuf.resize(size_t(2) * groups * width);
  t_wbuf.resize(size_t(width) * CHUNK * 2);
  t_ybuf.resize(size_t(a.M) * width);
  float* s = t_sbuf.data();
  const auto fill = isa == Isa::avx512vnni && width % 16 == 0 ? fill_scales16 : fill_scales;
  fill(p.scales, p.s_stride, p.st, tile * width, p.w.N, width, groups, s);
  float* b = s + int64_t(groups) * width;
  fill(p.biases, p.s_stride, p.st, tile * width, p.w.N, width, groups, b);
  if (p.bias_times != 0.f) {
    for (int64_t i = 0; i < int64_t(groups) * width; ++i) b[i] *= p.bias_times;
  }
  const TileFn fn = isa == Isa::avx512vnni ? tile_avx512vnni
                    : isa == Isa::avxvnni  ? tile_avxvnni
                                           : tile_avx2;
  fn(p.w, a, tile, s, t_wbuf.data(), t_ybuf.data());
}

int width_of(Isa isa) {
  return isa == Isa::avx512vnni ? kWidthAvx512vnni
         : isa == Isa::avxvnni  ? kWidthAvxvnni
                                : kWidthAvx2;
}

constexpr int QUANT_ROWS = 8;  // rows of x quantized per part of the pool's work

// out[i] = x @ dequantize(w[i]).T for each weight; ins: x, then w, scales, biases per weight.
void compute(const std::vector<mx::array>& ins, std::vector<mx::array>& outs, int group_size,
             int bits, int xbits) {
  const Isa isa = active();
  const int K = ins[0].shape(-1);
  const int64_t M = ins[0].size() / K;
  std::vector<char> keep;
  const std::vector<const float*> xr = flashserve_arrays::x_rows(ins[0], M, K, keep);
  const int blocks = K / 32, groups = K / group_size;
  std::vector<uint8_t> q(size_t(M) * K * (xbits / 8));
  std::vector<float> scale(size_t(M) * blocks), gsum(size_t(M) * groups);
  flashserve_qmm::parallel_for(int((M + QUANT_ROWS - 1) / QUANT_ROWS), [&](int part) {
    for (int64_t m = int64_t(part) * QUANT_ROWS; m < std::min(M, int64_t(part + 1) * QUANT_ROWS); ++m) {
      quantize_row(xr[m], K, group_size, bits, xbits, q.data() + m * K * (xbits / 8),
                   scale.data() + m * blocks, gsum.data() + m * groups);
    }
  });
  const Acts acts{q.data(), scale.data(), gsum.data(), int(M), K, xbits};
  const int width = width_of(isa);
  std::vector<std::unique_ptr<flashserve_arrays::Weights>> held;
  std::vector<Problem> problems;
  std::vector<int> first_tile{0};
  for (size_t i = 0; i < outs.size(); ++i) {
    const auto &w = ins[1 + 3 * i], &scales = ins[2 + 3 * i];
    const int N = w.shape(0);
    held.push_back(std::make_unique<flashserve_arrays::Weights>(w, scales, ins[3 + 3 * i], N));
    const auto& wt = *held.back();
    Problem p{Weight{wt.w, wt.w_stride, N, K, bits, group_size, outs[i].data<float>(), N},
              wt.s, wt.b, wt.s_stride, flashserve_arrays::scale_type_of(scales),
              (N + width - 1) / width, wt.times};
    problems.push_back(p);
    first_tile.push_back(first_tile.back() + p.tiles);
  }
  flashserve_qmm::parallel_for(first_tile.back(), [&](int t) {
    size_t i = 0;
    while (t >= first_tile[i + 1]) ++i;
    run_tile(problems[i], acts, t - first_tile[i], isa, width);
  });
}

class FlashservePromptQGemm : public mx::Primitive {
 public:
  FlashservePromptQGemm(mx::Stream stream, int group_size, int bits, int xbits)
      : mx::Primitive(stream), group_size_(group_size), bits_(bits), xbits_(xbits) {}

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
    encoder.dispatch([ins = std::move(ins), outs = std::move(outs), gs = group_size_,
                      bits = bits_, xbits = xbits_]() mutable { compute(ins, outs, gs, bits, xbits); });
  }

  void eval_gpu(const std::vector<mx::array>&, std::vector<mx::array>&) override {
    throw std::runtime_error("flashserve prompt_qgemm runs on the CPU stream only");
  }

  const char* name() const override { return "FlashservePromptQGemm"; }

  bool is_equivalent(const mx::Primitive& other) const override {
    const auto& o = static_cast<const FlashservePromptQGemm&>(other);
    return group_size_ == o.group_size_ && bits_ == o.bits_ && xbits_ == o.xbits_;
  }

 private:
  int group_size_;
  int bits_;
  int xbits_;
};

void check(bool ok, const char* what) {
  if (!ok) throw std::invalid_argument(std::string("flashserve prompt_qgemm: ") + what);
}

std::vector<mx::array> prompt_qgemm(const mx::array& x, const std::vector<mx::array>& ws,
                                    const std::vector<mx::array>& scales,
                                    const std::vector<mx::array>& biases, int group_size,
                                    int bits, int x_bits) {
  const size_t n = ws.size();
  check(active() != Isa::none, "this CPU lacks AVX2, FMA and F16C");
  check(n > 0 && scales.size() == n && biases.size() == n, "one scales and biases per weight");
  check(bits == 4 || bits == 8, "bits must be 4 or 8");
  check(x_bits == 8 || x_bits == 16, "x_bits must be 8 or 16");
  check(group_size == 32 || group_size == 64 || group_size == 128, "group size 32, 64 or 128");
  check(x.dtype() == mx::float32 && x.ndim() >= 1, "x must be float32");
  const int K = x.shape(-1);
  check(K % group_size == 0, "x's last dimension must be a multiple of the group size");
  auto s = mx::default_stream(mx::Device(mx::Device::cpu));
  std::vector<mx::array> inputs{x};
  std::vector<mx::Shape> shapes;
  for (size_t i = 0; i < n; ++i) {
    check(ws[i].dtype() == mx::uint32 && ws[i].ndim() == 2, "w must be 2-D uint32");
    check(int64_t(ws[i].shape(1)) * 32 == int64_t(K) * bits, "w does not match x");
    check(scales[i].ndim() == 2 && scales[i].shape(0) == ws[i].shape(0) &&
              scales[i].shape(1) == K / group_size &&
              (flashserve_arrays::biases_of_scales(biases[i]) ||
               (biases[i].shape() == scales[i].shape() && biases[i].dtype() == scales[i].dtype())),
          "scales and biases must be (rows, groups) and of one dtype");
    flashserve_arrays::scale_type_of(scales[i]);
    auto shape = x.shape();
    shape.back() = ws[i].shape(0);
    shapes.push_back(shape);
    inputs.insert(inputs.end(), {ws[i], scales[i], biases[i]});
  }
  return mx::array::make_arrays(
      std::move(shapes), std::vector<mx::Dtype>(n, mx::float32),
      std::make_shared<FlashservePromptQGemm>(s, group_size, bits, x_bits), inputs);
}

}  // namespace
}  // namespace flashserve_qgemm

void add_prompt_qgemm(nb::module_& m) {
  using namespace flashserve_qgemm;
  m.def("prompt_qgemm", &prompt_qgemm, "x"_a, "w"_a, "scales"_a, "biases"_a, "group_size"_a,
        "bits"_a, "x_bits"_a = 16,
        "[x @ dequantize(w[i]).T] for weights sharing x (4/8 bits, affine), x rounded per "
        "row to integers of x_bits (8 or 16) in blocks of 32, integer dot products");
  m.def("prompt_qgemm_isa", [] { return std::string(kIsaNames[int(active())]); },
        "the instruction set prompt_qgemm uses now: avx512vnni, avxvnni, avx2 or none");
  m.def("prompt_qgemm_isas", [] {
        std::vector<std::string> out;
        for (int i = int(Isa::avx512vnni); i > 0; --i) {
          if (has(Isa(i))) out.emplace_back(kIsaNames[i]);
        }
        return out;
      },
      "the instruction sets this CPU gives prompt_qgemm, best first");
  m.def("set_prompt_qgemm_isa", [](const std::string& cap) {
        for (int i = 1; i <= int(Isa::avx512vnni); ++i) {
          if (cap == kIsaNames[i]) return g_cap.store(i);
        }
        throw std::invalid_argument("set_prompt_qgemm_isa: avx512vnni, avxvnni or avx2");
      },
      "cap"_a, "the best instruction set prompt_qgemm may use (tests force each path)");
}
