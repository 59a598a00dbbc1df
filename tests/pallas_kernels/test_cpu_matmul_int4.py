"""The C++ int4 product (``cpu_kernels.matmul_i4``) against a float64 numpy oracle, and the
jnp form (``matmul_i4_reference``) that lowering for another platform keeps.

The oracle unpacks the bytes itself, from the layout's definition (each run of 32
inputs is 16 bytes; byte j: input j in the low nibble, input j + 16 in the high one;
weight = nibble · step + offset of the input's group), in float64. Shapes cover
both forms of the shared kernel code (the dot form below 32 rows, the outer-product
form from 32, which reads float32 copies of int4 chunks), K of one run, of chunks
and a partial chunk (the outer form's chunks are 128 inputs), group sizes 32, 64
and 128, and odd N past the 6-column register blocks.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import cpu_kernels

pytestmark = [
    pytest.mark.skipif(jax.default_backend() != "cpu", reason="the C++ kernel is the CPU's"),
    pytest.mark.skipif(jax.default_backend() == "cpu" and not cpu_kernels.available(),
                       reason=f"no C++ kernel: {cpu_kernels.unavailable_reason()}"),
]


def _pack(q: np.ndarray) -> np.ndarray:
    """int4 values [N, K] in [0, 15] → bytes [N, K / 2] (the layout, written out)."""
    n, k = q.shape
    out = np.zeros((n, k // 2), np.uint8)
    for run in range(k // 32):
        for j in range(16):
            lo, hi = q[:, 32 * run + j], q[:, 32 * run + 16 + j]
            out[:, 16 * run + j] = lo | (hi << 4)
    return out


def _operands(m: int, n: int, k: int, group: int, seed: int = 0):
    rng = np.random.default_rng(seed + 1000 * m + 10 * n + k + group)
    q = rng.integers(0, 16, (n, k))
    step = rng.uniform(1e-3, 2e-2, (n, k // group))
    offset = -7.5 * step + rng.uniform(-1e-2, 1e-2, (n, k // group))
    return (rng.standard_normal((m, k)).astype(np.float32), q, _pack(q),
            np.stack([step, offset], axis=-1).astype(np.float32))


def _oracle(x, q, scale):
    group = q.shape[1] // scale.shape[1]
    step, offset = (np.repeat(scale[..., i].astype(np.float64), group, axis=1) for i in (0, 1))
    w = q.astype(np.float64) * step + offset
    exact = x.astype(np.float64) @ w.T
    # float32 sums of k products: error bounded by ~k·eps times the sum of |terms|
    return exact, np.abs(x).astype(np.float64) @ np.abs(w).T


@pytest.mark.parametrize("m", [1, 2, 3, 5, 7, 8, 9, 16, 31, 32, 33, 64])
@pytest.mark.parametrize("n,k,group", [(1, 32, 32), (6, 64, 32), (47, 96, 32), (13, 192, 64),
                                       (25, 256, 128), (49, 320, 32)])
def test_matches_float64_oracle(m, n, k, group):
    x, q, packed, scale = _operands(m, n, k, group)
    args = tuple(map(jnp.asarray, (x, packed, scale)))
    out = np.asarray(jax.jit(cpu_kernels.matmul_i4)(*args))
    exact, bound = _oracle(x, q, scale)
    assert out.shape == (m, n) and out.dtype == np.float32
    tol = 4 * (k + 1) * np.finfo(np.float32).eps * bound + 1e-30
    np.testing.assert_array_less(np.abs(out - exact), tol)
    ref = np.asarray(jax.jit(cpu_kernels.matmul_i4_reference)(*args))
    np.testing.assert_array_less(np.abs(ref - exact), tol)


@pytest.mark.parametrize("m", [8, 9, 17, 31])
def test_a_row_is_the_same_bits_alone_and_among_many(m):
    """Below the outer form's 32 rows every row's sums run in one order whatever the row count:
    from 8 rows an 8-lane build widens each column block once into a float32 copy for all
    the rows (matmul.cc, ``Panel``), which must give the very bits of widening in place, as
    one row does."""
    x, q, packed, scale = _operands(m, 47, 320, 64)
    many = np.asarray(jax.jit(cpu_kernels.matmul_i4)(*map(jnp.asarray, (x, packed, scale))))
    for i in (0, m // 2, m - 1):
        one = np.asarray(cpu_kernels.matmul_i4(*map(jnp.asarray, (x[i:i + 1], packed, scale))))
        np.testing.assert_array_equal(many[i], one[0])


def test_extreme_nibbles_and_leading_axes():
    """0 and 15 everywhere (the mask and shift's extremes), x [..., K] keeps its axes."""
    rng = np.random.default_rng(3)
    x = rng.standard_normal((2, 3, 64)).astype(np.float32)
    q = np.where(rng.random((50, 64)) < 0.5, 0, 15)
    scale = np.stack([rng.uniform(0.5, 1.5, (50, 2)), rng.uniform(-8, 0, (50, 2))],
                     axis=-1).astype(np.float32)
    out = np.asarray(cpu_kernels.matmul_i4(*map(jnp.asarray, (x, _pack(q), scale))))
    assert out.shape == (2, 3, 50)
    exact, bound = _oracle(x.reshape(6, 64), q, scale)
    np.testing.assert_allclose(out.reshape(6, 50), exact, rtol=0, atol=1e-5 * bound.max())


@pytest.mark.parametrize("m,n,k", [(0, 5, 32), (3, 0, 32), (3, 5, 0), (40, 0, 32), (40, 5, 0)])
def test_empty_operands(m, n, k):
    """No rows, no columns, or K = 0 (every output the empty sum, 0), in both forms."""
    out = np.asarray(cpu_kernels.matmul_i4(jnp.ones((m, k), jnp.float32),
                                           jnp.full((n, k // 2), 0x99, jnp.uint8),
                                           jnp.ones((n, k // 32, 2), jnp.float32)))
    assert out.shape == (m, n)
    np.testing.assert_array_equal(out, np.zeros((m, n), np.float32))


@pytest.mark.parametrize("x_shape,q_shape,s_shape,q_dtype,match", [
    ((4, 64), (3, 31), (3, 2, 2), jnp.uint8, "K / 2"),
    ((4, 64), (3, 32), (4, 2, 2), jnp.uint8, "scale"),
    ((4, 64), (3, 32), (3, 4, 2), jnp.uint8, "power of two >= 32"),  # G = 16
    ((4, 96), (3, 48), (3, 2, 2), jnp.uint8, "power of two"),  # G = 48
    ((4, 64), (3, 32), (3, 2), jnp.uint8, "scale"),
    ((4, 64), (3, 32), (3, 2, 1), jnp.uint8, "scale"),
    ((4, 64), (3, 32), (3, 2, 2), jnp.int8, "uint8"),
])
def test_refuses_bad_operands(x_shape, q_shape, s_shape, q_dtype, match):
    with pytest.raises(ValueError, match=match):
        cpu_kernels.matmul_i4(jnp.zeros(x_shape, jnp.float32), jnp.zeros(q_shape, q_dtype),
                              jnp.ones(s_shape, jnp.float32))
