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
candidate when k <= KC, and the top-p threshold is a candidate's value when
every kept value is one (the kept set ends at or above the KC-th candidate,
e.g. whenever top-k <= KC is on); both are exact, ties included (tokens tied
with the KC-th candidate outside the candidates are counted into the top-p
mass). A threshold past the candidates (k > KC, or a nucleus that reaches
below the KC-th candidate) comes from the exact search in
``threshold_search.py`` (32 passes over the row each for top-k and top-p).
There is no data-dependent control flow: with ``search=True`` both searches
and the full-vocabulary kept mass always run, for all rows, and only the
rows that need them take their results (``jnp.where``); with
``search=False`` they are left out of the graph, and the thresholds are exact
only for rows that provably stay inside the candidates (the host's choice,
``variants.py``).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

from jaxserve.worker.sampler.threshold_search import search_threshold
from jaxserve.worker.sampler.top_k import exact_top_k

NUM_CANDIDATES = 128  # KC: candidates from lax.top_k; the fast path covers k <= KC


def filter_threshold(logits: jax.Array, temperature: jax.Array, top_k: jax.Array,
                     top_p: jax.Array, min_p: jax.Array, active: jax.Array,
                     num_candidates: int = NUM_CANDIDATES, *, search: bool = True
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
      search: static; include the exact searches past the candidates. When
        False, a row's threshold is exact only if it needs no search: top-k
        off or <= KC, and top-p off or top-k <= KC on (or KC >= V).

    Returns:
      threshold: f32[R] in z units; keep the tokens with z >= threshold.
      cand_z: f32[R, KC], the KC largest z per row, descending (ties: lower
        token id first; cand_ids[:, 0] is the argmax of ``logits``).
      cand_ids: i32[R, KC], their token ids.
    """
    vocab = logits.shape[1]
    kc = min(num_candidates, vocab)
    t = temperature[:, None]  # [R, 1]
    # The barriers keep XLA from folding the consumers' slices into top_k's
    # sort, which would stop the CPU backend from using its partial-sort TopK.
    # One per output: a barrier over top_k's whole tuple crashes XLA's
    # TopkDecomposer (CPU, compiling for several devices), which expects
    # every user of a TopK to take one element.
    cand_l, cand_ids = exact_top_k(logits, kc)  # no sort of V on a GPU (top_k.py)
    cand_l, cand_ids = lax.optimization_barrier(cand_l), lax.optimization_barrier(cand_ids)
    # ^ [R, KC] f32, i32
    cand_z = cand_l / t  # [R, KC]; bitwise equal to (logits / t) at cand_ids
    zmax, zlast = cand_z[:, 0], cand_z[:, kc - 1]  # [R]
    z = logits / t  # [R, V]
    zmin = jnp.min(logits, axis=-1) / temperature  # [R]; = min(z)
    # Past the candidates, a search covers [row min, zlast]: every token
    # above zlast is a candidate, so S just above zlast is known.
    hi = jnp.nextafter(zlast, jnp.inf)  # [R]

    t_min = jnp.where(min_p > 0, zmax + jnp.log(min_p), -jnp.inf)  # [R]
    k_on = active & (top_k > 0) & (top_k < vocab)
    k_fast = top_k <= kc
    kth = jnp.take_along_axis(cand_z, jnp.clip(top_k - 1, 0, kc - 1)[:, None], axis=-1)[:, 0]
    t_k = jnp.where(k_on & k_fast, kth, -jnp.inf)  # [R]
    if search:
        # Past the candidates t_k <= zlast, so it only matters while t_min < zlast.
        k_slow = k_on & ~k_fast & (t_min < zlast)  # [R] bool
        found = search_threshold(z, None, top_k.astype(jnp.float32), zmin, hi, k_slow)
        t_k = jnp.where(k_slow, found, t_k)
    t1 = jnp.where(active, jnp.maximum(t_min, t_k), -jnp.inf)  # [R]

    p_on = active & (top_p < 1.0)
    # Every kept value is a candidate's value; tokens outside the candidates
    # can only be kept as ties of zlast.
    covered = (t1 >= zlast) | (kc == vocab)  # [R] bool
    q = jnp.where(cand_z >= t1[:, None], jnp.exp(cand_z - zmax[:, None]), 0.0)  # [R, KC]
    cum = jnp.cumsum(q, axis=-1)  # [R, KC]
    n_tied = jnp.sum(z >= zlast[:, None], axis=-1, dtype=jnp.int32) - kc  # [R] outside ties
    tied = (t1 <= zlast) & (n_tied > 0)
    tied_mass = jnp.where(tied, n_tied.astype(jnp.float32) * jnp.exp(zlast - zmax), 0.0)
    mass = cum[:, -1] + tied_mass  # [R]: sum over z >= t1 of exp(z - zmax), covered rows
    if search:
        weights = jnp.where(z >= t1[:, None], jnp.exp(z - zmax[:, None]), 0.0)  # [R, V]
        mass = jnp.where(covered, mass, jnp.sum(weights, axis=-1))
    target = top_p * mass  # [R]
    hit = cum >= target[:, None]  # [R, KC]
    t_p = jnp.take_along_axis(cand_z, jnp.argmax(hit, axis=-1)[:, None], axis=-1)[:, 0]
    # No candidate reaches the target: in a covered row the nucleus is every
    # kept token (the lowest kept value is t1 = zlast); else it ends below zlast.
    p_slow = p_on & ~jnp.any(hit, axis=-1)  # [R] bool
    t_p = jnp.where(p_slow, t1, t_p)
    if search:
        p_past = p_slow & ~covered
        found = search_threshold(z, weights, target, jnp.maximum(t1, zmin), hi, p_past)
        t_p = jnp.where(p_past, found, t_p)
    threshold = jnp.where(p_on, jnp.maximum(t1, t_p), t1)
    return threshold, cand_z, cand_ids


def needs_filter(top_k: jax.Array, top_p: jax.Array, min_p: jax.Array,
                 random_rows: jax.Array, vocab_size: int) -> jax.Array:
    """bool[R]: random rows with any of top-k, top-p, min-p switched on."""
    return random_rows & (((top_k > 0) & (top_k < vocab_size)) | (top_p < 1.0) | (min_p > 0))
