"""The CLI's user errors: one line on stderr and a non-zero status, never a traceback.

No server runs here: the errors are caught before any is needed (``chat``
validates its sampling flags up front; ``serve`` checks the model path
before it starts a process).
"""

from __future__ import annotations

import subprocess
import sys


def _cli(*args: str, stdin: str = "") -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "jaxserve", *args], input=stdin,
                          capture_output=True, text=True, timeout=120)


def test_chat_refuses_bad_sampling_flags_before_the_first_message():
    proc = _cli("chat", "--server", "127.0.0.1:9", "--temperature", "-1", stdin="Hi\n")
    assert proc.returncode == 2, proc.stderr
    assert "temperature" in proc.stderr and "Traceback" not in proc.stderr
    assert "assistant>" not in proc.stdout


def test_chat_exits_non_zero_when_a_reply_failed():
    proc = _cli("chat", "--server", "127.0.0.1:9", "--timeout", "5", stdin="Hi\n")
    assert proc.returncode == 1, proc.stderr
    assert "error: UNAVAILABLE" in proc.stderr and "Traceback" not in proc.stderr


def test_serve_with_a_missing_model_directory_fails_in_one_line(tmp_path):
    proc = _cli("serve", "--model", str(tmp_path / "missing"), "--port", "0")
    assert proc.returncode == 1, proc.stderr
    assert "missing" in proc.stderr and "Traceback" not in proc.stderr
