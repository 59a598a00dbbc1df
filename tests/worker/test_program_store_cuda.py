"""The program store holds the served step as lowered for a GPU, and never stops a start.

The served ladder (the model body with the Pallas attention backend at two
T buckets, the LM head + sampler in every variant, the staged row writes) of
a tiny random-weight bf16 Llama is exported for platform ``cuda`` on this
CPU (inside ``abstract_gpu()``) through the store's own path —
``compile_manager.trace_program`` → ``ProgramStore.save`` → ``load`` — and
must come back the same program. Before the store allowed the Pallas Triton
custom call (``__gpu$xla.gpu.triton``) every body export raised, so neither
``LLM`` nor ``serve`` started on a GPU.

The fallback: a store that cannot write, or a program ``jax.export`` refuses,
logs one line and the start goes on without the store.
"""

from __future__ import annotations

import logging
import threading

import jax
import numpy as np
import pytest
from jax.sharding import AbstractDevice

from jaxserve.worker import program_store as ps
from jaxserve.worker.compile_manager import StepExecutable, compile_all, trace_program
from jaxserve.worker.sampler import COMPILED_VARIANTS
from pallas_kernels.gpu_target import TRITON_CUSTOM_CALL, abstract_gpu
from tests.worker.tiny_ladder import tiny_pallas_ladder

CUDA = ("cuda",)


@pytest.fixture(scope="module")
def ladder(tmp_path_factory):
    return tiny_pallas_ladder(tmp_path_factory.mktemp("tiny_llama_store"), token_buckets=(1, 64),
                              request_buckets=(8,))


def test_the_served_step_exported_for_cuda_round_trips_through_the_store(ladder, tmp_path):
    names = [exe.name for exe in ladder]
    assert sum(n.startswith("body[") for n in names) == 2
    assert sum(n.startswith("sampler[") for n in names) == len(COMPILED_VARIANTS)
    store = ps.ProgramStore(tmp_path / "programs")
    for exe in ladder:
        with abstract_gpu():
            program, out_tree = trace_program(exe, platforms=CUDA)
        key = store.key(exe.name, exe.key)
        store.save(key, program, out_tree)
        loaded = store.load(key)
        assert loaded is not None, f"{exe.name}: the stored program did not load"
        back, back_tree = loaded
        assert back.platforms == CUDA
        assert back_tree == out_tree
        assert _avals(back.in_avals) == _avals(program.in_avals)
        assert _avals(back.out_avals) == _avals(program.out_avals)
        assert back.mlir_module_serialized == program.mlir_module_serialized, exe.name
        if exe.kind == "body":
            assert f"custom_call @{TRITON_CUSTOM_CALL}" in back.mlir_module(), (
                f"{exe.name}: the Pallas kernel is not in the stored program")


def _avals(avals) -> list[tuple]:
    return [(a.shape, a.dtype) for a in avals]


def test_a_refused_custom_call_is_named_in_one_short_line(ladder, monkeypatch):
    monkeypatch.setattr(ps, "_DISABLED_CHECKS", ())  # as before the Triton call was allowed
    body = next(exe for exe in ladder if exe.kind == "body")
    with abstract_gpu(), pytest.raises(ps.StoreUnusable) as caught:
        trace_program(body, platforms=CUDA)
    message = str(caught.value)
    assert TRITON_CUSTOM_CALL in message and "\n" not in message and len(message) < 400


def _square(x):
    return x * x


def _double(x):
    return x + x


def _small_ladder() -> list[StepExecutable]:
    spec = (jax.ShapeDtypeStruct((4,), np.float32),)
    return [StepExecutable("body", "square", _square, spec, key="k"),
            StepExecutable("body", "double", _double, spec, key="k")]


def _check_ran(report) -> None:
    x = np.arange(4, dtype=np.float32)
    np.testing.assert_array_equal(report.functions["square"](x), x * x)
    np.testing.assert_array_equal(report.functions["double"](x), x + x)


def _store_lines(caplog) -> list[str]:
    """This thread's "program store off" lines: ``compile_all`` lowers (and so
    exports and writes) in the calling thread, while a background compile that
    another test left running logs from its own."""
    return [r.getMessage() for r in caplog.records
            if "program store" in r.getMessage() and r.thread == threading.get_ident()]


def test_a_store_that_cannot_write_logs_one_line_and_the_start_goes_on(tmp_path, caplog):
    blocked = tmp_path / "not_a_directory"
    blocked.write_text("a file where the store's directory should be")
    with caplog.at_level(logging.WARNING, logger="jaxserve.worker.compile_manager"):
        report = compile_all(_small_ladder(), progress=False, store=ps.ProgramStore(blocked))
    _check_ran(report)
    lines = _store_lines(caplog)
    assert len(lines) == 1 and str(blocked) in lines[0], lines
    assert report.num_programs_loaded == 0


def test_a_program_export_refuses_compiles_without_the_store(tmp_path, caplog, monkeypatch):
    def refuse(*args, **kwargs):
        raise ps.StoreUnusable("jax.export refuses the custom call(s) x (no compatibility "
                               "guarantee)")

    monkeypatch.setattr("jaxserve.worker.compile_manager.export_program", refuse)
    with caplog.at_level(logging.WARNING, logger="jaxserve.worker.compile_manager"):
        report = compile_all(_small_ladder(), progress=False,
                             store=ps.ProgramStore(tmp_path / "programs"))
    _check_ran(report)
    lines = _store_lines(caplog)
    assert len(lines) == 1 and "refuses the custom call" in lines[0], lines
    assert not (tmp_path / "programs").exists()


def test_the_key_holds_the_device_kind_and_the_backend_version(tmp_path):
    h100, h200 = (AbstractDevice(device_kind=kind, num_cores=132, platform="gpu")
                  for kind in ("NVIDIA H100 80GB HBM3", "NVIDIA H200"))
    keys = {ps.ProgramStore(tmp_path, ps.environment(device, version)).key("body[T=1]", "m")
            for device in (h100, h200) for version in ("cuda 12090", "cuda 13000")}
    assert len(keys) == 4
    here = ps.environment()
    assert jax.devices()[0].device_kind in here.split("|")
    assert ps.ProgramStore(tmp_path).key("body[T=1]", "m") == ps.ProgramStore(
        tmp_path, here).key("body[T=1]", "m")


def test_compile_all_on_threads_stores_then_loads_every_program(tmp_path):
    store = ps.ProgramStore(tmp_path / "programs")
    first = compile_all(_small_ladder(), progress=False, store=store, threads=3)
    _check_ran(first)
    assert first.num_programs_loaded == 0 and len(list(store.directory.iterdir())) == 2
    again = compile_all(_small_ladder(), progress=False, store=ps.ProgramStore(store.directory),
                        threads=3)
    _check_ran(again)
    assert again.num_programs_loaded == 2 and again.store_off_reason is None
