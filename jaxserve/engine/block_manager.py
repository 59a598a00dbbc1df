"""The logical KV cache: block ids, ref counts, prefix caching, LRU eviction (jax-free).

Blocks ``1 .. num_blocks - 1`` belong to the pool; block 0 is the null block
(padding target, ``jaxserve.model.kv_cache.NULL_BLOCK``) and is never
handed out. Each block is in exactly one of three states:

- **used**: ``ref_cnt > 0``, held by one sequence, or by several when shared
  through the prefix cache;
- **cached**: ``ref_cnt == 0`` with a hash: free, but its tokens can still
  be hit; evicted (unhashed) when allocated;
- **free**: ``ref_cnt == 0``, no hash.

Cached and free blocks sit in one LRU free queue (an ``OrderedDict``: O(1)
append, pop of the oldest, and removal on a hit). A finished sequence's
blocks are appended last-block-first, so its tail is evicted before its
prefix (vLLM V1's order).

Prefix caching hashes *full* blocks in a chain (vLLM V1): block ``i``'s
hash is ``sha256(hash[i - 1] || token ids of block i)`` and the chain starts
from ``sha256(salt)``, so equal hashes mean equal salts and equal token
prefixes. SHA-256 keeps collisions (which would silently serve another
prompt's KV) out of reach. A block is registered when the step that fills
it is scheduled (its KV is written by that step before any later reader
runs; see ``scheduler``); one block per hash (a duplicate computed
concurrently stays unhashed). A prompt found whole in the cache still recomputes its last
token: hits are taken only among blocks that end before the last token.
"""

from __future__ import annotations

import array
import hashlib
from collections import OrderedDict

from jaxserve.engine.request import Request

NULL_BLOCK = 0  # mirrors jaxserve.model.kv_cache.NULL_BLOCK (that module imports jax)


def root_hash(salt: str | None) -> bytes:
    """The parent hash of a chain's first block, from the request's cache salt."""
    return hashlib.sha256(b"jaxserve-prefix\0" + (salt or "").encode()
                          + (b"\1" if salt is not None else b"\0")).digest()


def block_hash(parent: bytes, token_ids: list[int]) -> bytes:
    """sha256(parent || int32 token ids), 32 bytes."""
    return hashlib.sha256(parent + array.array("i", token_ids).tobytes()).digest()


class BlockManager:
    """Allocates, shares, caches and frees KV blocks for sequences.

    Args:
      num_blocks: B, including the null block.
      block_size: S, tokens per block.
      enable_caching: register blocks of every cacheable sequence. When off,
        only sequences marked ``cacheable`` (the ``n > 1`` siblings, under a
        per-request salt) hash and share blocks.
    """

    def __init__(self, num_blocks: int, block_size: int, enable_caching: bool):
        if num_blocks < 2:
            raise ValueError(f"num_blocks must be >= 2, got {num_blocks}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_caching = enable_caching
        self.ref_cnt = [0] * num_blocks
        self.hash_of: list[bytes | None] = [None] * num_blocks
        self.free_queue: OrderedDict[int, None] = OrderedDict.fromkeys(range(1, num_blocks))
        self.cached: dict[bytes, int] = {}
        self.num_registered: dict[tuple[str, int], int] = {}  # blocks registered per sequence
        self.query_tokens = 0
        self.hit_tokens = 0

    # ------------------------------------------------------------------ queries
    @property
    def num_free_blocks(self) -> int:
        """Blocks that can be allocated now (free + cached)."""
        return len(self.free_queue)

    @property
    def num_total_blocks(self) -> int:
        """Blocks in the pool (B - 1: the null block is not)."""
        return self.num_blocks - 1

    def num_cached_free_blocks(self) -> int:
        """Free blocks that still hold a cached prefix (O(B); for stats)."""
        return sum(1 for b in self.free_queue if self.hash_of[b] is not None)

    # ------------------------------------------------------------------ hashing
    def _hash_full_blocks(self, req: Request, num_blocks: int) -> None:
        """Extends ``req.block_hashes`` to its first ``num_blocks`` full blocks."""
        hashes, s = req.block_hashes, self.block_size
        parent = hashes[-1] if hashes else root_hash(req.cache_salt)
        for i in range(len(hashes), num_blocks):
            parent = block_hash(parent, req.token_ids[i * s:(i + 1) * s])
            hashes.append(parent)

    def find_cached_blocks(self, req: Request) -> list[int]:
        """The longest run of ``req``'s leading full blocks found in the cache.

        Only blocks that end before the sequence's last token count, so at
        least one token is always computed (its logits are sampled).
        """
        if not req.cacheable:
            return []
        max_blocks = (req.num_tokens - 1) // self.block_size
        self._hash_full_blocks(req, max_blocks)
        hits = []
        for h in req.block_hashes[:max_blocks]:
            block = self.cached.get(h)
            if block is None:
                break
            hits.append(block)
        return hits

    # --------------------------------------------------------------- allocation
    def allocate_slots(self, req: Request, num_total_tokens: int,
                       cached_blocks: list[int] | None = None) -> bool:
        """Gives ``req`` blocks for its first ``num_total_tokens`` tokens.

        Args:
          req: the sequence; its ``block_ids`` grow.
          num_total_tokens: tokens that must have a slot after this call.
          cached_blocks: prefix-cache hits to take first (a waiting sequence
            with no blocks yet).

        Returns:
          False, changing nothing, when too few blocks are free.
        """
        cached_blocks = cached_blocks or []
        need = -(-num_total_tokens // self.block_size) - len(req.block_ids) - len(cached_blocks)
        evictable_hits = sum(1 for b in cached_blocks if self.ref_cnt[b] == 0)
        if need > len(self.free_queue) - evictable_hits:
            return False
        ref_cnt, free_queue = self.ref_cnt, self.free_queue
        for b in cached_blocks:  # touch: a cached free block leaves the free queue
            if ref_cnt[b] == 0:
                del free_queue[b]
            ref_cnt[b] += 1
        if cached_blocks:
            req.block_ids.extend(cached_blocks)
            self.num_registered[req.key] = len(cached_blocks)
        for _ in range(max(need, 0)):
            b, _ = free_queue.popitem(last=False)
            h = self.hash_of[b]
            if h is not None:  # evict the least recently freed cached block
                self.hash_of[b] = None
                if self.cached.get(h) == b:
                    del self.cached[h]
            ref_cnt[b] = 1
            req.block_ids.append(b)
        return True

    def free(self, req: Request) -> None:
        """Releases ``req``'s blocks (last block first) and forgets them."""
        ref_cnt, free_queue = self.ref_cnt, self.free_queue
        for b in reversed(req.block_ids):
            ref_cnt[b] -= 1
            assert ref_cnt[b] >= 0, f"block {b} freed twice"
            if ref_cnt[b] == 0:
                free_queue[b] = None
        req.block_ids = []
        self.num_registered.pop(req.key, None)

    def cache_full_blocks(self, req: Request) -> None:
        """Registers ``req``'s blocks that are full of computed (or scheduled) tokens."""
        if not req.cacheable:
            return
        num_full = req.num_computed_tokens // self.block_size
        done = self.num_registered.get(req.key, 0)
        if num_full <= done:
            return
        self._hash_full_blocks(req, num_full)
        for i in range(done, num_full):
            b, h = req.block_ids[i], req.block_hashes[i]
            if self.hash_of[b] is None and h not in self.cached:
                self.cached[h] = b
                self.hash_of[b] = h
        self.num_registered[req.key] = num_full

    def record_lookup(self, num_query_tokens: int, num_hit_tokens: int) -> None:
        """Counts a prefix-cache lookup of a sequence that got scheduled."""
        self.query_tokens += num_query_tokens
        self.hit_tokens += num_hit_tokens
