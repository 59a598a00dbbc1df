"""The kernel's launch is sized to the step's live work, and split-K fills an H100.

Shapes only: the launch grid is read from the ``pallas_call`` of abstract
Llama-3-8B problems (32 query heads over 8 KV heads, head_dim 128, bfloat16,
block size 16), with R taken from the worker's own layout
(``StepLayout.for_bucket``: R = min(T, max_num_seqs)). Nothing runs.
"""

import pytest

from jaxserve.worker.inputs import StepLayout
from pallas_kernels.tuning import H100_NUM_SMS, H100_TARGET_CONFIG, PROGRAMS_PER_SM
from tests.pallas_kernels.shapes import LLAMA3_8B, Problem
from tests.pallas_kernels.test_lowering import pallas_calls


def launch_grid(num_tokens: int, max_num_seqs: int, max_context: int = 8192) -> tuple[int, ...]:
    """The attention kernel's grid (NT, K, NS) in the worker's T bucket at this max_num_seqs."""
    rows = StepLayout.for_bucket(num_tokens, max_num_seqs, LLAMA3_8B["block_size"]).num_rows
    problem = Problem(num_tokens=num_tokens, num_rows=rows, max_context=max_context, **LLAMA3_8B)
    (call,) = pallas_calls(problem)
    return tuple(call.params["grid_mapping"].grid)


@pytest.mark.parametrize("bucket", [1, 16])
def test_batch1_decode_grid_does_not_depend_on_max_num_seqs(bucket):
    """A batch-1 decode (in the T = 1 bucket of the default ladder, or padded up
    to T = 16) launches the same grid at max_num_seqs 16 and 256: rows without
    tokens get no tile, and the tile bound min(T, ceil(T / block_q) + R) stays <= T."""
    assert launch_grid(bucket, 16) == launch_grid(bucket, 256)
    num_tiles = launch_grid(bucket, 256)[0]
    assert num_tiles <= bucket


def test_llama3_8b_batch1_decode_fills_the_h100():
    """Batch-1 decode at 8k context: 1 tile x 8 KV heads x 33 splits = 264 programs,
    two per SM of the H100 SXM (no fixed split cap)."""
    assert f"core_count: {H100_NUM_SMS}" in H100_TARGET_CONFIG.read_text()
    grid = launch_grid(1, 256)
    assert grid == (1, 8, 33)
    assert grid[0] * grid[1] * grid[2] >= PROGRAMS_PER_SM * H100_NUM_SMS == 264


@pytest.mark.parametrize("num_tokens,splits", [(4, 9), (16, 3), (64, 1), (256, 1)])
def test_more_live_rows_split_less(num_tokens, splits):
    """Decode buckets with more live rows (T rows x 8 KV heads) need fewer splits to
    reach 264 programs; 64 rows or more already fill the GPU without split-K."""
    grid = launch_grid(num_tokens, 256)
    assert grid[2] == splits
    assert grid[0] * grid[1] * grid[2] >= PROGRAMS_PER_SM * H100_NUM_SMS


def test_splits_never_exceed_the_key_tiles():
    """At 2k context the 64-key tiles of a row number 32: more splits would be empty."""
    assert launch_grid(1, 256, max_context=2048) == (1, 8, 32)
