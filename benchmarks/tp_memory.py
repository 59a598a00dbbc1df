"""Per-device memory and collectives of a tensor-parallel step, without the devices.

For a model too large to run here (Llama-3-70B by default) split over TP
devices, this reports, from the sharded layout the worker would build and
from XLA's own compile of the worker's step executables:

- **weights per device**: every parameter's shard (``NamedSharding.shard_shape``
  of the sharding ``jaxserve.model.sharding`` gives it), summed — exact;
- **KV cache per block per device**: 2 · L · (K' / TP) · S · H · itemsize, K'
  the built model's KV heads (``ModelConfig.for_tensor_parallel``);
- **collectives per step**: the all-reduce / all-gather / reduce-scatter /
  collective-permute / all-to-all instructions in the compiled body (model
  over T tokens) and sampler (LM head + sampler over R rows) executables,
  compiled for TP simulated CPU devices with abstract (unallocated) weights.
  The body is compiled with 1 and 2 layers: the difference is one layer's
  collectives, the rest the fixed part (embedding, final norm); a step of L
  layers has ``fixed + L · per_layer``. XLA's SPMD partitioner inserts the
  same collectives for a GPU mesh; the CPU compile counts them without a GPU.
- **KV capacity** on a device of ``--device-gib`` memory at
  ``--memory-utilization``: what is left after the weights and the peak
  activations (``memory_analysis`` of the 2-layer body, scaled to L layers
  conservatively by taking it whole), in blocks and tokens.

Usage: python -m benchmarks.tp_memory [--tp 8] [--tokens 64] [--reqs 64] [--json PATH]
The process needs TP devices: on a CPU it sets
``XLA_FLAGS=--xla_force_host_platform_device_count=TP`` itself (before JAX starts).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import re
import sys

COLLECTIVES = ("all-reduce", "all-gather", "reduce-scatter", "collective-permute", "all-to-all")


def llama3_70b():
    """Meta-Llama-3-70B's config.json as a ``ModelConfig``."""
    from jaxserve.config import ModelConfig, RopeScaling

    return ModelConfig(
        architecture="LlamaForCausalLM", vocab_size=128256, hidden_size=8192,
        intermediate_size=28672, num_layers=80, num_heads=64, num_kv_heads=8, head_dim=128,
        rms_norm_eps=1e-5, rope_theta=500000.0, max_position_embeddings=8192,
        tie_word_embeddings=False, rope_scaling=RopeScaling(8.0, 1.0, 4.0, 8192),
        eos_token_ids=(128001,))


def count_collectives(hlo_text: str) -> dict[str, int]:
    """Collective instructions in an optimized HLO module's text (async pairs counted once)."""
    counts = {}
    for name in COLLECTIVES:
        # "all-reduce(" or the async form "all-reduce-start(" — never "-done(".
        counts[name] = len(re.findall(rf"\b{name}(?:-start)?\(", hlo_text))
    return counts


def analyse(config, *, tp: int, dtype: str, block_size: int, tokens: int, reqs: int,
            max_model_len: int) -> dict:
    import jax
    import numpy as np

    from jaxserve.model import sharding
    from jaxserve.model.kv_cache import kv_cache_bytes_per_block, kv_cache_shapes
    from jaxserve.model.loader import abstract_model, resolve_dtype
    from jaxserve.worker.executables import (LadderShapes, body_executable,
                                             sampler_executable)
    from jaxserve.worker.rows import RowState
    from jaxserve.worker.sampler import GREEDY

    mesh = sharding.make_mesh(tp)
    built = config.for_tensor_parallel(tp)
    jdtype = resolve_dtype(dtype)
    _, params = abstract_model(built, jdtype, mesh=mesh)
    weight_bytes = sum(int(np.prod(x.sharding.shard_shape(x.shape))) * x.dtype.itemsize
                       for x in jax.tree.leaves(params))
    kv_block_bytes = kv_cache_bytes_per_block(built, block_size, jdtype) // tp

    def compiled(num_layers: int):
        small = dataclasses.replace(built, num_layers=num_layers)
        graph, state = abstract_model(small, jdtype, mesh=mesh)
        rows = RowState(reqs, max_model_len, block_size, small.vocab_size, small.eos_token_ids)
        placement = sharding.replicated(mesh)
        shapes = LadderShapes(graph, state, kv_cache_shapes(small, 64, block_size, jdtype,
                                                            mesh=mesh), rows,
                              jax.ShapeDtypeStruct((reqs, small.hidden_size), jdtype,
                                                   sharding=placement), "reference", placement)
        return (body_executable(shapes, tokens).lower().compile(),
                sampler_executable(shapes, reqs, GREEDY).lower().compile())

    (body1, sampler), (body2, _) = compiled(1), compiled(2)
    c1, c2 = count_collectives(body1.as_text()), count_collectives(body2.as_text())
    per_layer = {k: c2[k] - c1[k] for k in COLLECTIVES}
    fixed = {k: c1[k] - per_layer[k] for k in COLLECTIVES}
    memory = body2.memory_analysis()
    activations = memory.temp_size_in_bytes if memory is not None else 0
    step = {k: fixed[k] + config.num_layers * per_layer[k] for k in COLLECTIVES}
    return dict(tp=tp, dtype=dtype, model_kv_heads=config.num_kv_heads,
                built_kv_heads=built.num_kv_heads, weight_bytes_per_device=weight_bytes,
                kv_bytes_per_block_per_device=kv_block_bytes, block_size=block_size,
                tokens=tokens, reqs=reqs, body_collectives_per_layer=per_layer,
                body_collectives_fixed=fixed, body_collectives_per_step=step,
                sampler_collectives=count_collectives(sampler.as_text()),
                body_temp_bytes_2_layers=activations)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tp", type=int, default=8)
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--tokens", type=int, default=64, help="T of the body (a decode of R rows)")
    parser.add_argument("--reqs", type=int, default=64, help="R of the sampler and M rows")
    parser.add_argument("--max-model-len", type=int, default=8192)
    parser.add_argument("--device-gib", type=float, default=80.0, help="H100 SXM: 80 GiB")
    parser.add_argument("--memory-utilization", type=float, default=0.9)
    parser.add_argument("--json", default=None)
    args = parser.parse_args(argv)
    if "xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
        os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_force_host_"
                                   f"platform_device_count={args.tp}").strip()
    config = llama3_70b()
    out = analyse(config, tp=args.tp, dtype=args.dtype, block_size=args.block_size,
                  tokens=args.tokens, reqs=args.reqs, max_model_len=args.max_model_len)
    free = (int(args.device_gib * 2**30 * args.memory_utilization)
            - out["weight_bytes_per_device"] - out["body_temp_bytes_2_layers"])
    blocks = max(free, 0) // out["kv_bytes_per_block_per_device"]
    out.update(device_gib=args.device_gib, memory_utilization=args.memory_utilization,
               kv_blocks=blocks, kv_tokens=blocks * args.block_size)
    gib = 2**30
    print(f"Llama-3-70B, TP={args.tp}, {args.dtype}: {out['built_kv_heads']} KV heads built "
          f"({out['model_kv_heads']} in the checkpoint)")
    print(f"  weights per device      {out['weight_bytes_per_device'] / gib:8.2f} GiB")
    print(f"  KV per block per device {out['kv_bytes_per_block_per_device'] / 2**10:8.1f} KiB "
          f"({args.block_size} tokens)")
    print(f"  KV capacity per device  {blocks} blocks = {blocks * args.block_size} tokens "
          f"({args.device_gib:g} GiB x {args.memory_utilization:g})")
    print(f"  body collectives: per layer {out['body_collectives_per_layer']}, fixed "
          f"{out['body_collectives_fixed']}, per step of {config.num_layers} layers "
          f"{out['body_collectives_per_step']}")
    print(f"  sampler collectives: {out['sampler_collectives']}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
