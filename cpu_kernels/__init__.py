"""CPU kernels as XLA FFI custom calls, built from C++ on first use.

``paged_attention.cc`` is ragged paged attention for float32 on the CPU (the
``cpu`` attention backend, ``jaxserve.model.attention``). Its contract and
results are ``pallas_kernels.ragged_paged_attention_reference``'s. The KV cache
is float32, or float8_e4m3fn (``--kv-cache-dtype fp8``), which the same code
(a second instantiation, ``F8_TARGET``) reads as bytes and widens to float32 in
registers, without a scale: the caller applies the per-layer k and v scales.

``matmul.cc`` is the matrix product of few rows against a kernel stored
``[out, in]`` (``matmul``), which ``jaxserve.model.llama.linear`` uses for
float32 products of at most ``MATMUL_MAX_ROWS`` rows on the CPU; the same code
instantiated for int8 kernels with a float32 scale per output channel
(``matmul_i8``, weight-only int8: ``jaxserve.model.quantization``) runs every
product of an int8 kernel on the CPU, at any row count, and instantiated for
packed int4 kernels with a float32 step and offset per group of inputs
(``matmul_i4``, group-wise int4) every product of an int4 kernel.

``kv_write.cc`` writes one layer's keys or values into an fp8 cache in place
(``write_kv_bytes``; XLA's CPU backend has no fp8 update, ``jaxserve.model.kv_cache``).

All are compiled into one library once per machine with the system C++ compiler (``$CXX``,
else ``g++``), ``-O3 -march=native``, against the XLA FFI headers that ship with
jaxlib (``jax.ffi.include_dir()``), into ``$JAXSERVE_KERNEL_CACHE`` (default
``$JAXSERVE_CACHE/kernels``, itself by default ``~/.cache/jaxserve/kernels``), keyed by a hash of the source, the compiler
command, the jax and jaxlib versions and the CPU's feature flags. With no compiler, or a failed build,
``available()`` is False (the reason is logged once) and the model uses the
pure-jnp reference instead.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import math
import os
import pathlib
import platform
import shutil
import subprocess
import sys
import tempfile

import jax
import jax.numpy as jnp
import numpy as np

logger = logging.getLogger(__name__)

SOURCES = tuple(pathlib.Path(__file__).with_name(name)
                for name in ("paged_attention.cc", "matmul.cc", "kv_write.cc"))
# Included by the sources; part of the build's cache key.
HEADERS = (pathlib.Path(__file__).with_name("parallel.h"),)
TARGET = "jaxserve_paged_attention_f32"
F8_TARGET = "jaxserve_paged_attention_f8e4m3fn"
MATMUL_TARGET = "jaxserve_matmul_f32"
MATMUL_I8_TARGET = "jaxserve_matmul_i8"
MATMUL_I4_TARGET = "jaxserve_matmul_i4"
KV_WRITE_BYTES_TARGET = "jaxserve_kv_write_bytes"
# Every custom call the library registers (the program store allows them in exports).
TARGETS = (TARGET, F8_TARGET, MATMUL_TARGET, MATMUL_I8_TARGET, MATMUL_I4_TARGET,
           KV_WRITE_BYTES_TARGET)
# A float32 product of at most this many rows runs the C++ kernel where it is built with
# AVX-512 (16-lane vectors); beyond, XLA's own (YNNPACK), which was level at 256 rows and
# faster at 512. Measured on the demo model's shapes, 2 cores: a 30-layer chain of its four
# products plus the LM head, XLA / C++ kernel, 1 row 21.7 / 18.7 ms, 8 rows 42.3 / 24.7,
# 16 rows 46.0 / 32.1, 32 rows 54.7 / 44.0, 64 rows 75.3 / 63.8, 128 rows 126.6 / 114.4,
# 256 rows 233.1 / 235.7, 512 rows 442.8 / 467.2 (one run, median of 7; docs/kernels.md).
# There an int8 or int4 product takes any row count.
MATMUL_MAX_ROWS = 128
# Without AVX-512 (AVX2, or another ISA) the library's vectors are 8 lanes and it has the
# dot form only (matmul.cc). Measured on a 2-core AVX2 AMD EPYC, one product of the demo
# model's shapes, C++ / XLA ms (mean of 30), qkv 3072 x 576, down 576 x 1536, LM head
# 49152 x 576: float32 at 8 rows 0.46 / 0.67, 0.20 / 0.56, 7.5 / 12.4; at 16 rows 1.03 /
# 0.70, 0.52 / 0.78, 15.3 / 23.6. Against the jnp form, int8 at 32 rows 1.41 / 1.67,
# 0.94 / 1.49, 24.9 / 68.9; at 64 rows 4.25 / 3.92, 1.49 / 1.62, 48.9 / 76.7 (int4 alike).
# Alone, XLA's float32 product is the faster there from 16 rows for qkv, from 32 for the LM
# head, from 64 for all three; inside the served step it is not: its YNNPACK fusions there
# ran at half the speed of the products alone. The demo model's decode step, products' ms
# a step (step_profile, mean over the run), XLA / C++: 16 rows 154 / 68, 32 rows 245 /
# 118, 64 rows 175 / 258.
# There a float32 product takes at most the first many rows, an int8 or int4 one the second.
MATMUL_MAX_ROWS_8_LANES = 32
MATMUL_MAX_ROWS_8_LANES_QUANTIZED = 64
# The head dims the kernel is instantiated for (``RunItem<H>`` in the C++).
HEAD_DIMS = (16, 32, 64, 96, 128, 256)
# No -ffast-math: linked into a shared library it sets flush-to-zero and
# denormals-are-zero for the whole process at load time (GCC's crtfastmath.o),
# changing every other computation's float results. The kernel's vector code does
# not need it.
_CXXFLAGS = ("-O3", "-march=native", "-fno-math-errno", "-fno-trapping-math", "-std=c++17",
             "-fPIC", "-shared", "-w")


def cache_dir() -> pathlib.Path:
    """Where built libraries live: ``$JAXSERVE_KERNEL_CACHE``, else ``kernels`` under the
    jaxserve cache root (``$JAXSERVE_CACHE``, default ``~/.cache/jaxserve``; see
    ``jaxserve.demo_model.cache_root``)."""
    from jaxserve.demo_model import cache_root

    env = os.environ.get("JAXSERVE_KERNEL_CACHE")
    return pathlib.Path(env) if env else cache_root() / "kernels"


def _cpu_flags() -> str:
    try:
        for line in pathlib.Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(("flags", "Features")):
                return line
    except OSError:
        pass
    return platform.processor()


def _build() -> pathlib.Path:
    """Compiles the library if it is not built yet; returns its path.

    Raises:
      RuntimeError: no compiler, or the compiler failed (its output attached).
    """
    cxx = os.environ.get("CXX") or shutil.which("g++") or shutil.which("c++")
    if cxx is None:
        raise RuntimeError("no C++ compiler (g++ or $CXX) on PATH")
    if shutil.which(cxx) is None:
        raise RuntimeError(f"the C++ compiler {cxx!r} is not an executable")
    include = jax.ffi.include_dir()
    cmd = [cxx, *_CXXFLAGS, f"-I{include}"]
    import jaxlib  # its FFI headers are compiled in

    key = hashlib.sha256("\0".join([*(src.read_text() for src in (*SOURCES, *HEADERS)), *cmd, jax.__version__, jaxlib.__version__,
                                    _cpu_flags(), platform.machine()]).encode()).hexdigest()[:16]
    path = cache_dir() / f"kernels-{key}.so"
    if path.exists():
        return path
    path.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=path.parent) as tmp:
        out = pathlib.Path(tmp, path.name)
        proc = subprocess.run([*cmd, *map(str, SOURCES), "-o", str(out)], capture_output=True,
                              text=True)
        if proc.returncode != 0:
            raise RuntimeError(f"{' '.join(cmd)} failed:\n{proc.stderr[-2000:]}")
        os.replace(out, path)  # atomic: concurrent builders each write a complete file
    logger.info("built %s", path)
    return path


@functools.cache
def _library() -> ctypes.CDLL:
    """The built library, loaded once per process.

    Raises:
      RuntimeError: no compiler, or the compiler failed.
      OSError: the library could not be loaded.
    """
    return ctypes.cdll.LoadLibrary(str(_build()))


@functools.cache
def _load() -> str | None:
    """Builds and registers the kernels once per process; None when they work, else why not."""
    try:
        lib = _library()
        symbols = (lib.JaxservePagedAttentionF32, lib.JaxservePagedAttentionF8E4M3FN,
                   lib.JaxserveMatmulF32, lib.JaxserveMatmulI8, lib.JaxserveMatmulI4,
                   lib.JaxserveKvWriteBytes)
        for target, symbol in zip(TARGETS, symbols, strict=True):
            jax.ffi.register_ffi_target(target, jax.ffi.pycapsule(symbol), platform="cpu")
        if lib.JaxserveMatmulLanes() not in (8, 16):
            raise RuntimeError(f"the library's vectors have {lib.JaxserveMatmulLanes()} lanes, "
                               "not 8 or 16")
    except (OSError, RuntimeError, AttributeError) as err:
        logger.warning("CPU kernels unavailable, using the jnp attention reference and XLA's "
                       "products: %s", err)
        return str(err)
    return None


def available() -> bool:
    """Whether the C++ kernels are built and registered in this process."""
    return _load() is None


@functools.cache
def matmul_lanes() -> int:
    """The float32 lanes of the matrix products' vectors: 16 where the library has the
    AVX-512 forms (``-march=native`` on a CPU with AVX-512F), 8 otherwise (AVX2 or the
    portable fallback); 0 when the kernels are unavailable."""
    return int(_library().JaxserveMatmulLanes()) if _load() is None else 0


def has_avx512() -> bool:
    """Whether the loaded library has the AVX-512 forms (``matmul_lanes() == 16``)."""
    return matmul_lanes() == 16


def matmul_max_rows(quantized: bool = False) -> int:
    """The most rows of x a C++ product takes on this machine (``jaxserve.model.llama.linear``
    sends more to XLA): with AVX-512, ``MATMUL_MAX_ROWS`` for float32 and any count
    (``sys.maxsize``) for int8 / int4 (``quantized``); with 8 lanes
    ``MATMUL_MAX_ROWS_8_LANES`` and ``MATMUL_MAX_ROWS_8_LANES_QUANTIZED``; 0 when the kernels
    are unavailable."""
    lanes = matmul_lanes()
    if lanes == 16:
        return sys.maxsize if quantized else MATMUL_MAX_ROWS
    if lanes == 8:
        return MATMUL_MAX_ROWS_8_LANES_QUANTIZED if quantized else MATMUL_MAX_ROWS_8_LANES
    return 0


def unavailable_reason() -> str | None:
    """Why the kernels could not be built or loaded (None when they work)."""
    return _load()


def ragged_paged_attention(q: jax.Array, k_cache: jax.Array, v_cache: jax.Array,
                           block_table: jax.Array, seq_lens: jax.Array,
                           query_start_loc: jax.Array, *, sm_scale: float,
                           sliding_window: int | None = None,
                           soft_cap: float | None = None) -> jax.Array:
    """Ragged causal paged attention by the C++ kernel (float32, CPU).

    Same arguments, shapes and results as
    ``pallas_kernels.ragged_paged_attention_reference`` (q [T, N, H],
    caches [B, K, S, H], block_table i32[R, MB], seq_lens i32[R],
    query_start_loc i32[R + 1]; returns [T, N, H] of q's dtype, zeros for
    padding tokens), computed in float32. q is cast to float32. float8_e4m3fn
    caches (both) reach the kernel as they are, each element widened to float32
    as it is read, with no scale (a per-layer k_scale belongs in q, a v_scale on
    the output: the caller's); the values equal ``k_cache.astype(float32)``'s
    but for the NaN codes, which the kernel reads as ±480 (an fp8 cache writer
    clips to ±448). Caches of any other dtype are cast to float32 (a copy of the
    whole cache per call).

    Raises:
      RuntimeError: the kernel could not be built (``available()`` is False).
      ValueError: inconsistent shapes, or a head_dim not in ``HEAD_DIMS``.
    """
    from pallas_kernels.rpa_reference import check_shapes

    check_shapes(q, k_cache, v_cache, block_table, seq_lens, query_start_loc)
    if q.shape[-1] not in HEAD_DIMS:
        raise ValueError(f"the CPU attention kernel supports head_dim in {HEAD_DIMS}, "
                         f"got {q.shape[-1]}; use the 'reference' backend")
    why = _load()
    if why is not None:
        raise RuntimeError(f"the CPU attention kernel is unavailable: {why}")
    f32 = lambda x: x.astype(jnp.float32)  # noqa: E731
    if k_cache.dtype == v_cache.dtype == jnp.float8_e4m3fn:
        target = F8_TARGET
    else:
        target, k_cache, v_cache = TARGET, f32(k_cache), f32(v_cache)
    out = jax.ffi.ffi_call(target, jax.ShapeDtypeStruct(q.shape, jnp.float32))(
        f32(q), k_cache, v_cache, block_table.astype(jnp.int32),
        seq_lens.astype(jnp.int32), query_start_loc.astype(jnp.int32),
        sm_scale=np.float32(sm_scale), sliding_window=np.int64(sliding_window or 0),
        soft_cap=np.float32(soft_cap or 0.0))
    return out.astype(q.dtype)


def write_kv_bytes(cache: jax.Array, values: jax.Array, slot_mapping: jax.Array) -> jax.Array:
    """One layer's KV write into a cache of one-byte elements, in place, by the C++ kernel.

    ``cache [B, K, S, H]`` (float8_e4m3fn), ``values [T, K, H]`` of the same dtype (rounded
    already), ``slot_mapping i32[T]``: returns the cache with ``cache[slot // S, :, slot % S]
    = values[t]`` for each token, slots past the cache dropped (as the jnp scatter's
    ``mode="drop"``) and negative ones too (the engine passes none; the jnp scatter
    would wrap them). The output aliases the cache operand, so a donated cache
    is updated in place: only the T · K rows of H bytes are written (XLA's CPU backend
    has no fp8 update, ``jaxserve.model.kv_cache.write_kv``).

    Raises:
      RuntimeError: the kernels could not be built (``available()`` is False).
      ValueError: shapes other than the above, or dtypes that differ or are not one byte.
    """
    if (cache.ndim != 4 or values.ndim != 3 or slot_mapping.ndim != 1
            or values.shape != (slot_mapping.shape[0], cache.shape[1], cache.shape[3])):
        raise ValueError(f"write_kv_bytes: cache [B, K, S, H], values [T, K, H] and slot_mapping "
                         f"[T] expected, got {cache.shape}, {values.shape} and {slot_mapping.shape}")
    if values.dtype != cache.dtype or cache.dtype.itemsize != 1:
        raise ValueError(f"write_kv_bytes: one-byte cache and values of one dtype expected, got "
                         f"{cache.dtype} and {values.dtype}")
    why = _load()
    if why is not None:
        raise RuntimeError(f"the CPU kernels are unavailable: {why}")
    return jax.ffi.ffi_call(KV_WRITE_BYTES_TARGET, jax.ShapeDtypeStruct(cache.shape, cache.dtype),
                            input_output_aliases={0: 0})(
        cache, values, slot_mapping.astype(jnp.int32))


def matmul(x: jax.Array, w: jax.Array) -> jax.Array:
    """x [..., K] times w [N, K] transposed (``x @ w.T``) → [..., N], float32, by the C++ kernel.

    The product ``jaxserve.model.llama.linear`` runs for few rows on the CPU
    (see ``MATMUL_MAX_ROWS``); agrees with XLA's to float32 rounding (another
    summation order).

    Raises:
      RuntimeError: the kernels could not be built (``available()`` is False).
      ValueError: w is not 2-D, K differs, or an operand is not float32.
    """
    if w.ndim != 2 or x.shape[-1] != w.shape[1]:
        raise ValueError(f"matmul: x [..., K] and w [N, K] expected, got {x.shape} and {w.shape}")
    if x.dtype != jnp.float32 or w.dtype != jnp.float32:
        raise ValueError(f"matmul: float32 operands expected, got {x.dtype} and {w.dtype}")
    why = _load()
    if why is not None:
        raise RuntimeError(f"the CPU kernels are unavailable: {why}")
    rows = x.reshape(math.prod(x.shape[:-1]), x.shape[-1])
    out = jax.ffi.ffi_call(MATMUL_TARGET, jax.ShapeDtypeStruct((rows.shape[0], w.shape[0]),
                                                               jnp.float32))(rows, w)
    return out.reshape(*x.shape[:-1], w.shape[0])


def matmul_i8(x: jax.Array, q: jax.Array, scale: jax.Array) -> jax.Array:
    """x f32[..., K] times an int8 kernel q i8[N, K] with scale f32[N] → f32[..., N], by the C++
    kernel: ``(x @ q.T) * scale``, the int8 values widened to float32 in registers.

    The product ``jaxserve.model.llama.linear`` runs for every int8 kernel on the CPU
    (``jaxserve.model.quantization``); agrees with ``matmul_i8_reference`` to float32
    rounding (another summation order).

    Raises:
      RuntimeError: the kernels could not be built (``available()`` is False).
      ValueError: q is not 2-D, K differs, scale is not [N], or a dtype is not
        float32 / int8 / float32.
    """
    if q.ndim != 2 or x.shape[-1] != q.shape[1] or scale.shape != q.shape[:1]:
        raise ValueError(f"matmul_i8: x [..., K], q [N, K] and scale [N] expected, got "
                         f"{x.shape}, {q.shape} and {scale.shape}")
    if x.dtype != jnp.float32 or q.dtype != jnp.int8 or scale.dtype != jnp.float32:
        raise ValueError(f"matmul_i8: float32, int8 and float32 operands expected, got "
                         f"{x.dtype}, {q.dtype} and {scale.dtype}")
    why = _load()
    if why is not None:
        raise RuntimeError(f"the CPU kernels are unavailable: {why}")
    rows = x.reshape(math.prod(x.shape[:-1]), x.shape[-1])
    out = jax.ffi.ffi_call(MATMUL_I8_TARGET, jax.ShapeDtypeStruct((rows.shape[0], q.shape[0]),
                                                                  jnp.float32))(rows, q, scale)
    return out.reshape(*x.shape[:-1], q.shape[0])


def matmul_i8_reference(x: jax.Array, q: jax.Array, scale: jax.Array) -> jax.Array:
    """``matmul_i8``'s contract in jnp (any platform): x [..., K], q i8[N, K], scale f32[N] →
    [..., N] of x's dtype, ``(x @ q.T as x's dtype) * scale``."""
    out = jax.lax.dot_general(x, q.astype(x.dtype), (((x.ndim - 1,), (1,)), ((), ())))
    return (out * scale).astype(x.dtype)


def matmul_i4(x: jax.Array, packed: jax.Array, scale: jax.Array) -> jax.Array:
    """x f32[..., K] times a packed int4 kernel (packed u8[N, K / 2], scale f32[N, K / G, 2])
    → f32[..., N], by the C++ kernel: ``x @ w.T`` with
    ``w[n, k] = q[n, k] · scale[n, k / G, 0] + scale[n, k / G, 1]`` (step, offset), each vector
    of int4 values (16 or 8: ``matmul_lanes()``) widened and scaled in float32 registers.

    The layout is ``jaxserve.model.quantization``'s int4 (llama.cpp Q4_0 / Q4_1's
    nibble order); G, the group size, is K / scale.shape[1]. The product
    ``jaxserve.model.llama.linear`` runs for every int4 kernel on the CPU; agrees with
    ``matmul_i4_reference`` to float32 rounding (another summation order).

    Raises:
      RuntimeError: the kernels could not be built (``available()`` is False).
      ValueError: packed is not [N, K / 2] or scale not [N, K / G, 2] with G a power of
        two >= 32 dividing K, or a dtype is not float32 / uint8 / float32.
    """
    k = x.shape[-1]
    groups = scale.shape[1] if scale.ndim == 3 else 0
    group = k // groups if groups else 0
    if (packed.ndim != 2 or scale.ndim != 3 or scale.shape[2] != 2 or 2 * packed.shape[1] != k
            or scale.shape[0] != packed.shape[0] or (k and (groups == 0 or group * groups != k
                                                           or group < 32 or group & (group - 1)))):
        raise ValueError(f"matmul_i4: x [..., K], packed [N, K / 2] and scale [N, K / G, 2] with G "
                         f"a power of two >= 32 expected, got {x.shape}, {packed.shape} and "
                         f"{scale.shape}")
    if x.dtype != jnp.float32 or packed.dtype != jnp.uint8 or scale.dtype != jnp.float32:
        raise ValueError(f"matmul_i4: float32, uint8 and float32 operands expected, got "
                         f"{x.dtype}, {packed.dtype} and {scale.dtype}")
    why = _load()
    if why is not None:
        raise RuntimeError(f"the CPU kernels are unavailable: {why}")
    rows = x.reshape(math.prod(x.shape[:-1]), k)
    out = jax.ffi.ffi_call(MATMUL_I4_TARGET, jax.ShapeDtypeStruct((rows.shape[0], packed.shape[0]),
                                                                  jnp.float32))(rows, packed, scale)
    return out.reshape(*x.shape[:-1], packed.shape[0])


def matmul_i4_reference(x: jax.Array, packed: jax.Array, scale: jax.Array) -> jax.Array:
    """``matmul_i4``'s contract in jnp (any platform): x [..., K], packed u8[N, K / 2],
    scale f32[N, K / G, 2] → [..., N] of x's dtype, x times the dequantized kernel
    (``jaxserve.model.quantization.dequantize``, as x's dtype) transposed."""
    from jaxserve.model.quantization import dequantize

    w = dequantize(packed, scale, x.dtype)  # [N, K]
    return jax.lax.dot_general(x, w, (((x.ndim - 1,), (1,)), ((), ())))
