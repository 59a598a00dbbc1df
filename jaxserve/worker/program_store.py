"""Traced step programs on disk, so that a restart neither traces nor lowers.

JAX's persistent compilation cache saves the XLA compile, but a restart
must still trace and lower every executable to compute its cache key; for
the step executables that was most of a warm start (the sampler alone lowers
in ~0.3 s, a 30-layer body in ~1 s on this CPU), which kept a warm start at
~4x a cold one. This store keeps each executable's *traced program*
(``jax.export``: serialized StableHLO plus its argument and result trees).
On a restart the program is deserialized and compiled — a JAX persistent
cache hit, since the same program was compiled on the first start — without
running any of the model's Python.

Executables themselves are deliberately not stored: XLA:CPU executables
serialized by hand (``jax.experimental.serialize_executable``) failed to run
in another process ("Function wrapped_iota not found") when the compiling
process had loaded kernels of the same name before; JAX's own cache is the
one tested path for executables.

Entries are keyed by everything that determines the program:

- the executable's name and shape material (``StepExecutable.key``: T or R,
  rows, vocabulary, cache and parameter shapes and dtypes, the model graph,
  the attention backend);
- jax and jaxlib versions, the platform, the device kind (e.g. "NVIDIA H100
  80GB HBM3") and the backend's version (``platform_version``: the CUDA
  runtime on a GPU) with the installed CUDA plugins' versions;
- a fingerprint of the source of every module that is traced into a step
  (``jaxserve/model``, ``jaxserve/worker``, ``pallas_kernels``, ``cpu_kernels``
  with its C++, ``jaxserve/config.py``): edit the model and the old entries no
  longer match.

Custom calls: ``jax.export`` refuses a custom call it does not vouch for
across versions. The served step holds two kinds, both allowed here because
the key pins the versions and the sources: Pallas' Triton kernels on a GPU
(``__gpu$xla.gpu.triton``, ``pallas_kernels.gpu_target.TRITON_CUSTOM_CALL``;
``triton_kernel_call`` is jax-triton's name) and the C++ CPU kernels
(``cpu_kernels``). Every other custom call the step lowers to on a GPU or a
CPU (sharding annotations) is on JAX's stable list;
``tests/worker/test_program_store_cuda.py`` exports the served step for
``cuda`` to prove it. A program that still cannot be exported raises
``StoreUnusable`` from ``export_program``; the compile manager then goes on
without the store (one log line), so the store never stops a start.

A missing or unreadable entry is traced again and rewritten. Files:
``<directory>/<sha256>.program`` (pickle of the serialized ``Exported`` and
the result tree), written to a temporary file and renamed.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import importlib.metadata
import logging
import os
import pathlib
import pickle
import re
import tempfile
from typing import Any

import jax
import jax.extend
import jaxlib
from jax import export

import cpu_kernels
from pallas_kernels.gpu_target import TRITON_CUSTOM_CALL

logger = logging.getLogger(__name__)

_TRACED_SOURCES = ("jaxserve/model", "jaxserve/worker", "pallas_kernels", "cpu_kernels",
                   "jaxserve/config.py")
# The custom calls of the served step that jax.export does not vouch for across
# versions (module docstring); the key pins the versions and the sources, so
# they are safe to store here.
CUSTOM_CALL_TARGETS = (TRITON_CUSTOM_CALL, "triton_kernel_call", *cpu_kernels.TARGETS)
_DISABLED_CHECKS = tuple(export.DisabledSafetyCheck.custom_call(t) for t in CUSTOM_CALL_TARGETS)
# Distributions whose version changes what a GPU program compiles to.
_PLUGINS = ("jax-cuda12-plugin", "jax-cuda12-pjrt", "jax-cuda13-plugin", "jax-cuda13-pjrt")


class StoreUnusable(Exception):
    """A program cannot be stored (its message says why, in one line)."""


@functools.cache
def code_fingerprint() -> str:
    """sha256 of the source files traced into step executables (computed once per process)."""
    root = pathlib.Path(__file__).resolve().parents[2]
    digest = hashlib.sha256()
    for entry in _TRACED_SOURCES:
        path = root / entry
        files = (sorted([*path.rglob("*.py"), *path.rglob("*.cc"), *path.rglob("*.h")])
                 if path.is_dir() else [path])
        for file in files:
            digest.update(str(file.relative_to(root)).encode())
            digest.update(file.read_bytes())
    return digest.hexdigest()


def environment(device: jax.Device | None = None, platform_version: str | None = None) -> str:
    """What besides the code and the shapes fixes a program: versions, platform, device kind.

    jax and jaxlib versions, ``device``'s platform and kind (default: the
    first device), the backend's ``platform_version`` (default: the default
    backend's; on a GPU the CUDA runtime and driver) and the installed CUDA
    plugins' versions, joined by "|".
    """
    device = device or jax.devices()[0]
    if platform_version is None:
        platform_version = jax.extend.backend.get_backend().platform_version
    plugins = []
    for name in _PLUGINS:
        try:
            plugins.append(f"{name}=={importlib.metadata.version(name)}")
        except importlib.metadata.PackageNotFoundError:
            pass
    return "|".join([jax.__version__, jaxlib.__version__, device.platform, device.device_kind,
                     platform_version, *plugins])


def export_program(jitted, flat_specs: list[jax.ShapeDtypeStruct],
                   platforms: tuple[str, ...] | None = None) -> export.Exported:
    """Traces and lowers ``jitted`` (a ``jax.jit`` over flat arguments) into a portable program.

    Args:
      jitted: the ``jax.jit``-wrapped function over flat array arguments.
      flat_specs: its arguments' ``jax.ShapeDtypeStruct``s.
      platforms: lower for these (e.g. ``("cuda",)``); None: the default
        backend. Lowering for a GPU without one needs
        ``pallas_kernels.gpu_target.abstract_gpu()``.

    Raises:
      StoreUnusable: ``jax.export`` refused the program, e.g. for a custom
        call with no compatibility guarantee (the message names the
        targets, in one line), or could not lower it. The compile manager
        then compiles without the store, where an error of the function
        itself shows again, whole.
    """
    exporter = export.export(jitted, platforms=platforms, disabled_checks=_DISABLED_CHECKS)
    try:
        return exporter(*flat_specs)
    except Exception as err:  # noqa: BLE001 - reported in one line, the cause chained
        text = str(err)
        if text.startswith("Cannot serialize code with custom calls"):
            targets = sorted(set(re.findall(r"custom_call @([\w$.\-]+)", text))
                             | set(re.findall(r'call_target_name = "([^"]+)"', text)))
            raise StoreUnusable(f"jax.export refuses the custom call(s) {', '.join(targets)} "
                                f"(no compatibility guarantee)") from err
        raise StoreUnusable(f"jax.export failed: {_first_line(err)}") from err


def _first_line(err: BaseException, limit: int = 300) -> str:
    line = (str(err).strip().splitlines() or [""])[0]
    return f"{type(err).__name__}: {line[:limit]}"


class ProgramStore:
    """A directory of traced step programs.

    Args:
      directory: where entries live (created on first save).
      env: the key's environment (default: ``environment()``, this
        process's devices and versions).
    """

    def __init__(self, directory: str | os.PathLike, env: str | None = None):
        self.directory = pathlib.Path(directory)
        self._environment = f"{env or environment()}|{code_fingerprint()}"
        self._warned = False

    def key(self, name: str, material: str) -> str:
        """The entry key of executable ``name`` whose shapes are described by ``material``."""
        return hashlib.sha256(f"{name}|{material}|{self._environment}".encode()).hexdigest()

    def load(self, key: str) -> tuple[export.Exported, Any] | None:
        """(program, result tree) stored under ``key``, or None when absent or unreadable.

        The first unreadable entry of this store is logged (one line); it and
        any later one are traced again. A CPU program may call the C++ kernels,
        whose FFI handlers are registered when a model using them is traced: a
        program that is loaded instead is never traced, so they are registered
        here (XLA's compile fails with "No FFI handler registered" otherwise).
        """
        path = self.directory / f"{key}.program"
        try:
            with open(path, "rb") as f:
                payload, out_tree = pickle.load(f)
            program = export.deserialize(payload)
            if "cpu" in program.platforms:
                cpu_kernels.available()  # registers the handlers, once per process
            return program, out_tree
        except (FileNotFoundError, NotADirectoryError):
            return None
        except Exception as err:  # noqa: BLE001 - a bad entry is traced again, not fatal
            log = logger.debug if self._warned else logger.warning
            self._warned = True
            log("program store entry %s is unusable (%s); tracing it again (later unusable "
                "entries are not logged)", path.name, _first_line(err))
            return None

    def save(self, key: str, program: export.Exported, out_tree: Any) -> None:
        """Writes ``program`` under ``key`` atomically.

        Raises:
          StoreUnusable: the program could not be serialized or written
            (the message names the cause in one line; no file is left).
        """
        temporary = None
        try:
            payload = pickle.dumps((program.serialize(), out_tree))
            self.directory.mkdir(parents=True, exist_ok=True)
            with tempfile.NamedTemporaryFile(dir=self.directory, delete=False,
                                             suffix=".tmp") as f:
                temporary = f.name
                f.write(payload)
            os.replace(temporary, self.directory / f"{key}.program")
        except Exception as err:  # noqa: BLE001 - the store is an optimisation
            if temporary is not None:
                with contextlib.suppress(OSError):
                    os.unlink(temporary)
            raise StoreUnusable(f"cannot write {self.directory}: {_first_line(err)}") from err
