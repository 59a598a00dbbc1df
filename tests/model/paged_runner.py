"""Test helper: runs sequences through the jitted forward on a paged cache.

A deliberately simple host-side block allocator (a shuffled free list, so
block tables are non-contiguous) and step-input builder, independent of the
engine, so that model tests do not depend on the scheduler.
"""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp
import numpy as np

from jaxserve.model.attention import AttentionMetadata
from jaxserve.model.forward import StepInputs, forward
from jaxserve.model.kv_cache import NULL_BLOCK, init_kv_cache
from jaxserve.model.loader import is_scanned


@dataclasses.dataclass
class _Seq:
    blocks: list[int]
    length: int = 0  # tokens already in the cache


class PagedRunner:
    """Feeds token chunks of named sequences through ``forward``; returns logits.

    Args:
      config, graphdef, state: a loaded model.
      block_size: S.
      num_blocks: B, including the null block.
      max_blocks: MB, the block-table width.
      rows: R, padded row count of the attention metadata.
      backend: attention backend.
      seed: for the block shuffle; unused blocks are poisoned with NaN.
    """

    def __init__(self, config, graphdef, state, *, block_size=16, num_blocks=64, max_blocks=16,
                 rows=4, backend="reference", seed=0, cache_dtype=jnp.float32):
        self.config, self.graphdef, self.state = config, graphdef, state
        self.block_size, self.max_blocks, self.rows, self.backend = block_size, max_blocks, rows, backend
        rng = np.random.default_rng(seed)
        self.free = [int(b) for b in rng.permutation(np.arange(1, num_blocks))]
        cache = init_kv_cache(config, num_blocks, block_size, cache_dtype, stacked=is_scanned(state))
        # Poison every slot: anything read before it is written shows up as NaN.
        self.kv_cache = type(cache)(k=tuple(jnp.full_like(k, jnp.nan) for k in cache.k),
                                    v=tuple(jnp.full_like(v, jnp.nan) for v in cache.v))
        self.seqs: dict[str, _Seq] = {}

    def step(self, chunks: dict[str, list[int]], pad_tokens: int = 0,
             all_logits: bool = False) -> dict[str, np.ndarray]:
        """Runs one step; ``chunks`` maps sequence name → new token ids (one row each).

        Returns the logits of each row's last token, f32[V] (or f32[n, V] for every
        new token when ``all_logits``).
        """
        ids, pos, slots, qsl, seq_lens, table, logit_idx = [], [], [], [0], [], [], []
        owners = []
        for name, toks in chunks.items():
            seq = self.seqs.setdefault(name, _Seq(blocks=[]))
            start = seq.length
            for j, tok in enumerate(toks):
                p = start + j
                if p // self.block_size >= len(seq.blocks):
                    seq.blocks.append(self.free.pop())
                ids.append(tok)
                pos.append(p)
                slots.append(seq.blocks[p // self.block_size] * self.block_size + p % self.block_size)
            seq.length += len(toks)
            qsl.append(qsl[-1] + len(toks))
            seq_lens.append(seq.length)
            table.append(seq.blocks + [NULL_BLOCK] * (self.max_blocks - len(seq.blocks)))
            n = len(toks)
            idx = list(range(qsl[-1] - n, qsl[-1])) if all_logits else [qsl[-1] - 1]
            owners.append((name, len(logit_idx), len(idx)))
            logit_idx.extend(idx)
        for _ in range(pad_tokens):  # padding tokens write into the null block
            ids.append(0)
            pos.append(0)
            slots.append(NULL_BLOCK * self.block_size)
        while len(seq_lens) < self.rows:
            qsl.append(qsl[-1])
            seq_lens.append(0)
            table.append([NULL_BLOCK] * self.max_blocks)
        i32 = lambda x: jnp.asarray(np.asarray(x, np.int32))  # noqa: E731
        inputs = StepInputs(
            input_ids=i32(ids), positions=i32(pos),
            attention=AttentionMetadata(slot_mapping=i32(slots), block_table=i32(table),
                                        seq_lens=i32(seq_lens), query_start_loc=i32(qsl)),
            logits_indices=i32(logit_idx))
        logits, self.kv_cache = forward(self.graphdef, self.state, self.kv_cache, inputs,
                                        backend=self.backend)
        logits = np.asarray(logits)
        out = {}
        for name, first, n in owners:
            out[name] = logits[first:first + n] if all_logits else logits[first]
        return out
