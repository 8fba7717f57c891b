// Attention for a decode step (few query rows) as one MLX primitive on the
// CPU stream; step_ops.cpp says why the step ops exist.
//
// Keys are taken in fixed chunks of KEY_CHUNK, counted from the newest key:
// each (sequence, kv head, chunk) is one part with its own softmax maximum,
// sum and weighted values, and the parts are combined in chunk order. Parts
// run on the kernel's threads (compute/csrc/qmm_kernels.h) once a context is
// long enough to be worth it. The chunks depend neither on the thread count
// nor on left padding, and every key's score and weight take the same
// arithmetic wherever it falls in a chunk, so a row's result is the same on
// any number of threads and alone or in a batch.
#include <nanobind/nanobind.h>
#include <nanobind/stl/vector.h>

#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <memory>
#include <vector>

#include "mlx/allocator.h"
#include "mlx/array.h"
#include "mlx/primitives.h"
#include "qmm_kernels.h"
#include "step_common.h"
#include "sdpa_parts.h"
#include "step_ops.h"

namespace nb = nanobind;
namespace mx = mlx::core;
using namespace nb::literals;
using namespace flashserve_step;
using namespace flashserve_sdpa;

namespace {

struct SdpaArgs {
  const mx::array& q;
  const mx::array& k;
  const mx::array& v;
  const mx::array* mask;
  int mode;
  float scale;
  int Lk;  // keys taken: k's rows up to the last one a bool mask lets any query row see
};

// Part (b, hk, chunk c): one kv head's query rows (its `repeats` query heads
// times Lq) against the keys of chunk c, so each key and value row is read
// once for all of them.
__attribute__((target("avx2,fma"))) void sdpa_part(const SdpaArgs& a, int b, int hk, int c,
                                                   Partial& part) {
  const int Hq = a.q.shape(1), Lq = a.q.shape(2), D = a.q.shape(3);
  const int Hk = a.k.shape(1), Lk = a.Lk, Dv = a.v.shape(3);
  const int repeats = Hq / Hk;
  const int R = repeats * Lq;
  int j0, n;
  chunk_rows(Lk, c, j0, n);
  const auto qs = a.q.strides(), ks = a.k.strides(), vs = a.v.strides();
  const float* qp = a.q.data<float>();
  const float* kp = a.k.data<float>() + b * ks[0] + hk * ks[1];
  const float* vp = a.v.data<float>() + b * vs[0] + hk * vs[1];
  const float inf = std::numeric_limits<float>::infinity();
  std::vector<float> qrows(size_t(R) * D), scores(size_t(R) * n), tmp;
  // Row r is query head hk * repeats + r / Lq, position r % Lq. MLX's
  // fallback scales q first, then multiplies by k^T.
  for (int r = 0; r < R; ++r) {
    const int h = hk * repeats + r / Lq, i = r % Lq;
    const float* qr = qp + b * qs[0] + h * qs[1] + i * qs[2];
    for (int d = 0; d < D; ++d) qrows[size_t(r) * D + d] = a.scale * qr[d * qs[3]];
  }
  // Eight keys a pass; the last few through a zero-padded copy, so every
  // key's score takes the same arithmetic wherever it falls in a chunk.
  if (D % 8 == 0) {
    const int whole = n / 8 * 8;
    std::vector<float> rest;
    if (whole < n) {
      rest.assign(size_t(8) * D, 0.0f);
      for (int j = whole; j < n; ++j) {
        const float* kr = row(kp + (j0 + j) * ks[2], ks[3], D, tmp);
        std::copy(kr, kr + D, &rest[size_t(j - whole) * D]);
      }
    }
    std::vector<float> keys8;
    for (int j = 0; j < whole; j += 8) {
      const float* k8 = kp + (j0 + j) * ks[2];
      int64_t stride = ks[2];
      if (ks[3] != 1) {  // strided rows: contiguous copies first
        keys8.resize(size_t(8) * D);
        for (int t = 0; t < 8; ++t) {
          const float* kr = row(kp + (j0 + j + t) * ks[2], ks[3], D, tmp);
          std::copy(kr, kr + D, &keys8[size_t(t) * D]);
        }
        k8 = keys8.data();
        stride = D;
      }
      for (int r = 0; r < R; ++r) {
        scores8(&qrows[size_t(r) * D], k8, stride, D, &scores[size_t(r) * n + j]);
      }
    }
    if (whole < n) {
      float out[8];
      for (int r = 0; r < R; ++r) {
        scores8(&qrows[size_t(r) * D], rest.data(), D, D, out);
        std::copy(out, out + (n - whole), &scores[size_t(r) * n + whole]);
      }
    }
  } else {
    for (int j = 0; j < n; ++j) {
      const float* kr = row(kp + (j0 + j) * ks[2], ks[3], D, tmp);
      for (int r = 0; r < R; ++r) scores[size_t(r) * n + j] = dot(&qrows[size_t(r) * D], kr, D);
    }
  }
  softmax_part(scores.data(), R, n, j0, Lk, Lq, repeats, b, hk, a.mask, a.mode, Dv, part);
  if (vs[3] == 1 && Dv % 64 == 0) {
    const float* v0 = vp + int64_t(j0) * vs[2];
    for (int r = 0; r < R; ++r) {
      if (part.top[r] == -inf) continue;
      for (int d = 0; d < Dv; d += 64) {
        weighted_sum<64>(&scores[size_t(r) * n], v0 + d, vs[2], n, &part.acc[size_t(r) * Dv + d]);
      }
    }
    return;
  }
  for (int j = 0; j < n; ++j) {
    const float* vr = row(vp + (j0 + j) * vs[2], vs[3], Dv, tmp);
    for (int r = 0; r < R; ++r) {
      if (part.top[r] != -inf) {
        axpy(&part.acc[size_t(r) * Dv], scores[size_t(r) * n + j], vr, Dv);
      }
    }
  }
}

void sdpa_compute(const mx::array& q, const mx::array& k, const mx::array& v,
                  const mx::array* mask, int mode, float scale, mx::array& out) {
  const int B = q.shape(0), Hq = q.shape(1), Lq = q.shape(2);
  const int Hk = k.shape(1), Lk = keys_seen(k.shape(2), mask, mode), Dv = v.shape(3);
  const SdpaArgs args{q, k, v, mask, mode, scale, Lk};
  run_parts(B, Hq, Hk, Lq, Dv, Lk, out.data<float>(),
            [&](int b, int hk, int c, Partial& part) { sdpa_part(args, b, hk, c, part); });
}

mx::array sdpa(const mx::array& q, const mx::array& k, const mx::array& v,
               const std::vector<mx::array>& mask, int mode, float scale) {
  return attention_op<sdpa_compute>("sdpa", "FlashserveSDPA", q, k, v, mask, mode, scale);
}

}  // namespace

void add_sdpa(nb::module_& m) {
  m.def("sdpa", &sdpa, "q"_a, "k"_a, "v"_a, "mask"_a, "mask_mode"_a, "scale"_a,
        "softmax(scale * q k^T + mask) v as one op; mask: [] or [mask]");
}
