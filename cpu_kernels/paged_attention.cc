// Ragged paged attention for the CPU, float32: an XLA FFI custom call.
//
// The contract is pallas_kernels.ragged_paged_attention's (the pure-jnp
// reference in pallas_kernels/rpa_reference.py is the oracle): q f32[T, N, H],
// k_cache/v_cache [B, K, S, H] (the step's K/V already written),
// block_table i32[R, MB], seq_lens i32[R], query_start_loc i32[R + 1]; the
// output is f32[T, N, H], zero for padding tokens.
//
// The caches are float32 (JaxservePagedAttentionF32) or float8_e4m3fn
// (JaxservePagedAttentionF8E4M3FN): one implementation, a template over the
// cache element type E. An fp8 chunk's key and value rows are widened to
// float32, 16 lanes at a time, into a small per-thread buffer that the float32
// code then reads (WidenF8E4M3FN); a float32 cache is read in place. No scale:
// the caller applies per-layer k and v scales to q and to the output.
//
// Work is split into items of (row, KV head, up to kQueryTile query tokens);
// an item's G·Tq query vectors share every key they read, straight from the
// cache through the block table (no gathered copy). Keys go in chunks of kLanes
// positions (16 with AVX-512, 8 otherwise). Items with few query vectors (decode: G)
// put a chunk's keys in the lanes of a vector (a dot product per key); items with many
// (prefill) put kLanes queries in the lanes (the queries transposed once per item, a
// key's scores are H multiply-adds, and the softmax runs on whole vectors). FlashAttention's
// online softmax (Dao et al., 2022, Alg. 1) merges the chunks. Items run on
// XLA's intra-op thread pool (parallel.h).

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <memory>
#include <thread>
#include <type_traits>
#include <vector>

#if defined(__AVX2__) && defined(__F16C__)
#include <immintrin.h>
#endif

#include "parallel.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

constexpr int kQueryTile = 16;
// float32 lanes of the vectors (VL): 16 with AVX-512, one register; 8 otherwise, one AVX2
// register. Wider generic vectors than the registers live in register pairs, and GCC
// moved them through the stack in half-register pieces that the next wide load waits
// on (store-to-load forwarding fails): with 16 lanes on AVX2 a decode row of the demo
// model took 2.3x the time of the 8-lane form.
#ifdef __AVX512F__
constexpr int kLanes = 16;
#else
constexpr int kLanes = 8;
#endif
// Keys per score vector.
constexpr int64_t kChunk = kLanes;
// Query vectors per item from which they go kLanes to a vector (RunItemQueriesInLanes).
constexpr int kQueriesInLanesAt = 12;
// Multiply-adds below which a call runs on the calling thread alone: ~20 µs of one core's
// vector work, about what waking a pool thread and waiting for it costs. A decode row of
// the demo model with 100 tokens of context is ~1.2·10^5 (2 · 100 keys · 9 heads · 64).
constexpr int64_t kSerialWork = 1 << 19;
// Masked scores: finite (see MASK_VALUE in pallas_kernels/rpa_reference.py).
constexpr float kMask = -1e30f;

// E, the cache element type: float, or uint8_t for float8_e4m3fn's bits.
template <typename E>
struct Problem {
  const float* q;
  const E* k;
  const E* v;
  const int32_t* block_table;
  const int32_t* seq_lens;
  const int32_t* query_start_loc;
  float* out;
  int64_t num_tokens, num_heads, head_dim, num_blocks, num_kv_heads, block_size;
  int64_t num_rows, max_blocks;
  float sm_scale;
  int64_t sliding_window;  // 0: none
  float soft_cap;          // 0: none
};

struct Item {
  int32_t row, kv_head, first, count;  // query tokens [first, first + count)
};

typedef float VL __attribute__((vector_size(4 * kLanes), aligned(4 * kLanes)));
typedef int32_t IL __attribute__((vector_size(4 * kLanes), aligned(4 * kLanes)));
// The same vector at any float's alignment, for loads straight from the cache.
typedef float VLu __attribute__((vector_size(4 * kLanes), aligned(4), may_alias));
// 16 lanes, for widening fp8 16 values at a time on CPUs without AVX2.
typedef float V16u __attribute__((vector_size(64), aligned(4), may_alias));
typedef int32_t I16 __attribute__((vector_size(64), aligned(64)));

// Whether a cache of E is widened into a float32 buffer chunk by chunk (fp8), rather
// than read in place (float32).
template <typename E>
constexpr bool kWidened = !std::is_same_v<E, float>;

typedef uint8_t U8x16u __attribute__((vector_size(16), aligned(1), may_alias));

// 16 float8_e4m3fn values from src as float32 at dst (32-byte aligned), exactly, with no
// float32 subnormal on the way: XLA runs custom calls with denormals flushed (DAZ and FTZ
// on its threads), so a subnormal float32 operand reads as 0 (the shortcut of shifting
// the fp8 bits into a float32 and multiplying by 2^120 lost every fp8 subnormal).
//
// With AVX2 and F16C: the byte shifted left by 7 puts e4m3's sign, 4 exponent and 3
// mantissa bits in float16's sign, the low 4 of its 5 exponent bits and the top of its
// mantissa: a float16 of the fp8 value times 2^-8 (biases 15 and 7), subnormals
// included; vcvtph2ps widens it exactly (it ignores DAZ: Intel SDM, VCVTPH2PS) and
// times 2^8, a product of normals, is the value. Elsewhere: the 7 magnitude bits, shifted left by 20, re-biased by an integer
// add (biases 7 and 127) are the value for e >= 1; a subnormal (e = 0, m · 2^-9) is
// 2^-6 · 1.mmm − 2^-6, exact (Sterbenz); then the sign bit. Either way the NaN codes
// 0x7f / 0xff come out as ±480, not NaN: the cache writer clips to ±448, e4m3fn's
// largest finite value, so they never occur.
inline void WidenF8E4M3FN(const uint8_t* src, float* dst) {
#if defined(__AVX2__) && defined(__F16C__)
  // Sign-extended to 16 bits, shifted by 7: the sign lands in bits 15 and 14, the
  // exponent and mantissa in 13..7; clearing bit 14 leaves the float16.
  const __m256i bytes = _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(src)));
  const __m256i half = _mm256_and_si256(_mm256_slli_epi16(bytes, 7), _mm256_set1_epi16(int16_t(0xbf80)));
  const __m256 scale = _mm256_set1_ps(0x1p8f);
  _mm256_store_ps(dst, _mm256_mul_ps(_mm256_cvtph_ps(_mm256_castsi256_si128(half)), scale));
  _mm256_store_ps(dst + 8, _mm256_mul_ps(_mm256_cvtph_ps(_mm256_extracti128_si256(half, 1)), scale));
#else
  typedef float V16 __attribute__((vector_size(64), aligned(64)));
  const I16 bytes = __builtin_convertvector(*reinterpret_cast<const U8x16u*>(src), I16);
  const I16 magnitude = bytes & 0x7f;
  const V16 normal = reinterpret_cast<V16>((magnitude << 20) + (120 << 23));
  const V16 subnormal = reinterpret_cast<V16>((magnitude << 20) + (121 << 23)) - 0x1p-6f;
  const V16 value = magnitude < 8 ? subnormal : normal;
  *reinterpret_cast<V16u*>(dst) = reinterpret_cast<V16>(reinterpret_cast<I16>(value) | (bytes & 0x80) << 24);
#endif
}

// Sum and maximum of a vector's lanes: halving steps (lane i with i + kLanes / 2, then
// + kLanes / 4, ... + 1), each one lane shuffle.
#ifdef __AVX512F__
const IL kHalvings[4] = {{8, 9, 10, 11, 12, 13, 14, 15, 0, 1, 2, 3, 4, 5, 6, 7},
                         {4, 5, 6, 7, 0, 1, 2, 3, 12, 13, 14, 15, 8, 9, 10, 11},
                         {2, 3, 0, 1, 6, 7, 4, 5, 10, 11, 8, 9, 14, 15, 12, 13},
                         {1, 0, 3, 2, 5, 4, 7, 6, 9, 8, 11, 10, 13, 12, 15, 14}};
#else
const IL kHalvings[3] = {{4, 5, 6, 7, 0, 1, 2, 3}, {2, 3, 0, 1, 6, 7, 4, 5}, {1, 0, 3, 2, 5, 4, 7, 6}};
#endif
inline VL Fold(VL v, bool take_max) {
  for (const IL& perm : kHalvings) {
    const VL other = __builtin_shuffle(v, perm);
    v = take_max ? (v > other ? v : other) : v + other;
  }
  return v;
}
inline float LaneSum(VL v) { return Fold(v, false)[0]; }
inline float LaneMax(VL v) { return Fold(v, true)[0]; }

// Lane sums of kLanes vectors as one vector: lane t = the sum of v[t]'s lanes. A
// transposing tree of log2(kLanes) levels, each pairing two vectors with two two-source
// shuffles and an add (2 · (kLanes − 1) shuffles in all, where kLanes LaneSums take
// kLanes · log2(kLanes)); it adds the lanes in LaneSum's order, so each sum is bit for
// bit LaneSum's.
#ifdef __AVX512F__
const IL kTransposeLo[4] = {{0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23},
                            {0, 1, 2, 3, 8, 9, 10, 11, 16, 17, 18, 19, 24, 25, 26, 27},
                            {0, 1, 4, 5, 8, 9, 12, 13, 16, 17, 20, 21, 24, 25, 28, 29},
                            {0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30}};
#else
const IL kTransposeLo[3] = {{0, 1, 2, 3, 8, 9, 10, 11}, {0, 1, 4, 5, 8, 9, 12, 13},
                            {0, 2, 4, 6, 8, 10, 12, 14}};
#endif
inline VL LaneSums(const VL* v) {
  VL cur[kLanes];
  for (int t = 0; t < kLanes; ++t) cur[t] = v[t];
  int n = kLanes, level = 0;
  for (const IL& lo : kTransposeLo) {
    const IL hi = lo + ((kLanes / 2) >> level);  // the partner lanes
    for (int t = 0; t < n / 2; ++t)
      cur[t] = __builtin_shuffle(cur[2 * t], cur[2 * t + 1], lo) +
               __builtin_shuffle(cur[2 * t], cur[2 * t + 1], hi);
    n /= 2;
    ++level;
  }
  return cur[0];
}

// exp(x) for x <= 0, lane by lane: 2^(x·log2 e) = 2^n · 2^f with n = round(x·log2 e) and
// f in [-1/2, 1/2]; 2^f = e^(f·ln 2) by its Taylor polynomial of degree 7 (the first omitted
// term, (ln 2 / 2)^8 / 8!, bounds the relative error by 5e-9). x below -87 (the masked -1e30
// included) gives exactly 0.
inline VL ExpNonPositive(VL x) {
  const VL zero = {};
  VL y = x * 1.4426950408889634f;
  y = y < -126.0f ? zero - 126.0f : y;
  // round half down: y + 0.5 truncated toward zero, minus one where that rounded up.
  const VL shifted = y + 0.5f;
  IL n = __builtin_convertvector(shifted, IL);
  n += __builtin_convertvector(n, VL) > shifted;  // a true lane compare is -1
  const VL t = (y - __builtin_convertvector(n, VL)) * 0.6931471805599453f;
  VL p = zero + (1.0f / 5040.0f);
  p = p * t + (1.0f / 720.0f);
  p = p * t + (1.0f / 120.0f);
  p = p * t + (1.0f / 24.0f);
  p = p * t + (1.0f / 6.0f);
  p = p * t + 0.5f;
  p = p * t + 1.0f;
  p = p * t + 1.0f;
  VL scale;
  const IL bits = (n + 127) << 23;
  __builtin_memcpy(&scale, &bits, sizeof(scale));
  const VL e = p * scale;
  return x < -87.0f ? zero : e;
}

// One item's queries: scaled query vectors, their positions and window starts, and
// the key range [key_lo, key_hi] that any of them sees. Query vector j = i·G + g is
// query head kv_head·G + g of the item's token i.
struct Queries {
  int64_t count = 0;  // query vectors (nq)
  int64_t key_lo = INT64_MAX, key_hi = -1;
  std::vector<float> q;    // [nq, H], times sm_scale
  std::vector<float> pos;  // [nq] positions as floats (exact below 2^24)
  std::vector<float> lo;   // [nq] first visible key position
};

template <typename E>
void LoadQueries(const Problem<E>& p, const Item& it, int64_t H, Queries& out) {
  const int64_t G = p.num_heads / p.num_kv_heads;
  const int64_t ctx = p.seq_lens[it.row] - (p.query_start_loc[it.row + 1] - p.query_start_loc[it.row]);
  out.count = it.count * G;
  out.key_lo = INT64_MAX;
  out.key_hi = -1;
  out.q.resize(out.count * H);
  out.pos.resize(out.count);
  out.lo.resize(out.count);
  for (int64_t i = 0; i < it.count; ++i) {
    const int64_t t = it.first + i;
    const int64_t pos = ctx + t - p.query_start_loc[it.row];  // tokens cached before this step: ctx
    const int64_t lo = p.sliding_window > 0 ? std::max<int64_t>(0, pos - p.sliding_window + 1) : 0;
    out.key_lo = std::min(out.key_lo, lo);
    out.key_hi = std::max(out.key_hi, pos);
    for (int64_t g = 0; g < G; ++g) {
      const int64_t j = i * G + g;
      const float* src = p.q + (t * p.num_heads + it.kv_head * G + g) * H;
      for (int64_t h = 0; h < H; ++h) out.q[j * H + h] = src[h] * p.sm_scale;
      out.pos[j] = static_cast<float>(pos);
      out.lo[j] = static_cast<float>(lo);
    }
  }
}

// The key and value rows of positions [base, base + valid) of the item's row and KV
// head, through the block table (a chunk spans several blocks when S < kChunk), as float32
// rows: a float32 cache's in place; an fp8 cache's widened into `staging`
// ([2 · kChunk, H]: keys, then values), once per chunk, as every query vector of the
// item reads them.
template <typename E>
void ChunkRows(const Problem<E>& p, const Item& it, int64_t H, int64_t base, int64_t valid,
               float* staging, const float** krows, const float** vrows) {
  const int32_t* table = p.block_table + static_cast<int64_t>(it.row) * p.max_blocks;
  // One division per chunk: consecutive positions walk a block's slots, then the next block.
  int64_t index = base / p.block_size, slot = base % p.block_size, start = 0;
  for (int64_t c = 0; c < valid; ++c) {
    if (c == 0 || slot == 0) {
      int64_t block = table[std::min<int64_t>(index, p.max_blocks - 1)];
      block = std::min<int64_t>(std::max<int64_t>(block, 0), p.num_blocks - 1);
      start = (block * p.num_kv_heads + it.kv_head) * p.block_size * H;
    }
    if constexpr (kWidened<E>) {
      float* kdst = staging + c * H;
      float* vdst = staging + (kChunk + c) * H;
      for (int64_t h = 0; h < H; h += 16) {
        WidenF8E4M3FN(p.k + start + slot * H + h, kdst + h);
        WidenF8E4M3FN(p.v + start + slot * H + h, vdst + h);
      }
      krows[c] = kdst;
      vrows[c] = vdst;
    } else {
      krows[c] = p.k + start + slot * H;
      vrows[c] = p.v + start + slot * H;
    }
    if (++slot == p.block_size) {
      slot = 0;
      ++index;
    }
  }
}

// acc [nq, H] / l [nq] into the output rows of the item's query vectors (0 where l == 0).
template <typename E>
void StoreOutputs(const Problem<E>& p, const Item& it, int64_t H, const float* acc, const float* l) {
  const int64_t G = p.num_heads / p.num_kv_heads;
  for (int64_t i = 0; i < it.count; ++i) {
    for (int64_t g = 0; g < G; ++g) {
      const int64_t j = i * G + g;
      float* dst = p.out + ((it.first + i) * p.num_heads + it.kv_head * G + g) * H;
      const float inv = l[j] > 0.0f ? 1.0f / l[j] : 0.0f;
      for (int64_t h = 0; h < H; ++h) dst[h] = acc[j * H + h] * inv;
    }
  }
}

#ifdef __AVX512F__
const VL kLane = {0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15};
#else
const VL kLane = {0, 1, 2, 3, 4, 5, 6, 7};
#endif

// Few query vectors (decode: G of them): a query's kLanes scores of a chunk are one
// vector: a dot product (H/kLanes FMAs) per key, the kLanes lane sums at once (LaneSums).
template <int H, typename E>
void RunItemKeysInLanes(const Problem<E>& p, const Item& it, Queries& qs, std::vector<VL>& scratch) {
  constexpr int64_t HV = H / kLanes;
  const int64_t nq = qs.count;
  // Scratch: acc [nq, H], then (fp8) the chunk's widened rows [2 · kChunk, H].
  scratch.assign(nq * HV + (kWidened<E> ? 2 * kChunk * HV : 0), VL{});
  VL* acc = scratch.data();
  float* staging = reinterpret_cast<float*>(acc + nq * HV);
  std::vector<float> m(nq, kMask), l(nq, 0.0f);
  const float* krows[kChunk];
  const float* vrows[kChunk];
  for (int64_t base = qs.key_lo / kChunk * kChunk; base <= qs.key_hi; base += kChunk) {
    const int64_t valid = std::min<int64_t>(kChunk, qs.key_hi + 1 - base);  // later keys: never read
    ChunkRows(p, it, H, base, valid, staging, krows, vrows);
    const VL kpos = kLane + static_cast<float>(base);
    for (int64_t j = 0; j < nq; ++j) {
      const VLu* qj = reinterpret_cast<const VLu*>(qs.q.data() + j * H);  // not 64-byte aligned
      VL d[kChunk];
      for (int64_t c = 0; c < valid; ++c) {
        const VLu* krow = reinterpret_cast<const VLu*>(krows[c]);
        d[c] = qj[0] * krow[0];
#pragma GCC unroll 16
        for (int64_t x = 1; x < HV; ++x) d[c] += qj[x] * krow[x];
      }
      for (int64_t c = valid; c < kChunk; ++c) d[c] = VL{};  // past key_hi: masked below
      VL s = LaneSums(d);
      if (p.soft_cap > 0.0f)
        for (int64_t c = 0; c < kChunk; ++c) s[c] = p.soft_cap * std::tanh(s[c] / p.soft_cap);
      s = (kpos <= qs.pos[j]) & (kpos >= qs.lo[j]) ? s : VL{} + kMask;
      const float block_max = LaneMax(s);
      if (block_max == kMask) continue;  // no key of this chunk is visible to this query
      const float m_new = std::max(m[j], block_max);
      const float alpha = std::exp(m[j] - m_new);
      const VL e = ExpNonPositive(s - m_new);  // masked: exactly 0
      l[j] = l[j] * alpha + LaneSum(e);
      m[j] = m_new;
      VL a[HV];
#pragma GCC unroll 16
      for (int64_t x = 0; x < HV; ++x) a[x] = acc[j * HV + x] * alpha;
      // Only keys this query sees: a masked key's value (before a sliding window, or past
      // ``valid``) may hold anything, NaN included, and 0 · NaN is NaN.
      for (int64_t c = 0; c < valid; ++c) {
        const float pc = e[c];
        if (pc == 0.0f) continue;
        const VLu* vrow = reinterpret_cast<const VLu*>(vrows[c]);
#pragma GCC unroll 16
        for (int64_t x = 0; x < HV; ++x) a[x] += pc * vrow[x];
      }
#pragma GCC unroll 16
      for (int64_t x = 0; x < HV; ++x) acc[j * HV + x] = a[x];
    }
  }
  StoreOutputs(p, it, H, reinterpret_cast<const float*>(acc), l.data());
}

// Many query vectors (prefill): kLanes queries in the lanes of a vector. The queries are
// transposed once per item; a key's scores against kLanes queries are then H FMAs, and
// the online softmax runs on whole vectors (no lane sums).
template <int H, typename E>
void RunItemQueriesInLanes(const Problem<E>& p, const Item& it, Queries& qs, std::vector<VL>& scratch) {
  constexpr int64_t HV = H / kLanes;
  const int64_t nq = qs.count;
  const int64_t groups = (nq + kLanes - 1) / kLanes;  // query vectors of kLanes lanes
  // Scratch: qT [groups, H] (query lanes per channel), acc [groups·kLanes, HV],
  // m, l, pos, lo [groups], p [kChunk] (one chunk's probabilities of a group), then
  // (fp8) the chunk's widened rows [2 · kChunk, H].
  scratch.assign(groups * H + groups * kLanes * HV + 4 * groups + kChunk +
                     (kWidened<E> ? 2 * kChunk * HV : 0),
                 VL{});
  VL* qT = scratch.data();
  VL* acc = qT + groups * H;
  VL* m = acc + groups * kLanes * HV;
  VL* l = m + groups;
  VL* posv = l + groups;
  VL* lov = posv + groups;
  VL* prob = lov + groups;
  float* staging = reinterpret_cast<float*>(prob + kChunk);
  for (int64_t gi = 0; gi < groups; ++gi) {
    m[gi] = VL{} + kMask;
    posv[gi] = VL{} - 1.0f;  // lanes past nq see no key
    lov[gi] = VL{};
  }
  for (int64_t j = 0; j < nq; ++j) {
    float* lanes = reinterpret_cast<float*>(qT + (j / kLanes) * H);
    for (int64_t h = 0; h < H; ++h) lanes[h * kLanes + j % kLanes] = qs.q[j * H + h];
    posv[j / kLanes][j % kLanes] = qs.pos[j];
    lov[j / kLanes][j % kLanes] = qs.lo[j];
  }
  const float* krows[kChunk];
  const float* vrows[kChunk];
  for (int64_t base = qs.key_lo / kChunk * kChunk; base <= qs.key_hi; base += kChunk) {
    const int64_t valid = std::min<int64_t>(kChunk, qs.key_hi + 1 - base);  // later keys: never read
    ChunkRows(p, it, H, base, valid, staging, krows, vrows);
    for (int64_t gi = 0; gi < groups; ++gi) {
      const VL* qg = qT + gi * H;
      VL s[kChunk];
      VL block_max = VL{} + kMask;
      for (int64_t c = 0; c < valid; ++c) {
        // Four independent sums: one chain of H dependent FMAs waits on their latency.
        const float* k = krows[c];
        VL s0 = {}, s1 = {}, s2 = {}, s3 = {};
#pragma GCC unroll 4
        for (int64_t h = 0; h < H; h += 4) {
          s0 += k[h] * qg[h];
          s1 += k[h + 1] * qg[h + 1];
          s2 += k[h + 2] * qg[h + 2];
          s3 += k[h + 3] * qg[h + 3];
        }
        VL sc = (s0 + s1) + (s2 + s3);
        if (p.soft_cap > 0.0f)
          for (int64_t z = 0; z < kLanes; ++z) sc[z] = p.soft_cap * std::tanh(sc[z] / p.soft_cap);
        const float kp = static_cast<float>(base + c);
        sc = (kp <= posv[gi]) & (kp >= lov[gi]) ? sc : VL{} + kMask;
        s[c] = sc;
        block_max = block_max > sc ? block_max : sc;
      }
      const VL m_new = m[gi] > block_max ? m[gi] : block_max;
      const VL alpha = ExpNonPositive(m[gi] - m_new);  // m == kMask: acc and l are 0 anyway
      VL sum = {};
      for (int64_t c = 0; c < valid; ++c) {
        const VL e = ExpNonPositive(s[c] - m_new);
        prob[c] = s[c] > kMask ? e : VL{};  // masked, even where m_new is still kMask: 0
        sum += prob[c];
      }
      l[gi] = l[gi] * alpha + sum;
      m[gi] = m_new;
      const int64_t lanes = std::min<int64_t>(kLanes, nq - gi * kLanes);
      for (int64_t z = 0; z < lanes; ++z) {
        VL* aj = acc + (gi * kLanes + z) * HV;
        VL a[HV];
        const float az = alpha[z];
#pragma GCC unroll 16
        for (int64_t x = 0; x < HV; ++x) a[x] = aj[x] * az;
        const float* pz = reinterpret_cast<const float*>(prob) + z;
        for (int64_t c = 0; c < valid; ++c) {  // only visible keys: see RunItemKeysInLanes
          const float pc = pz[c * kLanes];
          if (pc == 0.0f) continue;
          const VLu* vrow = reinterpret_cast<const VLu*>(vrows[c]);
#pragma GCC unroll 16
          for (int64_t x = 0; x < HV; ++x) a[x] += pc * vrow[x];
        }
#pragma GCC unroll 16
        for (int64_t x = 0; x < HV; ++x) aj[x] = a[x];
      }
    }
  }
  std::vector<float> lsum(nq);
  for (int64_t j = 0; j < nq; ++j) lsum[j] = l[j / kLanes][j % kLanes];
  StoreOutputs(p, it, H, reinterpret_cast<const float*>(acc), lsum.data());
}

template <int H, typename E>
void RunItem(const Problem<E>& p, const Item& it, Queries& qs, std::vector<VL>& scratch) {
  static_assert(H % 16 == 0, "head_dim must be a multiple of 16");
  LoadQueries(p, it, H, qs);
  if (qs.count >= kQueriesInLanesAt)
    RunItemQueriesInLanes<H>(p, it, qs, scratch);
  else
    RunItemKeysInLanes<H>(p, it, qs, scratch);
}

template <typename E>
void RunItems(const Problem<E>& p, const std::vector<Item>& items, std::atomic<int64_t>& next) {
  std::vector<VL> scratch;
  Queries qs;
  for (int64_t i = next.fetch_add(1); i < static_cast<int64_t>(items.size()); i = next.fetch_add(1)) {
    switch (p.head_dim) {
      case 16: RunItem<16>(p, items[i], qs, scratch); break;
      case 32: RunItem<32>(p, items[i], qs, scratch); break;
      case 64: RunItem<64>(p, items[i], qs, scratch); break;
      case 96: RunItem<96>(p, items[i], qs, scratch); break;
      case 128: RunItem<128>(p, items[i], qs, scratch); break;
      case 256: RunItem<256>(p, items[i], qs, scratch); break;
      default: break;  // refused before the items are run
    }
  }
}

// The call for caches of element type E (ffi::Buffer<F32>, or AnyBuffer holding
// float8_e4m3fn: the FFI header maps no C++ type to F8E4M3FN, so Buffer<F8E4M3FN> does
// not compile).
template <typename E, typename Cache>
ffi::Error PagedAttention(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> q, Cache k_cache, Cache v_cache,
                          ffi::Buffer<ffi::S32> block_table, ffi::Buffer<ffi::S32> seq_lens,
                          ffi::Buffer<ffi::S32> query_start_loc, float sm_scale,
                          int64_t sliding_window, float soft_cap, ffi::ResultBuffer<ffi::F32> out) {
  Problem<E> p;
  auto qd = q.dimensions(), kd = k_cache.dimensions(), bd = block_table.dimensions();
  if (qd.size() != 3 || kd.size() != 4 || bd.size() != 2)
    return ffi::Error::InvalidArgument("paged_attention: q [T, N, H], caches [B, K, S, H], block_table [R, MB]");
  p.q = q.typed_data();
  p.k = static_cast<const E*>(k_cache.untyped_data());
  p.v = static_cast<const E*>(v_cache.untyped_data());
  p.block_table = block_table.typed_data();
  p.seq_lens = seq_lens.typed_data();
  p.query_start_loc = query_start_loc.typed_data();
  p.out = out->typed_data();
  p.num_tokens = qd[0];
  p.num_heads = qd[1];
  p.head_dim = qd[2];
  p.num_blocks = kd[0];
  p.num_kv_heads = kd[1];
  p.block_size = kd[2];
  p.num_rows = bd[0];
  p.max_blocks = bd[1];
  p.sm_scale = sm_scale;
  p.sliding_window = sliding_window;
  p.soft_cap = soft_cap;
  if (p.num_heads % p.num_kv_heads || kd[3] != p.head_dim)
    return ffi::Error::InvalidArgument("paged_attention: N must be a multiple of K, and H must match");
  if (p.head_dim != 16 && p.head_dim != 32 && p.head_dim != 64 && p.head_dim != 96 &&
      p.head_dim != 128 && p.head_dim != 256)
    return ffi::Error::InvalidArgument("paged_attention: head_dim must be 16, 32, 64, 96, 128 or 256");
  std::memset(p.out, 0, sizeof(float) * p.num_tokens * p.num_heads * p.head_dim);
  std::vector<Item> items;
  // Rows' query tokens clamped to [0, T) and to after the previous row's: malformed
  // metadata can neither reach outside q and out nor give two rows the same token.
  int64_t prev_end = 0;
  for (int32_t r = 0; r < p.num_rows; ++r) {
    const int32_t begin = static_cast<int32_t>(std::min<int64_t>(
        std::max<int64_t>(p.query_start_loc[r], prev_end), p.num_tokens));
    const int32_t end = static_cast<int32_t>(std::min<int64_t>(
        std::max<int64_t>(p.query_start_loc[r + 1], begin), p.num_tokens));
    prev_end = end;
    if (p.seq_lens[r] <= 0) continue;
    for (int32_t t = begin; t < end; t += kQueryTile)
      for (int32_t kh = 0; kh < p.num_kv_heads; ++kh)
        items.push_back({r, kh, t, std::min<int32_t>(kQueryTile, end - t)});
  }
  // Longer contexts first, so that the last items to start are the short ones.
  std::stable_sort(items.begin(), items.end(), [&](const Item& a, const Item& b) {
    return (p.seq_lens[a.row] - (p.query_start_loc[a.row + 1] - a.first)) >
           (p.seq_lens[b.row] - (p.query_start_loc[b.row + 1] - b.first));
  });
  // The items go to the pool (parallel.h); the shared state outlives the call for late helpers.
  struct Shared {
    Problem<E> p;
    std::vector<Item> items;
    std::atomic<int64_t> next{0};
  };
  auto shared = std::make_shared<Shared>();
  shared->p = p;
  shared->items = std::move(items);
  const int64_t num_items = static_cast<int64_t>(shared->items.size());
  // Multiply-adds of the call (scores and values): below kSerialWork the caller runs every
  // item itself, as starting a helper takes longer than the work.
  int64_t macs = 0;
  for (const Item& it : shared->items)
    macs += 2 * static_cast<int64_t>(p.seq_lens[it.row]) * it.count * (p.num_heads / p.num_kv_heads) *
            p.head_dim;
  const int64_t helpers =
      macs < kSerialWork ? 0 : std::min<int64_t>(jaxserve::MaxHelpers(pool), num_items - 1);
  jaxserve::RunWithHelpers(pool, helpers,
                           [shared] { RunItems(shared->p, shared->items, shared->next); });
  return ffi::Error::Success();
}

ffi::Error PagedAttentionF32(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> q, ffi::Buffer<ffi::F32> k_cache,
                             ffi::Buffer<ffi::F32> v_cache, ffi::Buffer<ffi::S32> block_table,
                             ffi::Buffer<ffi::S32> seq_lens, ffi::Buffer<ffi::S32> query_start_loc,
                             float sm_scale, int64_t sliding_window, float soft_cap,
                             ffi::ResultBuffer<ffi::F32> out) {
  return PagedAttention<float>(pool, q, k_cache, v_cache, block_table, seq_lens, query_start_loc,
                               sm_scale, sliding_window, soft_cap, out);
}

ffi::Error PagedAttentionF8E4M3FN(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> q, ffi::AnyBuffer k_cache,
                                  ffi::AnyBuffer v_cache, ffi::Buffer<ffi::S32> block_table,
                                  ffi::Buffer<ffi::S32> seq_lens, ffi::Buffer<ffi::S32> query_start_loc,
                                  float sm_scale, int64_t sliding_window, float soft_cap,
                                  ffi::ResultBuffer<ffi::F32> out) {
  if (k_cache.element_type() != ffi::F8E4M3FN || v_cache.element_type() != ffi::F8E4M3FN)
    return ffi::Error::InvalidArgument("paged_attention_f8e4m3fn: float8_e4m3fn caches expected");
  return PagedAttention<uint8_t>(pool, q, k_cache, v_cache, block_table, seq_lens, query_start_loc,
                                 sm_scale, sliding_window, soft_cap, out);
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxservePagedAttentionF32, PagedAttentionF32,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Attr<float>("sm_scale")
                                  .Attr<int64_t>("sliding_window")
                                  .Attr<float>("soft_cap")
                                  .Ret<ffi::Buffer<ffi::F32>>());

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxservePagedAttentionF8E4M3FN, PagedAttentionF8E4M3FN,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Attr<float>("sm_scale")
                                  .Attr<int64_t>("sliding_window")
                                  .Attr<float>("soft_cap")
                                  .Ret<ffi::Buffer<ffi::F32>>());
