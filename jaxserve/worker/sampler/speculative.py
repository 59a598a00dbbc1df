"""Verifying draft tokens (speculative decoding): which sampled tokens a row keeps.

A row with d draft tokens runs d + 1 sampling *slots* in one step: slot j
samples the token after the row's query token ``last - d + j`` (slot 0: after
its last accepted token; slot j > 0: after draft j). Draft j + 1 is the token
slot j would have to sample for the row to go on. The row keeps the slots up to
and including the first whose sample differs from its draft (the last slot has
no draft and always differs): the accepted drafts, then one token of its own.

Why sampling every slot and comparing is the rejection-sampling rule of
speculative decoding (Leviathan et al., 2023, "Fast Inference from Transformers
via Speculative Decoding", algorithm 1; Chen et al., 2023) for proposals that
are one token with certainty (n-gram prompt lookup, vLLM's ``ngram``): with the
proposal q = δ(d) the rule accepts d with probability min(1, p(d) / q(d)) = p(d)
and otherwise draws from norm(max(0, p − q)), which is p restricted to tokens
other than d. Drawing x ~ p and accepting when x = d does exactly that: x = d
with probability p(d), and given x ≠ d, x is distributed as p restricted to
the other tokens. So every kept token is distributed as the unspeculated
sampler's, and greedy rows (argmax) keep a draft exactly when it is the argmax.
Each slot's draw comes from the row's key at that slot's position
(``gumbel.row_keys``), so a seeded row's tokens are the ones it would sample
without speculation, wherever its drafts are accepted or not. (A proposer
whose proposal q is a distribution — a draft model sampling — needs the
general rule with its q; it has its own function when it lands.)

Fixed shapes, no data-dependent control flow: a cumulative sum of
mismatches, compared within each row's run of slots.

Shape legend: R sampling slots (a request bucket), a row's slots contiguous.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def verify_drafts(token_ids: jax.Array, draft: jax.Array, start: jax.Array
                  ) -> tuple[jax.Array, jax.Array]:
    """Which slots' tokens each row keeps.

    Args:
      token_ids: i32[R] the token sampled at each slot.
      draft: i32[R] the draft each slot's sample is compared with; -1 at a
        row's last slot (and in padding slots).
      start: i32[R] the index of the first slot of each slot's row (a slot
        of a row without drafts, and a padding slot, is its own row).

    Returns:
      (kept bool[R]: the slots whose tokens the row keeps — its accepted
      drafts and the slot after them; last bool[R]: the row's last kept slot,
      one per row, whose token is the row's new last token).
    """
    mismatch = (token_ids != draft).astype(jnp.int32)  # [R]; 1 at every row's last slot
    before = jnp.cumsum(mismatch) - mismatch  # [R] mismatches at earlier slots
    kept = before == before[start]  # no mismatch since the row's first slot
    return kept, kept & (mismatch == 1)


def count_earlier_drafts(counts: jax.Array, draft: jax.Array, start: jax.Array) -> jax.Array:
    """Output counts i32[R, V] with each slot's earlier drafts of its row added.

    A slot samples after the row's drafts before it, so its repetition /
    presence / frequency penalties count them as output (as they would count
    those tokens once accepted).

    Args:
      counts: i32[R, V] each slot's row's output counts before the step.
      draft: i32[R], start: i32[R] as in ``verify_drafts``.
    """
    r = draft.shape[0]
    slot = jnp.arange(r, dtype=jnp.int32)
    earlier = ((start[None, :] == start[:, None]) & (slot[None, :] < slot[:, None])
               & (draft[None, :] >= 0))  # [R target, R source]
    target = jnp.broadcast_to(slot[:, None], (r, r))
    token = jnp.broadcast_to(jnp.maximum(draft, 0)[None, :], (r, r))
    return counts.at[target, token].add(earlier.astype(counts.dtype))
