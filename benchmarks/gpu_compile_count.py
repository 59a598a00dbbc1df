"""How many executables a GPU start-up compiles, and their deviceless H100 compile seconds.

What it measures: the served ladder of a Llama-3-8B-shaped model (abstract
bfloat16 weights: ``jax.ShapeDtypeStruct``s, nothing allocated), at
``max_num_seqs`` 256 and 8,192 batched tokens (T ladder 1, 4, 8, ..., 8192:
13 bodies; R ladder 1, 2, ..., 256: 9 rungs × 6 sampler variants (the two masked ones, for
structured outputs, in the background); 9 staged row writes and the
penalty-row write), each executable compiled one after
another for one H100 of a topology built from
``pallas_kernels/h100_target_config.pbtxt`` — XLA:GPU's real compile, Triton
kernels to cubins included, on a CPU. The JAX persistent cache is off.

Reported per executable and summed: compile seconds (lowering excluded),
split into what is compiled before the worker is ready
(``executables.split_for_startup``) and what compiles in the background
after. ``--scan-layers`` compiles the scanned model (one layer under
``jax.lax.scan``) instead of 32 unrolled layers; ``--all-before-ready``
counts every executable as before-ready (the start-up before the split).

Needs the CUDA plugin and ptxas (``/tmp/v312gpu`` or
scripts/h100_compile_env.sh) and ``JAX_PLATFORMS=cpu``.

Usage: JAX_PLATFORMS=cpu python -m benchmarks.gpu_compile_count [--scan-layers]
       [--all-before-ready] [--layers 32] [--only body,sampler,rows] [--json PATH]
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import sys
import time

import jax
import jax.numpy as jnp

from benchmarks.llama8b_decode import llama3_8b
from jaxserve.engine.config import default_request_buckets, default_token_buckets
from jaxserve.model.kv_cache import kv_cache_shapes
from jaxserve.model.loader import abstract_model
from jaxserve.worker.executables import LadderShapes, ladder_executables, split_for_startup
from jaxserve.worker.rows import RowState
from pallas_kernels.gpu_target import abstract_gpu

TARGET_CONFIG = pathlib.Path(__file__).parents[1] / "pallas_kernels" / "h100_target_config.pbtxt"
MAX_NUM_SEQS, MAX_NUM_BATCHED_TOKENS, MAX_MODEL_LEN, BLOCK_SIZE = 256, 8192, 8192, 16


def h100_sharding() -> jax.sharding.Sharding:
    """One device of a deviceless H100 topology."""
    from jax.experimental import topologies

    topology = topologies.get_topology_desc("h100", "cuda", target_config=TARGET_CONFIG.read_text(),
                                            topology="1x1x1")
    return jax.sharding.SingleDeviceSharding(topology.devices[0])


def ladder(layers: int, scan_layers: bool):
    config = llama3_8b(layers)
    graphdef, state = abstract_model(config, jnp.bfloat16, scan_layers=scan_layers)
    kv = kv_cache_shapes(config, 4096, BLOCK_SIZE, jnp.bfloat16, stacked=scan_layers)
    rows = RowState(MAX_NUM_SEQS, MAX_MODEL_LEN, BLOCK_SIZE, config.vocab_size,
                    config.eos_token_ids)
    hidden = jax.ShapeDtypeStruct((MAX_NUM_SEQS, config.hidden_size), jnp.bfloat16)
    shapes = LadderShapes(graphdef, state, kv, rows, hidden, "pallas")
    return ladder_executables(shapes, default_token_buckets(MAX_NUM_BATCHED_TOKENS),
                              default_request_buckets(MAX_NUM_SEQS))


def compile_seconds(exe, sharding) -> float:
    specs = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sharding),
                         exe.args)
    with abstract_gpu():  # Pallas asks which GPU; the topology device does not say
        lowered = jax.jit(exe.fn, donate_argnums=exe.donate).trace(*specs).lower(
            lowering_platforms=("cuda",))
    start = time.perf_counter()
    lowered.compile()
    return time.perf_counter() - start


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--scan-layers", action="store_true")
    parser.add_argument("--all-before-ready", action="store_true")
    parser.add_argument("--layers", type=int, default=32)
    parser.add_argument("--only", default="body,sampler,rows",
                        help="kinds to compile (the others are counted, not compiled)")
    parser.add_argument("--json", default=None)
    args = parser.parse_args(argv)
    if os.environ.get("JAX_PLATFORMS") != "cpu":
        sys.exit("run with JAX_PLATFORMS=cpu (a deviceless compile)")
    jax.config.update("jax_enable_compilation_cache", False)
    sharding = h100_sharding()
    exes = ladder(args.layers, args.scan_layers)
    before, after = (exes, []) if args.all_before_ready else split_for_startup(exes)
    kinds = set(args.only.split(","))
    rows = []
    for when, group in (("before_ready", before), ("background", after)):
        for exe in group:
            seconds = compile_seconds(exe, sharding) if exe.kind in kinds else None
            rows.append({"name": exe.name, "kind": exe.kind, "when": when, "seconds": seconds})
            print(f"{exe.name:48s} {when:12s} "
                  f"{'-' if seconds is None else f'{seconds:6.2f} s'}", file=sys.stderr, flush=True)

    def total(when=None, kind=None):
        picked = [r for r in rows if (when is None or r["when"] == when)
                  and (kind is None or r["kind"] == kind) and r["seconds"] is not None]
        return {"count": sum(1 for r in rows if (when is None or r["when"] == when)
                             and (kind is None or r["kind"] == kind)),
                "seconds": round(sum(r["seconds"] for r in picked), 2)}

    result = {
        "model": f"Llama-3-8B-shaped, {args.layers} layers, bfloat16, pallas attention",
        "scan_layers": args.scan_layers, "all_before_ready": args.all_before_ready,
        "max_num_seqs": MAX_NUM_SEQS, "max_num_batched_tokens": MAX_NUM_BATCHED_TOKENS,
        "jax": jax.__version__, "compiled_kinds": sorted(kinds),
        "before_ready": total("before_ready"), "background": total("background"),
        "by_kind": {k: total(kind=k) for k in ("body", "sampler", "rows")},
        "executables": rows,
    }
    text = json.dumps(result, indent=1)
    if args.json:
        pathlib.Path(args.json).write_text(text)
    print(text)
    return result


if __name__ == "__main__":
    main()
