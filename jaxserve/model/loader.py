"""Loads a Hugging Face model directory into the NNX model, tensor by tensor.

The model is first built abstractly (``nnx.eval_shape``: shapes only, no
memory), then every parameter is filled from safetensors through a
declarative table (``_hf_sources``): parameter path → Hugging Face tensor
names + how to combine them. Tensors are read one at a time (memory-mapped
by safetensors), cast to the target dtype and placed on the device, so the
host never holds a second full copy of the weights. With ``scan_layers`` each
stacked ``[L, ...]`` parameter is filled layer by layer into one array (a
transient second copy of that one parameter, never of the model).
"""

from __future__ import annotations

import json
import logging
import os
import pathlib
import time
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxserve.config import ModelConfig
from jaxserve.model.graph import StaticGraph
from jaxserve.model.llama import CausalLM

logger = logging.getLogger(__name__)

DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16, "float16": jnp.float16}


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


def _t(x: jax.Array) -> jax.Array:  # HF Linear weights are [out, in]; ours are [in, out]
    return x.T


def _cat_t(*xs: jax.Array) -> jax.Array:
    return jnp.concatenate([x.T for x in xs], axis=1)


def _cat(*xs: jax.Array) -> jax.Array:
    return jnp.concatenate(xs, axis=0)


def _ident(x: jax.Array) -> jax.Array:
    return x


def _hf_sources(path: tuple) -> tuple[list[str], Callable[..., jax.Array]]:
    """Hugging Face tensor names and combiner for one parameter path of CausalLM."""
    if path == ("embed",):
        return ["model.embed_tokens.weight"], _ident
    if path == ("norm", "weight"):
        return ["model.norm.weight"], _ident
    if path == ("lm_head",):
        return ["lm_head.weight"], _t
    _, i, *rest = path
    pre = f"model.layers.{i}."
    table = {
        ("input_norm", "weight"): ([pre + "input_layernorm.weight"], _ident),
        ("post_attn_norm", "weight"): ([pre + "post_attention_layernorm.weight"], _ident),
        ("attn", "qkv_proj"): ([pre + f"self_attn.{p}_proj.weight" for p in "qkv"], _cat_t),
        ("attn", "qkv_bias"): ([pre + f"self_attn.{p}_proj.bias" for p in "qkv"], _cat),
        ("attn", "o_proj"): ([pre + "self_attn.o_proj.weight"], _t),
        ("attn", "q_norm", "weight"): ([pre + "self_attn.q_norm.weight"], _ident),
        ("attn", "k_norm", "weight"): ([pre + "self_attn.k_norm.weight"], _ident),
        ("mlp", "gate_up_proj"): ([pre + f"mlp.{p}_proj.weight" for p in ("gate", "up")], _cat_t),
        ("mlp", "down_proj"): ([pre + "mlp.down_proj.weight"], _t),
    }
    return table[tuple(rest)]


class _SafetensorsIndex:
    """Tensor name → file, over a single file or a sharded index."""

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
        self._handles = {f: safe_open(os.fspath(model_dir / f), framework="flax") for f in files}
        if weight_map is None:
            weight_map = {k: f for f, h in self._handles.items() for k in h.keys()}
        self.weight_map = weight_map

    def get(self, name: str) -> jax.Array:
        if name not in self.weight_map:
            raise KeyError(f"tensor {name!r} is missing from the checkpoint")
        return self._handles[self.weight_map[name]].get_tensor(name)


def abstract_model(config: ModelConfig, dtype: jnp.dtype, scan_layers: bool = False
                   ) -> tuple[StaticGraph, dict]:
    """(graph, parameters as a pure dict of ShapeDtypeStructs) of CausalLM, allocating nothing."""
    graphdef, state = nnx.split(nnx.eval_shape(
        lambda: CausalLM(config, dtype, nnx.Rngs(0), scan_layers=scan_layers)))
    return StaticGraph(graphdef), nnx.to_pure_dict(state)


def is_scanned(params: dict) -> bool:
    """Whether ``params`` (a pure dict) is of a model built with ``scan_layers``."""
    return 0 not in params["layers"]


def _read_param(index: "_SafetensorsIndex", param_path: tuple, dtype: jnp.dtype,
                num_layers: int, scanned: bool) -> tuple[jax.Array, list[str]]:
    """One parameter from the checkpoint (stacked over the layers when scanned)."""
    if scanned and param_path[0] == "layers":
        parts = [_read_param(index, ("layers", i, *param_path[1:]), dtype, num_layers, False)
                 for i in range(num_layers)]
        return jnp.stack([v for v, _ in parts]), [n for _, names in parts for n in names]
    names, combine = _hf_sources(param_path)
    return combine(*(index.get(n).astype(jnp.float32) for n in names)).astype(dtype), names


def load_model(model_dir: str | os.PathLike | None = None, dtype: str | jnp.dtype = "float32",
               scan_layers: bool = False) -> tuple[ModelConfig, StaticGraph, dict]:
    """Loads a Hugging Face Llama-family directory.

    Args:
      model_dir: a directory with config.json and *.safetensors; None = the
        demo model (built on first use, see ``jaxserve download-demo``).
      dtype: parameter dtype, "float32" (CPU default) or "bfloat16".
      scan_layers: build the scanned model (stacked layers, see
        ``jaxserve.model.llama``); its KV cache must be stacked too.

    Returns:
      (config, graph, params): ``graph.merge(params)`` is the model; ``params``
      is a pure (nested dict) pytree of arrays, cheap to flatten per call.

    Raises:
      NotImplementedError: unsupported architecture (lists the supported ones).
      FileNotFoundError / KeyError: missing files or tensors.
      ValueError: a tensor whose shape does not match the config.
    """
    if model_dir is None:
        from jaxserve.demo_model import ensure_demo_model

        path = ensure_demo_model()
    else:
        path = pathlib.Path(model_dir)
        if not (path / "config.json").is_file():
            raise FileNotFoundError(f"{path} is not a Hugging Face model directory (no config.json)")
    dtype = resolve_dtype(dtype)
    config = ModelConfig.from_pretrained(path)
    start = time.perf_counter()
    graphdef, state = nnx.split(nnx.eval_shape(
        lambda: CausalLM(config, dtype, nnx.Rngs(0), scan_layers=scan_layers)))
    index = _SafetensorsIndex(path)
    filled = {}
    for param_path, abstract in state.flat_state():
        value, names = _read_param(index, param_path, dtype, config.num_layers, scan_layers)
        if value.shape != abstract.shape:
            raise ValueError(
                f"{'.'.join(map(str, param_path))} from {names}: shape {value.shape}, "
                f"expected {abstract.shape}")
        filled[param_path] = value
    state = nnx.from_flat_state([(p, v.replace(filled[p])) for p, v in state.flat_state()])
    params = nnx.to_pure_dict(state)
    logger.info("loaded %s (%s, %d layers) in %.1f s", path, config.architecture,
                config.num_layers, time.perf_counter() - start)
    return config, StaticGraph(graphdef), params


def param_bytes(params) -> int:
    """Total bytes of all parameter arrays in ``params``."""
    return sum(int(np.prod(x.shape)) * x.dtype.itemsize for x in jax.tree.leaves(params))
