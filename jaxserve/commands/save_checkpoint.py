"""``jaxserve save-checkpoint``: convert a model once into a parameter checkpoint directory.

Loads the Hugging Face directory (``--model``, default the demo model) as the
worker would — ``--dtype``, ``--scan-layers``, ``--tensor-parallel-size``,
``--quantization`` —
and writes ``--output``: an Orbax checkpoint of the converted parameters plus
the model's config, tokenizer and generation config
(``jaxserve.model.loader.save_model_checkpoint``). ``jaxserve serve --model
OUTPUT`` (same dtype, layer layout, tensor-parallel size and quantization) then restores it
straight into its shardings instead of converting the safetensors.
"""

from __future__ import annotations

import argparse
import logging

from jaxserve.config import QUANTIZATION_METHODS
from jaxserve.engine.service import positive_int

logger = logging.getLogger(__name__)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default=None,
                        help="Hugging Face model directory (default: the demo model)")
    parser.add_argument("--output", required=True, help="the checkpoint directory to write")
    parser.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32",
                        help="parameter dtype (default float32)")
    parser.add_argument("--scan-layers", action="store_true",
                        help="stack the layers (for a server run with --scan-layers)")
    parser.add_argument("--tensor-parallel-size", "-tp", type=positive_int, default=1,
                        help="the tensor-parallel size the checkpoint is for (default 1)")
    parser.add_argument("--quantization", "-q", choices=QUANTIZATION_METHODS, default=None,
                        help="save the weights quantized (int8 / int4 / fp8, for a "
                             "server run with the same --quantization); the checkpoint "
                             "records it")
    parser.add_argument("--force", action="store_true",
                        help="replace a checkpoint already in --output")


def run(args: argparse.Namespace) -> int:
    from jaxserve.model.loader import save_model_checkpoint
    from jaxserve.model.sharding import make_mesh

    if logging.getLogger().getEffectiveLevel() > logging.DEBUG:
        logging.getLogger("absl").setLevel(logging.WARNING)  # Orbax's per-step INFO lines

    try:
        mesh = make_mesh(args.tensor_parallel_size)
        out = save_model_checkpoint(args.model, args.output, args.dtype, args.scan_layers, mesh,
                                    force=args.force, quantization=args.quantization)
    except (FileNotFoundError, FileExistsError, ValueError) as err:
        logger.error("%s", err)
        return 1
    logger.info("saved the parameter checkpoint to %s (serve it with: jaxserve serve %s)",
                out, " ".join(serve_flags(args, out)))
    return 0


def serve_flags(args: argparse.Namespace, out: object) -> list[str]:
    """The ``jaxserve serve`` flags a checkpoint written with ``args`` must be served with
    (its metadata records each; a server started without them refuses it)."""
    flags = ["--model", str(out), "--dtype", args.dtype]
    if args.scan_layers:
        flags.append("--scan-layers")
    if args.tensor_parallel_size > 1:
        flags += ["-tp", str(args.tensor_parallel_size)]
    if args.quantization:
        flags += ["-q", args.quantization]
    return flags
