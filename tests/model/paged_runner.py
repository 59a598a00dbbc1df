"""Test helper: runs sequences through the worker's step body on a paged cache.

A deliberately simple host-side block allocator (a shuffled free list, so
block tables are non-contiguous) and schedule, independent of the engine, so
that model tests do not depend on the scheduler; the step itself is the
worker's (``run_body_logits``: the packed buffer, the device-built inputs
and the model body the server runs), with every token's logits.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from jaxserve.model.kv_cache import NULL_BLOCK, init_kv_cache
from jaxserve.model.loader import is_scanned
from jaxserve.worker.inputs import StepLayout, pack
from jaxserve.worker.model_runner import run_body_logits


@dataclasses.dataclass
class _Seq:
    row: int
    blocks: list[int]
    length: int = 0  # tokens already in the cache


class PagedRunner:
    """Feeds token chunks of named sequences through the worker's step; returns logits.

    Args:
      config, graphdef, state: a loaded model.
      block_size: S.
      num_blocks: B, including the null block.
      max_blocks: MB, the block-table width.
      rows: M, the persistent rows (most sequences).
      backend: attention backend.
      seed: for the block shuffle; unused blocks are poisoned with NaN.
      mesh: the tensor-parallel mesh the model was loaded for (None: one device).
    """

    def __init__(self, config, graphdef, state, *, block_size=16, num_blocks=64, max_blocks=16,
                 rows=4, backend="reference", seed=0, cache_dtype=jnp.float32, mesh=None):
        self.config, self.graphdef, self.state = config, graphdef, state
        self.block_size, self.max_blocks, self.rows, self.backend = block_size, max_blocks, rows, backend
        rng = np.random.default_rng(seed)
        self.free = [int(b) for b in rng.permutation(np.arange(1, num_blocks))]
        cache = init_kv_cache(config, num_blocks, block_size, cache_dtype,
                              stacked=is_scanned(state), mesh=mesh)
        # Poison every slot (an fp8 cache's scales stay): anything read before it is
        # written shows up as NaN.
        poison = lambda x: jax.device_put(jnp.full_like(x, jnp.nan), x.sharding)  # noqa: E731
        self.kv_cache = dataclasses.replace(cache, k=tuple(map(poison, cache.k)),
                                            v=tuple(map(poison, cache.v)))
        self.block_table = jnp.full((rows + 1, max_blocks), NULL_BLOCK, jnp.int32)
        self.last_token = jnp.zeros(rows + 1, jnp.int32)
        self.seqs: dict[str, _Seq] = {}
        self.num_steps = 0

    def step(self, chunks: dict[str, list[int]], pad_tokens: int = 0,
             all_logits: bool = False) -> dict[str, np.ndarray]:
        """Runs one step; ``chunks`` maps sequence name → new token ids (one row each).

        Returns the logits of each row's last token, f32[V] (or f32[n, V] for every
        new token when ``all_logits``).
        """
        ids, rows, computed, counts = [], [], [], []
        append_rows, append_index, append_blocks = [], [], []
        owners, start = [], 0
        for name, toks in chunks.items():
            seq = self.seqs.setdefault(name, _Seq(row=len(self.seqs), blocks=[]))
            while len(seq.blocks) * self.block_size < seq.length + len(toks):
                append_rows.append(seq.row)
                append_index.append(len(seq.blocks))
                append_blocks.append(self.free.pop())
                seq.blocks.append(append_blocks[-1])
            ids.extend(toks)
            rows.append(seq.row)
            computed.append(seq.length)
            counts.append(len(toks))
            seq.length += len(toks)
            n = len(toks)
            owners.append((name, start, n))
            start += n
        num_tokens = start + pad_tokens  # padding tokens write into the null block
        layout = StepLayout.for_bucket(num_tokens, self.rows, self.block_size)
        i32 = lambda x: np.asarray(x, np.int32)  # noqa: E731
        buffer = pack(layout, seed=0, step_id=self.num_steps, input_ids=i32(ids),
                      rows=i32(rows), num_computed=i32(computed), num_tokens=i32(counts),
                      sample=i32([0] * len(rows)), append_rows=i32(append_rows),
                      append_index=i32(append_index), append_blocks=i32(append_blocks))
        self.num_steps += 1
        logits, self.kv_cache, self.block_table = run_body_logits(
            self.graphdef, self.state, self.kv_cache, self.block_table, self.last_token,
            jnp.asarray(buffer), layout=layout, backend=self.backend)
        logits = np.asarray(logits)
        out = {}
        for name, first, n in owners:
            out[name] = logits[first:first + n] if all_logits else logits[first + n - 1]
        return out
