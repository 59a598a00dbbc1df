"""The C++ int8 product (``cpu_kernels.matmul_i8``) against a float64 numpy oracle, and the
jnp form (``matmul_i8_reference``) that lowering for another platform keeps.

Shapes cover both forms of the shared kernel code (the dot form below 32 rows, the
outer-product form from 32: ``test_cpu_matmul.py`` explains its blocks), K not a
multiple of 16 (the int8 loads take 16 values), odd N past the 6-column register
blocks, and empty operands. The oracle is ``(x @ q.T) * scale`` in float64.
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


def _operands(m: int, n: int, k: int, seed: int = 0):
    rng = np.random.default_rng(seed + 1000 * m + 10 * n + k)
    return (rng.standard_normal((m, k)).astype(np.float32),
            rng.integers(-127, 128, (n, k)).astype(np.int8),
            rng.uniform(1e-3, 2e-2, n).astype(np.float32))


def _oracle(x, q, scale):
    exact = (x.astype(np.float64) @ q.astype(np.float64).T) * scale.astype(np.float64)
    # float32 sums of k products: error bounded by ~k·eps times the sum of |terms|
    bound = (np.abs(x).astype(np.float64) @ np.abs(q).astype(np.float64).T) * scale
    return exact, bound


@pytest.mark.parametrize("m", [1, 2, 5, 31, 32, 33, 65, 130])
@pytest.mark.parametrize("n,k", [(1, 1), (6, 16), (47, 15), (49, 17), (96, 100), (25, 257)])
def test_matches_float64_oracle(m, n, k):
    x, q, scale = _operands(m, n, k)
    out = np.asarray(jax.jit(cpu_kernels.matmul_i8)(*map(jnp.asarray, (x, q, scale))))
    exact, bound = _oracle(x, q, scale)
    assert out.shape == (m, n) and out.dtype == np.float32
    np.testing.assert_array_less(np.abs(out - exact),
                                 4 * (k + 1) * np.finfo(np.float32).eps * bound + 1e-30)
    ref = np.asarray(jax.jit(cpu_kernels.matmul_i8_reference)(*map(jnp.asarray, (x, q, scale))))
    np.testing.assert_array_less(np.abs(ref - exact),
                                 4 * (k + 1) * np.finfo(np.float32).eps * bound + 1e-30)


def test_extreme_values_and_leading_axes():
    """-127 and 127 everywhere (no int8 overflow in the widening), x [..., K] keeps its axes."""
    rng = np.random.default_rng(3)
    x = rng.standard_normal((2, 3, 40)).astype(np.float32)
    q = np.where(rng.random((50, 40)) < 0.5, -127, 127).astype(np.int8)
    scale = rng.uniform(0.5, 1.5, 50).astype(np.float32)
    out = np.asarray(cpu_kernels.matmul_i8(*map(jnp.asarray, (x, q, scale))))
    assert out.shape == (2, 3, 50)
    exact, bound = _oracle(x.reshape(6, 40), q, scale)
    np.testing.assert_allclose(out.reshape(6, 50), exact, rtol=0, atol=1e-5 * bound.max())


@pytest.mark.parametrize("m,n,k", [(0, 5, 8), (3, 0, 8), (3, 5, 0), (40, 0, 8), (40, 5, 0)])
def test_empty_operands(m, n, k):
    """No rows, no columns, or K = 0 (every output the empty sum, 0), in both forms."""
    out = np.asarray(cpu_kernels.matmul_i8(jnp.ones((m, k), jnp.float32),
                                           jnp.ones((n, k), jnp.int8), jnp.ones((n,), jnp.float32)))
    assert out.shape == (m, n)
    np.testing.assert_array_equal(out, np.zeros((m, n), np.float32))


@pytest.mark.parametrize("x_shape,q_shape,s_shape,q_dtype,match", [
    ((4, 8), (3, 9), (3,), jnp.int8, "K"),
    ((4, 8), (3, 8), (4,), jnp.int8, "scale"),
    ((4, 8), (3, 8), (3,), jnp.float32, "int8"),
])
def test_refuses_bad_operands(x_shape, q_shape, s_shape, q_dtype, match):
    with pytest.raises(ValueError, match=match):
        cpu_kernels.matmul_i8(jnp.zeros(x_shape, jnp.float32), jnp.zeros(q_shape, q_dtype),
                              jnp.ones(s_shape, jnp.float32))
