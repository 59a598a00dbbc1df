"""Exact ``lax.top_k`` over the vocabulary without sorting it on a GPU.

XLA's GPU backend runs ``lax.top_k`` with k <= 16 as one pass of its TopK
kernel (custom call ``__gpu$TopK``) and any larger k as a sort of the whole
row (checked in the optimized HLO of a deviceless H100 compile, jax 0.12:
k = 20 and k = 128 over f32[256, 49152] each became
``sort(f32[256,49152], s32[256,49152])``). The sampler takes k = 128
candidates (``top_k_top_p.NUM_CANDIDATES``) and up to 20 logprobs per step, so
on a GPU ``exact_top_k`` takes them in rounds of 16: each round is the TopK
kernel over the row, whose winners are then masked out (set to -inf) for the
next. The rounds' values come out in descending order and ties keep the lower
token id first, so the result equals ``lax.top_k``'s. Other platforms (the CPU
has a partial-sort TopK) call ``lax.top_k`` as it is; the choice is made when
the function is lowered (a primitive with a ``cuda`` lowering rule of its
own), so the lowered program holds one path and no branch.

Masking with -inf needs the row's own -inf values kept apart: they are
lifted to the lowest finite float for the rounds and put back in the values
returned. Logits are finite or -inf (a banned token), so this is exact for
them; a row that holds the lowest finite float itself would see it reported
as -inf.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax
from jax.extend.core import Primitive
from jax.interpreters import mlir

GPU_TOP_K_KERNEL_MAX_K = 16  # largest k XLA's GPU TopK kernel takes; above it, a sort of V


def exact_top_k(x: jax.Array, k: int) -> tuple[jax.Array, jax.Array]:
    """The k largest values of each row and their indices, as ``lax.top_k``.

    Args:
      x: f32[R, V].
      k: static, 1 <= k <= V.

    Returns:
      values f32[R, k] descending (ties: lower index first) and indices i32[R, k].

    Raises:
      ValueError: k outside [1, V].
    """
    if not 1 <= k <= x.shape[-1]:
        raise ValueError(f"k must be in [1, {x.shape[-1]}], got {k}")
    if k <= GPU_TOP_K_KERNEL_MAX_K:
        return lax.top_k(x, k)
    values, indices = _top_k_p.bind(x, k=k)
    return values, indices


def top_k_in_rounds(x: jax.Array, k: int, per_round: int = GPU_TOP_K_KERNEL_MAX_K
                    ) -> tuple[jax.Array, jax.Array]:
    """``lax.top_k(x, k)`` as ceil(k / per_round) top-``per_round`` passes (the GPU path).

    Public for the CPU test that checks it against ``lax.top_k``.
    """
    lowest = jnp.finfo(x.dtype).min
    rest = jnp.where(x == -jnp.inf, lowest, x)  # [R, V]; -inf is the mask below
    rows = jnp.arange(x.shape[0])[:, None]  # [R, 1]
    values, indices = [], []
    for start in range(0, k, per_round):
        v, i = lax.top_k(rest, min(per_round, k - start))  # [R, n]
        values.append(v)
        indices.append(i)
        if start + per_round < k:
            rest = rest.at[rows, i].set(-jnp.inf)
    v = jnp.concatenate(values, axis=1)  # [R, k]
    return jnp.where(v == lowest, -jnp.inf, v), jnp.concatenate(indices, axis=1)


def _abstract_eval(x, *, k):
    shape = (*x.shape[:-1], k)
    return (jax.core.ShapedArray(shape, x.dtype), jax.core.ShapedArray(shape, jnp.int32))


def _default_lowering(x, *, k):
    return list(lax.top_k(x, k))


def _cuda_lowering(x, *, k):
    return list(top_k_in_rounds(x, k))


_top_k_p = Primitive("jaxserve_top_k")
_top_k_p.multiple_results = True
_top_k_p.def_abstract_eval(_abstract_eval)
_top_k_p.def_impl(lambda x, *, k: _default_lowering(x, k=k))
mlir.register_lowering(_top_k_p, mlir.lower_fun(_default_lowering, multiple_results=True))
mlir.register_lowering(_top_k_p, mlir.lower_fun(_cuda_lowering, multiple_results=True),
                       platform="cuda")
