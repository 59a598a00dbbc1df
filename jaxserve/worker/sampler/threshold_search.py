"""Exact per-row threshold search for top-k / top-p cuts past the candidates.

Problem, per row: values z f32[V] and weights w >= 0 (1 for top-k, the
kept probabilities for top-p); S(v) = sum of w over z >= v; find the largest
value v of the row with S(v) >= target. The answer is returned as a threshold
t whose kept set {z >= t} equals {z >= v}.

Method, without sorting V: bisection on an interval [lo, hi) that keeps
S(lo) >= target > S(hi), one pass over the row per step computing S(mid) and
count(z >= mid) together. Midpoints alternate between the value midpoint
(narrows fast where tokens are dense) and the midpoint of the floats' ordered
bit patterns (guarantees the interval shrinks to a single float within 64
steps). A row stops once at most F tokens lie in [lo, hi) or the interval
holds one float; the loop runs while any row is open (typically 10-20 steps).
Then the F largest values below hi (``lax.top_k``) are scanned in order with
S = S(hi) + their cumulative weight: the first that reaches the target is the
answer. A collapsed interval answers lo.
"""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp
from jax import lax

MAX_STEPS = 64  # alternate bit-pattern midpoints halve 2**32 patterns in <= 64 steps

_SIGN = jnp.uint32(0x80000000)


def ordered_key(x: jax.Array) -> jax.Array:
    """u32 keys ordered as the f32 values (-inf lowest, +inf highest; no NaN)."""
    bits = lax.bitcast_convert_type(x, jnp.uint32)
    return jnp.where(bits & _SIGN, ~bits, bits | _SIGN)


def key_to_float(key: jax.Array) -> jax.Array:
    """Inverse of ``ordered_key``."""
    bits = jnp.where(key & _SIGN, key & ~_SIGN, ~key)
    return lax.bitcast_convert_type(bits, jnp.float32)


def search_threshold(z: jax.Array, weights: jax.Array | None,
                     weight_of: Callable[[jax.Array], jax.Array], target: jax.Array,
                     lo: jax.Array, hi: jax.Array, s_hi: jax.Array, n_hi: jax.Array,
                     active: jax.Array, num_finish: int) -> jax.Array:
    """Per row, a threshold t with {z >= t} = {z >= largest v: S(v) >= target}.

    Args:
      z: f32[R, V] values (-inf allowed, no NaN).
      weights: f32[R, V] w, or None for w = 1 (S counts tokens).
      weight_of: maps values f32[R, F] to their weights (must agree with
        ``weights`` elementwise).
      target: f32[R].
      lo: f32[R] with S(lo) >= target (not checked).
      hi: f32[R] > lo with S(hi) < target; the search covers [lo, hi).
      s_hi: f32[R] = S(hi); n_hi: i32[R] = count(z >= hi).
      active: bool[R]; other rows return ``lo`` without being searched.
      num_finish: static F, the width of the final top-k scan.

    Returns:
      f32[R] thresholds, to be compared with z on the device (XLA's CPU
      backend flushes denormals; a threshold may be one).
    """
    vocab = z.shape[1]

    def stats(mid: jax.Array) -> tuple[jax.Array, jax.Array]:
        ge = z >= mid[:, None]  # [R, V]
        if weights is None:
            n = jnp.sum(ge, axis=-1, dtype=jnp.int32)
            return n.astype(jnp.float32), n
        return lax.reduce((jnp.where(ge, weights, 0.0), ge.astype(jnp.int32)),
                          (jnp.float32(0), jnp.int32(0)),
                          lambda a, b: (a[0] + b[0], a[1] + b[1]), (1,))

    def is_open(lo, hi, n_lo, n_hi):
        one_float = ordered_key(hi) - ordered_key(lo) <= 1
        return active & ~one_float & (n_lo - n_hi > num_finish)

    def cond(state):
        step, lo, hi, _, n_lo, n_hi = state
        return (step < MAX_STEPS) & jnp.any(is_open(lo, hi, n_lo, n_hi))

    def body(state):
        step, lo, hi, s_hi, n_lo, n_hi = state
        open_ = is_open(lo, hi, n_lo, n_hi)
        lo_k, hi_k = ordered_key(lo), ordered_key(hi)
        key_mid = key_to_float(lo_k + (hi_k - lo_k) // 2)  # strictly inside when open
        value_mid = lo * 0.5 + hi * 0.5
        use_value = (step % 2 == 0) & (value_mid > lo) & (value_mid < hi)
        mid = jnp.where(use_value, value_mid, key_mid)  # [R]
        s, n = stats(mid)
        up = open_ & (s >= target)  # the cut is at or above mid
        down = open_ & ~up
        return (step + 1, jnp.where(up, mid, lo), jnp.where(down, mid, hi),
                jnp.where(down, s, s_hi), jnp.where(up, n, n_lo), jnp.where(down, n, n_hi))

    n_lo = jnp.full_like(n_hi, vocab)  # an upper bound on count(z >= lo)
    _, lo, hi, s_hi, _, _ = lax.while_loop(cond, body, (0, lo, hi, s_hi, n_lo, n_hi))

    # Finish: scan the F largest values below hi.
    below = jnp.where(z < hi[:, None], z, -jnp.inf)  # [R, V]
    vals, _ = lax.optimization_barrier(lax.top_k(below, num_finish))  # [R, F] descending
    cum = s_hi[:, None] + jnp.cumsum(weight_of(vals), axis=-1)  # [R, F]
    hit = cum >= target[:, None]
    first = jnp.take_along_axis(vals, jnp.argmax(hit, axis=-1)[:, None], axis=-1)[:, 0]
    found = jnp.any(hit, axis=-1) & (first >= lo)
    return jnp.where(active & found, first, lo)
