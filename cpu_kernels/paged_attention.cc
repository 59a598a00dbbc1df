// Ragged paged attention for the CPU, float32: an XLA FFI custom call.
//
// The contract is pallas_kernels.ragged_paged_attention's (the pure-jnp
// reference in pallas_kernels/rpa_reference.py is the oracle): q [T, N, H],
// k_cache/v_cache [B, K, S, H] (the step's K/V already written),
// block_table i32[R, MB], seq_lens i32[R], query_start_loc i32[R + 1]; the
// output is [T, N, H], zero for padding tokens.
//
// Work is split into items of (row, KV head, up to kQueryTile query tokens);
// an item's G·Tq query vectors share every key they read, straight from the
// cache through the block table (no gathered copy). Keys go in chunks of 16
// positions: the 16 scores of one query vector are one vector (from a dot
// product per key, or, for items with many query vectors, from the chunk's keys
// transposed once for all of them); FlashAttention's online softmax (Dao et
// al., 2022, Alg. 1) merges the chunks. Items run on XLA's intra-op thread pool.

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <thread>
#include <vector>

#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

constexpr int kQueryTile = 16;
// Keys per score vector.
constexpr int64_t kChunk = 16;
// Query vectors per item from which a block's keys are transposed once for all of them.
constexpr int kTransposeAt = 12;
// Masked scores: finite (see MASK_VALUE in pallas_kernels/rpa_reference.py).
constexpr float kMask = -1e30f;

struct Problem {
  const float* q;
  const float* k;
  const float* v;
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

// 16 floats: one AVX-512 register (two AVX2 ones); GCC/Clang lower it to what the CPU has.
typedef float V16 __attribute__((vector_size(64), aligned(64)));
typedef int32_t I16 __attribute__((vector_size(64), aligned(64)));
// The same vector at any float's alignment, for loads straight from the cache.
typedef float V16u __attribute__((vector_size(64), aligned(4), may_alias));

// Sum and maximum of a vector's 16 lanes: four halving steps, each one lane shuffle.
inline V16 Fold(V16 v, bool take_max) {
  const I16 h8 = {8, 9, 10, 11, 12, 13, 14, 15, 0, 1, 2, 3, 4, 5, 6, 7};
  const I16 h4 = {4, 5, 6, 7, 0, 1, 2, 3, 12, 13, 14, 15, 8, 9, 10, 11};
  const I16 h2 = {2, 3, 0, 1, 6, 7, 4, 5, 10, 11, 8, 9, 14, 15, 12, 13};
  const I16 h1 = {1, 0, 3, 2, 5, 4, 7, 6, 9, 8, 11, 10, 13, 12, 15, 14};
  for (const I16& perm : {h8, h4, h2, h1}) {
    const V16 other = __builtin_shuffle(v, perm);
    v = take_max ? (v > other ? v : other) : v + other;
  }
  return v;
}
inline float LaneSum(V16 v) { return Fold(v, false)[0]; }
inline float LaneMax(V16 v) { return Fold(v, true)[0]; }

// exp(x) for x <= 0, 16 lanes: 2^(x·log2 e) = 2^n · 2^f with n = round(x·log2 e) and
// f in [-1/2, 1/2]; 2^f = e^(f·ln 2) by its Taylor polynomial of degree 7 (the first omitted
// term, (ln 2 / 2)^8 / 8!, bounds the relative error by 5e-9). x below -87 (the masked -1e30
// included) gives exactly 0.
inline V16 ExpNonPositive(V16 x) {
  const V16 zero = {};
  V16 y = x * 1.4426950408889634f;
  y = y < -126.0f ? zero - 126.0f : y;
  // round half down: y + 0.5 truncated toward zero, minus one where that rounded up.
  const V16 shifted = y + 0.5f;
  I16 n = __builtin_convertvector(shifted, I16);
  n += __builtin_convertvector(n, V16) > shifted;  // a true lane compare is -1
  const V16 t = (y - __builtin_convertvector(n, V16)) * 0.6931471805599453f;
  V16 p = zero + (1.0f / 5040.0f);
  p = p * t + (1.0f / 720.0f);
  p = p * t + (1.0f / 120.0f);
  p = p * t + (1.0f / 24.0f);
  p = p * t + (1.0f / 6.0f);
  p = p * t + 0.5f;
  p = p * t + 1.0f;
  p = p * t + 1.0f;
  V16 scale;
  const I16 bits = (n + 127) << 23;
  __builtin_memcpy(&scale, &bits, sizeof(scale));
  const V16 e = p * scale;
  return x < -87.0f ? zero : e;
}

template <int H>
void RunItem(const Problem& p, const Item& it, std::vector<V16>& scratch) {
  static_assert(H % 16 == 0, "head_dim must be a multiple of 16");
  constexpr int64_t HV = H / 16;  // vectors per head vector
  const int64_t G = p.num_heads / p.num_kv_heads;
  const int64_t nq = it.count * G;  // query vectors
  const int64_t q_len = p.query_start_loc[it.row + 1] - p.query_start_loc[it.row];
  const int64_t ctx = p.seq_lens[it.row] - q_len;  // tokens cached before this step
  // Scratch (in 16-float vectors): q [nq, HV], acc [nq, HV], kt [H] (a block's keys
  // transposed), then m/l/pos/lo [nq] floats.
  scratch.resize(2 * nq * HV + H + 4 * nq);
  float* qv = reinterpret_cast<float*>(scratch.data());
  V16* acc = scratch.data() + nq * HV;
  V16* kt = acc + nq * HV;
  float* m = reinterpret_cast<float*>(kt + H);
  float* l = m + nq;
  float* posf = l + nq;  // positions as floats: exact below 2^24
  float* lof = posf + nq;
  int64_t key_lo = INT64_MAX, key_hi = -1;
  for (int64_t i = 0; i < it.count; ++i) {
    const int64_t t = it.first + i;
    const int64_t pos = ctx + t - p.query_start_loc[it.row];
    const int64_t lo = p.sliding_window > 0 ? std::max<int64_t>(0, pos - p.sliding_window + 1) : 0;
    key_lo = std::min(key_lo, lo);
    key_hi = std::max(key_hi, pos);
    for (int64_t g = 0; g < G; ++g) {
      const int64_t j = i * G + g;
      const float* src = p.q + (t * p.num_heads + it.kv_head * G + g) * H;
      for (int64_t h = 0; h < H; ++h) qv[j * H + h] = src[h] * p.sm_scale;
      posf[j] = static_cast<float>(pos);
      lof[j] = static_cast<float>(lo);
      m[j] = kMask;
      l[j] = 0.0f;
    }
  }
  std::memset(static_cast<void*>(acc), 0, sizeof(V16) * nq * HV);
  const V16 lane = {0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15};
  const int32_t* table = p.block_table + static_cast<int64_t>(it.row) * p.max_blocks;
  const float* krows[kChunk];
  const float* vrows[kChunk];
  // Keys in chunks of 16 consecutive positions; each key's row is found through the
  // block table (a chunk may span several blocks when S < 16).
  for (int64_t base = key_lo / kChunk * kChunk; base <= key_hi; base += kChunk) {
    const int64_t valid = std::min<int64_t>(kChunk, key_hi + 1 - base);  // later keys: never read
    for (int64_t c = 0; c < valid; ++c) {
      const int64_t pos = base + c;
      int64_t block = table[std::min<int64_t>(pos / p.block_size, p.max_blocks - 1)];
      block = std::min<int64_t>(std::max<int64_t>(block, 0), p.num_blocks - 1);
      const int64_t offset = ((block * p.num_kv_heads + it.kv_head) * p.block_size + pos % p.block_size) * H;
      krows[c] = p.k + offset;
      vrows[c] = p.v + offset;
    }
    const V16 kpos = lane + static_cast<float>(base);
    // Many query vectors: transpose the block's keys once ([H] vectors of 16 keys), then a
    // query's 16 scores are H FMAs. Few (decode): a dot product per key is cheaper.
    const bool transposed = nq >= kTransposeAt;
    if (transposed) {
      float* ktf = reinterpret_cast<float*>(kt);
      for (int64_t c = 0; c < kChunk; ++c)
        for (int64_t h = 0; h < H; ++h) ktf[h * kChunk + c] = c < valid ? krows[c][h] : 0.0f;
    }
    for (int64_t j = 0; j < nq; ++j) {
      V16 s = {};
      if (transposed) {
        // Four independent sums: one chain of H dependent multiply-adds would wait on
        // the FMA latency at every step.
        const float* qj = qv + j * H;
        V16 s1 = {}, s2 = {}, s3 = {};
#pragma GCC unroll 4
        for (int64_t h = 0; h < H; h += 4) {
          s += qj[h] * kt[h];
          s1 += qj[h + 1] * kt[h + 1];
          s2 += qj[h + 2] * kt[h + 2];
          s3 += qj[h + 3] * kt[h + 3];
        }
        s = (s + s1) + (s2 + s3);
      } else {
        const V16* qj = reinterpret_cast<const V16*>(qv + j * H);
        for (int64_t c = 0; c < valid; ++c) {  // H/16 FMAs and a lane sum per key
          const V16u* krow = reinterpret_cast<const V16u*>(krows[c]);
          V16 d = qj[0] * krow[0];
#pragma GCC unroll 16
          for (int64_t x = 1; x < HV; ++x) d += qj[x] * krow[x];
          s[c] = LaneSum(d);
        }
      }
      if (p.soft_cap > 0.0f)
        for (int64_t c = 0; c < kChunk; ++c) s[c] = p.soft_cap * std::tanh(s[c] / p.soft_cap);
      const V16 mask_value = V16{} + kMask;
      s = (kpos <= posf[j]) & (kpos >= lof[j]) ? s : mask_value;
      const float block_max = LaneMax(s);
      if (block_max == kMask) continue;  // no key of this block is visible to this query
      const float m_new = std::max(m[j], block_max);
      const float alpha = std::exp(m[j] - m_new);
      const V16 e = ExpNonPositive(s - m_new);
      l[j] = l[j] * alpha + LaneSum(e);
      m[j] = m_new;
      V16 a[HV];
#pragma GCC unroll 16
      for (int64_t x = 0; x < HV; ++x) a[x] = acc[j * HV + x] * alpha;
      // Slots at or past ``valid`` are never read: a stale slot may hold anything, NaN included.
      for (int64_t c = 0; c < valid; ++c) {
        const float pc = e[c];
        const V16u* vrow = reinterpret_cast<const V16u*>(vrows[c]);
#pragma GCC unroll 16
        for (int64_t x = 0; x < HV; ++x) a[x] += pc * vrow[x];
      }
#pragma GCC unroll 16
      for (int64_t x = 0; x < HV; ++x) acc[j * HV + x] = a[x];
    }
  }
  const float* accf = reinterpret_cast<const float*>(acc);
  for (int64_t i = 0; i < it.count; ++i) {
    const int64_t t = it.first + i;
    for (int64_t g = 0; g < G; ++g) {
      const int64_t j = i * G + g;
      float* dst = p.out + (t * p.num_heads + it.kv_head * G + g) * H;
      const float inv = l[j] > 0.0f ? 1.0f / l[j] : 0.0f;
      for (int64_t h = 0; h < H; ++h) dst[h] = accf[j * H + h] * inv;
    }
  }
}

void RunItems(const Problem& p, const std::vector<Item>& items, std::atomic<int64_t>& next) {
  std::vector<V16> scratch;
  for (int64_t i = next.fetch_add(1); i < static_cast<int64_t>(items.size()); i = next.fetch_add(1)) {
    switch (p.head_dim) {
      case 16: RunItem<16>(p, items[i], scratch); break;
      case 32: RunItem<32>(p, items[i], scratch); break;
      case 64: RunItem<64>(p, items[i], scratch); break;
      case 96: RunItem<96>(p, items[i], scratch); break;
      case 128: RunItem<128>(p, items[i], scratch); break;
      case 256: RunItem<256>(p, items[i], scratch); break;
      default: break;  // refused before the items are run
    }
  }
}

ffi::Error PagedAttention(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> q, ffi::Buffer<ffi::F32> k_cache,
                          ffi::Buffer<ffi::F32> v_cache, ffi::Buffer<ffi::S32> block_table,
                          ffi::Buffer<ffi::S32> seq_lens, ffi::Buffer<ffi::S32> query_start_loc,
                          float sm_scale, int64_t sliding_window, float soft_cap,
                          ffi::ResultBuffer<ffi::F32> out) {
  Problem p;
  auto qd = q.dimensions(), kd = k_cache.dimensions(), bd = block_table.dimensions();
  if (qd.size() != 3 || kd.size() != 4 || bd.size() != 2)
    return ffi::Error::InvalidArgument("paged_attention: q [T, N, H], caches [B, K, S, H], block_table [R, MB]");
  p.q = q.typed_data();
  p.k = k_cache.typed_data();
  p.v = v_cache.typed_data();
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
  for (int32_t r = 0; r < p.num_rows; ++r) {
    const int32_t begin = p.query_start_loc[r], end = std::min<int64_t>(p.query_start_loc[r + 1], p.num_tokens);
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
  std::atomic<int64_t> next{0};
  std::atomic<int64_t> running{0};
  const int64_t helpers = std::min<int64_t>(pool.num_threads(), static_cast<int64_t>(items.size()) - 1);
  for (int64_t i = 0; i < helpers; ++i) {
    running.fetch_add(1);
    pool.Schedule([&] {
      RunItems(p, items, next);
      running.fetch_sub(1);
    });
  }
  RunItems(p, items, next);
  while (running.load() > 0) std::this_thread::yield();
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxservePagedAttentionF32, PagedAttention,
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
