// Matrix products of few rows for the CPU, float32: an XLA FFI custom call.
//
// y[M, N] = x[M, K] · w[N, K]ᵀ, the kernel stored [out, in] as the model
// stores it (jaxserve.model.llama.linear). Made for the M = 1..32 rows of a
// decode step, where each product streams its whole weight from memory once
// and XLA's CPU backend (YNNPACK from M = 2) is far from that bound.
//
// Each output is a dot product along K, 16 lanes at a time: a register block of
// kRowBlock rows of x times kColBlock rows of w keeps kRowBlock·kColBlock vector
// accumulators (24 of the 32 AVX-512 registers) and reduces each across its lanes
// once at the end. A block of w (kColBlock·K floats) is read from memory once and
// reused from L1 for every row block of x. While one block is used, the next one
// is prefetched into L2, spread evenly over the block's multiply-adds, so that
// memory traffic overlaps arithmetic. Work items of kColsPerItem columns (and up
// to kRowsPerItem rows) run on XLA's intra-op thread pool (parallel.h).
//
// The sums run in another order than XLA's (lanes, then across lanes), so results
// agree with XLA's product to float32 rounding, not bit for bit.

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <memory>

#include "parallel.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

constexpr int kRowBlock = 4;  // rows of x per register block
constexpr int kColBlock = 6;  // rows of w (output columns) per register block
constexpr int64_t kColsPerItem = 8 * kColBlock;
constexpr int64_t kRowsPerItem = 64;  // x's rows per item: 64 · K floats stay in L2
constexpr int64_t kLine = 64;         // bytes per cache line

typedef float V16 __attribute__((vector_size(64), aligned(64)));
typedef int32_t I16 __attribute__((vector_size(64), aligned(64)));
typedef float V16u __attribute__((vector_size(64), aligned(4), may_alias));

inline float LaneSum(V16 v) {
  const I16 h8 = {8, 9, 10, 11, 12, 13, 14, 15, 0, 1, 2, 3, 4, 5, 6, 7};
  const I16 h4 = {4, 5, 6, 7, 0, 1, 2, 3, 12, 13, 14, 15, 8, 9, 10, 11};
  const I16 h2 = {2, 3, 0, 1, 6, 7, 4, 5, 10, 11, 8, 9, 14, 15, 12, 13};
  const I16 h1 = {1, 0, 3, 2, 5, 4, 7, 6, 9, 8, 11, 10, 13, 12, 15, 14};
  for (const I16& perm : {h8, h4, h2, h1}) v += __builtin_shuffle(v, perm);
  return v[0];
}

// The next block's bytes still to prefetch, and how many lines per step of 16 K.
struct Prefetch {
  const char* next;
  const char* end;
  int64_t lines_per_step;
};

// y[i, j] = x[i, :] · w[j, :] for i < MB rows, j < kColBlock columns.
template <int MB>
inline void Block(const float* x, const float* w, float* y, int64_t K, int64_t N, Prefetch& pf) {
  V16 acc[MB][kColBlock] = {};
  const int64_t k16 = K & ~int64_t{15};
  for (int64_t k = 0; k < k16; k += 16) {
    for (int64_t l = 0; l < pf.lines_per_step && pf.next < pf.end; ++l, pf.next += kLine)
      __builtin_prefetch(pf.next, 0, 1);  // locality 1: into L2
    V16 wv[kColBlock];
#pragma GCC unroll 16
    for (int j = 0; j < kColBlock; ++j) wv[j] = *reinterpret_cast<const V16u*>(w + j * K + k);
#pragma GCC unroll 16
    for (int i = 0; i < MB; ++i) {
      const V16 xv = *reinterpret_cast<const V16u*>(x + i * K + k);
#pragma GCC unroll 16
      for (int j = 0; j < kColBlock; ++j) acc[i][j] += xv * wv[j];
    }
  }
  for (int i = 0; i < MB; ++i)
    for (int j = 0; j < kColBlock; ++j) {
      float s = LaneSum(acc[i][j]);
      for (int64_t k = k16; k < K; ++k) s += x[i * K + k] * w[j * K + k];
      y[i * N + j] = s;
    }
}

struct Problem {
  const float* x;
  const float* w;
  float* y;
  int64_t M, N, K;
  int64_t col_items;  // items along N
};

void RunItem(const Problem& p, int64_t item) {
  const int64_t m0 = item / p.col_items * kRowsPerItem, m1 = std::min(p.M, m0 + kRowsPerItem);
  const int64_t n0 = item % p.col_items * kColsPerItem, n1 = std::min(p.N, n0 + kColsPerItem);
  const int64_t block_bytes = kColBlock * p.K * static_cast<int64_t>(sizeof(float));
  const int64_t steps = (m1 - m0 + kRowBlock - 1) / kRowBlock * std::max<int64_t>(p.K / 16, 1);
  const int64_t lines_per_step = ((block_bytes + kLine - 1) / kLine + steps - 1) / steps;
  const char* w_end = reinterpret_cast<const char*>(p.w + p.N * p.K);
  int64_t n = n0;
  for (; n + kColBlock <= n1; n += kColBlock) {
    const float* w = p.w + n * p.K;
    const char* next = reinterpret_cast<const char*>(w) + block_bytes;
    Prefetch pf{next, std::min(w_end, next + block_bytes), lines_per_step};
    const float* x = p.x + m0 * p.K;
    float* y = p.y + m0 * p.N + n;
    int64_t m = m0;
    for (; m + kRowBlock <= m1; m += kRowBlock, x += kRowBlock * p.K, y += kRowBlock * p.N)
      Block<kRowBlock>(x, w, y, p.K, p.N, pf);
    switch (m1 - m) {
      case 3: Block<3>(x, w, y, p.K, p.N, pf); break;
      case 2: Block<2>(x, w, y, p.K, p.N, pf); break;
      case 1: Block<1>(x, w, y, p.K, p.N, pf); break;
      default: break;
    }
  }
  for (; n < n1; ++n)  // columns past the last whole block
    for (int64_t m = m0; m < m1; ++m) {
      float s = 0.0f;
      for (int64_t k = 0; k < p.K; ++k) s += p.x[m * p.K + k] * p.w[n * p.K + k];
      p.y[m * p.N + n] = s;
    }
}

ffi::Error Matmul(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::F32> w,
                  ffi::ResultBuffer<ffi::F32> y) {
  auto xd = x.dimensions(), wd = w.dimensions(), yd = y->dimensions();
  if (xd.size() != 2 || wd.size() != 2 || yd.size() != 2 || xd[1] != wd[1] || yd[0] != xd[0] ||
      yd[1] != wd[0])
    return ffi::Error::InvalidArgument("matmul: x [M, K], w [N, K], y [M, N]");
  struct Shared {
    Problem p;
    int64_t num_items;
    std::atomic<int64_t> next{0};
  };
  auto shared = std::make_shared<Shared>();
  Problem& p = shared->p;
  p.x = x.typed_data();
  p.w = w.typed_data();
  p.y = y->typed_data();
  p.M = xd[0];
  p.K = xd[1];
  p.N = wd[0];
  p.col_items = (p.N + kColsPerItem - 1) / kColsPerItem;
  shared->num_items = p.col_items * ((p.M + kRowsPerItem - 1) / kRowsPerItem);
  auto work = [shared] {
    for (int64_t i = shared->next.fetch_add(1); i < shared->num_items; i = shared->next.fetch_add(1))
      RunItem(shared->p, i);
  };
  jaxserve::RunWithHelpers(pool, std::min(jaxserve::MaxHelpers(pool), shared->num_items - 1), work);
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxserveMatmulF32, Matmul,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>());
