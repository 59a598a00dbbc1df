"""Shared pieces of the benchmarks: results files, environment facts, percentiles.

Every benchmark writes one JSON file ``<results>/<name>.json`` holding its
arguments, the environment (``environment()``) and its numbers. Times are in
seconds unless a key ends in ``_ms``.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import pathlib
import platform
import sys
import time
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

logger = logging.getLogger(__name__)

DEFAULT_RESULTS = "results"


def add_common_arguments(parser: argparse.ArgumentParser) -> None:
    """``--results DIR``, ``--model DIR``, ``--tokenizer DIR``, ``--seed``."""
    parser.add_argument("--results", default=DEFAULT_RESULTS,
                        help=f"folder for the JSON results and plots (default {DEFAULT_RESULTS}/)")
    parser.add_argument("--model", default=None,
                        help="Hugging Face model directory (default: the demo model)")
    parser.add_argument("--tokenizer", default=None,
                        help="tokenizer directory (default: the model's)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the workload (default 0)")


def setup_logging(level: int = logging.INFO) -> None:
    """Logs to stderr unless the caller (``jaxserve`` CLI) already configured logging."""
    if not logging.getLogger().handlers:
        logging.basicConfig(level=level, stream=sys.stderr,
                            format="%(asctime)s %(levelname)s %(name)s: %(message)s")


def resolve_model(model: str | None) -> pathlib.Path:
    """The model directory; None = the demo model (built on first use)."""
    from jaxserve.demo_model import resolve_model_path

    return pathlib.Path(resolve_model_path(model))


def use_compilation_cache() -> None:
    """Defaults JAX's persistent compilation cache to ``$JAXSERVE_CACHE/jax_cache``.

    The same default as ``jaxserve serve`` (``jaxserve.launcher``): a second
    run loads the step executables instead of compiling them. Call before jax
    starts; an explicit ``JAX_COMPILATION_CACHE_DIR`` wins.
    """
    from jaxserve.demo_model import cache_root

    os.environ.setdefault("JAX_COMPILATION_CACHE_DIR", str(cache_root() / "jax_cache"))
    os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")
    os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES", "0")


def load_average() -> tuple[float, float, float]:
    """The 1, 5 and 15 minute load averages (the machine is shared: quote them with numbers)."""
    try:
        return tuple(round(x, 2) for x in os.getloadavg())  # type: ignore[return-value]
    except OSError:
        return (float("nan"),) * 3  # type: ignore[return-value]


def environment() -> dict[str, Any]:
    """Machine and library facts recorded with every result."""
    info: dict[str, Any] = {
        "time": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "host": platform.node(),
        "cpu_count": os.cpu_count(),
        "load_average": load_average(),
        "python": platform.python_version(),
    }
    for name in ("jax", "jaxlib", "torch", "transformers"):
        module = sys.modules.get(name)
        if module is not None:
            info[name] = getattr(module, "__version__", "?")
    if "jax" in sys.modules:
        import jax

        info["jax_backend"] = jax.default_backend()
        info["jax_devices"] = [str(d) for d in jax.devices()]
    return info


def percentiles(values: Sequence[float], qs: Sequence[int] = (50, 90, 99)) -> dict[str, float]:
    """``{"mean", "p50", "p90", "p99"}`` of ``values`` (NaN when empty)."""
    arr = np.asarray(values, dtype=np.float64)
    if arr.size == 0:
        return {"mean": float("nan"), **{f"p{q}": float("nan") for q in qs}}
    return {"mean": float(arr.mean()), **{f"p{q}": float(np.percentile(arr, q)) for q in qs}}


def write_json(results_dir: str | os.PathLike, name: str, payload: dict[str, Any]) -> pathlib.Path:
    """Writes ``payload`` to ``<results_dir>/<name>.json`` (folder created); returns the path."""
    path = pathlib.Path(results_dir)
    path.mkdir(parents=True, exist_ok=True)
    out = path / f"{name}.json"
    out.write_text(json.dumps(payload, indent=2, sort_keys=False, default=_json_default) + "\n")
    logger.info("wrote %s", out)
    return out


def run_cli(name: str, doc: str, add_arguments: Callable[[argparse.ArgumentParser], None],
            run: Callable[[argparse.Namespace], dict[str, Any]], argv: Sequence[str] | None
            ) -> tuple[argparse.Namespace, dict[str, Any], pathlib.Path]:
    """The shared part of every benchmark's ``main``: parse, log, run, write the JSON.

    Args:
      name: the benchmark's name (``jaxserve bench <name>``, ``<name>.json``).
      doc: its module docstring (the first line describes it in ``--help``).
      add_arguments, run: the benchmark's own.
      argv: the command line (None = ``sys.argv``).

    Returns:
      (parsed arguments, the result, the JSON's path).
    """
    parser = argparse.ArgumentParser(prog=f"jaxserve bench {name}", allow_abbrev=False,
                                     description=doc.splitlines()[0])
    add_arguments(parser)
    args = parser.parse_args(argv)
    setup_logging()
    result = run(args)
    return args, result, write_json(args.results, name, result)


def _json_default(value: Any) -> Any:
    if isinstance(value, (np.integer,)):
        return int(value)
    if isinstance(value, (np.floating,)):
        return float(value)
    if isinstance(value, np.ndarray):
        return value.tolist()
    if isinstance(value, pathlib.Path):
        return str(value)
    raise TypeError(f"not JSON serializable: {type(value).__name__}")
