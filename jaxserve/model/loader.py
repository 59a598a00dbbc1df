"""Loads a Hugging Face model directory into the NNX model, tensor by tensor.

The model is first built abstractly (``nnx.eval_shape``: shapes only, no
memory), then every parameter is filled from safetensors through a
declarative table (``_hf_sources``): parameter path → Hugging Face tensor
names + how to combine them. Tensors are read one at a time (memory-mapped
by safetensors), combined and cast on the device — or, with a
tensor-parallel ``mesh``, on the host (JAX's CPU device) and then placed
straight into its sharding, each device receiving only its slice
(``jaxserve.model.sharding``): no device ever holds a full copy of a split
parameter, and the host holds one parameter at a time. With ``scan_layers`` each stacked ``[L, ...]`` parameter
is filled layer by layer into one array (a transient second copy of that one
parameter, never of the model).

With ``quantization`` "int8" or "int4" every linear kernel, the embedding and the LM
head are quantized as they are read (``jaxserve.model.quantization``: int8 plus
a float32 scale per output channel, or packed int4 plus a float32 scale per group
of 32 inputs, computed from the float32 tensor); with "fp8" the decoder's linear
kernels, as float8 e4m3 plus a float32 scale per output channel. So the full float model is never
in memory either. A compressed-tensors fp8 checkpoint (``jaxserve.compressed_tensors``:
vLLM's pre-quantized ``*-FP8`` models) loads as "fp8" whether or not it is asked for: its
kernels' e4m3 bytes and scales are taken as stored (a per-tensor scale repeated on every
row), fused by the same table, never dequantized. A directory that names the GGUF file it
was converted from (``jaxserve.model.gguf_source``: the demo model does) gets its int4 kernels whose
GGUF tensors are Q4_1 from that file's blocks instead, exactly as stored
(``quantization.int4_from_q4_1``), fused and row-ordered by the same table.

A model directory may instead hold a parameter checkpoint that
``save_model_checkpoint`` wrote (``jaxserve.model.checkpoint``: Orbax, the
converted parameters of one dtype, layer layout and tensor-parallel size);
``load_model`` then restores it straight into the parameters' shardings, no
conversion (``load_format``: "auto" takes the checkpoint when there is one).
"""

from __future__ import annotations

import json
import dataclasses
import logging
import os
import pathlib
import time
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxserve import compressed_tensors
from jaxserve.config import ModelConfig
from jaxserve.model import checkpoint, gguf_source, quantization as quant, sharding
from jaxserve.model.graph import StaticGraph
from jaxserve.model.llama import CausalLM

logger = logging.getLogger(__name__)

DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16, "float16": jnp.float16}
LOAD_FORMATS = ("auto", "safetensors", "orbax")
# What a checkpoint directory keeps of the Hugging Face directory besides the weights.
_NOT_COPIED = ("*.safetensors", "model.safetensors.index.json", gguf_source.GGUF_SOURCE_FILE)


def served_dtype(dtype: str, platform: str) -> str:
    """The dtype name a worker on ``platform`` ("cpu", "gpu", "tpu") serves for ``dtype``.

    "auto" (vLLM's default) is float32 on a CPU (bfloat16 measured several
    times slower there) and bfloat16 on a GPU or TPU: vLLM's auto keeps a
    bfloat16 checkpoint's dtype and halves a float32 one, and float16 is not
    served (the Pallas kernel takes float32 and bfloat16), so every
    checkpoint is served in bfloat16. Any other name is returned as given.
    """
    if dtype != "auto":
        return dtype
    return "float32" if platform == "cpu" else "bfloat16"


def resolve_dtype(dtype: str | jnp.dtype) -> jnp.dtype:
    """'float32' / 'bfloat16' / 'float16' or a jnp dtype → jnp dtype.

    Raises:
      ValueError: an unsupported dtype name.
    """
    if isinstance(dtype, str):
        if dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {sorted(DTYPES)}, got {dtype!r}")
        return DTYPES[dtype]
    return jnp.dtype(dtype)


def _ident(x: jax.Array) -> jax.Array:
    return x


@dataclasses.dataclass(frozen=True)
class _FusedLayout:
    """How the fused projections' columns are laid out for a TP group (``sharding``).

    Attributes:
      config: the checkpoint's architecture.
      num_kv_heads: the built model's KV heads (more than the checkpoint's
        when TP > K: replicated).
      num_shards: TP.
    """

    config: ModelConfig
    num_kv_heads: int
    num_shards: int

    def _fuse(self, parts: list[jax.Array], sizes: tuple[int, ...]) -> jax.Array:
        """HF [out, in] weights (or [out] biases) → one [Σ out, in] (or [Σ out]), grouped."""
        fused = jnp.concatenate(parts, axis=0)
        if self.num_shards == 1:
            return fused
        return fused[sharding.fused_output_order(sizes, self.num_shards)]

    def _kv_heads(self, x: jax.Array) -> jax.Array:
        """A k or v projection's [K·H, ...] rows → the built model's [K'·H, ...]."""
        k, h = self.config.num_kv_heads, self.config.head_dim
        if self.num_kv_heads == k:
            return x
        sources = sharding.kv_head_sources(self.config, self.num_kv_heads)
        return x.reshape(k, h, *x.shape[1:])[jnp.array(sources)].reshape(-1, *x.shape[1:])

    def qkv(self, q: jax.Array, k: jax.Array, v: jax.Array) -> jax.Array:
        h = self.config.head_dim
        sizes = (self.config.num_heads * h, self.num_kv_heads * h, self.num_kv_heads * h)
        return self._fuse([q, self._kv_heads(k), self._kv_heads(v)], sizes)

    def gate_up(self, gate: jax.Array, up: jax.Array) -> jax.Array:
        f = self.config.intermediate_size
        return self._fuse([gate, up], (f, f))


def _hf_sources(path: tuple, layout: _FusedLayout) -> tuple[list[str], Callable[..., jax.Array]]:
    """Hugging Face tensor names and combiner for one parameter path of CausalLM."""
    if path == ("embed",):
        return ["model.embed_tokens.weight"], _ident
    if path == ("norm", "weight"):
        return ["model.norm.weight"], _ident
    if path == ("lm_head",):
        return ["lm_head.weight"], _ident
    _, i, *rest = path
    pre = f"model.layers.{i}."
    table = {
        ("input_norm", "weight"): ([pre + "input_layernorm.weight"], _ident),
        ("post_attn_norm", "weight"): ([pre + "post_attention_layernorm.weight"], _ident),
        ("attn", "qkv_proj"): ([pre + f"self_attn.{p}_proj.weight" for p in "qkv"], layout.qkv),
        ("attn", "qkv_bias"): ([pre + f"self_attn.{p}_proj.bias" for p in "qkv"], layout.qkv),
        ("attn", "o_proj"): ([pre + "self_attn.o_proj.weight"], _ident),
        ("attn", "q_norm", "weight"): ([pre + "self_attn.q_norm.weight"], _ident),
        ("attn", "k_norm", "weight"): ([pre + "self_attn.k_norm.weight"], _ident),
        ("mlp", "gate_up_proj"): ([pre + f"mlp.{p}_proj.weight" for p in ("gate", "up")],
                                  layout.gate_up),
        ("mlp", "down_proj"): ([pre + "mlp.down_proj.weight"], _ident),
    }
    return table[tuple(rest)]


class _SafetensorsIndex:
    """Tensor name → file, over a single file or a sharded index.

    safetensors' flax reader converts through numpy, which has no float8 type, so an
    F8_E4M3 tensor (a compressed-tensors fp8 checkpoint's kernels) is read from the
    file's bytes by ``_float8``.
    """

    def __init__(self, model_dir: pathlib.Path):
        from safetensors import safe_open

        index = model_dir / "model.safetensors.index.json"
        if index.exists():
            weight_map = json.loads(index.read_text())["weight_map"]
            files = sorted(set(weight_map.values()))
        else:
            files = [p.name for p in sorted(model_dir.glob("*.safetensors"))]
            if not files:
                raise FileNotFoundError(f"no *.safetensors files in {model_dir}")
            weight_map = None
        self._dir = model_dir
        self._headers: dict[str, tuple[int, dict]] = {}  # file → (data offset, header)
        self._handles = {f: safe_open(os.fspath(model_dir / f), framework="flax") for f in files}
        if weight_map is None:
            weight_map = {k: f for f, h in self._handles.items() for k in h.keys()}
        self.weight_map = weight_map

    def get(self, name: str) -> jax.Array:
        if name not in self.weight_map:
            raise KeyError(f"tensor {name!r} is missing from the checkpoint")
        handle = self._handles[self.weight_map[name]]
        if handle.get_slice(name).get_dtype() == _F8_E4M3:
            return jnp.asarray(self._float8(name))
        return handle.get_tensor(name)

    def _float8(self, name: str) -> np.ndarray:
        """An F8_E4M3 tensor as float8_e4m3fn (ml_dtypes) values, from the file's bytes.

        The safetensors layout (its specification, huggingface/safetensors README): a
        little-endian u64 header length, a JSON header giving each tensor's dtype, shape
        and ``data_offsets`` [begin, end) into the data that follows the header.
        """
        file = self.weight_map[name]
        with open(self._dir / file, "rb") as f:
            if file not in self._headers:
                header_len = int.from_bytes(f.read(8), "little")
                self._headers[file] = (8 + header_len, json.loads(f.read(header_len)))
            data_start, header = self._headers[file]
            begin, end = header[name]["data_offsets"]
            f.seek(data_start + begin)
            data = f.read(end - begin)
        return np.frombuffer(data, quant.FP8_DTYPE).reshape(header[name]["shape"])


# The safetensors dtype code of float8 e4m3 (``jnp.float8_e4m3fn``).
_F8_E4M3 = "F8_E4M3"


# Where a checkpoint may store layer i's calibrated fp8 KV cache scales (one value each):
# llm-compressor's names (a compressed-tensors ``kv_cache_scheme``), and the output
# scales of k_proj / v_proj that some writers store instead — the names vLLM loads.
KV_SCALE_NAMES = {
    "k_scale": ("model.layers.{i}.self_attn.k_scale", "model.layers.{i}.self_attn.k_proj.output_scale"),
    "v_scale": ("model.layers.{i}.self_attn.v_scale", "model.layers.{i}.self_attn.v_proj.output_scale"),
}


def kv_cache_scales(model_dir: str | os.PathLike | None,
                    num_layers: int) -> tuple[np.ndarray, np.ndarray] | None:
    """A checkpoint's calibrated per-layer fp8 KV cache scales, (k_scale, v_scale) f32[L], or
    None when it stores none (the cache then takes 1.0, as vLLM's).

    Read from the safetensors files under the names of ``KV_SCALE_NAMES``; a stored key is
    key / k_scale (``jaxserve.model.kv_cache``). None for the demo model (``model_dir``
    None) and for a directory without safetensors files (an orbax parameter checkpoint).

    Raises:
      ValueError: some layers have a scale and others not (the first missing name), or a
        scale is not one positive finite value.
    """
    if model_dir is None or not any(pathlib.Path(model_dir).glob("*.safetensors")):
        return None
    index = _SafetensorsIndex(pathlib.Path(model_dir))
    found = {kind: [next((n.format(i=i) for n in names if n.format(i=i) in index.weight_map),
                         None) for i in range(num_layers)]
             for kind, names in KV_SCALE_NAMES.items()}
    if all(name is None for names in found.values() for name in names):
        return None
    scales = []
    for kind, names in found.items():
        if None in names:
            missing = KV_SCALE_NAMES[kind][0].format(i=names.index(None))
            raise ValueError(f"{model_dir}: the checkpoint stores fp8 KV cache scales for some "
                             f"layers but not {missing!r}")
        values = np.array([np.asarray(index.get(n), np.float32).reshape(-1) for n in names])
        if values.shape != (num_layers, 1) or not (np.isfinite(values) & (values > 0)).all():
            raise ValueError(f"{model_dir}: fp8 KV cache {kind} must be one positive finite "
                             f"value per layer, got {values.reshape(num_layers, -1).tolist()}")
        scales.append(values[:, 0])
    return scales[0], scales[1]


def abstract_model(config: ModelConfig, dtype: jnp.dtype, scan_layers: bool = False,
                   mesh=None, quantization: str | None = None) -> tuple[StaticGraph, dict]:
    """(graph, parameters as a pure dict of ShapeDtypeStructs) of CausalLM, allocating nothing.

    With a tensor-parallel ``mesh``, ``config`` is the TP group's
    (``ModelConfig.for_tensor_parallel``) and every spec carries its sharding.
    """
    graphdef, state = nnx.split(nnx.eval_shape(
        lambda: CausalLM(config, dtype, nnx.Rngs(0), scan_layers=scan_layers, mesh=mesh,
                         quantization=quantization)))
    params = nnx.to_pure_dict(state)
    if mesh is not None:
        params = jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s),
                              params, sharding.param_shardings(params, mesh, config.vocab_size))
    return StaticGraph(graphdef), params


def is_scanned(params: dict) -> bool:
    """Whether ``params`` (a pure dict) is of a model built with ``scan_layers``."""
    return 0 not in params["layers"]


def _read_param(index: "_SafetensorsIndex", param_path: tuple, dtype: jnp.dtype,
                layout: _FusedLayout, scanned: bool) -> tuple[jax.Array, list[str]]:
    """One parameter from the checkpoint (stacked over the layers when scanned)."""
    if scanned and param_path[0] == "layers":
        parts = [_read_param(index, ("layers", i, *param_path[1:]), dtype, layout, False)
                 for i in range(layout.config.num_layers)]
        return jnp.stack([v for v, _ in parts]), [n for _, names in parts for n in names]
    names, combine = _hf_sources(param_path, layout)
    return combine(*(index.get(n).astype(jnp.float32) for n in names)).astype(dtype), names


def _read_stored(read_one: Callable[[str], tuple[jax.Array, jax.Array] | None],
                 param_path: tuple, layout: _FusedLayout, scanned: bool
                 ) -> tuple[jax.Array, jax.Array, list[str]] | None:
    """One quantized kernel and its scale as the checkpoint stores them (stacked over the
    layers when scanned), or None when ``read_one`` has none for any of its tensors.

    ``read_one(hf_name)`` gives one Hugging Face kernel's (values [out, ...], scale
    [out, ...]); the fused kernels' parts are combined by ``_hf_sources``' table, values
    and scales alike (row operations: a row keeps its scale).
    """
    if scanned and param_path[0] == "layers":
        parts = [_read_stored(read_one, ("layers", i, *param_path[1:]), layout, False)
                 for i in range(layout.config.num_layers)]
        if any(part is None for part in parts):
            return None
        values, scales, names = zip(*parts)
        return jnp.stack(values), jnp.stack(scales), [n for layer in names for n in layer]
    names, combine = _hf_sources(param_path, layout)
    parts = [read_one(n) for n in names]
    if any(part is None for part in parts):
        return None
    values, scales = zip(*parts)
    return combine(*values), combine(*scales), names


def _q4_1_reader(source: gguf_source.GgufSource) -> Callable[[str], tuple | None]:
    """``_read_stored``'s reader of the GGUF source's Q4_1 blocks (None: not Q4_1 there)."""
    def read_one(name: str) -> tuple[jax.Array, jax.Array] | None:
        rows = source.q4_1_rows(name)
        return None if rows is None else quant.int4_from_q4_1(jnp.asarray(rows))
    return read_one


def _fp8_reader(index: _SafetensorsIndex) -> Callable[[str], tuple[jax.Array, jax.Array]]:
    """``_read_stored``'s reader of a compressed-tensors fp8 checkpoint (``jaxserve.
    compressed_tensors``): ``<name>`` F8_E4M3 [out, in] as it is stored, and
    ``<name>_scale`` ([out, 1] per channel, or one value per tensor, broadcast to every row)
    widened to f32[out] — exactly, from float32, bfloat16 or float16.

    Raises:
      ValueError: a kernel stored in another dtype (a layer the checkpoint's ``ignore``
        kept float), or a scale that is neither one value nor one per row.
    """
    def read_one(name: str) -> tuple[jax.Array, jax.Array]:
        q = index.get(name)
        if q.dtype != quant.FP8_DTYPE:
            raise ValueError(f"{name} is {q.dtype} in a compressed-tensors fp8 checkpoint; "
                             f"jaxserve serves every decoder linear layer in fp8 (is it in "
                             f"the checkpoint's quantization_config.ignore?)")
        scale = index.get(name + compressed_tensors.SCALE_SUFFIX).astype(jnp.float32)
        out = q.shape[0]
        if scale.size == 1:
            return q, jnp.broadcast_to(scale.reshape(()), (out,))
        if scale.shape not in ((out,), (out, 1)):
            raise ValueError(f"{name}{compressed_tensors.SCALE_SUFFIX}: shape "
                             f"{tuple(scale.shape)}, expected ({out}, 1) (channel) or one "
                             f"value (tensor)")
        return q, scale.reshape(out)
    return read_one


def load_model(model_dir: str | os.PathLike | None = None, dtype: str | jnp.dtype = "float32",
               scan_layers: bool = False, mesh=None, load_format: str = "auto",
               quantization: str | None = None) -> tuple[ModelConfig, StaticGraph, dict]:
    """Loads a Hugging Face Llama-family directory.

    Args:
      model_dir: a directory with config.json and *.safetensors; None = the
        demo model (built on first use, see ``jaxserve download-demo``).
      dtype: parameter dtype, "float32" (CPU default) or "bfloat16".
      scan_layers: build the scanned model (stacked layers, see
        ``jaxserve.model.llama``); its KV cache must be stacked too.
      mesh: a tensor-parallel mesh (``sharding.make_mesh``): the model is built
        for it and every parameter placed in its sharding; None: one device.
      load_format: "safetensors" (convert the Hugging Face weights), "orbax"
        (restore the directory's parameter checkpoint) or "auto" (the
        checkpoint when the directory has one, else safetensors).
      quantization: None, "int8", "int4" or "fp8": weight-only int8 / group-wise int4
        / e4m3 weights (with per-token e4m3 activations) quantized at load time; a
        compressed-tensors fp8 directory loads as "fp8" with None or "fp8", its stored
        kernels and scales taken as they are (``compressed_tensors.resolve_quantization``)
        (``jaxserve.model.quantization``; int4 needs the kernels' input dimensions to be
        multiples of 32 and no mesh; fp8 loads on any platform, the worker refuses to
        serve it without fp8 matrix units), int4 kernels
        stored as Q4_1 in the directory's GGUF source taken from its blocks
        (``gguf_source``); a parameter checkpoint must have been saved with the same
        method.

    Returns:
      (config, graph, params): ``graph.merge(params)`` is the model; ``params``
      is a pure (nested dict) pytree of arrays, cheap to flatten per call.
      ``config`` is the model as built: with a mesh and TP > K, its
      ``num_kv_heads`` is TP (replicated KV heads).

    Raises:
      NotImplementedError: unsupported architecture (lists the supported ones).
      FileNotFoundError / KeyError: missing files or tensors.
      ValueError: a tensor whose shape does not match the config, a mesh the
        model's heads do not split over (``ModelConfig.for_tensor_parallel``),
        an unknown ``load_format`` or ``quantization``, a ``quantization_config`` jaxserve
        does not load or another method for a pre-quantized directory
        (``compressed_tensors``), a compressed-tensors kernel not stored in fp8, or a checkpoint of
        another dtype, layer layout, tensor-parallel size or quantization (the
        message names the field).
    """
    quant.check_method(quantization)
    if model_dir is None:
        from jaxserve.demo_model import ensure_demo_model

        path = ensure_demo_model()
    else:
        path = pathlib.Path(model_dir)
        if not (path / "config.json").is_file():
            raise FileNotFoundError(f"{path} is not a Hugging Face model directory (no config.json)")
    if load_format not in LOAD_FORMATS:
        raise ValueError(f"load_format must be one of {LOAD_FORMATS}, got {load_format!r}")
    dtype = resolve_dtype(dtype)
    checkpoint_config = ModelConfig.from_pretrained(path)
    tp = sharding.mesh_size(mesh)
    stored = compressed_tensors.checkpoint_quantization(path)
    quantization = compressed_tensors.resolve_quantization(path, quantization, tp)
    quant.check_model(checkpoint_config, quantization, tp)
    config = checkpoint_config.for_tensor_parallel(tp)
    has_checkpoint = (path / checkpoint.METADATA_FILE).is_file()
    if load_format == "orbax" or (load_format == "auto" and has_checkpoint):
        return _restore(path, config, dtype, scan_layers, mesh, quantization)
    if has_checkpoint and not any(path.glob("*.safetensors")):
        raise FileNotFoundError(f"{path} holds a jaxserve parameter checkpoint and no "
                                f"*.safetensors: load it with load_format 'auto' or 'orbax' "
                                f"(--load-format)")
    layout = _FusedLayout(checkpoint_config, config.num_kv_heads, tp)
    start = time.perf_counter()
    graphdef, state = nnx.split(nnx.eval_shape(
        lambda: CausalLM(config, dtype, nnx.Rngs(0), scan_layers=scan_layers, mesh=mesh,
                         quantization=quantization)))
    shardings = (None if mesh is None else
                 sharding.param_shardings(nnx.to_pure_dict(state), mesh, config.vocab_size))
    index = _SafetensorsIndex(path)
    # With a mesh, tensors are combined on the host (JAX's CPU device), then each
    # device receives its slice; without, on the default device.
    host = None if mesh is None else jax.local_devices(backend="cpu")[0]
    source = gguf_source.open_gguf_source(path) if quantization == "int4" else None
    # the kernels a checkpoint stores quantized, taken as they are (method → reader)
    stored_readers = {"int4": None if source is None else _q4_1_reader(source),
                      "fp8": _fp8_reader(index) if stored == "fp8" else None}
    abstracts = dict(nnx.to_flat_state(state))
    filled, from_gguf = {}, 0
    for param_path, abstract in abstracts.items():
        name = param_path[-1]
        if isinstance(name, str) and name.endswith(quant.SCALE_SUFFIX):
            continue  # filled with its kernel
        method = (quant.method_for(name, quantization)
                  if quantization is not None and name in quant.QUANTIZED_PARAMS else None)
        quantized = method is not None
        scale_path = (*param_path[:-1], f"{name}{quant.SCALE_SUFFIX}")
        with jax.default_device(host):
            read_one = stored_readers.get(method)
            direct = (None if read_one is None else
                      _read_stored(read_one, param_path, layout, scan_layers))
            if direct is not None:  # as the checkpoint (or the GGUF file) stores it
                kernel, scale, names = direct
                values = {param_path: kernel, scale_path: scale}
                from_gguf += method == "int4"
            else:
                value, names = _read_param(index, param_path,
                                           jnp.float32 if quantized else dtype, layout,
                                           scan_layers)
                values = {param_path: value}
                if quantized:  # from the float32 tensor: the quantized kernel + its scale
                    values[param_path], values[scale_path] = quant.quantize(value, method)
        for filled_path, value in values.items():
            expected = abstracts[filled_path]
            if value.shape != expected.shape:
                raise ValueError(
                    f"{'.'.join(map(str, filled_path))} from {names}: shape {value.shape}, "
                    f"expected {expected.shape}")
            target = None if shardings is None else _at_path(shardings, filled_path)
            filled[filled_path] = sharding.place(value, target)
    state = nnx.from_flat_state([(p, v.replace(filled[p])) for p, v in nnx.to_flat_state(state)])
    params = nnx.to_pure_dict(state)
    if source is not None:
        logger.info("%d int4 kernels taken from the Q4_1 blocks of %s", from_gguf, source.path)
    logger.info("loaded %s (%s, %d layers, TP=%d) in %.1f s", path, config.architecture,
                config.num_layers, tp, time.perf_counter() - start)
    return config, StaticGraph(graphdef), params


# The kernels' layout (``llama.linear``); a checkpoint converted with another is refused.
KERNEL_LAYOUT = "out_in"


def _layout(mesh, quantization: str | None = None) -> dict:
    """What a checkpoint's parameters depend on besides config, dtype and scan_layers.

    ``quantization`` is recorded only when set, so checkpoints saved before it
    existed (float) still match an unquantized restore.
    """
    layout = {"tensor_parallel_size": sharding.mesh_size(mesh), "kernels": KERNEL_LAYOUT}
    if quantization is not None:
        layout["quantization"] = quantization
    return layout


def _restore(path: pathlib.Path, config: ModelConfig, dtype: jnp.dtype, scan_layers: bool,
             mesh, quantization: str | None = None) -> tuple[ModelConfig, StaticGraph, dict]:
    """The directory's parameter checkpoint, restored into the mesh (or onto the default device)."""
    start = time.perf_counter()
    meta = checkpoint.read_metadata(path)
    try:
        checkpoint.check_metadata(meta, config=config, dtype=jnp.dtype(dtype).name,
                                  scan_layers=scan_layers, layout=_layout(mesh, quantization))
    except ValueError as err:
        saved = meta.get("layout") or {}
        raise ValueError(
            f"{err}: {path} holds parameters converted for "
            f"tensor_parallel_size={saved.get('tensor_parallel_size')}, "
            f"dtype={meta.get('dtype')}, scan_layers={meta.get('scan_layers')}, "
            f"quantization={saved.get('quantization')}; serve it with "
            f"those (-tp, --dtype, --scan-layers, --quantization) or convert the model again "
            f"with `jaxserve save-checkpoint`") from None
    graph, target = abstract_model(config, dtype, scan_layers, mesh, quantization)
    if mesh is None:
        one = jax.sharding.SingleDeviceSharding(jax.devices()[0])
        target = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=one),
                              target)
    params = checkpoint.restore_params(path, target)
    logger.info("restored the parameter checkpoint in %s (%s, %d layers, TP=%d) in %.1f s",
                path, config.architecture, config.num_layers, sharding.mesh_size(mesh),
                time.perf_counter() - start)
    return config, graph, params


def save_model_checkpoint(model_dir: str | os.PathLike | None, output_dir: str | os.PathLike,
                          dtype: str = "float32", scan_layers: bool = False, mesh=None,
                          force: bool = False, quantization: str | None = None) -> pathlib.Path:
    """Converts a Hugging Face directory once and saves it as a servable checkpoint directory.

    ``output_dir`` receives the parameter checkpoint (``jaxserve.model.checkpoint``)
    of ``load_model(model_dir, dtype, scan_layers, mesh)`` plus every file of
    ``model_dir`` but the safetensors weights (config, tokenizer, generation
    config), so ``load_model(output_dir, ...)`` / ``jaxserve serve --model
    output_dir`` restore it — with the same dtype, ``scan_layers``,
    tensor-parallel size and ``quantization`` (int8 / int4 parameters are saved
    quantized), which the checkpoint records and the restore checks.

    Returns:
      ``output_dir`` as a path.

    Raises:
      as ``load_model`` and ``checkpoint.save_params`` (an existing checkpoint
      without ``force``: FileExistsError).
    """
    import shutil

    if model_dir is None:
        from jaxserve.demo_model import ensure_demo_model

        model_dir = ensure_demo_model()
    model_dir, output_dir = pathlib.Path(model_dir), pathlib.Path(output_dir)
    checkpoint.check_destination(output_dir, force)  # before the conversion, not after
    # a pre-quantized directory's method, recorded with its parameters
    quantization = compressed_tensors.resolve_quantization(model_dir, quantization,
                                                           sharding.mesh_size(mesh))
    config, _, params = load_model(model_dir, dtype, scan_layers, mesh, load_format="safetensors",
                                   quantization=quantization)
    checkpoint.save_params(output_dir, params, config=config,
                           dtype=jnp.dtype(resolve_dtype(dtype)).name, scan_layers=scan_layers,
                           layout=_layout(mesh, quantization), force=force)
    for item in sorted(model_dir.iterdir()):
        if item.is_file() and not any(item.match(p) for p in _NOT_COPIED):
            shutil.copy2(item, output_dir / item.name)
    return output_dir


def _at_path(tree: dict, path: tuple):
    for key in path:
        tree = tree[key]
    return tree


def param_bytes(params) -> int:
    """Total bytes of all parameter arrays in ``params``."""
    return sum(int(np.prod(x.shape)) * x.dtype.itemsize for x in jax.tree.leaves(params))
