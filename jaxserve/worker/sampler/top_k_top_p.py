"""Min-p, top-k and top-p as one per-row threshold on the processed logits.

All three filters keep a prefix of the tokens sorted by z = logits / T, so
each row's result is one threshold ``t``: keep the tokens with ``z >= t``.
Tokens tied with the threshold are always kept together (vLLM's sort-based
masks instead cut ties at an arbitrary sort position), so the result never
depends on token order:

- min-p (vLLM's ``MinPLogitsProcessor``): drop ``p_i < min_p * max_j p_j``,
  i.e. ``t_min = max(z) + log(min_p)``.
- top-k: ``t_k`` = the k-th largest z.
- top-p (after min-p and top-k, over the renormalized kept distribution, as
  vLLM): ``t_p`` = the largest value v whose tokens ``z >= v`` hold at least
  ``top_p`` of the mass. The final threshold is ``max(t_min, t_k, t_p)``.

Computing them without sorting V: ``lax.top_k`` gives the KC largest logits
per row (the candidates; KC = ``NUM_CANDIDATES``). The top-k threshold is a
candidate when k <= KC, and the top-p threshold is one when the nucleus ends
inside the candidates; both are exact, ties included. Rows where a threshold
falls past the candidates (k > KC, or a nucleus wider than KC) get it from the
exact search in ``threshold_search.py`` (about 10-20 passes over the row), run
under ``lax.cond`` only when such a row exists.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

from jaxserve.worker.sampler.threshold_search import search_threshold

NUM_CANDIDATES = 128  # KC: candidates from lax.top_k; the fast path covers k <= KC


def filter_threshold(logits: jax.Array, temperature: jax.Array, top_k: jax.Array,
                     top_p: jax.Array, min_p: jax.Array, active: jax.Array,
                     num_candidates: int = NUM_CANDIDATES
                     ) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Thresholds of min-p, top-k and top-p on z = logits / temperature.

    Args:
      logits: f32[R, V] after bias, bans and penalties.
      temperature: f32[R] > 0 (greedy rows: pass 1).
      top_k: i32[R]; <= 0 or >= V = off.
      top_p: f32[R] in (0, 1]; 1 = off.
      min_p: f32[R] in [0, 1]; 0 = off.
      active: bool[R]; inactive rows get threshold -inf (no filtering).
      num_candidates: static KC (capped at V).

    Returns:
      threshold: f32[R] in z units; keep the tokens with z >= threshold.
      cand_z: f32[R, KC], the KC largest z per row, descending (ties: lower
        token id first; cand_ids[:, 0] is the argmax of ``logits``).
      cand_ids: i32[R, KC], their token ids.
    """
    vocab = logits.shape[1]
    kc = min(num_candidates, vocab)
    t = temperature[:, None]  # [R, 1]
    # The barrier keeps XLA from folding the consumers' slices into top_k's
    # sort, which would stop the CPU backend from using its partial-sort TopK.
    cand_l, cand_ids = lax.optimization_barrier(lax.top_k(logits, kc))  # [R, KC] f32, i32
    cand_z = cand_l / t  # [R, KC]; bitwise equal to (logits / t) at cand_ids
    zmax, zlast = cand_z[:, 0], cand_z[:, kc - 1]  # [R]
    z = logits / t  # [R, V]

    t_min = jnp.where(min_p > 0, zmax + jnp.log(min_p), -jnp.inf)  # [R]
    k_on = active & (top_k > 0) & (top_k < vocab)
    k_fast = top_k <= kc
    kth = jnp.take_along_axis(cand_z, jnp.clip(top_k - 1, 0, kc - 1)[:, None], axis=-1)[:, 0]
    t_k = jnp.where(k_on & k_fast, kth, -jnp.inf)
    # Past the candidates t_k <= zlast, so it only matters while t_min < zlast.
    k_slow = k_on & ~k_fast & (t_min < zlast)

    # Past the candidates, the search covers [row min, zlast]: every token
    # above zlast is a candidate, so S just above zlast is known.
    hi = jnp.nextafter(zlast, jnp.inf)  # [R]
    above = cand_z > zlast[:, None]  # [R, KC]
    n_above = jnp.sum(above, axis=-1, dtype=jnp.int32)  # [R]

    def kth_by_search(t_k: jax.Array) -> jax.Array:
        zmin = jnp.min(logits, axis=-1) / temperature  # [R]; = min(z)
        found = search_threshold(z, None, jnp.ones_like, top_k.astype(jnp.float32), zmin, hi,
                                 n_above.astype(jnp.float32), n_above, k_slow, kc)
        return jnp.where(k_slow, found, t_k)

    t_k = lax.cond(jnp.any(k_slow), kth_by_search, lambda t_k: t_k, t_k)
    t1 = jnp.where(active, jnp.maximum(t_min, t_k), -jnp.inf)  # [R]

    p_on = active & (top_p < 1.0)
    inside = (t1 > zlast) | (kc == vocab)  # every kept token is a candidate
    q = jnp.where(cand_z >= t1[:, None], jnp.exp(cand_z - zmax[:, None]), 0.0)  # [R, KC]
    cum = jnp.cumsum(q, axis=-1)  # [R, KC]

    def kept_mass(_: jax.Array) -> jax.Array:  # sum over z >= t1 of exp(z - zmax)
        e = jnp.where(z >= t1[:, None], jnp.exp(z - zmax[:, None]), 0.0)
        return jnp.where(inside, cum[:, -1], jnp.sum(e, axis=-1))

    mass = lax.cond(jnp.any(p_on & ~inside), kept_mass, lambda c: c, cum[:, -1])
    target = top_p * mass  # [R]
    hit = cum >= target[:, None]  # [R, KC]
    t_p = jnp.take_along_axis(cand_z, jnp.argmax(hit, axis=-1)[:, None], axis=-1)[:, 0]
    p_slow = p_on & ~jnp.any(hit, axis=-1)

    def nucleus_by_search(t_p: jax.Array) -> jax.Array:
        def weight_of(values: jax.Array) -> jax.Array:
            return jnp.where(values >= t1[:, None], jnp.exp(values - zmax[:, None]), 0.0)
        zmin = jnp.min(logits, axis=-1) / temperature  # [R]
        s_above = jnp.sum(jnp.where(above, q, 0.0), axis=-1)  # [R]
        found = search_threshold(z, weight_of(z), weight_of, target, jnp.maximum(t1, zmin), hi,
                                 s_above, n_above, p_slow, kc)
        return jnp.where(p_slow, found, t_p)

    t_p = lax.cond(jnp.any(p_slow), nucleus_by_search, lambda t_p: t_p, t_p)
    threshold = jnp.where(p_on, jnp.maximum(t1, t_p), t1)
    return threshold, cand_z, cand_ids


def needs_filter(top_k: jax.Array, top_p: jax.Array, min_p: jax.Array,
                 random_rows: jax.Array, vocab_size: int) -> jax.Array:
    """bool[R]: random rows with any of top-k, top-p, min-p switched on."""
    return random_rows & (((top_k > 0) & (top_k < vocab_size)) | (top_p < 1.0) | (min_p > 0))
