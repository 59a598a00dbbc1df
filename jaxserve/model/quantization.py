"""Weight quantization (vLLM's ``quantization`` setting): "int8", "int4" and "fp8".

int8 and int4 are weight-only: they keep the activations in floating point and store
a kernel ``[out, in]`` (as ``jaxserve.model.llama.linear`` stores them) as integers
plus float32 scales. fp8 stores it as float8 e4m3 values plus float32 scales and
quantizes the activations too (W8A8). The method is a parameter of one code path
(``quantize`` / ``dequantize``), and the arrays describe their format (int8 values,
uint8 bytes of packed int4 values, or float8_e4m3fn values).

**int8** — symmetric, one scale per output channel: ``q i8[out, in]``,
``scale f32[out]``,

    scale[o] = max_i |w[o, i]| / 127,   q[o, i] = round(w[o, i] / scale[o])

(clipped to [-127, 127]). This is the absmax ("symmetric linear") scheme of
LLM.int8()'s vector-wise quantization (Dettmers et al., 2022, section 3.1)
without its outlier decomposition, and what vLLM's and TensorRT-LLM's weight-only
int8 ("W8A16") store.

**int4** — asymmetric, group-wise along the input axis (``GROUP_SIZE`` = 32
consecutive inputs share a step and an offset; the scheme of llama.cpp's Q4_1 and of
AWQ / GPTQ with a zero point): ``packed u8[out, in / 2]`` and
``scale f32[out, in / G, 2]`` holding (step d, offset m) per group; for the group g
holding input i,

    m = min_{i in g} w[o, i],   d = (max_{i in g} w[o, i] - m) / 15,
    q[o, i] = clip(round((w[o, i] - m) / d), 0, 15),   w ≈ q · d + m

(a constant group gets d = 1 and q = 0: exact). Both ends of the group are on the
grid, and every weight within half a step of it: error <= d / 2. The dequantization
is one multiply-add per weight (``q · d + m``), which the CPU kernel does in
registers, 16 lanes at a time (``cpu_kernels.matmul_i4``).

Why asymmetric rather than symmetric (Q4_0-like ``(q - 8) · s``, which costs the
kernel exactly the same multiply-add): measured on the demo model (the fixed text of
``benchmarks.quantization``, float32 perplexity 28.07), symmetric int4 with
``s = absmax / 7.5`` (GPTQ's symmetric grid) for every kernel gave perplexity 43.55
(+55 %), asymmetric 29.48 (+5.0 %), asymmetric with group 64 45.29. The demo model's
decoder weights are themselves Q4_1 (group 32, asymmetric) dequantized, so the
asymmetric grid finds them exactly and its whole cost there is the embedding's: this
measures the format on weights already on a 4-bit grid, not on a fresh float model.
The extra float per group makes it 6 bits per weight in all (float32 step and offset;
Q4_1 stores them as float16: 5).

**Which kernels.** With "int4" the decoder's linear kernels are int4 and the
embedding and the LM head are int8 (``method_for``): as llama.cpp's 4-bit files keep
``token_embd`` / ``output`` at 6-8 bits and GPTQ / AWQ checkpoints keep them in 16
bits. Measured: int4 everywhere gave the demo model +5.0 % perplexity, int8 for the
embedding (tied LM head) +0.3 % (28.14; ``benchmarks.quantization``, docs/model.md).

The packing is llama.cpp's Q4_0 / Q4_1 order: each run of 32 inputs is 16 bytes, byte j
holding input j in its low nibble and input j + 16 in its high one — so a 16-byte
load gives the CPU kernel two 16-lane vectors. The input dimension must be a multiple
of the group size (``check_model`` refuses other models at start-up).

For int8 a zero row gets scale 1 and q = 0, and the error is at most ``scale / 2``
per element (round to nearest).

**fp8** — e4m3 (OCP 8-bit floating point specification, OFP8 rev. 1.0, 2023: 4
exponent bits, 3 mantissa bits, no infinities, largest finite value ``FP8_MAX`` = 448),
symmetric, one scale per output channel: ``q f8e4m3[out, in]``, ``scale f32[out]``,

    scale[o] = max_i |w[o, i]| / 448,   q[o, i] = e4m3(w[o, i] / scale[o])

(round to nearest even, the ratio clipped to [-448, 448] since an out-of-range convert
is NaN; a zero row gets scale 1). With 3 mantissa bits, rounding a ratio in e4m3's
normal range (|w / scale| >= 2^-6) errs by at most half a unit in the last place, 2^-4
of its magnitude; below it the subnormals are spaced 2^-9, so the error is at most
max(|w| · 2^-4, 2^-10 · scale) per element. The activations
are quantized the same way at run time, one scale per token (row), by
``matmul_fp8``: ``x_scale[t] = max_i |x[t, i]| / 448``; the product is XLA's dot of
the two e4m3 operands (``preferred_element_type`` the activations' dtype: bfloat16
on a GPU), which XLA lowers on Hopper to cuBLASLt's fp8 GEMM (custom call
``__cublas$lt$matmul$f8``) or a Triton GEMM fusion over fp8 operands, then rescaled by
``x_scale[t] · scale[o]``. This is vLLM's ``fp8`` method for a float checkpoint
(``Fp8LinearMethod``: weights quantized at load with per-channel or per-tensor scales,
dynamic per-token activation scales). fp8 needs fp8 matrix units: a GPU of compute
capability 8.9 or higher (``check_platform``; elsewhere it is refused at start-up,
though the numerics run anywhere at the function level).

*Pre-quantized fp8 checkpoints*: a compressed-tensors fp8 directory (vLLM's ``*-FP8``
models; ``jaxserve.compressed_tensors``) stores each decoder kernel as e4m3 ``[out, in]``
with a scale per output channel or per tensor, the same symmetric absmax format; the
loader takes its bytes and scales as they are into this representation (a per-tensor
scale repeated on every row), never dequantizing. Its activations stay dynamic per token
here, even where the checkpoint carries static ``input_scale`` values (docs/model.md).

*Which kernels under fp8*: the decoder's linear kernels; the embedding and the LM head
stay in the model's float dtype (``method_for`` gives None), as vLLM's fp8 keeps
``lm_head`` and ``embed_tokens`` unquantized: the logits feed sampling directly, the
head is one GEMM among 4 · L + 1, and an e4m3 embedding row would be dequantized back
to the float dtype anyway (no fp8 product to gain).

**From a GGUF file's Q4_1 blocks.** A llama.cpp ``block_q4_1`` (ggml-common.h; the
``gguf`` package's ``gguf.quants.Q4_1``) is float16 d, float16 m and 16 bytes of 32
nibbles in the order above, w = q · d + m: int4's group, packing and formula, so
``int4_from_q4_1`` takes a Q4_1 tensor's bytes as the packed kernel and widens (d, m)
to the float32 scale, exactly (``dequantize`` then gives ``gguf.quants.dequantize``'s
values bit for bit). Q8_0 has no such mapping to int8: its float16 step is per block of
32 inputs, int8's per output channel.

Quantized at load time from the float checkpoint (``jaxserve.model.loader``):
every linear kernel of the decoder (the fused ``qkv_proj`` and
``gate_up_proj``, ``o_proj``, ``down_proj``), the LM head and the embedding
table (fp8: the decoder's kernels only). The embedding ``[V, D]`` is quantized as the tied LM head is (its rows are
the output channels), and a lookup dequantizes the gathered rows
(``embed_lookup``). In the parameter pytree a quantized kernel ``name`` keeps
its name (now int8 or packed uint8) and gains a sibling ``name + SCALE_SUFFIX``
(f32[out] or f32[out, in / G, 2], with a leading ``[L]`` for scanned layers); norms
and biases stay float.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

# The check of EngineConfig.quantization / LLM(quantization=...) / --quantization
# (jax-free, in jaxserve.config, for the engine and api processes).
from jaxserve.config import INT4_GROUP_SIZE as GROUP_SIZE, check_quantization as check_method
# A quantized kernel ``name``'s scale parameter is ``name + SCALE_SUFFIX``.
SCALE_SUFFIX = "_scale"
# The parameters quantized (their names in the parameter pytree).
QUANTIZED_PARAMS = ("qkv_proj", "o_proj", "gate_up_proj", "down_proj", "embed", "lm_head")
# The parameters "int4" keeps at int8 (module docstring, *Which kernels*).
INT4_INT8_PARAMS = ("embed", "lm_head")
_QMAX = 127
# The largest finite float8 e4m3 value (OCP OFP8 spec: S.1111.110 = 1.75 · 2^8), which is
# jnp.finfo(jnp.float8_e4m3fn).max.
FP8_MAX = 448.0
FP8_DTYPE = jnp.float8_e4m3fn
# fp8 matrix units (cuBLASLt's fp8 GEMM): NVIDIA compute capability 8.9 (Ada) and later.
FP8_MIN_COMPUTE_CAPABILITY = (8, 9)
# int4 values are packed in runs of this many inputs (16 bytes: low nibbles, high nibbles).
PACK = 32


def check_int4_shape(in_dim: int, group_size: int = GROUP_SIZE,
                     name: str = "a kernel's input dimension") -> None:
    """Raises ValueError (one line, naming ``--quantization int4`` and ``name``) unless
    ``in_dim`` is a multiple of ``group_size``, itself a power of two and a multiple
    of ``PACK`` (the CPU kernel's unit)."""
    if group_size < PACK or group_size & (group_size - 1):
        raise ValueError(f"int4 group size must be a power of two >= {PACK}, got {group_size}")
    if in_dim % group_size:
        raise ValueError(f"--quantization int4 needs every linear input dimension to be a "
                         f"multiple of its group size {group_size}; {name} is {in_dim}")


def check_model(config, quantization: str | None, tensor_parallel_size: int = 1) -> None:
    """Start-up check of a method against a model (``ModelConfig``): ``check_method``, and for
    int4 the input dimensions of its kernels — hidden_size (q/k/v, gate/up, the LM head;
    the embedding's rows), num_heads · head_dim (o_proj), intermediate_size (down_proj).

    Raises:
      ValueError: one line naming the flag and the offending value.
    """
    check_method(quantization, tensor_parallel_size=tensor_parallel_size)
    if quantization == "int4":
        for name, dim in (("hidden_size", config.hidden_size),
                          ("num_attention_heads * head_dim", config.num_heads * config.head_dim),
                          ("intermediate_size", config.intermediate_size)):
            check_int4_shape(dim, name=name)


def check_platform(quantization: str | None, platform: str,
                   compute_capability: str | None = None) -> None:
    """Start-up check of a method against the worker's platform ("cpu", "gpu", "tpu") and,
    on a GPU, its compute capability ("9.0"): fp8 needs fp8 matrix units, a GPU of compute
    capability >= ``FP8_MIN_COMPUTE_CAPABILITY``; every other method runs anywhere.

    Raises:
      ValueError: one line naming ``quantization`` and the reason.
    """
    if quantization != "fp8":
        return
    if platform != "gpu":
        raise ValueError(f"quantization='fp8' needs a GPU with fp8 matrix units (compute "
                         f"capability >= 8.9: Ada, Hopper or later); this worker's platform "
                         f"is {platform} (use int8 there)")
    if compute_capability is not None:
        major, minor = (int(part) for part in compute_capability.split(".")[:2])
        if (major, minor) < FP8_MIN_COMPUTE_CAPABILITY:
            raise ValueError(f"quantization='fp8' needs a GPU of compute capability >= 8.9 "
                             f"(Ada, Hopper or later) for fp8 matrix units; this one is "
                             f"{compute_capability} (use int8 there)")


def method_for(name: str, quantization: str) -> str | None:
    """The method parameter ``name`` (one of ``QUANTIZED_PARAMS``) gets under ``quantization``:
    int4 keeps ``INT4_INT8_PARAMS`` at int8; fp8 keeps them unquantized (None; module
    docstring, *Which kernels under fp8*)."""
    if name in INT4_INT8_PARAMS and quantization in ("int4", "fp8"):
        return "int8" if quantization == "int4" else None
    return quantization


def quantize(w: jax.Array, method: str = "int8", group_size: int = GROUP_SIZE
             ) -> tuple[jax.Array, jax.Array]:
    """w [..., out, in] (any float dtype) → the quantized kernel and its scale (float32 math).

    int8: (q i8[..., out, in], scale f32[..., out]). int4: (packed u8[..., out, in / 2],
    scale f32[..., out, in / group_size, 2] of (step, offset)). fp8: (q f8e4m3[..., out,
    in], scale f32[..., out]). Leading axes (a scanned model's ``[L]``) are kept.
    Formulas: the module docstring.

    Raises:
      ValueError: an unknown method, or (int4) ``in`` not a multiple of ``group_size``.
    """
    wf = w.astype(jnp.float32)
    if method in ("int8", "fp8"):
        return _absmax_quantize(wf, method)
    if method != "int4":
        raise ValueError(f"quantize: method must be 'int8', 'int4' or 'fp8', got {method!r}")
    check_int4_shape(w.shape[-1], group_size)
    groups = wf.reshape(*w.shape[:-1], w.shape[-1] // group_size, group_size)
    low, high = jnp.min(groups, axis=-1), jnp.max(groups, axis=-1)  # [..., out, in / G]
    step = jnp.where(high > low, (high - low) / 15, 1.0)
    q = jnp.clip(jnp.round((groups - low[..., None]) / step[..., None]), 0, 15)
    return _pack(q.reshape(w.shape).astype(jnp.uint8)), jnp.stack([step, low], axis=-1)


def _absmax_quantize(x: jax.Array, method: str) -> tuple[jax.Array, jax.Array]:
    """f32[..., n] → (int8 or e4m3 values [..., n], scale f32[...]): one symmetric scale per
    row, ``max |x| / qmax`` (1 for a zero row); int8 rounds to an integer, fp8 to the
    nearest e4m3 value (XLA's convert: round to nearest even)."""
    qmax = _QMAX if method == "int8" else FP8_MAX
    absmax = jnp.max(jnp.abs(x), axis=-1)  # [...]
    scale = jnp.where(absmax > 0, absmax / qmax, 1.0).astype(jnp.float32)
    ratio = jnp.clip(x / scale[..., None], -qmax, qmax)  # an out-of-range e4m3 convert is NaN
    if method == "int8":
        return jnp.round(ratio).astype(jnp.int8), scale
    return ratio.astype(FP8_DTYPE), scale


def matmul_fp8(x: jax.Array, q: jax.Array, scale: jax.Array) -> jax.Array:
    """x [..., in] (float) times an fp8 kernel (q f8e4m3[out, in], scale f32[out]) → [..., out]
    of x's dtype, W8A8 (module docstring, **fp8**).

    Each row (token) of x is quantized to e4m3 with its own scale ``max |x[t]| / 448``,
    the two e4m3 operands go to one ``dot_general`` with ``preferred_element_type``
    x's dtype (on Hopper, cuBLASLt's fp8 GEMM or a Triton fp8 GEMM fusion; on a CPU XLA
    widens the operands, exactly), and the result is rescaled in float32 by
    ``x_scale[t] · scale[o]``.
    """
    xq, x_scale = _absmax_quantize(x.astype(jnp.float32), "fp8")  # [..., in] e4m3, f32[...]
    out = jax.lax.dot_general(xq, q, (((x.ndim - 1,), (1,)), ((), ())),
                              preferred_element_type=x.dtype)  # [..., out]
    return (out.astype(jnp.float32) * x_scale[..., None] * scale).astype(x.dtype)


def _pack(q: jax.Array) -> jax.Array:
    """int4 values u8[..., in] in [0, 15] → u8[..., in / 2] (``PACK``-runs, low nibbles first)."""
    runs = q.reshape(*q.shape[:-1], q.shape[-1] // PACK, 2, PACK // 2)
    return (runs[..., 0, :] | (runs[..., 1, :] << 4)).reshape(*q.shape[:-1], q.shape[-1] // 2)


def unpack_int4(packed: jax.Array) -> jax.Array:
    """u8[..., in / 2] → the int4 values u8[..., in] in [0, 15] (``_pack``'s inverse)."""
    runs = packed.reshape(*packed.shape[:-1], packed.shape[-1] * 2 // PACK, PACK // 2)
    nib = jnp.stack([runs & 15, runs >> 4], axis=-2)  # [..., in / 32, 2, 16]
    return nib.reshape(*packed.shape[:-1], packed.shape[-1] * 2)


# Bytes of one llama.cpp block_q4_1: float16 d, float16 m, PACK / 2 bytes of nibbles.
Q4_1_BLOCK_BYTES = 4 + PACK // 2


def int4_from_q4_1(blocks: jax.Array) -> tuple[jax.Array, jax.Array]:
    """A Q4_1 tensor's rows → the int4 kernel and its scale, exactly (module docstring).

    ``blocks`` u8[..., out, in / 32 · 20]: each row's ``block_q4_1`` structs in input
    order, as a GGUF file stores a Q4_1 tensor ``[ne1 = out, ne0 = in]``. Returns
    (packed u8[..., out, in / 2], scale f32[..., out, in / 32, 2] of (d, m)), ``quantize``'s
    int4 format at ``GROUP_SIZE`` 32 (a block's 32 inputs are one group).

    Raises:
      ValueError: a last axis that is not a whole number of 20-byte blocks.
    """
    assert GROUP_SIZE == PACK, "a Q4_1 block is one int4 group"
    if blocks.dtype != jnp.uint8 or blocks.shape[-1] % Q4_1_BLOCK_BYTES:
        raise ValueError(f"Q4_1 rows must be uint8 whole {Q4_1_BLOCK_BYTES}-byte blocks, got "
                         f"{blocks.dtype}{list(blocks.shape)}")
    rows = blocks.shape[:-1]
    structs = blocks.reshape(*rows, -1, Q4_1_BLOCK_BYTES)  # [..., out, in / 32, 20]
    d_m = jax.lax.bitcast_convert_type(structs[..., :4].reshape(*structs.shape[:-1], 2, 2),
                                       jnp.float16)  # [..., out, in / 32, 2] (little-endian)
    packed = structs[..., 4:].reshape(*rows, -1)  # [..., out, in / 2]
    return packed, d_m.astype(jnp.float32)


# A quantized kernel's dtype → its method.
_METHOD_BY_DTYPE = {jnp.dtype(jnp.int8): "int8", jnp.dtype(jnp.uint8): "int4",
                    jnp.dtype(FP8_DTYPE): "fp8"}


def method_of(q: jax.Array) -> str:
    """The method of a quantized kernel, from its dtype: "int8" (int8), "int4" (uint8) or
    "fp8" (float8_e4m3fn).

    Raises:
      ValueError: any other dtype.
    """
    method = _METHOD_BY_DTYPE.get(jnp.dtype(q.dtype))
    if method is None:
        raise ValueError(f"not a quantized kernel: dtype {q.dtype}")
    return method


def params_method(params) -> str | None:
    """The quantization method of a parameter pytree (None: no quantized kernel in it)."""
    methods = {_METHOD_BY_DTYPE.get(jnp.dtype(x.dtype)) for x in jax.tree.leaves(params)}
    for method in ("int4", "fp8", "int8"):  # int4's embedding is int8
        if method in methods:
            return method
    return None


def dequantize(q: jax.Array, scale: jax.Array, dtype: jnp.dtype = jnp.float32) -> jax.Array:
    """A quantized kernel and its scale (``quantize``'s outputs, any method) → the float
    kernel [..., out, in] of ``dtype``: q · scale (int4: q · step + offset of its group)."""
    if method_of(q) in ("int8", "fp8"):
        return (q.astype(jnp.float32) * scale[..., None]).astype(dtype)
    values = unpack_int4(q).astype(jnp.float32)  # [..., out, in]
    groups = values.reshape(*scale.shape[:-1], -1)  # [..., out, in / G, G]
    groups = groups * scale[..., 0:1] + scale[..., 1:2]
    return groups.reshape(values.shape).astype(dtype)


def embed_lookup(q: jax.Array, scale: jax.Array, ids: jax.Array, dtype: jnp.dtype) -> jax.Array:
    """Rows ``ids`` (i32[T]) of a quantized embedding (``quantize`` of [V, D], either method)
    → [T, D] of ``dtype``: the gathered rows dequantized (the table never is)."""
    return dequantize(jnp.take(q, ids, axis=0), jnp.take(scale, ids, axis=0), dtype)


def quantize_params(params: dict, quantization: str | None) -> dict:
    """A float model's pure-dict parameters → the quantized model's (a new dict).

    Every ``QUANTIZED_PARAMS`` array that ``method_for`` quantizes is replaced by its
    quantized values and a ``+ SCALE_SUFFIX`` sibling is added; everything else is kept. For random
    models and tests; the loader quantizes tensor by tensor as it reads them.
    ``quantization`` None returns ``params`` unchanged.

    Raises:
      ValueError: an unsupported method (``check_method``), or an int4 kernel whose
        input dimension is not a multiple of ``GROUP_SIZE``.
    """
    check_method(quantization)
    if quantization is None:
        return params
    out = {}
    for key, value in params.items():
        if isinstance(value, dict):
            out[key] = quantize_params(value, quantization)
        elif (key in QUANTIZED_PARAMS and value is not None
              and method_for(key, quantization) is not None):
            out[key], out[key + SCALE_SUFFIX] = quantize(value, method_for(key, quantization))
        else:
            out[key] = value
    return out
