"""The C++ matrix product of few rows (``cpu_kernels.matmul``) against float64 and XLA's product,
and where ``jaxserve.model.llama.linear`` uses it.

Shapes cover both forms of the kernel (with AVX-512 the dot form below 32 rows, the
outer-product form from 32; with 8-lane vectors the dot form at every count), their
register blocks (16 lanes: 4 rows × 6 columns, 64 rows × 6 columns; 8 lanes: 2 rows × 4
columns), work items (48 or 32 columns; 24 columns of one row block), K chunks (128) and
row blocks (up to 64 rows, balanced: 80 rows are 48 + 32), and every tail: rows, columns
and K that are not multiples of them (K: of 16 or 8 lanes).
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import cpu_kernels
from jaxserve.model.llama import linear

pytestmark = [
    pytest.mark.skipif(jax.default_backend() != "cpu", reason="the C++ kernel is the CPU's"),
    pytest.mark.skipif(jax.default_backend() == "cpu" and not cpu_kernels.available(),
                       reason=f"no C++ kernel: {cpu_kernels.unavailable_reason()}"),
]


def _operands(m: int, n: int, k: int, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed + 1000 * m + 10 * n + k)
    return (rng.standard_normal((m, k)).astype(np.float32),
            rng.standard_normal((n, k)).astype(np.float32))


@pytest.mark.parametrize("m", [1, 2, 3, 4, 5, 16, 31, 32, 33, 63, 64, 65, 80, 128, 130, 200])
@pytest.mark.parametrize("n,k", [(1, 1), (6, 16), (47, 15), (49, 17), (96, 100), (300, 576),
                                 (25, 257)])
def test_matches_float64_and_xla(m, n, k):
    x, w = _operands(m, n, k)
    out = np.asarray(jax.jit(cpu_kernels.matmul)(jnp.asarray(x), jnp.asarray(w)))
    exact = x.astype(np.float64) @ w.astype(np.float64).T
    # float32 sums of k products: error bounded by ~k·eps times the sum of |terms|
    scale = np.abs(x).astype(np.float64) @ np.abs(w).astype(np.float64).T
    assert out.shape == (m, n) and out.dtype == np.float32
    np.testing.assert_array_less(np.abs(out - exact), 4 * k * np.finfo(np.float32).eps * scale + 1e-30)
    xla = np.asarray(jax.jit(lambda a, b: a @ b.T)(jnp.asarray(x), jnp.asarray(w)))
    np.testing.assert_allclose(out, xla, rtol=1e-4, atol=1e-4 * np.sqrt(k))


def test_leading_axes_and_non_finite_rows():
    """x [..., K] keeps its leading axes; a NaN row stays in its own outputs."""
    x, w = _operands(6, 50, 64)
    x = x.reshape(2, 3, 64)
    x[1, 2, 5] = np.nan
    out = np.asarray(cpu_kernels.matmul(jnp.asarray(x), jnp.asarray(w)))
    assert out.shape == (2, 3, 50)
    assert np.isnan(out[1, 2]).all()
    np.testing.assert_allclose(out[0], x[0] @ w.T, rtol=1e-5, atol=1e-4)
    np.testing.assert_allclose(out[1, :2], x[1, :2] @ w.T, rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("m,n,k", [(0, 5, 8), (3, 0, 8), (3, 5, 0), (40, 0, 8), (40, 5, 0)])
def test_empty_operands(m, n, k):
    """No rows, no columns, or K = 0 (every output the empty sum, 0), in both forms."""
    out = np.asarray(cpu_kernels.matmul(jnp.ones((m, k), jnp.float32), jnp.ones((n, k), jnp.float32)))
    assert out.shape == (m, n)
    np.testing.assert_array_equal(out, np.zeros((m, n), np.float32))


@pytest.mark.parametrize("x_shape,w_shape,dtype,match", [
    ((4, 8), (3, 9), jnp.float32, "K"),
    ((4, 8), (3, 8, 1), jnp.float32, "K"),
    ((4, 8), (3, 8), jnp.bfloat16, "float32"),
])
def test_refuses_bad_operands(x_shape, w_shape, dtype, match):
    with pytest.raises(ValueError, match=match):
        cpu_kernels.matmul(jnp.zeros(x_shape, jnp.float32), jnp.zeros(w_shape, dtype))


def _uses_kernel(x, w, **kwargs) -> bool:
    text = jax.jit(lambda a, b: linear(a, b, **kwargs)).lower(x, w).as_text()
    return cpu_kernels.MATMUL_TARGET in text


def test_the_row_cut_follows_the_builds_vector_width():
    """-march=native: the library has the AVX-512 forms (16 lanes) exactly where the CPU has
    AVX-512F (/proc/cpuinfo); without them (8 lanes) float32 products of more than 32 rows
    and quantized ones of more than 64 go to XLA."""
    flags = next(line for line in open("/proc/cpuinfo") if line.startswith("flags")).split()
    assert cpu_kernels.has_avx512() == ("avx512f" in flags)
    assert cpu_kernels.matmul_lanes() == (16 if "avx512f" in flags else 8)
    assert cpu_kernels.matmul_max_rows() == (
        cpu_kernels.MATMUL_MAX_ROWS if "avx512f" in flags else cpu_kernels.MATMUL_MAX_ROWS_8_LANES)


def test_linear_uses_the_kernel_for_few_float32_rows_only():
    w = jnp.zeros((32, 16), jnp.float32)
    few, many = cpu_kernels.matmul_max_rows(), cpu_kernels.matmul_max_rows() + 1
    assert _uses_kernel(jnp.zeros((few, 16), jnp.float32), w)
    assert _uses_kernel(jnp.zeros((1, 16), jnp.float32), w)
    assert not _uses_kernel(jnp.zeros((many, 16), jnp.float32), w)
    assert not _uses_kernel(jnp.zeros((few, 16), jnp.float32), w, tensor_parallel=True)
    assert not _uses_kernel(jnp.zeros((few, 16), jnp.bfloat16), w.astype(jnp.bfloat16))
    # lowered for a GPU, the CPU kernel is not in the program
    text = jax.jit(linear).trace(jnp.zeros((4, 16), jnp.float32), w).lower(
        lowering_platforms=("cuda",)).as_text()
    assert cpu_kernels.MATMUL_TARGET not in text and "dot_general" in text


@pytest.mark.parametrize("m", sorted({1, 2, 3, 16, 64, cpu_kernels.MATMUL_MAX_ROWS,
                                      cpu_kernels.MATMUL_MAX_ROWS + 1,
                                      cpu_kernels.matmul_max_rows(),
                                      cpu_kernels.matmul_max_rows() + 1}))
def test_linear_agrees_with_xla_on_either_side_of_the_threshold(m):
    x, w = _operands(m, 96, 64, seed=7)
    out = np.asarray(jax.jit(linear)(jnp.asarray(x), jnp.asarray(w)))
    np.testing.assert_allclose(out, x.astype(np.float64) @ w.astype(np.float64).T,
                               rtol=1e-5, atol=1e-4)
