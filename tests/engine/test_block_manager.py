"""Block manager: allocation, prefix hits, salts, LRU eviction order, counters.

Expected values are worked out by hand from the rules in the module
docstring (block size 4 throughout).
"""

from __future__ import annotations

import random

import pytest

from jaxserve.engine.block_manager import BlockManager, block_hash, root_hash
from jaxserve.engine.request import Request, RequestGroup
from jaxserve.sampling_params import SamplingParams

S = 4


def _req(tokens, salt=None, cacheable=True, rid="r"):
    return Request(rid, 0, RequestGroup(rid), list(tokens), SamplingParams(), None, 0.0, (0, 0),
                   1000, (), cacheable, salt)


def _tokens(n, seed):
    rng = random.Random(seed)
    return [rng.randrange(1, 1000) for _ in range(n)]


def _compute(bm, req, n):
    """Allocates and 'computes' the first n tokens, as the scheduler does."""
    assert bm.allocate_slots(req, n)
    req.num_computed_tokens = n
    bm.cache_full_blocks(req)


def test_allocates_every_block_but_the_null_block_then_refuses():
    bm = BlockManager(9, S, enable_caching=True)
    a, b = _req(_tokens(20, 0)), _req(_tokens(12, 1), rid="b")
    assert bm.allocate_slots(a, 20)  # 5 blocks
    assert not bm.allocate_slots(b, 16)  # 4 more > 3 left: nothing changes
    assert b.block_ids == [] and bm.num_free_blocks == 3
    assert bm.allocate_slots(b, 12)
    assert sorted(a.block_ids + b.block_ids) == list(range(1, 9))
    bm.free(a)
    bm.free(b)
    assert bm.num_free_blocks == 8 and set(bm.ref_cnt) == {0}


def test_prefix_hit_takes_full_blocks_and_counts_refs():
    bm = BlockManager(32, S, enable_caching=True)
    shared = _tokens(10, 2)  # 2 full blocks + 2 tokens
    a = _req(shared + _tokens(3, 3), rid="a")
    _compute(bm, a, a.num_tokens)  # 13 tokens: 3 full blocks registered
    b = _req(shared + _tokens(5, 4), rid="b")
    hits = bm.find_cached_blocks(b)
    assert hits == a.block_ids[:2]  # the third block differs
    assert bm.allocate_slots(b, b.num_tokens, hits)
    assert b.block_ids[:2] == a.block_ids[:2] and b.block_ids[2] not in a.block_ids
    assert [bm.ref_cnt[x] for x in a.block_ids] == [2, 2, 1, 1]


def test_fully_cached_prompt_recomputes_its_last_token():
    bm = BlockManager(32, S, enable_caching=True)
    prompt = _tokens(12, 5)  # exactly 3 blocks
    a = _req(prompt, rid="a")
    _compute(bm, a, 12)
    b = _req(prompt, rid="b")
    # Only blocks ending before the last token: (12 - 1) // 4 = 2 blocks.
    assert bm.find_cached_blocks(b) == a.block_ids[:2]


def test_cache_salt_isolates_requests():
    bm = BlockManager(32, S, enable_caching=True)
    prompt = _tokens(9, 6)
    _compute(bm, _req(prompt, salt="alice", rid="a"), 9)
    assert bm.find_cached_blocks(_req(prompt, salt="bob", rid="b")) == []
    assert bm.find_cached_blocks(_req(prompt, rid="c")) == []  # no salt != any salt
    assert len(bm.find_cached_blocks(_req(prompt, salt="alice", rid="d"))) == 2
    assert root_hash(None) != root_hash("") != root_hash("alice")


def test_hash_chain_depends_on_parent():
    t = [1, 2, 3, 4]
    assert block_hash(b"x", t) != block_hash(b"y", t)
    assert block_hash(b"x", t) != block_hash(b"x", [1, 2, 3, 5])


def test_non_cacheable_request_neither_hits_nor_registers():
    bm = BlockManager(32, S, enable_caching=False)
    prompt = _tokens(9, 7)
    a = _req(prompt, cacheable=False, rid="a")
    _compute(bm, a, 9)
    assert bm.cached == {} and a.block_hashes == []
    assert bm.find_cached_blocks(_req(prompt, cacheable=False, rid="b")) == []


def test_lru_eviction_order_tail_blocks_first_oldest_request_first():
    bm = BlockManager(9, S, enable_caching=True)  # 8 blocks
    a = _req(_tokens(12, 8), rid="a")
    b = _req(_tokens(12, 9), rid="b")
    _compute(bm, a, 12)
    _compute(bm, b, 12)
    a_blocks, b_blocks = list(a.block_ids), list(b.block_ids)
    bm.free(a)  # freed first: evicted first, its last block before its first
    bm.free(b)
    assert len(bm.cached) == 6
    c = _req(_tokens(20, 10), rid="c")
    assert bm.allocate_slots(c, 20)  # 5 blocks: 2 never used, then a's 3 (tail first)
    assert c.block_ids[2:] == a_blocks[::-1]
    assert set(bm.cached.values()) == set(b_blocks)  # b's prefix survives
    d = _req(b.token_ids, rid="d")
    assert bm.find_cached_blocks(d) == b_blocks[:2]


def test_hit_on_a_cached_free_block_takes_it_out_of_the_free_queue():
    bm = BlockManager(6, S, enable_caching=True)  # 5 blocks
    a = _req(_tokens(9, 11), rid="a")
    _compute(bm, a, 9)
    first_two = a.block_ids[:2]
    bm.free(a)
    b = _req(a.token_ids[:8] + _tokens(4, 12), rid="b")
    hits = bm.find_cached_blocks(b)
    assert hits == first_two
    assert bm.allocate_slots(b, 12, hits)  # 2 hits + 1 new
    assert all(x not in bm.free_queue for x in b.block_ids)
    # Needing more than the free queue minus the evictable hits fails cleanly.
    e = _req(a.token_ids[:8] + _tokens(12, 13), rid="e")
    hits_e = bm.find_cached_blocks(e)
    assert hits_e == first_two
    assert not bm.allocate_slots(e, 20, hits_e) and e.block_ids == []


def test_lookup_counters():
    bm = BlockManager(16, S, enable_caching=True)
    bm.record_lookup(20, 8)
    bm.record_lookup(10, 0)
    assert (bm.query_tokens, bm.hit_tokens) == (30, 8)


def test_rejects_a_pool_without_blocks():
    with pytest.raises(ValueError):
        BlockManager(1, S, enable_caching=True)
