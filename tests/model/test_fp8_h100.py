"""fp8 (W8A8 e4m3) compiled for an H100 without one (marker ``h100``; scripts/h100_compile_env.sh).

The deviceless compile of ``tests/pallas_kernels/test_h100_compile.py`` (the CUDA plugin,
``JAX_PLATFORMS=cpu``, an H100 topology from pallas_kernels/h100_target_config.pbtxt),
applied to one fp8 linear and to the served step body of a tiny Llama loaded with
``quantization="fp8"`` in bfloat16. The claim checked: the product runs on fp8 operands —
the e4m3 kernel goes into the GEMM as it is stored, never widened to a bfloat16 or float32
copy of its shape first.

What XLA emits, found by compiling (jax 0.12): with its default options a deviceless
compile cannot autotune, and every fp8 product becomes a Triton GEMM fusion
(``__triton_nested_gemm_fusion``) whose two parameters are f8e4m3fn. With Triton GEMMs
off (``xla_gpu_enable_triton_gemm=false``: the library path, cuBLAS, which XLA's
autotuner weighs against Triton on a real H100) every product of 2 rows or more is
cuBLASLt's fp8 GEMM, custom call ``__cublas$lt$matmul$f8`` (thunk ``kCublasLtMatmul``);
a 1-row product there is rewritten to a bfloat16 GEMV of a widened kernel (printed, not
asserted: XLA's choice, not ours), so batch-1 decode relies on the Triton fusion.
"""

import importlib.util
import pathlib
import re
import tempfile

import jax
import jax.numpy as jnp
import pytest

if not any(importlib.util.find_spec(f"jax_plugins.xla_cuda{major}") is not None
           for major in (12, 13) if importlib.util.find_spec("jax_plugins") is not None):
    pytest.skip("CUDA plugin absent: scripts/h100_compile_env.sh", allow_module_level=True)

from jaxserve.model import quantization as quant  # noqa: E402
from jaxserve.model.llama import linear  # noqa: E402
from pallas_kernels.gpu_target import abstract_gpu  # noqa: E402
from tests.pallas_kernels.test_h100_compile import h100  # noqa: E402,F401  (the fixture)

pytestmark = pytest.mark.h100

CUBLASLT_FP8 = "__cublas$lt$matmul$f8"
TRITON_GEMM = "__triton_nested_gemm_fusion"
NO_TRITON_GEMM = {"xla_gpu_enable_triton_gemm": False}
_FUSION = re.compile(r"%(\S+) = \S+ fusion\(.*calls=%(\S+?),.*\"kind\":\"" + re.escape(TRITON_GEMM))
_CUSTOM_CALL = re.compile(r'custom_call_target="([^"]+)"')


def compile_for_h100(jitted, specs, options: dict | None = None) -> tuple[str, str]:
    """(optimized HLO text, thunk sequence) of ``jitted`` compiled for the H100 at ``specs``."""
    with tempfile.TemporaryDirectory() as dump, abstract_gpu():
        lowered = jitted.trace(*specs).lower(lowering_platforms=("cuda",))
        compiled = lowered.compile(compiler_options={"xla_dump_to": dump, **(options or {})})
        thunks = "\n".join(p.read_text() for p in pathlib.Path(dump).glob("*thunk_sequence*"))
        return compiled.as_text(), thunks


def _computations(hlo: str) -> dict[str, str]:
    """HLO text → {computation name: its body}."""
    out, name = {}, None
    for line in hlo.splitlines():
        head = re.match(r"^(?:ENTRY )?%(\S+) .*\{$", line)
        if head:
            name, out[head.group(1)] = head.group(1), ""
        elif name is not None:
            out[name] += line + "\n"
    return out


def fp8_gemms(hlo: str) -> dict[str, int]:
    """How many GEMMs of the compiled module take two f8e4m3fn operands, by kind: cuBLASLt's
    fp8 custom call, or a Triton GEMM fusion whose parameters are all f8e4m3fn."""
    comps = _computations(hlo)
    triton = 0
    for _, called in _FUSION.findall(hlo):
        params = re.findall(r"= (\S+?)\[[^\]]*\]\S* parameter\(", comps[called])
        triton += bool(params) and all(p == "f8e4m3fn" for p in params)
    return {"cublaslt_f8": _CUSTOM_CALL.findall(hlo).count(CUBLASLT_FP8), "triton_f8": triton}


def widened(hlo: str, kernel_shapes) -> list[str]:
    """Instructions outside GEMM fusions whose result is a bf16 / f32 array of a kernel's
    shape ``[out, in]``: an fp8 kernel widened in memory before its product."""
    comps = _computations(hlo)
    inside = {called for _, called in _FUSION.findall(hlo)}
    hits = []
    for name, body in comps.items():
        if name in inside or any(name.startswith(c) for c in inside):
            continue
        for out, inn in kernel_shapes:
            hits += [line.strip()[:160] for line in body.splitlines()
                     if re.search(rf"= (bf16|f32)\[{out},{inn}\]", line)]
    return hits


# Llama-3-8B's gate/up rows [2F, D] = [28672, 4096]: one fused gate_up_proj.
KERNEL = (28672, 4096)


@pytest.mark.parametrize("rows", [1, 16, 256])
def test_fp8_linear_is_an_fp8_gemm_on_h100(h100, rows):  # noqa: F811
    specs = (jax.ShapeDtypeStruct((rows, KERNEL[1]), jnp.bfloat16, sharding=h100),
             jax.ShapeDtypeStruct(KERNEL, quant.FP8_DTYPE, sharding=h100),
             jax.ShapeDtypeStruct(KERNEL[:1], jnp.float32, sharding=h100))
    hlo, thunks = compile_for_h100(jax.jit(linear), specs)
    gemms = fp8_gemms(hlo)
    print(f"\nH100 fp8 linear, {rows} rows, default options: {gemms}")
    assert sum(gemms.values()) == 1, (gemms, hlo)
    assert not widened(hlo, [KERNEL]), widened(hlo, [KERNEL])

    hlo, thunks = compile_for_h100(jax.jit(linear), specs, NO_TRITON_GEMM)
    gemms = fp8_gemms(hlo)
    print(f"H100 fp8 linear, {rows} rows, Triton GEMMs off: {gemms}, custom calls "
          f"{sorted(set(_CUSTOM_CALL.findall(hlo)))}, widened kernel: {widened(hlo, [KERNEL])}")
    if rows > 1:
        assert gemms == {"cublaslt_f8": 1, "triton_f8": 0}, hlo
        assert "kCublasLtMatmul" in thunks
        assert not widened(hlo, [KERNEL])
    else:  # either an fp8 GEMM, or the widening ``widened`` exists to catch (it is not vacuous)
        assert gemms["cublaslt_f8"] == 1 or widened(hlo, [KERNEL]), hlo


@pytest.fixture(scope="module")
def fp8_body(tmp_path_factory):
    """The served body (T = 16) of a tiny bfloat16 Llama loaded with fp8, and its kernels'
    shapes."""
    from tests.worker.tiny_ladder import tiny_pallas_ladder  # noqa: PLC0415

    ladder = tiny_pallas_ladder(tmp_path_factory.mktemp("fp8"), token_buckets=(16,),
                                request_buckets=(8,), quantization="fp8")
    body = next(e for e in ladder if e.kind == "body")
    shapes = {tuple(x.shape) for x in jax.tree.leaves(body.args) if x.dtype == quant.FP8_DTYPE}
    return body, shapes


@pytest.mark.parametrize("options", [None, NO_TRITON_GEMM], ids=["default", "no_triton_gemm"])
def test_fp8_served_body_runs_fp8_gemms_on_h100(h100, fp8_body, options):  # noqa: F811
    body, kernel_shapes = fp8_body
    num_kernels = sum(x.dtype == quant.FP8_DTYPE for x in jax.tree.leaves(body.args))
    assert num_kernels == 4 * 2  # qkv, o, gate_up, down of 2 layers; embedding / head float
    specs = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=h100),
                         body.args)
    hlo, thunks = compile_for_h100(jax.jit(body.fn, donate_argnums=body.donate), specs, options)
    gemms = fp8_gemms(hlo)
    print(f"\nH100 fp8 body[T=16] ({'Triton GEMMs off' if options else 'default options'}): "
          f"{gemms}; kernels {sorted(kernel_shapes)}")
    assert sum(gemms.values()) == num_kernels, gemms
    if options:
        assert gemms["cublaslt_f8"] == num_kernels and "kCublasLtMatmul" in thunks
    assert not widened(hlo, kernel_shapes), widened(hlo, kernel_shapes)
