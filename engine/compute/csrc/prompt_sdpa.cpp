// Attention for prompt chunks (more query rows than step_sdpa.cpp takes) as
// one MLX primitive on the CPU stream, spread over the kernel's threads.
//
// Before it, a chunk's attention was two BLAS matmuls around a vectorized
// softmax op. MLX calls the BLAS once per kv head, and one head's matmul (72
// rows x 128 x 792 keys in an agent's next turn on a 1.2B model) is too small
// for MKL to thread: a short chunk's attention ran on one core. Here a part
// is one kv head's block of query rows against every key they may see:
// scores, the softmax and the weighted values in one pass, the parts on
// every core, and no heads x rows x keys block of scores in MLX's memory.
//
// A row's result depends only on its query, and the keys and values it may
// see, never on how many rows or keys its chunk has: each score takes
// scores8's arithmetic wherever its key falls (a zero-padded copy for the
// last few), the softmax sums over 8-wide lanes fixed by the key's position
// (hidden keys adding zeros: sdpa_parts.h's softmax_row), and each value sum
// runs over the keys in order from the first. Rows are computed two or four
// at a time to share loads, and a partner's zero weights add nothing. So a
// prompt prefilled in other chunks (cold, or on top of a cached prefix)
// gets the same numbers.
#include <nanobind/nanobind.h>
#include <nanobind/stl/vector.h>

#include <algorithm>
#include <limits>
#include <memory>
#include <vector>

#include "mlx/allocator.h"
#include "mlx/array.h"
#include "mlx/primitives.h"
#include "qmm_kernels.h"
#include "sdpa_parts.h"
#include "step_common.h"
#include "step_ops.h"

namespace nb = nanobind;
namespace mx = mlx::core;
using namespace nb::literals;
using namespace flashserve_step;
using namespace flashserve_sdpa;

namespace {

constexpr int ROWS_PER_PART = 16;  // a kv head's query rows handed to a thread at a time

struct PromptArgs {
  const mx::array& q;
  const mx::array& k;
  const mx::array& v;
  const mx::array* mask;
  int mode;
  float scale;
};

// Two rows' scores against four keys `stride` floats apart (D a multiple of
// 8): each key's k load feeds both rows' FMAs. Every score takes scores8's
// arithmetic (sdpa_parts.h: the same lanes, the same sum8 tree).
__attribute__((target("avx2,fma"))) inline void scores2x4(const float* q0, const float* q1,
                                                          const float* k, int64_t stride, int D,
                                                          float* out0, float* out1) {
  __m256 a[8];
  for (int t = 0; t < 8; ++t) a[t] = _mm256_setzero_ps();
  for (int d = 0; d < D; d += 8) {
    const __m256 x0 = _mm256_loadu_ps(q0 + d), x1 = _mm256_loadu_ps(q1 + d);
    for (int t = 0; t < 4; ++t) {
      const __m256 kv = _mm256_loadu_ps(k + t * stride + d);
      a[t] = _mm256_fmadd_ps(kv, x0, a[t]);
      a[4 + t] = _mm256_fmadd_ps(kv, x1, a[4 + t]);
    }
  }
  float out[8];
  sum8(a, out);
  std::copy(out, out + 4, out0);
  std::copy(out + 4, out + 8, out1);
}

// Four rows' weighted values over n keys (rows `stride` floats apart), 16
// output lanes: each value load feeds the four rows. Every lane sums its
// keys in order from the first, as weighted_sum does.
__attribute__((target("avx2,fma"))) inline void weighted_sum4(const float* const* p,
                                                              const float* v, int64_t stride,
                                                              int n, float* const* out, int d) {
  __m256 a[4][2];
  for (int r = 0; r < 4; ++r) a[r][0] = a[r][1] = _mm256_setzero_ps();
  for (int j = 0; j < n; ++j) {
    const float* vr = v + j * stride;
    const __m256 x0 = _mm256_loadu_ps(vr), x1 = _mm256_loadu_ps(vr + 8);
    for (int r = 0; r < 4; ++r) {
      const __m256 w = _mm256_set1_ps(p[r][j]);
      a[r][0] = _mm256_fmadd_ps(w, x0, a[r][0]);
      a[r][1] = _mm256_fmadd_ps(w, x1, a[r][1]);
    }
  }
  for (int r = 0; r < 4; ++r) {
    _mm256_storeu_ps(out[r] + d, a[r][0]);
    _mm256_storeu_ps(out[r] + d + 8, a[r][1]);
  }
}

// Where the CPU has AVX-512 (and it is allowed: flashserve_qmm::avx512_active),
// its 32 registers hold four rows' sums at once: the same 256-bit arithmetic
// as the kernels above, lane for lane, with fewer loads per multiply-add, two
// 256-bit sums to a 512-bit instruction (a 1,160-token prompt's attention over
// 24 layers of the 1.2B model's shapes: 690 -> 626 ms). No header is included
// below the pragma (its inline functions must not be compiled for this
// instruction set).
#pragma GCC push_options
#pragma GCC target("avx512f,avx512dq,avx512vl,avx2,fma")

// Four rows' scores (q: rows D floats apart) against four keys; out[4 * row +
// key], each score scores8's arithmetic: a zmm register holds the 8-lane sums
// of one row against two keys, one per 256-bit half, so each half runs the
// same FMAs as scores2x4's ymm registers, with half the instructions.
void scores4x4(const float* q, int D, const float* k, int64_t stride, float* out) {
  __m512 z[4][2];
  for (int r = 0; r < 4; ++r) z[r][0] = z[r][1] = _mm512_setzero_ps();
  for (int d = 0; d < D; d += 8) {
    __m512 kp[2];
    for (int h = 0; h < 2; ++h) {
      const __m256 lo = _mm256_loadu_ps(k + (2 * h) * stride + d);
      const __m256 hi = _mm256_loadu_ps(k + (2 * h + 1) * stride + d);
      kp[h] = _mm512_insertf32x8(_mm512_castps256_ps512(lo), hi, 1);
    }
    for (int r = 0; r < 4; ++r) {
      const __m512 x = _mm512_broadcast_f32x8(_mm256_loadu_ps(q + r * D + d));
      z[r][0] = _mm512_fmadd_ps(kp[0], x, z[r][0]);
      z[r][1] = _mm512_fmadd_ps(kp[1], x, z[r][1]);
    }
  }
  __m256 a[16];
  for (int r = 0; r < 4; ++r) {
    for (int h = 0; h < 2; ++h) {
      a[4 * r + 2 * h] = _mm512_castps512_ps256(z[r][h]);
      a[4 * r + 2 * h + 1] = _mm512_extractf32x8_ps(z[r][h], 1);
    }
  }
  sum8(a, out);
  sum8(a + 8, out + 8);
}

// weighted_sum4 over 32 output lanes, as 16-lane registers: every lane's FMAs
// are weighted_sum4's.
void weighted_sum4x32(const float* const* p, const float* v, int64_t stride, int n,
                      float* const* out, int d) {
  __m512 a[4][2];
  for (int r = 0; r < 4; ++r) a[r][0] = a[r][1] = _mm512_setzero_ps();
  for (int j = 0; j < n; ++j) {
    const float* vr = v + j * stride;
    const __m512 x0 = _mm512_loadu_ps(vr), x1 = _mm512_loadu_ps(vr + 16);
    for (int r = 0; r < 4; ++r) {
      const __m512 w = _mm512_set1_ps(p[r][j]);
      a[r][0] = _mm512_fmadd_ps(w, x0, a[r][0]);
      a[r][1] = _mm512_fmadd_ps(w, x1, a[r][1]);
    }
  }
  for (int r = 0; r < 4; ++r) {
    _mm512_storeu_ps(out[r] + d, a[r][0]);
    _mm512_storeu_ps(out[r] + d + 16, a[r][1]);
  }
}

#pragma GCC pop_options

// The values weighted by p (n keys from the first, rows `stride` apart) into
// out (Dv floats): every output lane sums its keys in order.
__attribute__((target("avx2,fma"))) void weigh_values(const float* p, const float* v,
                                                      int64_t stride, int64_t vstep, int n,
                                                      int Dv, float* out) {
  if (vstep == 1 && Dv % 32 == 0) {
    int d = 0;
    for (; d + 64 <= Dv; d += 64) weighted_sum<64>(p, v + d, stride, n, out + d);
    for (; d < Dv; d += 32) weighted_sum<32>(p, v + d, stride, n, out + d);
    return;
  }
  std::fill(out, out + Dv, 0.0f);
  std::vector<float> tmp;
  for (int j = 0; j < n; ++j) axpy(out, p[j], row(v + j * stride, vstep, Dv, tmp), Dv);
}

// Part (b, hk, block): rows [r0, r0 + ROWS_PER_PART) of kv head hk's
// repeats x Lq query rows (row r: query head hk * repeats + r / Lq, position
// r % Lq) against the keys they may see.
__attribute__((target("avx2,fma"))) void prompt_part(const PromptArgs& a, int b, int hk,
                                                     int block, bool wide, float* op) {
  const int Hq = a.q.shape(1), Lq = a.q.shape(2), D = a.q.shape(3);
  const int Hk = a.k.shape(1), Lk = a.k.shape(2), Dv = a.v.shape(3);
  const int repeats = Hq / Hk, R = repeats * Lq;
  const int r0 = block * ROWS_PER_PART, rows = std::min(R, r0 + ROWS_PER_PART) - r0;
  const auto qs = a.q.strides(), ks = a.k.strides(), vs = a.v.strides();
  const float* qp = a.q.data<float>();
  const float* kp = a.k.data<float>() + b * ks[0] + hk * ks[1];
  const float* vp = a.v.data<float>() + b * vs[0] + hk * vs[1];
  const float inf = std::numeric_limits<float>::infinity();
  // The keys each row may see from the first: causal, the last Lq keys
  // against the Lq rows; any other mode, all of them (the mask hides some).
  std::vector<int> seen(rows, Lk);
  if (a.mode == kCausal) {
    for (int t = 0; t < rows; ++t) seen[t] = std::clamp(Lk - Lq + (r0 + t) % Lq + 1, 0, Lk);
  }
  const int n = *std::max_element(seen.begin(), seen.end());
  const int padded = (n + 7) / 8 * 8;
  std::vector<float> qrows(size_t(rows) * D), scores(size_t(rows) * padded, -inf), tmp;
  // MLX's fallback scales q first, then multiplies by k^T.
  for (int t = 0; t < rows; ++t) {
    const int r = r0 + t, h = hk * repeats + r / Lq, i = r % Lq;
    const float* qr = row(qp + b * qs[0] + h * qs[1] + i * qs[2], qs[3], D, tmp);
    for (int d = 0; d < D; ++d) qrows[size_t(t) * D + d] = a.scale * qr[d];
  }
  if (D % 8 == 0) {
    std::vector<float> keys8(size_t(8) * D);
    float out[8], out2[8], four[32];
    for (int j = 0; j < n; j += 8) {
      const int take = std::min(8, n - j);
      const float* k8 = kp + int64_t(j) * ks[2];
      int64_t stride = ks[2];
      if (take < 8 || ks[3] != 1) {  // the last few, or strided rows: a contiguous copy
        std::fill(keys8.begin(), keys8.end(), 0.0f);
        for (int u = 0; u < take; ++u) {
          const float* kr = row(kp + int64_t(j + u) * ks[2], ks[3], D, tmp);
          std::copy(kr, kr + D, &keys8[size_t(u) * D]);
        }
        k8 = keys8.data();
        stride = D;
      }
      // Rows in fours or pairs (a key's score is the same alone or grouped); a
      // row keeps the scores of the keys it may see.
      int t = 0;
      for (; wide && t + 3 < rows; t += 4) {
        if (j >= *std::max_element(&seen[t], &seen[t] + 4)) continue;
        scores4x4(&qrows[size_t(t) * D], D, k8, stride, four);
        scores4x4(&qrows[size_t(t) * D], D, k8 + 4 * stride, stride, four + 16);
        for (int u = 0; u < 4; ++u) {
          if (j >= seen[t + u]) continue;
          std::copy(four + 4 * u, four + 4 * u + 4, out);
          std::copy(four + 16 + 4 * u, four + 16 + 4 * u + 4, out + 4);
          std::copy(out, out + std::min(take, seen[t + u] - j),
                    &scores[size_t(t + u) * padded + j]);
        }
      }
      for (; t + 1 < rows; t += 2) {
        if (j >= std::max(seen[t], seen[t + 1])) continue;
        const float *x0 = &qrows[size_t(t) * D], *x1 = x0 + D;
        scores2x4(x0, x1, k8, stride, D, out, out2);
        scores2x4(x0, x1, k8 + 4 * stride, stride, D, out + 4, out2 + 4);
        if (j < seen[t]) {
          std::copy(out, out + std::min(take, seen[t] - j), &scores[size_t(t) * padded + j]);
        }
        if (j < seen[t + 1]) {
          std::copy(out2, out2 + std::min(take, seen[t + 1] - j),
                    &scores[size_t(t + 1) * padded + j]);
        }
      }
      if (t < rows && j < seen[t]) {
        scores8(&qrows[size_t(t) * D], k8, stride, D, out);
        std::copy(out, out + std::min(take, seen[t] - j), &scores[size_t(t) * padded + j]);
      }
    }
  } else {
    for (int t = 0; t < rows; ++t) {
      for (int j = 0; j < seen[t]; ++j) {
        const float* kr = row(kp + int64_t(j) * ks[2], ks[3], D, tmp);
        scores[size_t(t) * padded + j] = dot(&qrows[size_t(t) * D], kr, D);
      }
    }
  }
  std::vector<int64_t> ms;
  if (a.mask != nullptr) ms = strides_as(*a.mask, 4);
  const auto out_row = [&](int t) {
    const int r = r0 + t;
    return op + ((int64_t(b) * Hq + hk * repeats + r / Lq) * Lq + r % Lq) * Dv;
  };
  std::vector<float> all;  // a row that sees no key weighs every one (softmax_row)
  std::vector<char> weighed(rows, 0);
  for (int t = 0; t < rows; ++t) {
    const int r = r0 + t, h = hk * repeats + r / Lq, i = r % Lq;
    float* sr = &scores[size_t(t) * padded];
    if (a.mode == kBool) {
      const bool* m = a.mask->data<bool>() + b * ms[0] + h * ms[1] + i * ms[2];
      for (int j = 0; j < n; ++j) {
        if (!m[j * ms[3]]) sr[j] = -inf;
      }
    } else if (a.mode == kAdditive) {
      const float* m = a.mask->data<float>() + b * ms[0] + h * ms[1] + i * ms[2];
      for (int j = 0; j < n; ++j) sr[j] += m[j * ms[3]];
    }
    bool any = false;
    for (int j = 0; j < seen[t] && !any; ++j) any = sr[j] != -inf;
    if (!any) {
      all.assign(size_t(std::max(Lk, 8) + 7) / 8 * 8, -inf);
      softmax_row(all.data(), Lk, int(all.size()), all.data(), a.mode == kAdditive);
      weigh_values(all.data(), vp, vs[2], vs[3], Lk, Dv, out_row(t));
      weighed[t] = 1;
      continue;
    }
    // The weights past seen[t] (to `padded`) come out as exact zeros.
    softmax_row(sr, seen[t], padded, sr, a.mode == kAdditive);
  }
  // Rows in fours where all have weights, over the keys any of them sees: the
  // others' zero weights add nothing, so a row's sums are the same alone.
  const bool fours = vs[3] == 1 && Dv % 16 == 0;
  for (int t = 0; t < rows; ++t) {
    if (weighed[t]) continue;
    if (fours && t + 3 < rows && !weighed[t + 1] && !weighed[t + 2] && !weighed[t + 3]) {
      const float* p[4];
      float* o[4];
      int most = 0;
      for (int u = 0; u < 4; ++u) {
        p[u] = &scores[size_t(t + u) * padded];
        o[u] = out_row(t + u);
        most = std::max(most, seen[t + u]);
      }
      int d = 0;
      for (; wide && d + 32 <= Dv; d += 32) weighted_sum4x32(p, vp + d, vs[2], most, o, d);
      for (; d < Dv; d += 16) weighted_sum4(p, vp + d, vs[2], most, o, d);
      t += 3;
      continue;
    }
    weigh_values(&scores[size_t(t) * padded], vp, vs[2], vs[3], seen[t], Dv, out_row(t));
  }
}

void prompt_sdpa_compute(const mx::array& q, const mx::array& k, const mx::array& v,
                         const mx::array* mask, int mode, float scale, mx::array& out) {
  const int B = q.shape(0), Hq = q.shape(1), Lq = q.shape(2), Hk = k.shape(1);
  const int blocks = (Hq / Hk * Lq + ROWS_PER_PART - 1) / ROWS_PER_PART;
  const PromptArgs args{q, k, v, mask, mode, scale};
  const bool wide = flashserve_qmm::avx512_active();
  float* op = out.data<float>();
  flashserve_qmm::parallel_for(B * Hk * blocks, [&](int p) {
    prompt_part(args, p / (Hk * blocks), p / blocks % Hk, p % blocks, wide, op);
  });
}

mx::array prompt_sdpa(const mx::array& q, const mx::array& k, const mx::array& v,
                      const std::vector<mx::array>& mask, int mode, float scale) {
  return attention_op<prompt_sdpa_compute>("prompt_sdpa", "FlashservePromptSDPA", q, k, v,
                                           mask, mode, scale);
}

}  // namespace

void add_prompt_sdpa(nb::module_& m) {
  m.def("prompt_sdpa", &prompt_sdpa, "q"_a, "k"_a, "v"_a, "mask"_a, "mask_mode"_a, "scale"_a,
        "softmax(scale * q k^T + mask) v for prompt rows as one op on the kernel's threads; "
        "mask: [] or [mask]");
}
