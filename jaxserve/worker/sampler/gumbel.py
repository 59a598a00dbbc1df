"""Per-row PRNG keys and Gumbel-max sampling.

Method: the Gumbel-max trick, ``argmax_i (z_i + g_i)`` with i.i.d. standard
Gumbel ``g_i``, samples ``i`` with probability ``softmax(z)_i``. It is chosen
over inverse-CDF sampling because it needs no normalization, no cumulative
sum and no search, works directly on logits with -inf for filtered tokens,
and is exactly what vLLM's exponential race computes (``argmax p_i / E_i``
with ``E_i ~ Exp(1)`` is ``argmax log p_i - log E_i``, and ``-log E_i`` is
Gumbel); we stay in log space, which keeps large logits and tiny
probabilities exact.

Over the full vocabulary the trick is applied in two levels so that only
about 2 * sqrt(V) Gumbel draws are needed per row instead of V (on this CPU,
generating V threefry draws per row costs far more than the rest of the
sampler): the vocabulary is split into NBK blocks of BS tokens; a block is
drawn by Gumbel-max over the blocks' log-masses ``log sum_{i in b} exp(z_i)``,
then a token inside it by Gumbel-max over its logits. This is exact, because
the maximum of Gumbel-perturbed logits over a block is itself Gumbel with the
block's log-mass as location, independent of which token attains it.

Keys: a seeded row's key is ``fold_in(PRNGKey(seed), position)`` (threefry);
an unseeded row's is ``fold_in(fold_in(server_key, row), position)``. Every
draw of a row comes from its key alone, so a seeded request's tokens depend
only on (seed, position, its own logits), never on neighbours, row index or
padding.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp

_BLOCK_STREAM, _TOKEN_STREAM, _CANDIDATE_STREAM = 0, 1, 2


def row_keys(seeds: jax.Array, seeded: jax.Array, positions: jax.Array,
             server_key: jax.Array) -> jax.Array:
    """One threefry key per row for the token at ``positions``.

    Args:
      seeds: u32[R, 2] seed words (high, low).
      seeded: bool[R].
      positions: i32[R].
      server_key: a threefry key (typed, shape ()) or its raw data u32[2];
        the caller should pass a fresh one every step.

    Returns:
      key<threefry2x32>[R].

    Raises:
      ValueError: ``server_key`` is not a threefry key.
    """
    server_data = _threefry_data(server_key)  # [2] u32
    server = jax.random.wrap_key_data(server_data, impl="threefry2x32")
    rows = jnp.arange(seeds.shape[0], dtype=jnp.uint32)
    unseeded = jax.random.key_data(jax.vmap(jax.random.fold_in, (None, 0))(server, rows))
    data = jnp.where(seeded[:, None], seeds.astype(jnp.uint32), unseeded)  # [R, 2] u32
    keys = jax.random.wrap_key_data(data, impl="threefry2x32")
    return jax.vmap(jax.random.fold_in)(keys, positions.astype(jnp.uint32))


def _threefry_data(key: jax.Array) -> jax.Array:
    if jnp.issubdtype(key.dtype, jax.dtypes.prng_key):
        data = jax.random.key_data(key)
    else:
        data = jnp.asarray(key)
    if data.shape != (2,) or data.dtype != jnp.uint32:
        raise ValueError("server_key must be one threefry2x32 key (typed, or raw u32[2]), "
                         f"got data {data.dtype}{list(data.shape)}")
    return data


def _gumbel(keys: jax.Array, stream: int, size: int) -> jax.Array:
    """f32[R, size] standard Gumbel noise from each row's key and a stream id."""
    def one(key: jax.Array) -> jax.Array:
        return jax.random.gumbel(jax.random.fold_in(key, stream), (size,), jnp.float32)
    return jax.vmap(one)(keys)


def gumbel_max_candidates(keys: jax.Array, cand_z: jax.Array,
                          threshold: jax.Array) -> jax.Array:
    """Samples among candidate tokens whose z is >= the row's threshold.

    Args:
      keys: key[R].
      cand_z: f32[R, KC] processed logits of the candidates.
      threshold: f32[R]; candidates below it are excluded.

    Returns:
      i32[R], the index of the sampled candidate.
    """
    g = _gumbel(keys, _CANDIDATE_STREAM, cand_z.shape[1])  # [R, KC] f32
    scores = jnp.where(cand_z >= threshold[:, None], cand_z + g, -jnp.inf)
    return jnp.argmax(scores, axis=-1).astype(jnp.int32)


def block_size(vocab_size: int) -> int:
    """BS, the tokens per block of the two-level draw (a trace-time constant).

    The divisor of V nearest sqrt(V) when V factors well (no ragged block:
    reshaping [R, V] to [R, V / BS, BS] costs nothing); otherwise the power
    of two at or below sqrt(V), with a shorter last block.
    """
    root = math.isqrt(vocab_size)
    divisor = max(d for d in range(1, root + 1) if vocab_size % d == 0)
    if divisor + vocab_size // divisor <= 4 * math.sqrt(vocab_size):
        return divisor
    return 1 << max(0, root.bit_length() - 1)


def gumbel_max_full(keys: jax.Array, logits: jax.Array, temperature: jax.Array,
                    threshold: jax.Array) -> jax.Array:
    """Samples from softmax(logits / T) restricted to z = logits / T >= threshold.

    Two-level Gumbel-max (see the module docstring).

    Args:
      keys: key[R].
      logits: f32[R, V].
      temperature: f32[R] > 0.
      threshold: f32[R] in z units; -inf keeps every token.

    Returns:
      i32[R] token ids.
    """
    rows, vocab = logits.shape
    bs = block_size(vocab)
    full = vocab - vocab % bs  # tokens in whole blocks; the rest form one short block
    t = temperature[:, None]  # [R, 1]
    zmax = jnp.max(logits, axis=-1, keepdims=True) / t  # [R, 1]; = max(logits / T)
    z = logits / t  # [R, V] f32
    e = jnp.where(z >= threshold[:, None], jnp.exp(z - zmax), 0.0)  # [R, V]
    # Padding V up to whole blocks would copy [R, V]; a short tail is summed apart.
    block_mass = e[:, :full].reshape(rows, full // bs, bs).sum(axis=-1)  # [R, V // BS]
    if full < vocab:
        block_mass = jnp.concatenate([block_mass, e[:, full:].sum(-1, keepdims=True)], -1)
    nbk = block_mass.shape[1]
    block = jnp.argmax(jnp.log(block_mass) + _gumbel(keys, _BLOCK_STREAM, nbk), axis=-1)
    ids = block[:, None] * bs + jnp.arange(bs)[None, :]  # [R, BS] i32
    valid = ids < vocab
    zb = jnp.take_along_axis(logits, jnp.minimum(ids, vocab - 1), axis=-1) / t  # [R, BS]
    keep = valid & (zb >= threshold[:, None])
    scores = jnp.where(keep, zb + _gumbel(keys, _TOKEN_STREAM, bs), -jnp.inf)
    return jnp.take_along_axis(ids, jnp.argmax(scores, axis=-1)[:, None], axis=-1)[:, 0]
