"""The kernel's tile schedule covers every token exactly once, within its row.

Checked against a plain-Python reading of the metadata for random ragged
steps (empty rows, padding rows, padding tokens, rows longer than a tile).
"""

import jax
import numpy as np
import pytest

from pallas_kernels.rpa_kernel import num_query_tiles, tile_schedule

T, R = 40, 6


@pytest.mark.parametrize("block_q", [1, 4, 16])
def test_tiles_cover_each_token_once(block_q):
    schedule = jax.jit(lambda qsl, sl: tile_schedule(qsl, sl, num_tokens=T, block_q=block_q))
    rng = np.random.default_rng(block_q)
    for _ in range(25):
        q_lens = rng.integers(0, 12, R) * (rng.random(R) < 0.8)
        while q_lens.sum() > T:
            q_lens[rng.integers(R)] //= 2
        qsl = np.concatenate([[0], np.cumsum(q_lens)]).astype(np.int32)
        ctx = rng.integers(0, 50, R) * (q_lens > 0)
        seq_lens = (q_lens + ctx).astype(np.int32)
        tiles = np.asarray(schedule(qsl, seq_lens))
        assert tiles.shape == (num_query_tiles(T, R, block_q), 5)
        assert len(tiles) <= T
        owner = np.full(T, -1)
        for row, start, end, kv_len, pos_offset in tiles:
            assert end - start <= block_q
            for t in range(start, end):
                assert owner[t] == -1, "token served twice"
                owner[t] = row
                r = np.searchsorted(qsl, t, side="right") - 1
                if t < qsl[-1]:  # a real token: its row, kv length and position
                    assert row == r and kv_len == seq_lens[r]
                    assert t + pos_offset == ctx[r] + (t - qsl[r])
                else:  # a padding token: no keys
                    assert kv_len == 0
        assert (owner >= 0).all(), "token served by no tile"


def test_one_token_rows_fill_the_bound_exactly():
    """T one-token rows (a full decode bucket) need T tiles: the bound min(T, ...) is tight."""
    t, block_q = 12, 4
    qsl = np.arange(t + 1, dtype=np.int32)
    tiles = np.asarray(tile_schedule(qsl, np.full(t, 5, np.int32), num_tokens=t, block_q=block_q))
    assert tiles.shape == (num_query_tiles(t, t, block_q), 5) == (t, 5)
    assert [(start, end) for _, start, end, _, _ in tiles] == [(i, i + 1) for i in range(t)]
