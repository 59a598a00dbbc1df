"""Batch-1 (and small-batch) decode step of a Llama-3-8B-shaped model vs its weight-streaming floor.

Random bfloat16 weights with Llama-3-8B's configuration (no model hub is
reachable here; the step's cost does not depend on the values), the paged KV
cache, the model body + logits exactly as the worker runs them, on whatever
device JAX has. The floor is the parameter bytes divided by the device's
memory bandwidth, measured in the same run by streaming a large buffer
(``2 × bytes / time`` of an ``x + 1`` over it: one read, one write).

Usage: python -m benchmarks.llama8b_decode [--layers 32] [--batch 1,8] [--context 2048]
       [--backend pallas] [--scan-layers] [--json PATH]
On a CPU use e.g. ``--layers 2 --hidden-scale 8 --backend reference`` as a smoke test.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

from jaxserve.config import ModelConfig, RopeScaling
from jaxserve.model.attention import AttentionMetadata
from jaxserve.model.forward import compute_logits, model_body
from jaxserve.model.kv_cache import init_kv_cache
from jaxserve.model.loader import abstract_model, is_scanned, param_bytes


def llama3_8b(layers: int = 32, hidden_scale: int = 1) -> ModelConfig:
    """Meta-Llama-3-8B's config.json, optionally narrowed for smoke tests."""
    return ModelConfig(
        architecture="LlamaForCausalLM", vocab_size=128256 // hidden_scale,
        hidden_size=4096 // hidden_scale, intermediate_size=14336 // hidden_scale,
        num_layers=layers, num_heads=32 // hidden_scale, num_kv_heads=8 // hidden_scale,
        head_dim=128, rms_norm_eps=1e-5, rope_theta=500000.0, max_position_embeddings=8192,
        tie_word_embeddings=False,
        rope_scaling=RopeScaling(8.0, 1.0, 4.0, 8192), eos_token_ids=(128001,))


def random_state(config: ModelConfig, dtype, scan_layers: bool = False) -> tuple:
    """(graphdef, state) with N(0, 0.02) weights made on the device, leaf by leaf."""
    graphdef, abstract = abstract_model(config, dtype, scan_layers)
    key = jax.random.PRNGKey(0)
    leaves, treedef = jax.tree.flatten(abstract)
    make = jax.jit(lambda k, shape: (0.02 * jax.random.normal(k, shape, jnp.float32)).astype(dtype),
                   static_argnames=("shape",))  # one compile per distinct shape
    filled = [make(jax.random.fold_in(key, i), shape=leaf.shape) for i, leaf in enumerate(leaves)]
    return graphdef, jax.tree.unflatten(treedef, filled)


def measure_bandwidth(nbytes: int = 4 << 30) -> float:
    """Bytes/s of an elementwise pass over ``nbytes`` (counted as read + write)."""
    x = jnp.zeros((nbytes // 4,), jnp.float32)
    f = jax.jit(lambda a: a + 1.0)
    f(x).block_until_ready()
    times = []
    for _ in range(10):
        t = time.perf_counter()
        f(x).block_until_ready()
        times.append(time.perf_counter() - t)
    del x
    return 2 * nbytes / min(times)


def decode_step_seconds(config, graphdef, state, *, batch: int, context: int, block_size: int,
                        backend: str, iters: int, pipelined: bool = False,
                        timings: dict | None = None) -> float:
    """Seconds of one decode step (body + logits) for ``batch`` rows of ``context`` tokens.

    Synchronous (default): the median of steps each waited for, host dispatch
    included — what a worker that needs each step's tokens on the host sees.
    ``pipelined``: steps dispatched back to back and waited for once, so host
    work hides behind the device — what a worker feeding sampled tokens back on
    the device would see. ``timings`` (synchronous mode) receives
    ``first_step_s``, the first step's seconds: tracing and compiling included
    when nothing was compiled before.
    """
    blocks_per_row = -(-(context + iters + 2) // block_size)
    num_blocks = batch * blocks_per_row + 1
    cache_dtype = jax.tree.leaves(state)[0].dtype  # the KV cache in the parameter dtype
    kv = init_kv_cache(config, num_blocks, block_size, cache_dtype, stacked=is_scanned(state))
    table = 1 + np.arange(batch * blocks_per_row, dtype=np.int32).reshape(batch, blocks_per_row)

    def inputs(step):
        pos = np.full(batch, context + step, np.int32)
        slots = table[np.arange(batch), pos // block_size] * block_size + pos % block_size
        md = AttentionMetadata(slot_mapping=jnp.asarray(slots), block_table=jnp.asarray(table),
                               seq_lens=jnp.asarray(pos + 1),
                               query_start_loc=jnp.arange(batch + 1, dtype=jnp.int32))
        return jnp.asarray(np.ones(batch, np.int32)), jnp.asarray(pos), md

    logits_indices = jnp.arange(batch, dtype=jnp.int32)
    steps = [inputs(step) for step in range(iters + 3)]  # host → device copies up front
    if pipelined:  # dispatch every step, wait once: the device-bound step time
        for ids, pos, md in steps[:3]:  # compile and warm up
            hidden, kv = model_body(graphdef, state, kv, ids, pos, md, backend=backend)
            compute_logits(graphdef, state, hidden, logits_indices).block_until_ready()
        t = time.perf_counter()
        for ids, pos, md in steps[3:]:
            hidden, kv = model_body(graphdef, state, kv, ids, pos, md, backend=backend)
            logits = compute_logits(graphdef, state, hidden, logits_indices)
        logits.block_until_ready()
        return (time.perf_counter() - t) / iters
    times = []
    for step, (ids, pos, md) in enumerate(steps):
        t = time.perf_counter()
        hidden, kv = model_body(graphdef, state, kv, ids, pos, md, backend=backend)
        logits = compute_logits(graphdef, state, hidden, logits_indices)
        logits.block_until_ready()
        if step == 0 and timings is not None:
            timings["first_step_s"] = time.perf_counter() - t
        if step >= 3:  # the first steps compile
            times.append(time.perf_counter() - t)
    return statistics.median(times)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=32)
    parser.add_argument("--hidden-scale", type=int, default=1, help="divide widths (smoke tests)")
    parser.add_argument("--batch", default="1,8", help="comma-separated decode batch sizes")
    parser.add_argument("--context", type=int, default=2048, help="tokens already in each row")
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--backend", default="pallas", help="attention backend")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--iters", type=int, default=20)
    parser.add_argument("--scan-layers", action="store_true",
                        help="stacked layer weights run by jax.lax.scan (docs/model.md)")
    parser.add_argument("--json", default=None)
    args = parser.parse_args(argv)

    dtype = jnp.dtype(args.dtype)
    config = llama3_8b(args.layers, args.hidden_scale)
    graphdef, state = random_state(config, dtype, args.scan_layers)
    weights = param_bytes(state)
    bandwidth = measure_bandwidth(min(4 << 30, max(64 << 20, weights // 2)))
    floor = weights / bandwidth
    result = dict(device=str(jax.devices()[0].device_kind), backend=args.backend,
                  dtype=args.dtype, layers=args.layers, scan_layers=args.scan_layers,
                  weight_bytes=weights,
                  bandwidth_bytes_per_s=bandwidth, floor_ms=floor * 1e3, steps={})
    print(f"{result['device']}: weights {weights / 1e9:.2f} GB, streaming {bandwidth / 1e12:.2f} TB/s, "
          f"floor {floor * 1e3:.2f} ms/step", flush=True)
    for batch in (int(b) for b in args.batch.split(",")):
        kv_bytes = (batch * (args.context + 1) * config.num_layers * 2 * config.num_kv_heads
                    * config.head_dim * jnp.dtype(dtype).itemsize)
        kv_floor = (weights + kv_bytes) / bandwidth
        for mode in ("sync", "pipelined"):
            timings: dict = {}
            seconds = decode_step_seconds(config, graphdef, state, batch=batch,
                                          context=args.context, block_size=args.block_size,
                                          backend=args.backend, iters=args.iters,
                                          pipelined=mode == "pipelined", timings=timings)
            result["steps"][f"{batch}/{mode}"] = dict(
                ms=seconds * 1e3, ratio_to_weight_floor=seconds / floor,
                ratio_to_weight_plus_kv_floor=seconds / kv_floor, **timings)
            if "first_step_s" in timings:
                print(f"batch {batch:3d} first step (trace + compile): "
                      f"{timings['first_step_s']:.1f} s", flush=True)
            print(f"batch {batch:3d} context {args.context} {mode:9s}: {seconds * 1e3:.2f} ms/step, "
                  f"{seconds / floor:.3f}x the weight floor, {seconds / kv_floor:.3f}x weights+KV",
                  flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
