"""Which pre-quantized checkpoints jaxserve loads: ``config.json``'s ``quantization_config``.

Dependency-free (no jax): the engine resolves a model's method from it before it
initializes the worker, the worker and the loader resolve it the same way
(``resolve_quantization``), so ``EngineConfig.quantization``, ``WorkerInit.quantization``,
``GetModelInfo`` and the loaded parameters (``quantization.params_method``) agree.

One format is loaded: the compressed-tensors fp8 checkpoints that llm-compressor writes
and vLLM serves (``CompressedTensorsW8A8Fp8`` / ``W8A16Fp8``; e.g. the ``*-FP8`` and
``*-FP8-dynamic`` models), a ``quantization_config`` of the shape

    {"quant_method": "compressed-tensors", "format": "float-quantized",
     "config_groups": {"group_0": {"targets": ["Linear"],
         "weights": {"type": "float", "num_bits": 8, "strategy": "channel" | "tensor",
                     "symmetric": true, "dynamic": false},
         "input_activations": {"type": "float", "num_bits": 8,
                               "strategy": "token" | "tensor", "dynamic": ...} | null}},
     "ignore": ["lm_head"], "kv_cache_scheme": null}

(``format`` "naive-quantized" too: the same tensors). Every decoder linear layer then
stores ``<name>.weight`` F8_E4M3 ``[out, in]`` and ``<name>.weight_scale`` ``[out, 1]``
("channel") or one value ("tensor"), plus ``<name>.input_scale`` (one value) when the
activations are static; it loads as jaxserve's "fp8" (``jaxserve.model.loader``). Any other
``quant_method``, or a scheme outside that shape (integer weights, group or block
strategies, other bit widths, asymmetric weights, dynamic weight scales, output
activation quantization, KV cache schemes other than one static e4m3 scale per layer
and tensor, sparsity), is refused with a one-line ValueError naming the field and its
value. A ``kv_cache_scheme`` of that one shape stores ``self_attn.k_scale`` /
``v_scale`` per layer, which an fp8 KV cache takes (``loader.kv_cache_scales``; with
``kv_cache_dtype`` "auto" they are unused, as in vLLM).
"""

from __future__ import annotations

import json
import os
import pathlib

from jaxserve.config import check_quantization

QUANT_METHOD = "compressed-tensors"
# The compressed-tensors formats whose weights are stored as plain fp8 tensors.
FP8_FORMATS = ("float-quantized", "naive-quantized")
# The fp8 weight strategies: one scale per output channel, or one for the tensor.
WEIGHT_STRATEGIES = ("channel", "tensor")
# The activation strategies: every one becomes jaxserve's dynamic per-token scale.
INPUT_STRATEGIES = ("token", "tensor")
# A kernel ``<module>.weight``'s scale tensor is ``<module>.weight`` + SCALE_SUFFIX.
SCALE_SUFFIX = "_scale"


def _refuse(field: str, value, wanted: str) -> ValueError:
    return ValueError(f"quantization_config.{field} is {value!r}; jaxserve loads "
                      f"compressed-tensors fp8 checkpoints only ({wanted})")


def _check_fp8_args(args: dict | None, field: str, strategies: tuple[str, ...]) -> None:
    """One ``QuantizationArgs`` dict: e4m3 (float, 8 bits) with a strategy of ``strategies``."""
    if not isinstance(args, dict):
        raise _refuse(field, args, "a quantization args object")
    for key, wanted in (("type", "float"), ("num_bits", 8)):
        if args.get(key) != wanted:
            raise _refuse(f"{field}.{key}", args.get(key), f"{key} {wanted!r}")
    if args.get("strategy") not in strategies:
        raise _refuse(f"{field}.strategy", args.get("strategy"),
                      f"strategy one of {', '.join(map(repr, strategies))}")
    if not args.get("symmetric", True):
        raise _refuse(f"{field}.symmetric", args.get("symmetric"), "symmetric scales")


def fp8_scheme(quantization_config: dict) -> str:
    """Checks a ``quantization_config`` (module docstring) and returns "fp8".

    Raises:
      ValueError: another ``quant_method`` or an unsupported scheme; one line naming the
        field (``quantization_config.config_groups.group_0.weights.type``) and its value.
    """
    method = quantization_config.get("quant_method")
    if method != QUANT_METHOD:
        raise _refuse("quant_method", method, f"quant_method {QUANT_METHOD!r}")
    groups = quantization_config.get("config_groups") or {}
    if not groups:
        raise _refuse("config_groups", groups, "one or more fp8 groups")
    # newer writers put the format on each group (the top level then says "mixed")
    formats = [(f"config_groups.{name}.format", group["format"])
               for name, group in groups.items() if group.get("format") is not None]
    for field, value in formats or [("format", quantization_config.get("format"))]:
        if value not in FP8_FORMATS:
            raise _refuse(field, value, f"format one of {', '.join(map(repr, FP8_FORMATS))}")
    for name, group in groups.items():
        where = f"config_groups.{name}"
        weights = group.get("weights")
        _check_fp8_args(weights, f"{where}.weights", WEIGHT_STRATEGIES)
        if weights.get("dynamic"):
            raise _refuse(f"{where}.weights.dynamic", weights["dynamic"], "stored weight scales")
        if group.get("input_activations") is not None:
            _check_fp8_args(group["input_activations"], f"{where}.input_activations",
                            INPUT_STRATEGIES)
        if group.get("output_activations") is not None:
            raise _refuse(f"{where}.output_activations", group["output_activations"],
                          "no output activation quantization")
    kv_scheme = quantization_config.get("kv_cache_scheme")
    if kv_scheme is not None:  # its scales are read when the cache is fp8 (loader)
        _check_fp8_args(kv_scheme, "kv_cache_scheme", ("tensor",))
        if kv_scheme.get("dynamic"):
            raise _refuse("kv_cache_scheme.dynamic", kv_scheme["dynamic"],
                          "stored KV cache scales")
    sparsity = quantization_config.get("sparsity_config") or {}
    if sparsity.get("format", "dense") != "dense":
        raise _refuse("sparsity_config.format", sparsity["format"], "dense weights")
    return "fp8"


def checkpoint_quantization(model_dir: str | os.PathLike | None) -> str | None:
    """The method a model directory's weights are stored in: "fp8" for a compressed-tensors
    fp8 checkpoint, None for a float one (no ``quantization_config``), for None (the demo
    model) and for a directory without ``config.json`` (the loader reports that).

    Raises:
      ValueError: a ``quantization_config`` jaxserve does not load (``fp8_scheme``).
    """
    if model_dir is None:
        return None
    config_file = pathlib.Path(model_dir) / "config.json"
    if not config_file.is_file():
        return None
    quantization_config = json.loads(config_file.read_text()).get("quantization_config")
    return None if quantization_config is None else fp8_scheme(quantization_config)


def resolve_quantization(model_dir: str | os.PathLike | None, quantization: str | None,
                         tensor_parallel_size: int = 1) -> str | None:
    """The method the model is served with: the checkpoint's own when it is pre-quantized
    (``quantization`` None or the same method, as vLLM detects it), else ``quantization``.

    Raises:
      ValueError: an unsupported method (``check_quantization``), an unsupported
        checkpoint (``checkpoint_quantization``), or a method other than a pre-quantized
        checkpoint's (one line naming both).
    """
    check_quantization(quantization, tensor_parallel_size=tensor_parallel_size)
    stored = checkpoint_quantization(model_dir)
    if stored is None:
        return quantization
    if quantization not in (None, stored):
        raise ValueError(f"quantization={quantization!r} but {model_dir} holds a pre-quantized "
                         f"{QUANT_METHOD} {stored} checkpoint; serve it with quantization None "
                         f"or {stored!r}")
    return stored
