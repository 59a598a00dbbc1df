"""Structured-output token bitmasks: packed i32[R, W] words, W = ceil(V / 32).

Bit ``t % 32`` of word ``t // 32`` of a row is 1 when token t is allowed —
llguidance's layout (``LLMatcher.compute_bitmask``: little-endian u32 words),
read here as int32. A row of all ones (every word -1) allows every token:
the unconstrained rows and padding rows of a masked step carry it.

``apply_token_bitmask`` (jitted inside the sampler) sets the logits of
disallowed tokens to -inf before every other sampler stage, so penalties,
top-k / top-p / min-p, the draws and the logprobs all see the masked
distribution. ``pack_bitmask`` / ``unpack_bitmask`` are the NumPy host side.

Shape legend: R rows, V vocab, W = ceil(V / 32) words.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

ALL_ALLOWED = -1  # an i32 word with every bit set


def num_words(vocab_size: int) -> int:
    """W = ceil(V / 32)."""
    return -(-vocab_size // 32)


def apply_token_bitmask(logits: jax.Array, bitmask: jax.Array) -> jax.Array:
    """f32[R, V] logits with the disallowed tokens at -inf.

    Args:
      logits: f32[R, V].
      bitmask: i32[R, W], W = ceil(V / 32) (see the module docstring).

    Raises:
      ValueError: at trace time, when the shapes disagree.
    """
    rows, vocab = logits.shape
    if bitmask.shape != (rows, num_words(vocab)):
        raise ValueError(f"bitmask {bitmask.shape} does not fit logits {logits.shape}: "
                         f"need ({rows}, {num_words(vocab)})")
    bits = jnp.arange(32, dtype=jnp.int32)  # [32]
    allowed = (bitmask[:, :, None] >> bits) & 1  # [R, W, 32]; (x >> 31) & 1 is the sign bit
    allowed = allowed.reshape(rows, -1)[:, :vocab] != 0  # [R, V] bool
    return jnp.where(allowed, logits, -jnp.inf)


def pack_bitmask(allowed: np.ndarray) -> np.ndarray:
    """bool[R, V] -> i32[R, W] (host, NumPy)."""
    rows, vocab = allowed.shape
    padded = np.zeros((rows, num_words(vocab) * 32), bool)
    padded[:, :vocab] = allowed
    return np.packbits(padded, axis=1, bitorder="little").view("<u4").astype(
        np.uint32).view(np.int32)


def unpack_bitmask(bitmask: np.ndarray, vocab_size: int) -> np.ndarray:
    """i32[R, W] -> bool[R, V] (host, NumPy)."""
    words = np.ascontiguousarray(bitmask, dtype=np.int32).astype("<i4").view(np.uint8)
    return np.unpackbits(words, axis=1, bitorder="little")[:, :vocab_size].astype(bool)
