"""The C++ CPU attention kernel (``cpu_kernels``) against the float64 oracle and the reference.

Same cases and bound as the reference's test (``test_reference.py``): every
unowned cache slot is NaN, block ids past a row's last block are garbage, and
rows mix decode, prefill after cached blocks, empty and padding rows. float8_e4m3fn
caches: the kernel against both on the same caches widened to float32.
"""

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import cpu_kernels
from pallas_kernels.ragged_paged_attention import ragged_paged_attention_reference
from tests.pallas_kernels.attention_cases import make_case, oracle, relative_error

pytestmark = [
    pytest.mark.skipif(jax.default_backend() != "cpu", reason="the C++ kernel is the CPU's"),
    pytest.mark.skipif(jax.default_backend() == "cpu" and not cpu_kernels.available(),
                       reason=f"no C++ kernel: {cpu_kernels.unavailable_reason()}"),
]

BOUND = 1e-5  # float32, as the reference's


def _args(case, dtype=jnp.float32):
    cast = lambda x: jnp.asarray(x, dtype)  # noqa: E731
    return (cast(case.q), cast(case.k_cache), cast(case.v_cache), jnp.asarray(case.block_table),
            jnp.asarray(case.seq_lens), jnp.asarray(case.query_start_loc))


@pytest.mark.parametrize("block_size", [1, 8, 16, 32])
@pytest.mark.parametrize("heads", [(4, 4), (9, 3), (8, 2)], ids=["mha", "gqa3", "gqa4"])
@pytest.mark.parametrize("head_dim", [32, 64, 128])
def test_kernel_matches_oracle(block_size, heads, head_dim):
    rng = np.random.default_rng(block_size * 100 + heads[0] + head_dim)
    case = make_case(rng, num_heads=heads[0], num_kv_heads=heads[1], head_dim=head_dim,
                     block_size=block_size)
    scale = head_dim ** -0.5
    out = np.asarray(jax.jit(functools.partial(cpu_kernels.ragged_paged_attention,
                                               sm_scale=scale))(*_args(case)))
    ref = oracle(case, sm_scale=scale)
    assert np.isfinite(out).all()
    assert relative_error(out, ref) < BOUND
    assert (out[case.query_start_loc[-1]:] == 0).all(), "padding tokens must give zeros"


@pytest.mark.parametrize("window,cap", [(8, None), (None, 5.0), (20, 2.0)])
def test_sliding_window_and_soft_cap(window, cap):
    rng = np.random.default_rng(5)
    case = make_case(rng, num_heads=6, num_kv_heads=2, head_dim=32, block_size=16)
    scale = 32 ** -0.5
    out = np.asarray(cpu_kernels.ragged_paged_attention(
        *_args(case), sm_scale=scale, sliding_window=window, soft_cap=cap))
    ref = oracle(case, sm_scale=scale, sliding_window=window, soft_cap=cap)
    assert relative_error(out, ref) < BOUND


def test_long_rows_many_decodes_agree_with_the_reference():
    """A 300-token prefill (many query tiles, transposed keys) beside 40 decode rows."""
    rng = np.random.default_rng(7)
    rows = [(300, 0), (37, 100)] + [(1, int(c)) for c in rng.integers(1, 400, 40)]
    case = make_case(rng, num_heads=9, num_kv_heads=3, head_dim=64, block_size=16, rows=rows)
    args = _args(case)
    out = cpu_kernels.ragged_paged_attention(*args, sm_scale=0.125)
    ref = ragged_paged_attention_reference(*args, sm_scale=0.125)
    assert relative_error(np.asarray(out), np.asarray(ref)) < BOUND
    assert relative_error(np.asarray(out), oracle(case, sm_scale=0.125)) < BOUND


def test_bfloat16_inputs_are_computed_in_float32():
    rng = np.random.default_rng(3)
    case = make_case(rng, num_heads=4, num_kv_heads=2, head_dim=64, block_size=16)
    for name in ("q", "k_cache", "v_cache"):  # the oracle sees the same rounded inputs
        setattr(case, name, np.asarray(jnp.asarray(getattr(case, name), jnp.bfloat16), np.float32))
    out = cpu_kernels.ragged_paged_attention(*_args(case, jnp.bfloat16), sm_scale=0.125)
    assert out.dtype == jnp.bfloat16
    assert relative_error(np.asarray(out, np.float32), oracle(case, sm_scale=0.125)) < 1e-2


def _fp8_caches(case):
    """The case's caches as float8_e4m3fn (jax arrays), and the case with them widened to
    float32 (what the oracle and the reference see; NaN slots stay NaN)."""
    k8, v8 = (jnp.asarray(x, jnp.float8_e4m3fn) for x in (case.k_cache, case.v_cache))
    widened = dataclasses.replace(case, k_cache=np.asarray(k8, np.float32),
                                  v_cache=np.asarray(v8, np.float32))
    return k8, v8, widened


# (block_size, (N, K), head_dim, sliding_window, soft_cap): the float32 sweep's kinds —
# block sizes, MHA and GQA, head dims, window, soft cap — in four cases (a reference
# compile each); every case has decode, prefill, prefill-after-context, empty and
# padding rows.
FP8_CASES = [
    (16, (9, 3), 64, None, None),  # the demo model's shape
    (1, (4, 4), 32, 8, None),
    (8, (8, 2), 128, None, 5.0),
    (32, (6, 3), 256, 20, 2.0),
]


@pytest.mark.parametrize("block_size,heads,head_dim,window,cap", FP8_CASES)
def test_fp8_cache_matches_the_reference_on_the_widened_cache(block_size, heads, head_dim,
                                                              window, cap):
    rng = np.random.default_rng(block_size * 100 + heads[0] + head_dim)
    case = make_case(rng, num_heads=heads[0], num_kv_heads=heads[1], head_dim=head_dim,
                     block_size=block_size)
    k8, v8, widened = _fp8_caches(case)
    q, _, _, *meta = _args(case)
    kw = dict(sm_scale=head_dim ** -0.5, sliding_window=window, soft_cap=cap)
    out = np.asarray(jax.jit(functools.partial(cpu_kernels.ragged_paged_attention, **kw))(
        q, k8, v8, *meta))
    ref = np.asarray(ragged_paged_attention_reference(*_args(widened), **kw))
    assert out.dtype == np.float32 and np.isfinite(out).all()
    assert relative_error(out, ref) < BOUND
    assert relative_error(out, oracle(widened, **kw)) < BOUND
    assert (out[case.query_start_loc[-1]:] == 0).all(), "padding tokens must give zeros"


def test_fp8_widening_is_exact_for_every_byte():
    """All 256 float8_e4m3fn codes as one value row (H = 256) of a one-token row: the
    output is that row (one key: probability exactly 1), so it shows the kernel's
    widening, which must equal ml_dtypes' and XLA's. Exceptions: the NaN codes 0x7f / 0xff
    read as ±480 (documented: the cache writer never stores them), and -0 (0x80) comes
    out +0 (0 + -0 in the weighted sum), equal in value."""
    codes = np.arange(256, dtype=np.uint8)
    fp8 = codes.view(jnp.float8_e4m3fn)
    expected = fp8.astype(np.float32)  # ml_dtypes
    by_xla = np.asarray(jax.lax.bitcast_convert_type(jnp.asarray(codes), jnp.float8_e4m3fn)
                        .astype(jnp.float32))
    np.testing.assert_array_equal(by_xla.view(np.uint32), expected.view(np.uint32))
    v = jnp.asarray(fp8.reshape(1, 1, 1, 256))
    k = jnp.asarray(np.ones((1, 1, 1, 256), np.float32), jnp.float8_e4m3fn)
    q = jnp.asarray(np.random.default_rng(2).standard_normal((1, 1, 256)), jnp.float32)
    out = np.asarray(cpu_kernels.ragged_paged_attention(
        q, k, v, jnp.zeros((1, 1), jnp.int32), jnp.ones(1, jnp.int32),
        jnp.array([0, 1], jnp.int32), sm_scale=0.1))[0, 0]
    finite = (codes & 0x7f) != 0x7f
    bits_equal = out.view(np.uint32) == expected.view(np.uint32)
    assert bits_equal[finite & (codes != 0x80)].all(), codes[~bits_equal & finite]
    assert out[0x80] == 0
    assert out[0x7f] == 480 and out[0xff] == -480


def test_fp8_cache_reaches_the_kernel_unconverted():
    """The fp8 caches are the custom call's operands as they are: no float32 copy of a
    cache anywhere in the lowered or the compiled program (a convert of the whole cache
    per layer per step is what the fp8 target exists to avoid)."""
    rng = np.random.default_rng(4)
    case = make_case(rng, num_heads=9, num_kv_heads=3, head_dim=64, block_size=16)
    k8, v8, _ = _fp8_caches(case)
    q, _, _, *meta = _args(case)
    lowered = jax.jit(functools.partial(cpu_kernels.ragged_paged_attention, sm_scale=0.125)
                      ).lower(q, k8, v8, *meta)
    mlir = lowered.as_text()
    dims = "x".join(map(str, k8.shape))
    (call,) = [line for line in mlir.splitlines() if "custom_call" in line]
    assert cpu_kernels.F8_TARGET in call
    assert call.count(f"tensor<{dims}xf8E4M3FN>") == 2, call
    assert f"tensor<{dims}xf32>" not in mlir
    hlo = lowered.compile().as_text()
    assert f"f32[{','.join(map(str, k8.shape))}]" not in hlo
    assert f"f8e4m3fn[{','.join(map(str, k8.shape))}]" in hlo


def test_unsupported_head_dim_is_refused():
    q = jnp.zeros((2, 2, 24))
    cache = jnp.zeros((3, 2, 16, 24))
    with pytest.raises(ValueError, match="head_dim"):
        cpu_kernels.ragged_paged_attention(q, cache, cache, jnp.zeros((1, 2), jnp.int32),
                                           jnp.ones(1, jnp.int32), jnp.array([0, 1], jnp.int32),
                                           sm_scale=1.0)


def test_bad_shapes_raise():
    q = jnp.zeros((4, 6, 32))
    cache = jnp.zeros((3, 4, 16, 32))  # 6 heads over 4 KV heads
    with pytest.raises(ValueError, match="multiple"):
        cpu_kernels.ragged_paged_attention(q, cache, cache, jnp.zeros((2, 2), jnp.int32),
                                           jnp.zeros(2, jnp.int32), jnp.zeros(3, jnp.int32),
                                           sm_scale=1.0)


def test_without_a_compiler_the_default_is_the_reference(tmp_path):
    """No compiler (``$CXX`` names none) and nothing built: ``cpu`` is refused with the
    reason, the CPU default falls back to ``reference``. A fresh process: the build is
    attempted once per process."""
    import os
    import subprocess
    import sys

    code = ("import cpu_kernels; from jaxserve.model import attention as a\n"
            "assert not cpu_kernels.available()\n"
            "assert a.default_backend() == 'reference', a.default_backend()\n"
            "try:\n    a.check_backend('cpu')\nexcept ValueError as e:\n    print(e)\n"
            "else:\n    raise SystemExit('cpu was accepted')\n")
    env = {**os.environ, "CXX": str(tmp_path / "no-such-compiler"),
           "JAXSERVE_KERNEL_CACHE": str(tmp_path / "kernels")}
    proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "attention backend 'cpu'" in proc.stdout and "no-such-compiler" in proc.stdout


def test_head_dim_outside_the_kernel_defaults_to_the_reference():
    from jaxserve.model.attention import default_backend

    assert default_backend(head_dim=64) == "cpu"
    assert default_backend(head_dim=80) == "reference"


def test_loading_the_kernel_keeps_subnormals():
    """The library must not switch the process to flush-to-zero / denormals-are-zero
    (what linking with -ffast-math does): every other float computation would change."""
    assert cpu_kernels.available()
    tiny = np.array([1e-40], np.float32)  # a float32 subnormal
    assert (tiny * np.float32(2.0))[0] > 0


def test_concurrent_calls_on_several_devices():
    """One call per simulated CPU device in one program (as under tensor parallelism): the
    calls share XLA's thread pool, and none may wait on helper tasks the pool never runs."""
    from jax.sharding import Mesh, PartitionSpec as P

    devices = jax.devices()
    assert len(devices) >= 2, "tests/conftest.py simulates several CPU devices"
    rng = np.random.default_rng(11)
    rows = [(200, 0)] + [(1, int(c)) for c in rng.integers(1, 300, 20)]
    cases = [make_case(rng, num_heads=8, num_kv_heads=2, head_dim=64, block_size=16, rows=rows)
             for _ in devices]
    stacked = [jnp.stack([jnp.asarray(getattr(c, f)) for c in cases])
               for f in ("q", "k_cache", "v_cache", "block_table", "seq_lens", "query_start_loc")]
    mesh = Mesh(np.array(devices), ("d",))

    def per_device(*args):
        out = cpu_kernels.ragged_paged_attention(*(a[0] for a in args), sm_scale=0.125)
        return out[None]

    run = jax.jit(jax.shard_map(per_device, mesh=mesh, in_specs=(P("d"),) * 6, out_specs=P("d")))
    out = np.asarray(run(*stacked))
    for i, case in enumerate(cases):
        assert relative_error(out[i], oracle(case, sm_scale=0.125)) < BOUND


def test_nan_outside_the_sliding_window_does_not_leak():
    """Keys before a query's window are read (its key chunk starts below it) but must
    not contribute: a NaN value there (a freed or never-written slot) stays out, as in the
    reference. Both layouts: a 16-token prefill (queries in lanes) and a decode row."""
    rng = np.random.default_rng(1)
    head_dim, block_size, ctx = 32, 4, 20
    k = rng.standard_normal((12, 1, block_size, head_dim)).astype(np.float32)
    v = rng.standard_normal((12, 1, block_size, head_dim)).astype(np.float32)
    table = jnp.asarray(np.arange(1, 11, dtype=np.int32)[None])
    v[5, :, 0] = np.nan  # position 16
    k[5, :, 0] = np.nan
    for q_len in (16, 1):
        args = (jnp.asarray(rng.standard_normal((q_len, 1, head_dim)).astype(np.float32)),
                jnp.asarray(k), jnp.asarray(v), table,
                jnp.asarray([ctx + q_len], jnp.int32), jnp.asarray([0, q_len], jnp.int32))
        window = 4  # the first query (position 20) sees 17..20: position 16 is outside
        out = np.asarray(cpu_kernels.ragged_paged_attention(*args, sm_scale=0.2,
                                                            sliding_window=window))
        ref = np.asarray(ragged_paged_attention_reference(*args, sm_scale=0.2,
                                                          sliding_window=window))
        assert np.isfinite(out).all(), q_len
        assert relative_error(out, ref) < BOUND


def test_malformed_query_start_loc_stays_inside_the_buffers():
    """A negative or decreasing query_start_loc breaks the contract; the kernel must still
    read and write only inside q and the output (it once corrupted the heap)."""
    q = jnp.ones((4, 2, 32))
    cache = jnp.ones((3, 1, 16, 32))
    out = cpu_kernels.ragged_paged_attention(
        q, cache, cache, jnp.ones((2, 1), jnp.int32), jnp.array([4, 4], jnp.int32),
        jnp.array([-2, 2, 1], jnp.int32), sm_scale=1.0)
    assert out.shape == (4, 2, 32) and np.isfinite(np.asarray(out)).all()


def test_the_library_cache_follows_jaxserve_cache(tmp_path, monkeypatch):
    import cpu_kernels

    monkeypatch.delenv("JAXSERVE_KERNEL_CACHE", raising=False)
    monkeypatch.delenv("JAXSERVE_CACHE", raising=False)
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert cpu_kernels.cache_dir() == tmp_path / "home" / ".cache" / "jaxserve" / "kernels"
    monkeypatch.setenv("JAXSERVE_CACHE", str(tmp_path / "cache"))
    assert cpu_kernels.cache_dir() == tmp_path / "cache" / "kernels"
    monkeypatch.setenv("JAXSERVE_KERNEL_CACHE", str(tmp_path / "own"))  # the specific one wins
    assert cpu_kernels.cache_dir() == tmp_path / "own"
