// Matrix products for the CPU, float32 activations: XLA FFI custom calls.
//
// y[M, N] = x[M, K] · w[N, K]ᵀ, the kernel stored [out, in] as the model
// stores it (jaxserve.model.llama.linear). Three handlers share the code, a
// template on the kernel's format (a "weights" view: F32Weights, I8Weights,
// I4Weights below), which says how consecutive elements of a row of w become
// float32 lanes (kLanes of them: 16 with AVX-512, 8 without):
// - jaxserve_matmul_f32: w float32;
// - jaxserve_matmul_i8: w int8 with a float32 scale per output channel,
//   y[m, n] = (Σ_k x[m, k] · w[n, k]) · scale[n] (weight-only int8,
//   jaxserve.model.quantization). The int8 values are widened to float32 in
//   registers as they are loaded (a vector at a time) and the scale is applied once
//   per output, so the kernel streams a quarter of the float32 bytes and no
//   float copy of w exists.
// - jaxserve_matmul_i4: w int4, packed two per byte in llama.cpp Q4_0 / Q4_1's
//   order (each run of 32 inputs is 16 bytes, byte j = input j in the low
//   nibble, input j + 16 in the high one), with a float32 step and offset per
//   group of G inputs (a power of two >= 32) and output channel:
//   w[n, k] = q · scale[n, k / G, 0] + scale[n, k / G, 1]
//   (jaxserve.model.quantization). Each vector's values are widened and scaled in
//   registers (one multiply-add), so the kernel streams 6/32 of the float32
//   bytes (step and offset included).
// Made for the 1..128 rows of a decode
// step or a small prefill chunk, where XLA's CPU backend (YNNPACK from M = 2)
// is far from the speed of streaming the weights (few rows) or repacks the
// whole weight for every product (more rows). Two forms, both reading w in
// place, with no packed copy of it:
//
// - Fewer than kOuterMinRows rows, the dot form: each output is a dot product
//   along K, kLanes lanes at a time. A register block of kRowBlock rows of x times
//   kColBlock rows of w keeps kRowBlock·kColBlock vector accumulators (24 of the
//   32 AVX-512 registers; 8 of AVX2's 16) and reduces each across its lanes once
//   at the end. A
//   block of w (kColBlock rows) is read from memory once and reused from L1
//   for every row block of x. While one block is used, the next one is
//   prefetched into L2, spread evenly over the block's multiply-adds, so that
//   memory traffic overlaps arithmetic.
// - From kOuterMinRows rows, the outer-product form (below): x is transposed
//   so that 16 rows are one vector, and each multiply-add takes a broadcast
//   element of w (int4: of a float32 copy of the chunk of w in use, see there).
//   AVX-512 only: its 16-row vectors would take two AVX2 registers each and
//   spill, so without AVX-512 the dot form takes every row count.
//
// Without AVX-512 the dot form is compiled for 8-lane vectors: AVX2's
// intrinsics where the CPU has AVX2, else GCC's generic vector extensions (the
// portable fallback).
//
// Work items run on XLA's intra-op thread pool (parallel.h). The sums run in
// another order than XLA's, so results agree with XLA's product to float32
// rounding, not bit for bit.

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cstdlib>
#include <memory>

#if defined(__AVX512F__) || defined(__AVX2__)
#include <immintrin.h>
#endif

#include "parallel.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

// The dot form's vectors: kLanes float32 lanes, a whole register (AVX-512: 16 lanes, 32
// registers; AVX2 or the portable fallback: 8 lanes, 16 registers). Its register block is
// kRowBlock rows of x times kColBlock rows of w, sized to the register file: 4 × 6 = 24
// accumulators beside 6 vectors of w and one of x (AVX-512); 2 × 4 = 8 beside 4 and 1
// (AVX2: 13 of 16, so that the widening loads of int8 and int4 do not spill).
#ifdef __AVX512F__
constexpr int kLanes = 16;
constexpr int kRowBlock = 4;  // rows of x per register block
constexpr int kColBlock = 6;  // rows of w (output columns) per register block
#else
constexpr int kLanes = 8;
constexpr int kRowBlock = 2;
constexpr int kColBlock = 4;
#endif
constexpr int64_t kColsPerItem = 8 * kColBlock;
constexpr int64_t kRowsPerItem = 64;  // x's rows per item: 64 · K floats stay in L2
constexpr int64_t kLine = 64;         // bytes per cache line

typedef float VF __attribute__((vector_size(4 * kLanes), aligned(4 * kLanes)));
typedef float VFu __attribute__((vector_size(4 * kLanes), aligned(4), may_alias));
typedef int32_t VI __attribute__((vector_size(4 * kLanes), aligned(4 * kLanes)));
typedef int8_t I8xLu __attribute__((vector_size(kLanes), aligned(1), may_alias));
typedef uint8_t U8xLu __attribute__((vector_size(kLanes), aligned(1), may_alias));
// The outer-product form's vectors: 16 rows of x (two registers each without AVX-512).
typedef float V16 __attribute__((vector_size(64), aligned(64)));
typedef int32_t I16 __attribute__((vector_size(64), aligned(64)));
typedef float V16u __attribute__((vector_size(64), aligned(4), may_alias));
typedef uint8_t U8x16u __attribute__((vector_size(16), aligned(1), may_alias));

// kLanes consecutive kernel elements as float32 lanes (int8 widened in registers).
inline VF LoadV(const float* p) { return *reinterpret_cast<const VFu*>(p); }
inline VF LoadV(const int8_t* p) {
#if defined(__AVX512F__)
  // vpmovsxbd + vcvtdq2ps: GCC 12 scalarizes __builtin_convertvector of int8 to
  // float (a movsbl + vcvtsi2ss per lane: 4.4x slower products at 1 row, measured).
  return reinterpret_cast<VF>(_mm512_cvtepi32_ps(
      _mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)))));
#elif defined(__AVX2__)
  return reinterpret_cast<VF>(_mm256_cvtepi32_ps(
      _mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)))));
#else
  return __builtin_convertvector(*reinterpret_cast<const I8xLu*>(p), VF);
#endif
}

// kLanes bytes as int32 lanes, 0..255.
inline VI WidenBytes(const uint8_t* p) {
#if defined(__AVX512F__)
  return reinterpret_cast<VI>(
      _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
#elif defined(__AVX2__)
  return reinterpret_cast<VI>(
      _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))));
#else
  return __builtin_convertvector(*reinterpret_cast<const U8xLu*>(p), VI);
#endif
}

// 16 bytes' low (high = false) or high nibbles as int32 lanes, 0..15 (the outer form).
inline I16 Nibbles16(const uint8_t* p, bool high) {
#ifdef __AVX512F__
  __m512i b = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  if (high) b = _mm512_srli_epi32(b, 4);
  return reinterpret_cast<I16>(_mm512_and_si512(b, _mm512_set1_epi32(15)));
#else
  const I16 b = __builtin_convertvector(*reinterpret_cast<const U8x16u*>(p), I16);
  return (high ? b >> 4 : b) & 15;
#endif
}

// The kernel formats. Each view reads w[n, k] of a kernel [N, K]: Load(n, k) the kLanes
// elements from k (a multiple of kLanes below K & ~(kLanes - 1)) as float32 lanes, At(n, k)
// one element, Out(sum, n) the finished output (the per-channel scale, if any),
// Bytes(n) where row n starts and RowBytes() its size (for prefetching). A view with
// kPairs (int4) also has Load32(n, k, v): the 32 elements from k (a multiple of 32; K is
// one too) as 32 / kLanes vectors, from one 16-byte load — the dot form then steps 32 at
// a time. A view with kCopyChunks has Load16(n, k): 16 elements for the outer form.
struct F32Weights {
  const float* w;
  int64_t K;
  static constexpr bool kPairs = false;
  // Whether the outer-product form reads a float32 copy of each chunk (below).
  static constexpr bool kCopyChunks = false;
  VF Load(int64_t n, int64_t k) const { return LoadV(w + n * K + k); }
  float At(int64_t n, int64_t k) const { return w[n * K + k]; }
  float Out(float s, int64_t) const { return s; }
  const char* Bytes(int64_t n) const { return reinterpret_cast<const char*>(w + n * K); }
  int64_t RowBytes() const { return K * static_cast<int64_t>(sizeof(float)); }
};

struct I8Weights {
  const int8_t* w;
  const float* scale;  // [N]
  int64_t K;
  static constexpr bool kPairs = false;
  static constexpr bool kCopyChunks = false;
  VF Load(int64_t n, int64_t k) const { return LoadV(w + n * K + k); }
  float At(int64_t n, int64_t k) const { return static_cast<float>(w[n * K + k]); }
  float Out(float s, int64_t n) const { return s * scale[n]; }
  const char* Bytes(int64_t n) const { return reinterpret_cast<const char*>(w + n * K); }
  int64_t RowBytes() const { return K; }
};

struct I4Weights {
  const uint8_t* w;    // [N, K / 2]
  const float* scale;  // [N, K >> group_shift, 2]: (step, offset) per group
  int64_t K;
  int group_shift;     // log2 of the group size
  // Widening one value per broadcast would cost the outer form several scalar
  // instructions per multiply-add: it reads float32 copies of its chunks instead.
  static constexpr bool kCopyChunks = true;
  static constexpr bool kPairs = true;
  const float* Group(int64_t n, int64_t k) const {
    return scale + 2 * (n * (K >> group_shift) + (k >> group_shift));
  }
  V16 Load16(int64_t n, int64_t k) const {
    const I16 q = Nibbles16(w + (n * K + (k & ~int64_t{31})) / 2, (k & 16) != 0);
    const float* g = Group(n, k);
    return __builtin_convertvector(q, V16) * g[0] + g[1];  // one multiply-add
  }
  // One 16-byte load: the low nibbles are elements k..k+15, the high ones k+16..k+31.
  // Each vector is widened and scaled in one multiply-add.
  void Load32(int64_t n, int64_t k, VF (&v)[32 / kLanes]) const {
    const uint8_t* p = w + (n * K + k) / 2;
    const float* g = Group(n, k);
    const VF step = VF{} + g[0], offset = VF{} + g[1];
#pragma GCC unroll 4
    for (int h = 0; h < 16 / kLanes; ++h) {  // bytes [h·kLanes, (h + 1)·kLanes)
      const VI b = WidenBytes(p + h * kLanes);
      v[h] = __builtin_convertvector(b & 15, VF) * step + offset;
      v[h + 16 / kLanes] = __builtin_convertvector(b >> 4, VF) * step + offset;
    }
  }
  float At(int64_t n, int64_t k) const {
    const uint8_t b = w[(n * K + (k & ~int64_t{31})) / 2 + (k & 15)];
    const float* g = Group(n, k);
    return static_cast<float>((k & 16) ? b >> 4 : b & 15) * g[0] + g[1];
  }
  float Out(float s, int64_t) const { return s; }
  const char* Bytes(int64_t n) const { return reinterpret_cast<const char*>(w + n * K / 2); }
  int64_t RowBytes() const { return K / 2; }
};

// The sum of v's lanes, by halving: lane l adds lane l ^ h for h = kLanes / 2, ..., 1.
inline float LaneSum(VF v) {
#pragma GCC unroll 8
  for (int h = kLanes / 2; h > 0; h /= 2) {
    VI perm;
#pragma GCC unroll 16
    for (int l = 0; l < kLanes; ++l) perm[l] = l ^ h;
    v += __builtin_shuffle(v, perm);
  }
  return v[0];
}

// The next block's bytes still to prefetch, and how many lines per step of kLanes along K.
struct Prefetch {
  const char* next;
  const char* end;
  int64_t lines_per_step;
};

// Runs run(item, next) for every item < num_items claimed from `counter`, where
// `next` is the item the same thread claimed before running `item` (so that
// `item` can prefetch its data); next >= num_items when there is none.
template <typename Run>
void ForEachItemClaimingAhead(std::atomic<int64_t>& counter, int64_t num_items, const Run& run) {
  int64_t item = counter.fetch_add(1);
  while (item < num_items) {
    const int64_t next = counter.fetch_add(1);
    run(item, next);
    item = next;
  }
}

// y[i, j] = x[i, :] · w[n + j, :] (the view's Out applied) for i < MB rows, j < kColBlock
// columns.
template <int MB, typename W>
inline void Block(const float* x, const W& w, int64_t n, float* y, int64_t K, int64_t N,
                  Prefetch& pf) {
  VF acc[MB][kColBlock] = {};
  if constexpr (W::kPairs) {  // K is a multiple of 32
    constexpr int kVecs = 32 / kLanes;
    for (int64_t k = 0; k < K; k += 32) {
      for (int64_t l = 0; l < kVecs * pf.lines_per_step && pf.next < pf.end;
           ++l, pf.next += kLine)
        __builtin_prefetch(pf.next, 0, 1);  // locality 1: into L2
      // Column by column (32 / kLanes vectors of w each), x read from L1: the
      // accumulators, a column's vectors and x's fit the registers.
#pragma GCC unroll 16
      for (int j = 0; j < kColBlock; ++j) {
        VF wv[kVecs];
        w.Load32(n + j, k, wv);
#pragma GCC unroll 16
        for (int i = 0; i < MB; ++i)
#pragma GCC unroll 4
          for (int v = 0; v < kVecs; ++v)
            acc[i][j] += *reinterpret_cast<const VFu*>(x + i * K + k + v * kLanes) * wv[v];
      }
    }
    for (int i = 0; i < MB; ++i)
      for (int j = 0; j < kColBlock; ++j) y[i * N + j] = w.Out(LaneSum(acc[i][j]), n + j);
  } else {
    const int64_t kv = K & ~int64_t{kLanes - 1};
    for (int64_t k = 0; k < kv; k += kLanes) {
      for (int64_t l = 0; l < pf.lines_per_step && pf.next < pf.end; ++l, pf.next += kLine)
        __builtin_prefetch(pf.next, 0, 1);  // locality 1: into L2
      VF wv[kColBlock];
#pragma GCC unroll 16
      for (int j = 0; j < kColBlock; ++j) wv[j] = w.Load(n + j, k);
#pragma GCC unroll 16
      for (int i = 0; i < MB; ++i) {
        const VF xv = LoadV(x + i * K + k);
#pragma GCC unroll 16
        for (int j = 0; j < kColBlock; ++j) acc[i][j] += xv * wv[j];
      }
    }
    for (int i = 0; i < MB; ++i)
      for (int j = 0; j < kColBlock; ++j) {
        float s = LaneSum(acc[i][j]);
        for (int64_t k = kv; k < K; ++k) s += x[i * K + k] * w.At(n + j, k);
        y[i * N + j] = w.Out(s, n + j);
      }
  }
}

// Block<rows> for 0 < rows <= MB (the rows past the last whole register block).
template <int MB, typename W>
inline void TailBlock(int64_t rows, const float* x, const W& w, int64_t n, float* y, int64_t K,
                      int64_t N, Prefetch& pf) {
  if constexpr (MB > 0) {
    if (rows == MB) return Block<MB>(x, w, n, y, K, N, pf);
    TailBlock<MB - 1>(rows, x, w, n, y, K, N, pf);
  }
}

// Block over `rows` rows of x (from x) and the columns n.. of w, into y.
template <typename W>
inline void RowBlocks(const float* x, const W& w, int64_t n, float* y, int64_t rows, int64_t K,
                      int64_t N, Prefetch& pf) {
  int64_t m = 0;
  for (; m + kRowBlock <= rows; m += kRowBlock, x += kRowBlock * K, y += kRowBlock * N)
    Block<kRowBlock>(x, w, n, y, K, N, pf);
  TailBlock<kRowBlock - 1>(rows - m, x, w, n, y, K, N, pf);
}

// An int4 column block widened once to float32 (Panel::Fill), for items of many rows on
// 8-lane builds. Widening int4 (a nibble mask or shift, a convert and a multiply-add by the
// group's step and offset per vector) again for every 2-row register block costs more than
// storing the block once and reading it back from L1: a chain of the demo model's int4
// products (30 layers and the LM head, 2-core AVX2 EPYC, median of 7, two runs) took
// 0.78-0.83x the time at 16, 32 and 64 rows, 0.92-0.96x at 8, but 1.12x at 4. int8's
// widening (one widening load and a convert) is cheaper than the store and reload: the
// same form took int8 1.05-1.33x, so int8 keeps widening in place. Load / At read the
// float32 copy of rows n0 .. n0 + kColBlock; Out is the int4 view's.
template <typename W>
struct Panel {
  static_assert(W::kPairs, "the int4 view: K a multiple of 32, read 32 at a time");
  const W* src;
  float* buf;  // kColBlock · K floats: [K / kLanes][kColBlock][kLanes]
  int64_t n0, K;
  static constexpr bool kPairs = false;
  static constexpr bool kCopyChunks = false;
  // buf = w[n0 .. n0 + kColBlock, :] widened as the int4 view's Block widens it (the same
  // lanes, so the sums are bit for bit those of the int4 view's own Block). At each k the
  // block's kColBlock vectors are adjacent: one stream for the register block to read.
  void Fill() {
    for (int j = 0; j < kColBlock; ++j)
      for (int64_t k = 0; k < K; k += 32) {
        VF v[32 / kLanes];
        src->Load32(n0 + j, k, v);
        for (int h = 0; h < 32 / kLanes; ++h)
          *reinterpret_cast<VF*>(buf + ((k / kLanes + h) * kColBlock + j) * kLanes) = v[h];
      }
  }
  VF Load(int64_t n, int64_t k) const {
    return *reinterpret_cast<const VF*>(buf + (k / kLanes * kColBlock + (n - n0)) * kLanes);
  }
  float At(int64_t n, int64_t k) const {
    return buf[(k / kLanes * kColBlock + (n - n0)) * kLanes + k % kLanes];
  }
  float Out(float s, int64_t n) const { return src->Out(s, n); }
};

// A thread's Panel buffer of at least `floats` floats, 64-byte aligned (kept between calls).
inline float* PanelBuffer(int64_t floats) {
  thread_local std::unique_ptr<float, decltype(&std::free)> buf{nullptr, &std::free};
  thread_local int64_t size = 0;
  if (size < floats) {
    size = (floats + 15) & ~int64_t{15};
    buf.reset(static_cast<float*>(std::aligned_alloc(64, size * sizeof(float))));
    if (buf == nullptr) size = 0;
  }
  return buf.get();
}

// From this many rows in an item, int4 column blocks are widened once into a Panel (8-lane
// builds; AVX-512 builds take 32 rows and more in the outer form, and were not measured).
constexpr int64_t kPanelMinRows = 8;

template <typename W>
struct Problem {
  const float* x;
  W w;
  float* y;
  int64_t M, N, K;
  int64_t col_items;  // items along N
};

// Runs `item`; its last block of w prefetches `after` (the first block of the
// thread's next item, or nothing).
template <typename W>
void RunItem(const Problem<W>& p, int64_t item, const char* after) {
  const int64_t m0 = item / p.col_items * kRowsPerItem, m1 = std::min(p.M, m0 + kRowsPerItem);
  const int64_t n0 = item % p.col_items * kColsPerItem, n1 = std::min(p.N, n0 + kColsPerItem);
  const int64_t block_bytes = kColBlock * p.w.RowBytes();
  const int64_t steps = (m1 - m0 + kRowBlock - 1) / kRowBlock * std::max<int64_t>(p.K / kLanes, 1);
  const int64_t lines_per_step = ((block_bytes + kLine - 1) / kLine + steps - 1) / steps;
  const char* w_end = p.w.Bytes(p.N);
  // int4 with several register blocks of rows: widen each column block once (Panel).
  float* panel = W::kPairs && kLanes == 8 && m1 - m0 >= kPanelMinRows
                     ? PanelBuffer(kColBlock * p.K) : nullptr;
  int64_t n = n0;
  for (; n + kColBlock <= n1; n += kColBlock) {
    const char* next = n + 2 * kColBlock <= n1 ? p.w.Bytes(n) + block_bytes : after;
    Prefetch pf{next, next == nullptr ? nullptr : next + std::min(block_bytes, w_end - next),
                lines_per_step};
    float* y = p.y + m0 * p.N + n;
    if constexpr (W::kPairs) {
      if (panel != nullptr) {
        Panel<W> view{&p.w, panel, n, p.K};
        view.Fill();
        RowBlocks(p.x + m0 * p.K, view, n, y, m1 - m0, p.K, p.N, pf);
        continue;
      }
    }
    RowBlocks(p.x + m0 * p.K, p.w, n, y, m1 - m0, p.K, p.N, pf);
  }
  for (; n < n1; ++n)  // columns past the last whole block
    for (int64_t m = m0; m < m1; ++m) {
      float s = 0.0f;
      for (int64_t k = 0; k < p.K; ++k) s += p.x[m * p.K + k] * p.w.At(n, k);
      p.y[m * p.N + n] = p.w.Out(s, n);
    }
}

// ---------------------------------------------------------------------------
// Many rows (M >= kOuterMinRows): the outer-product form. x is transposed once
// per call (a gather per 16 rows) into xt [row block][K][64], rows past M zero,
// so that 16 rows of x at one k are one vector. A register block holds NV such
// vectors (up to 64 rows) times NC columns: at each k, NV vector loads of xt
// and NC broadcasts of w[n, k] feed NV·NC multiply-adds (4 × 6: 24 of them for
// 10 loads). K runs in chunks of kChunkK: a chunk of xt (64 rows × kChunkK
// floats, 32 KiB) stays in L1 while an item's column blocks go over it, their
// accumulators parked in the item's scratch between chunks. An item is
// kOuterColsPerItem columns of one row block; items run column-major, so an
// item's rows of w (contiguous) are read from memory once and serve the other
// row blocks from L2. Each thread claims its next item before it runs the
// current one and prefetches the next item's rows of w into L2, spread over the
// current one's work: without it, the chunked reads of w waited on memory and
// the form was slower than XLA's (a 64-row chain: 92 ms against 75).
//
// Why not the dot form for many rows: its 4 × 6 block needs 4 loads of x from
// L2 per 24 multiply-adds (x no longer fits L1 beside w's block), and the
// reductions across lanes add up; at 64 rows it ran at XLA's speed.

constexpr int kOuterCols = 6;                    // columns per register block
constexpr int kOuterVecs = 4;                    // 16-row vectors per register block
constexpr int64_t kOuterRows = 16 * kOuterVecs;  // rows per row block
constexpr int64_t kOuterBlocks = 4;              // column blocks per item
constexpr int64_t kOuterColsPerItem = kOuterBlocks * kOuterCols;
constexpr int64_t kChunkK = 128;
// From this many rows the outer-product form is used: on the demo model's shapes
// (a 30-layer chain of its products, 2 cores) the dot form and it were level at
// 16 and 32 rows, and at 48 / 64 rows the dot form took 57.8 / 75.2 ms, this
// form 51.1 / 63.1 ms.
constexpr int64_t kOuterMinRows = 32;

// acc[i][j] (rows 16i.., column j) += xt[k, 16i..] · w[j·K + k] over k < kc, w's elements
// (float32 or int8) widened to float32.
template <int NV, int NC, typename E>
inline void OuterBlock(const float* xt, const E* w, int64_t K, int64_t kc, V16* acc,
                       Prefetch& pf) {
  V16 a[NV][NC];
#pragma GCC unroll 16
  for (int i = 0; i < NV; ++i)
#pragma GCC unroll 16
    for (int j = 0; j < NC; ++j) a[i][j] = acc[i * kOuterCols + j];
  for (int64_t k = 0; k < kc; ++k, xt += kOuterRows) {
    if ((k & 15) == 0)
      for (int64_t l = 0; l < pf.lines_per_step && pf.next < pf.end; ++l, pf.next += kLine)
        __builtin_prefetch(pf.next, 0, 1);  // locality 1: into L2
    V16 xv[NV];
#pragma GCC unroll 16
    for (int i = 0; i < NV; ++i) xv[i] = *reinterpret_cast<const V16*>(xt + 16 * i);
#pragma GCC unroll 16
    for (int j = 0; j < NC; ++j) {
      const float wjk = static_cast<float>(w[j * K + k]);
#pragma GCC unroll 16
      for (int i = 0; i < NV; ++i) a[i][j] += xv[i] * wjk;
    }
  }
#pragma GCC unroll 16
  for (int i = 0; i < NV; ++i)
#pragma GCC unroll 16
    for (int j = 0; j < NC; ++j) acc[i * kOuterCols + j] = a[i][j];
}

template <int NV, typename E>
inline void OuterBlockCols(int nc, const float* xt, const E* w, int64_t K, int64_t kc,
                           V16* acc, Prefetch& pf) {
  switch (nc) {
    case 6: OuterBlock<NV, 6>(xt, w, K, kc, acc, pf); break;
    case 5: OuterBlock<NV, 5>(xt, w, K, kc, acc, pf); break;
    case 4: OuterBlock<NV, 4>(xt, w, K, kc, acc, pf); break;
    case 3: OuterBlock<NV, 3>(xt, w, K, kc, acc, pf); break;
    case 2: OuterBlock<NV, 2>(xt, w, K, kc, acc, pf); break;
    default: OuterBlock<NV, 1>(xt, w, K, kc, acc, pf); break;
  }
}

template <typename W>
struct OuterProblem {
  const float* xt;  // [row_blocks][K][kOuterRows]
  int64_t block_rows;  // rows per row block (a multiple of 16, at most kOuterRows)
  int64_t row_blocks;
  W w;
  float* y;
  int64_t M, N, K;
  int64_t col_items;
};

struct OuterItem {
  int64_t rb, n0, n1;  // row block, columns [n0, n1)
};

// Items run column-major: an item's columns of w (kOuterColsPerItem rows of w,
// contiguous) serve every row block from L2 before the next columns are read.
template <typename W>
OuterItem OuterItemAt(const OuterProblem<W>& p, int64_t item) {
  const int64_t n0 = item / p.row_blocks * kOuterColsPerItem;
  return {item % p.row_blocks, n0, std::min(p.N, n0 + kOuterColsPerItem)};
}

template <typename E>
inline void RunOuterBlock(int nv, int nc, const float* xt, const E* w, int64_t K, int64_t kc,
                          V16* acc, Prefetch& pf) {
  switch (nv) {
    case 4: OuterBlockCols<4>(nc, xt, w, K, kc, acc, pf); break;
    case 3: OuterBlockCols<3>(nc, xt, w, K, kc, acc, pf); break;
    case 2: OuterBlockCols<2>(nc, xt, w, K, kc, acc, pf); break;
    default: OuterBlockCols<1>(nc, xt, w, K, kc, acc, pf); break;
  }
}

// Runs `item`, prefetching [pf_begin, pf_end) (the next item's columns of w) over its work.
template <typename W>
void RunOuterItem(const OuterProblem<W>& p, const OuterItem& it, const char* pf_begin,
                  const char* pf_end) {
  const int64_t m0 = it.rb * p.block_rows, rows = std::min(p.block_rows, p.M - m0);
  const int nv = static_cast<int>((rows + 15) / 16);
  const int64_t blocks = (it.n1 - it.n0 + kOuterCols - 1) / kOuterCols;
  const int64_t steps = blocks * ((p.K + 15) / 16);  // prefetch points in the item
  const int64_t lines = (pf_end - pf_begin + kLine - 1) / kLine;
  Prefetch pf{pf_begin, pf_end, (lines + steps - 1) / std::max<int64_t>(steps, 1)};
  V16 acc[kOuterBlocks][kOuterVecs * kOuterCols] = {};
  // Formats with kCopyChunks (int4): K is a multiple of 32, so kc of 16.
  alignas(64) float chunk[W::kCopyChunks ? kOuterCols * kChunkK : 1];
  const float* xt_block = p.xt + it.rb * p.K * kOuterRows;
  for (int64_t k0 = 0; k0 < p.K; k0 += kChunkK) {
    const int64_t kc = std::min(kChunkK, p.K - k0);
    const float* xt = xt_block + k0 * kOuterRows;
    for (int64_t b = 0, n = it.n0; n < it.n1; ++b, n += kOuterCols) {
      const int nc = static_cast<int>(std::min<int64_t>(kOuterCols, it.n1 - n));
      if constexpr (W::kCopyChunks) {  // float32 copy of w[n.., k0..]: [nc][kChunkK]
        for (int j = 0; j < nc; ++j)
          for (int64_t k = 0; k < kc; k += 16)
            *reinterpret_cast<V16*>(chunk + j * kChunkK + k) = p.w.Load16(n + j, k0 + k);
        RunOuterBlock(nv, nc, xt, static_cast<const float*>(chunk), kChunkK, kc, acc[b], pf);
      } else {
        RunOuterBlock(nv, nc, xt, p.w.w + n * p.K + k0, p.K, kc, acc[b], pf);
      }
    }
  }
  for (int64_t b = 0, n = it.n0; n < it.n1; ++b, n += kOuterCols) {
    const int64_t nc = std::min<int64_t>(kOuterCols, it.n1 - n);
    for (int64_t r = 0; r < rows; ++r)
      for (int64_t j = 0; j < nc; ++j)
        p.y[(m0 + r) * p.N + n + j] = p.w.Out(acc[b][(r / 16) * kOuterCols + j][r % 16], n + j);
  }
}

// xt[rb][k][r] = x[rb·block_rows + r, k] for r < block_rows, zero for rows past
// the block or M. With AVX-512 a gather fills each 16-row vector (14x faster
// than scalar stores at 64 x 1536).
void TransposeRows(const float* x, float* xt, int64_t M, int64_t K, int64_t block_rows,
                   int64_t row_blocks) {
  for (int64_t rb = 0; rb < row_blocks; ++rb) {
    float* out = xt + rb * K * kOuterRows;
    for (int64_t v = 0; v < kOuterVecs; ++v) {
      const int64_t m0 = rb * block_rows + 16 * v;
      const int64_t rows = 16 * v < block_rows ? std::clamp<int64_t>(M - m0, 0, 16) : 0;
      float* dst = out + 16 * v;
#ifdef __AVX512F__
      const __m512i offsets = _mm512_mullo_epi32(
          _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15),
          _mm512_set1_epi32(static_cast<int32_t>(K)));
      const __mmask16 mask = static_cast<__mmask16>((uint32_t{1} << rows) - 1);
      const float* src = x + std::min(m0, M - 1) * K;  // not read when rows = 0
      for (int64_t k = 0; k < K; ++k)
        _mm512_store_ps(dst + k * kOuterRows,
                        _mm512_mask_i32gather_ps(_mm512_setzero_ps(), mask, offsets, src + k, 4));
#else
      for (int64_t k = 0; k < K; ++k)
        for (int64_t r = 0; r < 16; ++r)
          dst[k * kOuterRows + r] = r < rows ? x[(m0 + r) * K + k] : 0.0f;
#endif
    }
  }
}

template <typename W>
ffi::Error MatmulOuter(ffi::ThreadPool& pool, const float* x, const W& w, float* y, int64_t M,
                       int64_t N, int64_t K) {
  struct Shared {
    OuterProblem<W> p;
    std::unique_ptr<float, decltype(&std::free)> xt{nullptr, &std::free};
    int64_t num_items;
    std::atomic<int64_t> next{0};
  };
  auto shared = std::make_shared<Shared>();
  // Row blocks of at most 64 rows, balanced in 16-row vectors (80 rows: 48 + 32, not 64 + 16).
  const int64_t row_blocks = (M + kOuterRows - 1) / kOuterRows;
  const int64_t vectors = (M + 15) / 16;
  const int64_t block_rows = 16 * ((vectors + row_blocks - 1) / row_blocks);
  const size_t xt_bytes = row_blocks * K * kOuterRows * sizeof(float);  // a multiple of 64
  float* xt = static_cast<float*>(std::aligned_alloc(64, xt_bytes));
  if (xt == nullptr) return ffi::Error(ffi::ErrorCode::kResourceExhausted, "matmul: no memory");
  shared->xt.reset(xt);
  TransposeRows(x, xt, M, K, block_rows, row_blocks);
  OuterProblem<W>& p = shared->p;
  p = OuterProblem<W>{xt, block_rows, row_blocks, w, y, M, N, K,
                      (N + kOuterColsPerItem - 1) / kOuterColsPerItem};
  shared->num_items = p.col_items * row_blocks;
  // Each thread claims its next item before it runs the current one, and
  // prefetches the next item's columns of w meanwhile (unless the current one
  // already read them).
  auto work = [shared] {
    const OuterProblem<W>& p = shared->p;
    ForEachItemClaimingAhead(shared->next, shared->num_items, [&](int64_t i, int64_t next) {
      const OuterItem it = OuterItemAt(p, i);
      const char *pf_begin = nullptr, *pf_end = nullptr;
      if (next < shared->num_items) {
        const OuterItem nx = OuterItemAt(p, next);
        if (nx.n0 != it.n0) {
          pf_begin = p.w.Bytes(nx.n0);
          pf_end = p.w.Bytes(nx.n1);
        }
      }
      RunOuterItem(p, it, pf_begin, pf_end);
    });
  };
  jaxserve::RunWithHelpers(pool, std::min(jaxserve::MaxHelpers(pool), shared->num_items - 1), work);
  return ffi::Error::Success();
}

// y[M, N] = x[M, K] · w[N, K]ᵀ (w a weights view), either form by M.
template <typename W>
ffi::Error MatmulImpl(ffi::ThreadPool& pool, const float* x, const W& w, float* y, int64_t M,
                      int64_t N, int64_t K) {
  // The outer form's gathers take 32-bit offsets (row · K within 16 rows). Its vectors
  // are 16 lanes: without AVX-512 they spill (64 rows of the demo model's qkv product:
  // 39 ms, XLA 3.4 ms), and the dot form takes every row count.
  if (kLanes == 16 && M >= kOuterMinRows && K > 0 && N > 0 && K <= INT32_MAX / 16)
    return MatmulOuter<W>(pool, x, w, y, M, N, K);
  struct Shared {
    Problem<W> p;
    int64_t num_items;
    std::atomic<int64_t> next{0};
  };
  auto shared = std::make_shared<Shared>();
  Problem<W>& p = shared->p;
  p.x = x;
  p.w = w;
  p.y = y;
  p.M = M;
  p.K = K;
  p.N = N;
  p.col_items = (p.N + kColsPerItem - 1) / kColsPerItem;
  shared->num_items = p.col_items * ((p.M + kRowsPerItem - 1) / kRowsPerItem);
  // Each thread claims its next item before it runs the current one, so that
  // the current one's last block can prefetch the next one's first.
  auto work = [shared] {
    const Problem<W>& p = shared->p;
    ForEachItemClaimingAhead(shared->next, shared->num_items, [&](int64_t i, int64_t next) {
      const char* after = nullptr;
      if (next < shared->num_items) after = p.w.Bytes(next % p.col_items * kColsPerItem);
      RunItem(p, i, after);
    });
  };
  jaxserve::RunWithHelpers(pool, std::min(jaxserve::MaxHelpers(pool), shared->num_items - 1), work);
  return ffi::Error::Success();
}

ffi::Error Matmul(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::F32> w,
                  ffi::ResultBuffer<ffi::F32> y) {
  auto xd = x.dimensions(), wd = w.dimensions(), yd = y->dimensions();
  if (xd.size() != 2 || wd.size() != 2 || yd.size() != 2 || xd[1] != wd[1] || yd[0] != xd[0] ||
      yd[1] != wd[0])
    return ffi::Error::InvalidArgument("matmul: x [M, K], w [N, K], y [M, N]");
  return MatmulImpl(pool, x.typed_data(), F32Weights{w.typed_data(), xd[1]}, y->typed_data(),
                    xd[0], wd[0], xd[1]);
}

ffi::Error MatmulI8(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::S8> w,
                    ffi::Buffer<ffi::F32> scale, ffi::ResultBuffer<ffi::F32> y) {
  auto xd = x.dimensions(), wd = w.dimensions(), sd = scale.dimensions(), yd = y->dimensions();
  if (xd.size() != 2 || wd.size() != 2 || sd.size() != 1 || yd.size() != 2 || xd[1] != wd[1] ||
      sd[0] != wd[0] || yd[0] != xd[0] || yd[1] != wd[0])
    return ffi::Error::InvalidArgument("matmul_i8: x [M, K], w [N, K], scale [N], y [M, N]");
  return MatmulImpl(pool, x.typed_data(), I8Weights{w.typed_data(), scale.typed_data(), xd[1]},
                    y->typed_data(), xd[0], wd[0], xd[1]);
}

ffi::Error MatmulI4(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::U8> w,
                    ffi::Buffer<ffi::F32> scale, ffi::ResultBuffer<ffi::F32> y) {
  auto xd = x.dimensions(), wd = w.dimensions(), sd = scale.dimensions(), yd = y->dimensions();
  if (xd.size() != 2 || wd.size() != 2 || sd.size() != 3 || yd.size() != 2 ||
      xd[1] != 2 * wd[1] || xd[1] % 32 != 0 || sd[0] != wd[0] || sd[2] != 2 ||
      yd[0] != xd[0] || yd[1] != wd[0])
    return ffi::Error::InvalidArgument(
        "matmul_i4: x [M, K], w [N, K / 2], scale [N, K / G, 2], y [M, N], K a multiple of 32");
  const int64_t K = xd[1], groups = sd[1];
  int shift = 0;  // log2 of the group size K / groups, a power of two >= 32
  while (shift < 62 && (int64_t{1} << shift) * groups < K) ++shift;
  if (K > 0 && (groups <= 0 || (int64_t{1} << shift) * groups != K || shift < 5))
    return ffi::Error::InvalidArgument("matmul_i4: K / G must be a power of two >= 32");
  return MatmulImpl(pool, x.typed_data(),
                    I4Weights{w.typed_data(), scale.typed_data(), K, shift},
                    y->typed_data(), xd[0], wd[0], K);
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxserveMatmulF32, Matmul,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>());

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxserveMatmulI8, MatmulI8,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::S8>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>());

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxserveMatmulI4, MatmulI4,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::U8>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>());

// The dot form's float32 lanes per vector: 16 where the build has the AVX-512 forms
// (the outer-product form too), 8 otherwise (AVX2 or the portable fallback, the dot form
// only). Python sizes the row counts it sends here by it (cpu_kernels.matmul_max_rows).
extern "C" int JaxserveMatmulLanes() { return kLanes; }
