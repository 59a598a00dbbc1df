"""fp8 (W8A8 e4m3) perplexity on the demo model, with its spread and where it comes from.

Run: ``python -m benchmarks.fp8_quality [--model DIR] [--draws N] [--per-layer]`` (default:
the demo model, 8 draws; a few minutes on the 2-core CPU).

The perplexity of ``benchmarks.quantization.TEXT`` (its ``perplexity``: one prefill through
the worker's step body, float32 activations) under fp8 is one draw of a noisy quantity:
per-token e4m3 activation rounding is discontinuous, so a perturbation far below float32's
own noise flips some roundings, and the flips propagate through the layers to flip others.
Each draw d = 0 .. N-1 multiplies every RMSNorm weight by (1 + d · 2^-20) — a different but,
to float32, indistinguishable model — and the table gives each variant's mean, standard
deviation, min and max over the draws:

- **float32** (the control: the nudge alone) and **int8** (weight-only) through the served
  code;
- **fp8**: ``load_model(..., quantization="fp8")``, the served W8A8 path
  (``quantization.matmul_fp8``: XLA's fp8 dot);
- **fake W8A8**: the float32 model whose decoder products are replaced by fake quantization
  (``fake_quantized_linear``: the kernel's e4m3 round trip per output channel, the
  activations' per token, then a float32 product) — the same maths without the fp8 dot;
- fake quantization of the **weights only**, of the **activations only**, of **one kernel
  kind** (qkv, o, gate_up, down) only and, with ``--per-layer``, of three consecutive layers
  only: where the cost comes from.

Writes ``<results>/fp8_quality.json``.
"""

from __future__ import annotations

import argparse
import contextlib
import logging
from typing import Any, Callable

from benchmarks import common

logger = logging.getLogger(__name__)

NAME = "fp8_quality"
KINDS = ("qkv", "o", "gate_up", "down")  # the decoder's products, in call order per layer


def add_arguments(parser: argparse.ArgumentParser) -> None:
    common.add_common_arguments(parser)
    parser.add_argument("--draws", type=int, default=8,
                        help="nudged copies of each variant (default 8)")
    parser.add_argument("--per-layer", action="store_true",
                        help="also fake W8A8 in three consecutive layers at a time")


def nudged(state, draw: int):
    """``state`` with every RMSNorm weight multiplied by (1 + draw · 2^-20)."""
    import jax

    factor = 1 + draw * 2.0 ** -20
    return jax.tree_util.tree_map_with_path(
        lambda path, x: x * factor if "norm" in jax.tree_util.keystr(path) else x, state)


@contextlib.contextmanager
def fake_quantized_linear(num_layers: int, weights: bool = True, activations: bool = True,
                          select: Callable[[int, str], bool] = lambda layer, kind: True):
    """Within the block, the float model's decoder products (``llama.linear``, traced in
    order: ``KINDS`` for each of ``num_layers`` layers) selected by ``select(layer, kind)``
    run as fake fp8: the kernel [out, in] replaced by its e4m3 round trip (``quantize`` /
    ``dequantize``, per output channel), x by its per-token one (``matmul_fp8``'s scale),
    then a float32 product. The LM head stays float. For an analysis only: it swaps the
    module's function, so clear JAX's caches before tracing inside the block."""
    import jax
    import jax.numpy as jnp

    from jaxserve.model import llama, quantization as quant

    served = llama.linear
    calls = [0]

    def linear(x, kernel, scale=None, *, tensor_parallel=False):
        layer, kind = divmod(calls[0], len(KINDS))
        calls[0] += 1
        if scale is not None or layer >= num_layers or not select(layer, KINDS[kind]):
            return served(x, kernel, scale, tensor_parallel=tensor_parallel)
        if weights:
            kernel = quant.dequantize(*quant.quantize(kernel, "fp8"))
        if activations:
            xq, x_scale = quant._absmax_quantize(x.astype(jnp.float32), "fp8")
            x = xq.astype(jnp.float32) * x_scale[..., None]
        return jax.lax.dot_general(x, kernel, (((x.ndim - 1,), (1,)), ((), ())),
                                   precision=jax.lax.Precision.HIGHEST)

    llama.linear = linear
    try:
        yield
    finally:
        llama.linear = served


def draws(loaded, token_ids: list[int], n: int, fake: dict | None = None) -> dict[str, Any]:
    """Perplexity of ``n`` nudged copies of ``loaded`` (``fake``: ``fake_quantized_linear``'s
    arguments, or None for the served code): mean, std (n - 1), min, max, the draws."""
    import jax
    import numpy as np

    from benchmarks.quantization import perplexity

    config, graphdef, state = loaded
    jax.clear_caches()  # trace the step body again, with or without the swap
    with (fake_quantized_linear(config.num_layers, **fake) if fake is not None
          else contextlib.nullcontext()):
        values = np.array([perplexity((config, graphdef, nudged(state, d)), token_ids)
                           for d in range(n)])
    return {"mean": float(values.mean()), "std": float(values.std(ddof=1)) if n > 1 else 0.0,
            "min": float(values.min()), "max": float(values.max()), "draws": values.tolist()}


def run(args: argparse.Namespace) -> dict[str, Any]:
    from transformers import AutoTokenizer

    from benchmarks.quantization import TEXT
    from jaxserve.model.loader import load_model

    model_dir = str(common.resolve_model(args.model))
    token_ids = AutoTokenizer.from_pretrained(args.tokenizer or model_dir).encode(TEXT)
    f32 = load_model(model_dir, "float32")
    variants: dict[str, tuple[Any, dict | None]] = {
        "float32": (f32, None),
        "int8": (load_model(model_dir, "float32", quantization="int8"), None),
        "fp8": (load_model(model_dir, "float32", quantization="fp8"), None),
        "fake W8A8": (f32, {}),
        "fake weights only": (f32, {"activations": False}),
        "fake activations only": (f32, {"weights": False}),
    }
    for kind in KINDS:
        variants[f"fake W8A8, {kind} only"] = (f32, {"select": lambda l, k, kind=kind: k == kind})
    if args.per_layer:
        for first in range(0, f32[0].num_layers, 3):
            variants[f"fake W8A8, layers {first}-{first + 2} only"] = (
                f32, {"select": lambda l, k, first=first: first <= l < first + 3})
    result: dict[str, Any] = {"args": vars(args), "text_tokens": len(token_ids), "variants": {}}
    for name, (loaded, fake) in variants.items():
        result["variants"][name] = draws(loaded, token_ids, args.draws, fake)
        logger.info("%s: %s", name, result["variants"][name])
    result["environment"] = common.environment()
    return result


def main(argv=None) -> int:
    _, result, path = common.run_cli(NAME, __doc__, add_arguments, run, argv)
    base = result["variants"]["float32"]["mean"]
    print("| variant | perplexity mean (Δ vs f32) | std | min – max |")
    print("|---|---|---|---|")
    for name, v in result["variants"].items():
        delta = "" if name == "float32" else f" ({v['mean'] / base - 1:+.1%})"
        print(f"| {name} | {v['mean']:.2f}{delta} | {v['std']:.3f} | "
              f"{v['min']:.2f} – {v['max']:.2f} |")
    print(f"written to {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
