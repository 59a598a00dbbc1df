"""The served decode step of a Llama-3-8B-shaped model vs its weight-streaming floor.

What it measures: the worker's real step — ``InProcessWorker.submit`` /
``execute`` of a ``StepPlan``, i.e. one packed-buffer upload, the body and
sampler executables, and the copy of the sampled tokens to the host — for
``batch`` rows in a steady decode at ``context`` tokens, on whatever device
JAX has.

How: random weights with Llama-3-8B's configuration (no model hub is
reachable here; the step's cost does not depend on the values), bfloat16 by
default, handed to an ``InProcessWorker`` whose ladders hold exactly the
batch sizes (T = R = batch for a decode step), every executable compiled at
start-up. Each row starts as a ``NewRow`` of ``context + 1`` random prompt
tokens whose first ``context`` are treated as already cached (its first
step has ``num_computed = context``), so no long prefill runs: the KV values
are garbage but the step's cost is the same. Each later step runs one token
per row, its input read on the device from the row's last sampled token;
a block is appended when a row crosses a block boundary. Greedy sampling.

Two modes per batch size, after ``WARMUP`` untimed steps:

- ``sync``: ``worker.execute(plan)`` per step, the host waiting for every
  step's tokens; the median step time;
- ``dispatch_ahead``: step N + 1 is submitted before step N's tokens are
  read (``PendingStep.result``), as the engine's async scheduling does;
  total time / steps.

The floors: the parameter bytes, and the parameter plus KV-cache bytes a
step reads, divided by the device's memory bandwidth measured in the same
run by streaming a large buffer (``2 × bytes / time`` of an ``x + 1`` over
it: one read, one write).

Usage: python -m benchmarks.llama8b_decode [--layers 32] [--batch 1,64] [--context 2048]
       [--backend pallas] [--iters 20] [--scan-layers] [--json PATH]
On a CPU, as a smoke test: ``--layers 2 --hidden-scale 8 --backend reference
--dtype float32 --batch 1,4 --context 64 --iters 5``.
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
from jaxserve.model.loader import abstract_model, is_scanned, param_bytes
from jaxserve.sampling_params import SamplingParams
from jaxserve.step_plan import NewRow, StepPlan, WorkerInit
from jaxserve.worker.in_process import InProcessWorker

WARMUP = 3  # untimed steps before the timed ones (the first builds the rows)
SPARE_TOKENS = 4  # room per row beyond context + 1 + the steps run
MODES = ("sync", "dispatch_ahead")
_EMPTY = np.zeros(0, np.int32)


def llama3_8b(layers: int = 32, hidden_scale: int = 1) -> ModelConfig:
    """Meta-Llama-3-8B's config.json, optionally narrowed for smoke tests.

    ``hidden_scale`` divides the widths and the vocabulary; EOS then becomes
    the last id of the narrowed vocabulary (the sampler requires EOS < V).
    """
    vocab_size = 128256 // hidden_scale
    return ModelConfig(
        architecture="LlamaForCausalLM", vocab_size=vocab_size,
        hidden_size=4096 // hidden_scale, intermediate_size=14336 // hidden_scale,
        num_layers=layers, num_heads=32 // hidden_scale, num_kv_heads=8 // hidden_scale,
        head_dim=128, rms_norm_eps=1e-5, rope_theta=500000.0, max_position_embeddings=8192,
        tie_word_embeddings=False,
        rope_scaling=RopeScaling(8.0, 1.0, 4.0, 8192), eos_token_ids=(min(128001, vocab_size - 1),))


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


def blocks_per_row(context: int, iters: int, block_size: int) -> int:
    """Blocks a row may need: context + 1 prompt tokens, WARMUP + iters steps, spare room."""
    return -(-(context + 1 + WARMUP + iters + SPARE_TOKENS) // block_size)


def decode_worker(config: ModelConfig, graphdef, state, *, batches: tuple[int, ...],
                  context: int, block_size: int, backend: str, iters: int) -> InProcessWorker:
    """An initialised ``InProcessWorker`` for decode steps of each batch size in ``batches``.

    KV cache: ``max(batches) × blocks_per_row`` blocks plus the null block;
    ``max_model_len`` a whole number of blocks; ladders T = R = ``batches``;
    every executable compiled in ``initialize`` (``precompile``).

    Raises:
      ValueError: ``max_model_len`` would exceed the model's
        ``max_position_embeddings``.
    """
    per_row = blocks_per_row(context, iters, block_size)
    max_model_len = per_row * block_size
    if max_model_len > config.max_position_embeddings:
        raise ValueError(f"context {context} + {WARMUP + iters} steps needs max_model_len "
                         f"{max_model_len} > {config.max_position_embeddings}")
    buckets = tuple(sorted(set(batches)))
    worker = InProcessWorker(loaded=(config, graphdef, state), progress=False)
    worker.initialize(WorkerInit(
        model=None, dtype=str(jax.tree.leaves(state)[0].dtype), block_size=block_size,
        num_kv_blocks=max(buckets) * per_row + 1, kv_cache_bytes=None,
        max_num_seqs=max(buckets), max_model_len=max_model_len, token_buckets=buckets,
        request_buckets=buckets, attention_backend=backend, precompile=True,
        scan_layers=is_scanned(state)))
    return worker


class DecodePlans:
    """Step plans that keep rows ``0 .. batch - 1`` in a steady decode (see the module docstring).

    Row ``i`` owns blocks ``1 + i × blocks_per_row ..``; a run frees the
    previous run's rows in its first plan. Step ids increase across runs.

    Args:
      vocab_size: V, the range of the random prompt tokens.
      context: tokens treated as cached before a run's first step.
      block_size: S.
      blocks_per_row: blocks each row may use.
    """

    def __init__(self, vocab_size: int, context: int, block_size: int, blocks_per_row: int):
        self.vocab_size, self.context = vocab_size, context
        self.block_size, self.blocks_per_row = block_size, blocks_per_row
        self.step_id = 0
        self.live = _EMPTY  # [n] rows in use on the worker
        self.rng = np.random.default_rng(0)

    def run(self, batch: int, num_steps: int) -> list[StepPlan]:
        """The plans of one run: ``num_steps`` decode steps of ``batch`` rows, one token each."""
        c, s = self.context, self.block_size
        rows = np.arange(batch, dtype=np.int32)  # [n]
        owned = 1 + rows[:, None] * self.blocks_per_row + np.arange(self.blocks_per_row)
        num_blocks = np.full(batch, -(-(c + 1) // s), np.int32)  # [n]
        params = SamplingParams(temperature=0.0, max_tokens=num_steps)
        new_rows = tuple(NewRow(
            row=int(r), token_ids=self.rng.integers(0, self.vocab_size, c + 1, dtype=np.int32),
            num_prompt_tokens=c + 1, sampling_params=params, seed=None,
            block_ids=owned[r, :num_blocks[r]].astype(np.int32)) for r in rows)
        plans = []
        for k in range(num_steps):
            grow = rows[num_blocks * s < c + k + 1]  # rows whose next token starts a block
            appended = owned[grow, num_blocks[grow]].astype(np.int32)
            num_blocks[grow] += 1
            plans.append(StepPlan(
                step_id=self.step_id, freed_rows=self.live if k == 0 else _EMPTY,
                new_rows=new_rows if k == 0 else (), append_rows=grow,
                append_block_ids=appended, rows=rows,
                num_computed=np.full(batch, c + k, np.int32),
                num_tokens=np.ones(batch, np.int32), sample=np.ones(batch, bool),
                num_tokens_bucket=batch, num_reqs_bucket=batch))
            self.step_id += 1
        self.live = rows
        return plans


def time_steps(worker: InProcessWorker, plans: list[StepPlan], *,
               dispatch_ahead: bool) -> dict[str, float]:
    """Runs ``plans`` (WARMUP untimed, then the timed ones); seconds per step.

    Returns:
      ``step_s``: the median synchronous step, or with ``dispatch_ahead`` the
      total time of the timed steps / their number; ``first_step_s``: the
      first step (new rows written, nothing compiled: ``initialize`` did).
    """
    t = time.perf_counter()
    worker.execute(plans[0])
    first = time.perf_counter() - t
    for plan in plans[1:WARMUP]:
        worker.execute(plan)
    timed = plans[WARMUP:]
    if dispatch_ahead:  # one step in flight while the host dispatches the next
        t = time.perf_counter()
        pending = worker.submit(timed[0])
        for plan in timed[1:]:
            following = worker.submit(plan)
            pending.result()
            pending = following
        pending.result()
        return dict(step_s=(time.perf_counter() - t) / len(timed), first_step_s=first)
    times = []
    for plan in timed:
        t = time.perf_counter()
        worker.execute(plan)
        times.append(time.perf_counter() - t)
    return dict(step_s=statistics.median(times), first_step_s=first)


def decode_step_seconds(config: ModelConfig, graphdef, state, *, batch: int, context: int,
                        block_size: int, backend: str, iters: int, dispatch_ahead: bool = False,
                        timings: dict | None = None) -> float:
    """Seconds of one served decode step of ``batch`` rows at ``context`` tokens (own worker).

    ``timings`` receives ``first_step_s``. See ``time_steps`` for the modes.
    """
    worker = decode_worker(config, graphdef, state, batches=(batch,), context=context,
                           block_size=block_size, backend=backend, iters=iters)
    plans = DecodePlans(config.vocab_size, context, block_size,
                        blocks_per_row(context, iters, block_size))
    out = time_steps(worker, plans.run(batch, WARMUP + iters), dispatch_ahead=dispatch_ahead)
    worker.shutdown()
    if timings is not None:
        timings["first_step_s"] = out["first_step_s"]
    return out["step_s"]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=32)
    parser.add_argument("--hidden-scale", type=int, default=1, help="divide widths (smoke tests)")
    parser.add_argument("--batch", default="1,64", help="comma-separated decode batch sizes")
    parser.add_argument("--context", type=int, default=2048, help="tokens already in each row")
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--backend", default="pallas", help="attention backend")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--iters", type=int, default=20, help="timed steps per batch and mode")
    parser.add_argument("--scan-layers", action="store_true",
                        help="stacked layer weights run by jax.lax.scan (docs/model.md)")
    parser.add_argument("--json", default=None)
    args = parser.parse_args(argv)

    dtype = jnp.dtype(args.dtype)
    batches = [int(b) for b in args.batch.split(",")]
    config = llama3_8b(args.layers, args.hidden_scale)
    graphdef, state = random_state(config, dtype, args.scan_layers)
    weights = param_bytes(state)
    bandwidth = measure_bandwidth(min(4 << 30, max(64 << 20, weights // 2)))
    floor = weights / bandwidth
    result = dict(device=str(jax.devices()[0].device_kind), backend=args.backend,
                  dtype=args.dtype, layers=args.layers, scan_layers=args.scan_layers,
                  context=args.context, block_size=args.block_size, iters=args.iters,
                  weight_bytes=weights, bandwidth_bytes_per_s=bandwidth, floor_ms=floor * 1e3,
                  steps={})
    print(f"{result['device']}: weights {weights / 1e9:.2f} GB, "
          f"streaming {bandwidth / 1e12:.2f} TB/s, floor {floor * 1e3:.2f} ms/step", flush=True)
    t = time.perf_counter()
    worker = decode_worker(config, graphdef, state, batches=tuple(batches), context=args.context,
                           block_size=args.block_size, backend=args.backend, iters=args.iters)
    report = worker.compile_report
    result.update(initialize_s=time.perf_counter() - t, compile_s=report.seconds,
                  num_executables=report.num_executables)
    print(f"worker ready in {result['initialize_s']:.1f} s ({report.num_executables} executables "
          f"compiled in {report.seconds:.1f} s)", flush=True)
    plans = DecodePlans(config.vocab_size, args.context, args.block_size,
                        blocks_per_row(args.context, args.iters, args.block_size))
    for batch in batches:
        kv_bytes = (batch * (args.context + 1) * config.num_layers * 2 * config.num_kv_heads
                    * config.head_dim * dtype.itemsize)
        kv_floor = (weights + kv_bytes) / bandwidth
        for mode in MODES:
            out = time_steps(worker, plans.run(batch, WARMUP + args.iters),
                             dispatch_ahead=mode == "dispatch_ahead")
            seconds = out["step_s"]
            result["steps"][f"{batch}/{mode}"] = dict(
                ms=seconds * 1e3, ratio_to_weight_floor=seconds / floor,
                ratio_to_weight_plus_kv_floor=seconds / kv_floor,
                first_step_s=out["first_step_s"])
            print(f"batch {batch:3d} context {args.context} {mode:14s}: "
                  f"{seconds * 1e3:.2f} ms/step, {seconds / floor:.3f}x the weight floor, "
                  f"{seconds / kv_floor:.3f}x weights+KV "
                  f"(first step {out['first_step_s'] * 1e3:.1f} ms)", flush=True)
    result["recompiles"] = worker.guard.num_recompiles
    if result["recompiles"]:
        print(f"warning: {result['recompiles']} compiles after warm-up", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
