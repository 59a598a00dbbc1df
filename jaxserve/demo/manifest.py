"""The sha256 manifest that marks a demo model directory complete.

``jaxserve_manifest.json`` is written last, after every other file has been
written and checked; a directory is complete when the manifest exists, has the
current format version and every file it lists is present with the listed size
(``full=True`` also re-hashes every file).
"""

from __future__ import annotations

import json
import pathlib
from typing import Any

from jaxserve.demo.source import sha256_file

MANIFEST_NAME = "jaxserve_manifest.json"
# Bump when the converter's output changes; older directories are then rebuilt.
FORMAT_VERSION = 1


def write_manifest(model_dir: pathlib.Path, extra: dict[str, Any]) -> dict[str, Any]:
    """Hash every regular file of ``model_dir`` and write the manifest; returns its content.

    ``extra`` (source provenance, timings) is stored alongside under its own keys.
    """
    files = {}
    for path in sorted(p for p in model_dir.iterdir() if p.is_file() and p.name != MANIFEST_NAME):
        files[path.name] = {"bytes": path.stat().st_size, "sha256": sha256_file(path, desc=f"sha256 {path.name}")}
    manifest = {"format_version": FORMAT_VERSION, **extra, "files": files}
    (model_dir / MANIFEST_NAME).write_text(json.dumps(manifest, indent=2, sort_keys=True) + "\n")
    return manifest


def read_manifest(model_dir: pathlib.Path) -> dict[str, Any] | None:
    """The manifest of ``model_dir``, or None when it is missing or unreadable."""
    try:
        return json.loads((model_dir / MANIFEST_NAME).read_text())
    except (OSError, ValueError):
        return None


def manifest_problems(model_dir: pathlib.Path, *, full: bool = False) -> list[str]:
    """What is wrong with ``model_dir`` against its manifest; empty when it is complete.

    ``full=False`` checks presence and sizes (milliseconds); ``full=True`` also
    re-hashes every file (about a second for the demo model's 540 MB).
    """
    manifest = read_manifest(model_dir)
    if manifest is None:
        return [f"no readable {MANIFEST_NAME}"]
    if manifest.get("format_version") != FORMAT_VERSION:
        return [f"format version {manifest.get('format_version')!r}, current is {FORMAT_VERSION}"]
    problems = []
    for name, entry in manifest.get("files", {}).items():
        path = model_dir / name
        if not path.is_file():
            problems.append(f"{name} is missing")
        elif path.stat().st_size != entry["bytes"]:
            problems.append(f"{name} has {path.stat().st_size} bytes, manifest says {entry['bytes']}")
        elif full and sha256_file(path, desc=f"verify {name}") != entry["sha256"]:
            problems.append(f"{name} sha256 differs from the manifest")
    if not manifest.get("files"):
        problems.append("manifest lists no files")
    return problems
