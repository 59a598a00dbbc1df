"""Exact per-row threshold search for top-k / top-p cuts past the candidates.

Problem, per row: values z f32[V] and weights w >= 0 (1 for top-k, the
kept probabilities for top-p); S(v) = sum of w over z >= v; find the largest
value v of the row with S(v) >= target. The answer is returned as a threshold
t whose kept set {z >= t} equals {z >= v}.

Method, without sorting V and without data-dependent control flow: bisection
on the floats' ordered bit patterns (``ordered_key``: u32 keys in the order of
the f32 values). The interval [lo, hi) keeps S(lo) >= target > S(hi); each
step takes the key midpoint, computes S(mid) in one pass over the row and
moves lo or hi to it. An interval of at most 2**32 keys is halved (rounding
up) to width 1 in exactly ``NUM_STEPS`` = 32 steps, so the search is a
fixed-trip loop (unrolled; no ``while`` in the HLO, no host round trip on a
GPU). At width 1 no float lies strictly between lo and hi, and lo is a value
of the row (else S(lo) = S(hi) < target), so lo is the answer itself: no
final scan. Rows that are not active, or whose interval is already one key
wide, keep their bounds (``jnp.where``).

If rounding breaks the invariant at an end (the caller's S(lo) computed in
another summation order falls just below the target), every step moves the
same way and the search returns that end; callers pass bounds that are
correct answers in that case.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

NUM_STEPS = 32  # halving 2**32 keys, rounding up, leaves one key after 32 steps

_SIGN = jnp.uint32(0x80000000)


def ordered_key(x: jax.Array) -> jax.Array:
    """u32 keys ordered as the f32 values (-inf lowest, +inf highest; no NaN)."""
    bits = lax.bitcast_convert_type(x, jnp.uint32)
    return jnp.where(bits & _SIGN, ~bits, bits | _SIGN)


def key_to_float(key: jax.Array) -> jax.Array:
    """Inverse of ``ordered_key``."""
    bits = jnp.where(key & _SIGN, key & ~_SIGN, ~key)
    return lax.bitcast_convert_type(bits, jnp.float32)


def search_threshold(z: jax.Array, weights: jax.Array | None, target: jax.Array,
                     lo: jax.Array, hi: jax.Array, active: jax.Array) -> jax.Array:
    """Per row, a threshold t with {z >= t} = {z >= largest v: S(v) >= target}.

    Args:
      z: f32[R, V] values (-inf allowed, no NaN).
      weights: f32[R, V] w >= 0, or None for w = 1 (S counts tokens).
      target: f32[R].
      lo: f32[R] with S(lo) >= target (not checked).
      hi: f32[R] > lo with S(hi) < target (not checked); the search covers
        [lo, hi).
      active: bool[R]; other rows return ``lo`` (their bounds may be
        anything but NaN).

    Returns:
      f32[R] thresholds, to be compared with z on the device (XLA's CPU
      backend flushes denormals; a threshold may be one).
    """
    def mass_at_or_above(mid: jax.Array) -> jax.Array:  # [R] f32: S(mid)
        ge = z >= mid[:, None]  # [R, V] bool
        if weights is None:
            return jnp.sum(ge, axis=-1, dtype=jnp.int32).astype(jnp.float32)
        return jnp.sum(jnp.where(ge, weights, 0.0), axis=-1)

    lo_k, hi_k = ordered_key(lo), ordered_key(hi)  # [R] u32
    for _ in range(NUM_STEPS):  # fixed trip count: unrolled, no while loop
        open_ = active & (hi_k - lo_k > 1)  # [R] bool; inactive rows may wrap: masked
        mid_k = lo_k + (hi_k - lo_k) // 2  # strictly inside [lo, hi) when open
        up = mass_at_or_above(key_to_float(mid_k)) >= target  # the cut is at or above mid
        lo_k = jnp.where(open_ & up, mid_k, lo_k)
        hi_k = jnp.where(open_ & ~up, mid_k, hi_k)
    return jnp.where(active, key_to_float(lo_k), lo)
