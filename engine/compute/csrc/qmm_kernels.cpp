// The kernel behind qmm_kernels.h: unpack 32 values at a time into float
// registers, dequantize them with the group's scale and bias (one FMA), and
// accumulate them against up to four rows of x. Columns of large problems are
// split over a small pool of threads; each column is computed by one thread in
// a fixed order. qmm() sends 4- and 8-bit problems to the AVX-512 kernel
// (qmm_avx512.cpp) when the CPU has it; this file's AVX2 kernel takes the rest.
//
// The vector code is compiled for AVX2 + FMA + F16C (AVX-512 in its own file)
// through function target attributes, so the module builds and loads on any
// x86-64 CPU; the Python side asks cpu_supported() before it routes anything here.
#include "qmm_kernels.h"

#include "qmm_isa.h"

#include <immintrin.h>
#include <sched.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstring>
#include <functional>
#include <memory>
#include <mutex>
#include <thread>
#include <vector>

#define QMM_TARGET __attribute__((target("avx2,fma,f16c")))

namespace flashserve_qmm {
namespace {

using detail::ColumnsFn;
using detail::Prepared;

constexpr int CHUNK = 32;  // values unpacked at once; every group size is a multiple
// Bytes ahead of a weight row's read to prefetch (an eighth of it ahead of its
// scales and biases): one core's AVX2 pass over a 1.2B model's 4-bit weights went
// from ~8.5 to ~9.5 GB/s; the unpacking into floats, not memory, bounds the rest.
constexpr int PREFETCH = 4096;

// ---------------------------------------------------------------- scales

template <ScaleType ST>
QMM_TARGET inline float scale_at(const void* p, int64_t i) {
  if constexpr (ST == ScaleType::f32) {
    return static_cast<const float*>(p)[i];
  } else if constexpr (ST == ScaleType::f16) {
    return _cvtsh_ss(static_cast<const uint16_t*>(p)[i]);
  } else {
    uint32_t u = uint32_t(static_cast<const uint16_t*>(p)[i]) << 16;
    float f;
    std::memcpy(&f, &u, sizeof(f));
    return f;
  }
}

// ---------------------------------------------------------------- decoders
// Each turns the 32 values starting at value k0 of a row into four vectors of
// 8 floats, q[0..3]. The 4-bit decoder yields them in "nibble order" (even
// values, then odd ones); x is permuted to match once per call (prepare_x).

struct Decode4 {
  static constexpr bool permuted = true;
  QMM_TARGET static inline void run(const uint8_t* row, int k0, __m256 q[4]) {
    const __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(row + k0 / 2));
    const __m128i mask = _mm_set1_epi8(0x0F);
    const __m128i lo = _mm_and_si128(b, mask);
    const __m128i hi = _mm_and_si128(_mm_srli_epi16(b, 4), mask);
    q[0] = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(lo));
    q[1] = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(lo, 8)));
    q[2] = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(hi));
    q[3] = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(hi, 8)));
  }
};

struct Decode8 {
  static constexpr bool permuted = false;
  QMM_TARGET static inline void run(const uint8_t* row, int k0, __m256 q[4]) {
    const uint8_t* p = row + k0;
    for (int j = 0; j < 4; ++j) {
      const __m128i b = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(p + 8 * j));
      q[j] = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(b));
    }
  }
};

// Any width from 2 to 8 bits: MLX packs each row as one little-endian bit
// stream (3, 5 and 6 bits cross byte boundaries), so value i starts at bit
// i * bits. 32 values take exactly 4 * bits bytes; they are copied into a
// padded buffer so no read passes the row's end.
template <int BITS>
struct DecodeBits {
  static constexpr bool permuted = false;
  QMM_TARGET static inline void run(const uint8_t* row, int k0, __m256 q[4]) {
    uint8_t bytes[4 * BITS + 2] = {};
    std::memcpy(bytes, row + (int64_t(k0) * BITS) / 8, 4 * BITS);
    alignas(32) int32_t v[CHUNK];
    for (int i = 0; i < CHUNK; ++i) {
      const int bit = i * BITS;
      const uint32_t word = uint32_t(bytes[bit >> 3]) | (uint32_t(bytes[(bit >> 3) + 1]) << 8);
      v[i] = int32_t((word >> (bit & 7)) & ((1u << BITS) - 1));
    }
    for (int j = 0; j < 4; ++j) {
      q[j] = _mm256_cvtepi32_ps(_mm256_load_si256(reinterpret_cast<const __m256i*>(v + 8 * j)));
    }
  }
};

QMM_TARGET inline float hsum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

// ---------------------------------------------------------------- tiles
// MR rows of x against NC columns of W. Each (row, column) pair has two
// accumulators, fed in the same order whatever MR and NC are: that is what
// keeps a row's result independent of the batch it is computed in.

template <int MR, int NC, class D, ScaleType ST>
QMM_TARGET void tile(const QmmProblem& p, const float* xs, int m0, int n0) {
  __m256 acc[MR][NC][2];
  for (int m = 0; m < MR; ++m) {
    for (int c = 0; c < NC; ++c) {
      acc[m][c][0] = _mm256_setzero_ps();
      acc[m][c][1] = _mm256_setzero_ps();
    }
  }
  const int groups = p.K / p.group_size;
  const int chunks = p.group_size / CHUNK;
  const uint8_t* rows[NC];
  for (int c = 0; c < NC; ++c) {
    rows[c] = reinterpret_cast<const uint8_t*>(p.w + int64_t(n0 + c) * p.w_stride);
  }
  constexpr int SB = ST == ScaleType::f32 ? 4 : 2;
  for (int g = 0; g < groups; ++g) {
    float sc[NC], bi[NC];
    for (int c = 0; c < NC; ++c) {
      const int64_t at = int64_t(n0 + c) * p.s_stride + g;
      _mm_prefetch(static_cast<const char*>(p.scales) + at * SB + PREFETCH / 8, _MM_HINT_T0);
      _mm_prefetch(static_cast<const char*>(p.biases) + at * SB + PREFETCH / 8, _MM_HINT_T0);
      sc[c] = scale_at<ST>(p.scales, at);
      bi[c] = scale_at<ST>(p.biases, at);
      if (p.bias_times != 0.f) bi[c] *= p.bias_times;
    }
    for (int h = 0; h < chunks; ++h) {
      const int k0 = g * p.group_size + h * CHUNK;
      for (int c = 0; c < NC; ++c) {
        _mm_prefetch(reinterpret_cast<const char*>(rows[c]) + int64_t(k0) * p.bits / 8 + PREFETCH,
                     _MM_HINT_T0);
        __m256 q[4];
        D::run(rows[c], k0, q);
        const __m256 s = _mm256_set1_ps(sc[c]);
        const __m256 b = _mm256_set1_ps(bi[c]);
        const __m256 w0 = _mm256_fmadd_ps(q[0], s, b);
        const __m256 w1 = _mm256_fmadd_ps(q[1], s, b);
        const __m256 w2 = _mm256_fmadd_ps(q[2], s, b);
        const __m256 w3 = _mm256_fmadd_ps(q[3], s, b);
        for (int m = 0; m < MR; ++m) {
          const float* xr = xs + int64_t(m0 + m) * p.K + k0;
          acc[m][c][0] = _mm256_fmadd_ps(_mm256_loadu_ps(xr), w0, acc[m][c][0]);
          acc[m][c][1] = _mm256_fmadd_ps(_mm256_loadu_ps(xr + 16), w2, acc[m][c][1]);
          acc[m][c][0] = _mm256_fmadd_ps(_mm256_loadu_ps(xr + 8), w1, acc[m][c][0]);
          acc[m][c][1] = _mm256_fmadd_ps(_mm256_loadu_ps(xr + 24), w3, acc[m][c][1]);
        }
      }
    }
  }
  for (int m = 0; m < MR; ++m) {
    for (int c = 0; c < NC; ++c) {
      p.out[int64_t(m0 + m) * p.out_stride + n0 + c] =
          hsum(_mm256_add_ps(acc[m][c][0], acc[m][c][1]));
    }
  }
}

// Columns [n_begin, n_end) for every row. Columns go in blocks small enough
// that a block's packed weights stay in cache while every row tile uses them.
template <class D, ScaleType ST>
QMM_TARGET void columns(const QmmProblem& p, const Prepared& x, int n_begin, int n_end) {
  const float* xs = x.xs;
  const int64_t row_bytes = int64_t(p.K) * p.bits / 8;
  const int block = int(std::max<int64_t>(8, (48 * 1024) / std::max<int64_t>(1, row_bytes)));
  for (int nb = n_begin; nb < n_end; nb += block) {
    const int ne = std::min(n_end, nb + block);
    for (int m0 = 0; m0 < p.M;) {
      const int mr = std::min(4, p.M - m0);
      int n = nb;
      switch (mr) {
        case 1:
          for (; n + 4 <= ne; n += 4) tile<1, 4, D, ST>(p, xs, m0, n);
          for (; n < ne; ++n) tile<1, 1, D, ST>(p, xs, m0, n);
          break;
        case 2:
          for (; n + 2 <= ne; n += 2) tile<2, 2, D, ST>(p, xs, m0, n);
          for (; n < ne; ++n) tile<2, 1, D, ST>(p, xs, m0, n);
          break;
        case 3:
          for (; n < ne; ++n) tile<3, 1, D, ST>(p, xs, m0, n);
          break;
        default:
          for (; n < ne; ++n) tile<4, 1, D, ST>(p, xs, m0, n);
          break;
      }
      m0 += mr;
    }
  }
}

template <ScaleType ST>
ColumnsFn pick_bits(int bits) {
  switch (bits) {
    case 2: return columns<DecodeBits<2>, ST>;
    case 3: return columns<DecodeBits<3>, ST>;
    case 4: return columns<Decode4, ST>;
    case 5: return columns<DecodeBits<5>, ST>;
    case 6: return columns<DecodeBits<6>, ST>;
    case 8: return columns<Decode8, ST>;
    default: return nullptr;
  }
}

ColumnsFn pick(int bits, ScaleType st) {
  switch (st) {
    case ScaleType::f32: return pick_bits<ScaleType::f32>(bits);
    case ScaleType::f16: return pick_bits<ScaleType::f16>(bits);
    default: return pick_bits<ScaleType::bf16>(bits);
  }
}

// x rows, contiguous, in the order the decoder yields values: for 4 bits each
// chunk of 32 becomes x[0, 2, .., 14], x[16, .., 30], x[1, .., 15], x[17, .., 31].
Prepared prepare_x(const QmmProblem& p, bool permuted, std::vector<float>& buf) {
  buf.resize(size_t(p.M) * p.K);
  for (int m = 0; m < p.M; ++m) {
    const float* src = p.x[m];
    float* dst = buf.data() + int64_t(m) * p.K;
    if (!permuted) {
      std::memcpy(dst, src, sizeof(float) * p.K);
      continue;
    }
    for (int k0 = 0; k0 < p.K; k0 += CHUNK) {
      for (int i = 0; i < 8; ++i) {
        dst[k0 + i] = src[k0 + 2 * i];
        dst[k0 + 8 + i] = src[k0 + 16 + 2 * i];
        dst[k0 + 16 + i] = src[k0 + 2 * i + 1];
        dst[k0 + 24 + i] = src[k0 + 16 + 2 * i + 1];
      }
    }
  }
  return Prepared{buf.data(), p.K, nullptr, 0};
}

// ---------------------------------------------------------------- threads
// A few workers that spin briefly after a job, then sleep on a condition
// variable. Only problems of PARALLEL_MIN_WORK or more come here, a few per
// layer in a one-stream decode step, so the spin is short: a worker that spun
// 200 us after each job spun through the whole step and took a core from the
// thread building MLX's next graph (with step_ops.cpp's fewer nodes, spins of
// 300 us and 2 ms were still no better than 50 us; later, 20 us gave ~1.09x
// the one-stream tokens/s of 50 us, and 10 us the same as 20). A job is a
// number of parts claimed one at a time from a counter; the calling thread
// claims parts too, so a worker that is not scheduled in time (a busy
// machine) costs nothing: the caller does its parts instead.

constexpr int SPIN_US = 20;

struct Job {
  const std::function<void(int)>* fn;
  int parts;
  std::atomic<int> next{0};
  std::atomic<int> done{0};
  std::atomic<int> users{0};  // workers holding a pointer to this job
};

inline void work_on(Job& job) {
  for (;;) {
    const int part = job.next.fetch_add(1, std::memory_order_relaxed);
    if (part >= job.parts) return;
    (*job.fn)(part);
    job.done.fetch_add(1, std::memory_order_release);
  }
}

// Spin on `ready` with pause, then with yields, so a waiting thread gives its
// core away when the machine is oversubscribed.
template <class F>
inline void wait_until(F ready) {
  for (int spin = 0; !ready(); ++spin) {
    if (spin < 4096) {
      _mm_pause();
    } else {
      std::this_thread::yield();
    }
  }
}

class Pool {
 public:
  explicit Pool(int size) : size_(size) {
    for (int i = 1; i < size_; ++i) workers_.emplace_back([this] { loop(); });
  }
  ~Pool() {
    {
      std::lock_guard<std::mutex> lock(mu_);
      stop_ = true;
      gen_.fetch_add(1);
    }
    cv_.notify_all();
    for (auto& t : workers_) t.join();
  }
  int size() const { return size_; }

  void run(int parts, const std::function<void(int)>& fn) {
    Job job;
    job.fn = &fn;
    job.parts = parts;
    {
      std::lock_guard<std::mutex> lock(mu_);
      current_ = &job;
      gen_.fetch_add(1, std::memory_order_release);
    }
    cv_.notify_all();
    work_on(job);
    wait_until([&] { return job.done.load(std::memory_order_acquire) == parts; });
    {
      std::lock_guard<std::mutex> lock(mu_);
      current_ = nullptr;
    }
    wait_until([&] { return job.users.load(std::memory_order_acquire) == 0; });
  }

 private:
  void loop() {
    // From generation 0, not the current one: a worker first scheduled after
    // the pool was told to stop (created and deleted at once, on a busy
    // machine) would otherwise wait for a generation that never comes, and
    // the deleting thread would join it forever.
    uint64_t seen = 0;
    for (;;) {
      seen = wait_for_job(seen);
      Job* job;
      {
        std::lock_guard<std::mutex> lock(mu_);
        if (stop_) return;
        job = current_;
        if (job != nullptr) job->users.fetch_add(1);
      }
      if (job != nullptr) {
        work_on(*job);
        job->users.fetch_sub(1, std::memory_order_release);
      }
    }
  }

  uint64_t wait_for_job(uint64_t seen) {
    using clock = std::chrono::steady_clock;
    const auto until = clock::now() + std::chrono::microseconds(SPIN_US);
    for (int spin = 0;; ++spin) {
      const uint64_t g = gen_.load(std::memory_order_acquire);
      if (g != seen) return g;
      _mm_pause();
      if ((spin & 255) == 255 && clock::now() > until) break;
    }
    std::unique_lock<std::mutex> lock(mu_);
    cv_.wait(lock, [&] { return gen_.load() != seen; });
    return gen_.load();
  }

  int size_;
  std::vector<std::thread> workers_;
  std::mutex mu_;
  std::condition_variable cv_;
  std::atomic<uint64_t> gen_{0};
  Job* current_ = nullptr;
  bool stop_ = false;
};

std::mutex g_pool_mu;  // one problem on the pool at a time; others run alone
// Never destroyed at exit: a static destructor would join workers while MLX's
// stream thread may still be inside a matmul during interpreter shutdown
// (seen as "terminate called without an active exception"); the OS reaps the
// threads. set_threads() replaces it explicitly.
Pool* g_pool = nullptr;
int g_threads = 0;
std::atomic<bool> g_avx512_allowed{true};
std::atomic<int> g_x_bits{0};            // 16: 4- and 8-bit weights take the integer kernel
std::atomic<bool> g_vnni_allowed{true};

int cores() {
  cpu_set_t set;
  if (sched_getaffinity(0, sizeof(set), &set) == 0) return std::max(1, CPU_COUNT(&set));
  return std::max(1u, std::thread::hardware_concurrency());
}

// Below this much work (weights times rows) a problem runs on the calling
// thread. Waking a worker costs microseconds, and while a decode step runs,
// MLX's thread building the next step's graph wants the other core too. Once
// the per-layer small ops became one node each (step_ops.cpp), that thread
// idles most of a one-stream step, and splitting one row of a 576 x 576
// linear and larger (not the 576 x 192 k/v projections) gave ~10% more
// tokens/s than splitting only the LM head and batched steps (1M).
constexpr int64_t PARALLEL_MIN_WORK = 256 * 1024;

}  // namespace

bool cpu_supported() {
  __builtin_cpu_init();
  return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") &&
         __builtin_cpu_supports("f16c");
}

bool shape_supported(int bits, int group_size, int K) {
  const bool bits_ok = bits == 2 || bits == 3 || bits == 4 || bits == 5 || bits == 6 || bits == 8;
  const bool group_ok = group_size == 32 || group_size == 64 || group_size == 128;
  return bits_ok && group_ok && K > 0 && K % group_size == 0;
}

void set_threads(int n) {
  std::lock_guard<std::mutex> lock(g_pool_mu);
  g_threads = std::max(0, n);
  delete g_pool;
  g_pool = nullptr;
}

int threads() {
  // Asked once: sched_getaffinity is a system call, and threads() is asked per matmul.
  static const int n_cores = cores();
  return g_threads > 0 ? g_threads : n_cores;
}

void set_avx512(bool allowed) { g_avx512_allowed.store(allowed); }

void set_x_bits(int bits) { g_x_bits.store(bits == 16 ? 16 : 0); }

int x_bits() { return g_x_bits.load(); }

void set_vnni(bool allowed) { g_vnni_allowed.store(allowed); }

bool vnni_active() {
  return g_vnni_allowed.load() &&
         (avx512_active() ? detail::avx512_vnni_supported() : detail::avxvnni_supported());
}

bool avx512_active() { return g_avx512_allowed.load() && detail::avx512_supported(); }

namespace {

bool shares_x(const QmmProblem& a, const QmmProblem& b) {
  return a.x == b.x && a.M == b.M && a.K == b.K && a.bits == b.bits &&
         a.group_size == b.group_size && a.scale_type == b.scale_type;
}

// Columns [begin, end) of one problem: a part of a spread call.
struct Span {
  const QmmProblem* p;
  int begin;
  int end;
};

// Problems that share x (shares_x): prepared once, then computed on this
// thread, or spread over the pool in whole 4-column tiles, a few parts per
// thread so that a late worker leaves little for the others to wait on.
void run_shared(const QmmProblem* ps, int count) {
  const QmmProblem& first = ps[0];
  if (first.M <= 0) return;
  const bool avx512 = avx512_active();
  const bool integer = g_x_bits.load() == 16 && (first.bits == 4 || first.bits == 8);
  const bool vnni = g_vnni_allowed.load();
  ColumnsFn fn = integer && avx512 ? detail::avx512_int_columns(first.bits, first.scale_type, vnni)
                 : integer         ? detail::avx2_int_columns(first.bits, first.scale_type, vnni)
                 : avx512          ? detail::avx512_columns(first.bits, first.scale_type)
                                   : nullptr;
  thread_local std::vector<float> xbuf;
  Prepared x;
  if (integer) {
    x = detail::int_prepare(first, avx512 ? 16 : 8, xbuf);
  } else if (fn != nullptr) {
    x = detail::avx512_prepare(first, xbuf);
  } else {
    fn = pick(first.bits, first.scale_type);
    if (fn == nullptr) return;
    x = prepare_x(first, first.bits == 4, xbuf);
  }

  const int want = threads();
  int64_t columns = 0;
  for (int i = 0; i < count; ++i) columns += std::max(0, ps[i].N);
  const int64_t work = columns * first.K * first.M;
  if (want > 1 && work >= PARALLEL_MIN_WORK && columns >= 8 * want) {
    const int64_t parts = std::max<int64_t>(1, std::min<int64_t>(4 * want, columns / 16));
    const int per = int(((columns + parts - 1) / parts + 3) / 4 * 4);
    thread_local std::vector<Span> spans;
    spans.clear();
    for (int i = 0; i < count; ++i) {
      for (int n = 0; n < ps[i].N; n += per) {
        spans.push_back({&ps[i], n, std::min(ps[i].N, n + per)});
      }
    }
    const Span* all = spans.data();
    parallel_for(int(spans.size()), [&](int part) {
      fn(*all[part].p, x, all[part].begin, all[part].end);
    });
    return;
  }
  for (int i = 0; i < count; ++i) {
    if (ps[i].N > 0) fn(ps[i], x, 0, ps[i].N);
  }
}

}  // namespace

void qmm(const QmmProblem& p) { run_shared(&p, 1); }

void qmm_shared_x(const QmmProblem* problems, int count) {
  for (int i = 1; i < count; ++i) {
    if (!shares_x(problems[0], problems[i])) {
      for (int j = 0; j < count; ++j) qmm(problems[j]);
      return;
    }
  }
  if (count > 0) run_shared(problems, count);
}

void parallel_for(int parts, const std::function<void(int)>& fn) {
  const int want = threads();
  std::unique_lock<std::mutex> lock(g_pool_mu, std::defer_lock);
  if (want > 1 && parts > 1 && lock.try_lock()) {
    if (g_pool == nullptr || g_pool->size() != want) {
      delete g_pool;
      g_pool = new Pool(want);
    }
    g_pool->run(parts, fn);
    return;
  }
  for (int part = 0; part < parts; ++part) fn(part);
}

}  // namespace flashserve_qmm
