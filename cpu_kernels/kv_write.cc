// The KV write of one layer's fp8 cache, in place: an XLA FFI custom call.
//
// cache[block, h, offset, :] = values[t, h, :] for every token t, where
// block = slot_mapping[t] / S and offset = slot_mapping[t] % S, for a cache
// [B, K, S, H] and values [T, K, H] of one-byte elements (float8_e4m3fn: the
// values are already rounded, jaxserve.model.kv_cache.quantize_kv). A slot past
// the cache (block >= B) is dropped, as the jnp scatter's mode="drop" does, and
// a negative one too (the engine passes none; the jnp scatter would wrap it). The result is the cache itself: Python aliases the output
// to the cache operand (input_output_aliases), so only the T · K rows of H bytes
// are written, where XLA's CPU backend compiled the same scatter into a float
// copy of the whole cache and back (it has no fp8 update), and a bitcast to
// bytes still rewrote the whole cache. If XLA did not alias the buffers, the
// cache is copied to the output first (still correct).

#include <algorithm>
#include <cstdint>
#include <cstring>

#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

ffi::Error KvWriteBytes(ffi::AnyBuffer cache, ffi::AnyBuffer values,
                        ffi::Buffer<ffi::S32> slot_mapping, ffi::Result<ffi::AnyBuffer> out) {
  auto cd = cache.dimensions(), vd = values.dimensions(), sd = slot_mapping.dimensions();
  auto od = out->dimensions();
  if (cd.size() != 4 || vd.size() != 3 || sd.size() != 1 || vd[0] != sd[0] || vd[1] != cd[1] ||
      vd[2] != cd[3] || od.size() != 4 || !std::equal(od.begin(), od.end(), cd.begin()))
    return ffi::Error::InvalidArgument(
        "kv_write_bytes: cache [B, K, S, H], values [T, K, H], slot_mapping [T], out as cache");
  if (ffi::ByteWidth(cache.element_type()) != 1 || values.element_type() != cache.element_type() ||
      out->element_type() != cache.element_type())
    return ffi::Error::InvalidArgument("kv_write_bytes: one-byte elements of one type expected");
  const int64_t B = cd[0], K = cd[1], S = cd[2], H = cd[3], T = vd[0];
  auto* dst = static_cast<uint8_t*>(out->untyped_data());
  const auto* src = static_cast<const uint8_t*>(values.untyped_data());
  if (dst != cache.untyped_data()) std::memcpy(dst, cache.untyped_data(), cache.size_bytes());
  if (S == 0) return ffi::Error::Success();  // no slot to write
  const int32_t* slots = slot_mapping.typed_data();
  for (int64_t t = 0; t < T; ++t) {
    const int64_t slot = slots[t], block = slot / S, offset = slot % S;
    if (slot < 0 || block >= B) continue;
    for (int64_t h = 0; h < K; ++h)
      std::memcpy(dst + ((block * K + h) * S + offset) * H, src + (t * K + h) * H, H);
  }
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxserveKvWriteBytes, KvWriteBytes,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Ret<ffi::AnyBuffer>());
