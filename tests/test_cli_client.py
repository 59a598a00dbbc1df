"""``jaxserve generate`` / ``chat`` against the scripted loopback server (tests/api/fake_generate_server).

What the commands send: only the sampling flags given, except that ``chat``
bounds each reply with ``--max-tokens 512`` unless told otherwise; the API
key (``--api-key`` or ``$JAXSERVE_API_KEY``) as ``authorization`` metadata.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from tests.api.fake_generate_server import FakeServer


@pytest.fixture(scope="module")
def server():
    fake = FakeServer()
    yield fake
    fake.stop()


def _cli(*args: str, stdin: str = "") -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "jaxserve", *args], input=stdin,
                          capture_output=True, text=True, timeout=120)


def test_chat_bounds_each_reply_unless_told_otherwise(server):
    proc = _cli("chat", "--server", server.target, stdin="Hi\n")
    assert proc.returncode == 0, proc.stderr
    assert "assistant> user: Hi" in proc.stdout  # the echo model's reply
    sent = server.servicer.requests[-1].sampling_params
    assert sent.HasField("max_tokens") and sent.max_tokens == 512
    assert not sent.HasField("temperature")  # the server's default applies
    proc = _cli("chat", "--server", server.target, "--max-tokens", "3", stdin="Hi\n")
    assert proc.returncode == 0, proc.stderr
    assert server.servicer.requests[-1].sampling_params.max_tokens == 3
    assert "[the reply was cut at 3 tokens" in proc.stderr  # the user learns why it stopped


def test_generate_sends_only_the_flags_given(server):
    proc = _cli("generate", "--server", server.target, "abc", "--temperature", "0")
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout == "abc\n"
    sent = server.servicer.requests[-1].sampling_params
    assert sent.HasField("temperature") and not sent.HasField("max_tokens")


def test_api_key_flag_and_environment_reach_the_server(server):
    proc = _cli("generate", "--server", server.target, "abc", "--api-key", "k-1")
    assert proc.returncode == 0, proc.stderr
    assert server.servicer.metadata[-1]["authorization"] == "Bearer k-1"
    proc = subprocess.run([sys.executable, "-m", "jaxserve", "generate", "--server",
                           server.target, "abc"], capture_output=True, text=True, timeout=120,
                          env={**os.environ, "JAXSERVE_API_KEY": "k-2"})
    assert proc.returncode == 0, proc.stderr
    assert server.servicer.metadata[-1]["authorization"] == "Bearer k-2"
    proc = _cli("generate", "--server", server.target, "abc")
    assert "authorization" not in server.servicer.metadata[-1]


def test_tls_ca_that_is_missing_or_not_a_certificate_is_one_line(server, tmp_path):
    proc = _cli("generate", "--server", server.target, "--tls-ca", str(tmp_path / "no.pem"), "x")
    assert proc.returncode == 1 and "Traceback" not in proc.stderr
    assert proc.stderr.strip() == f"error: --tls-ca {tmp_path / 'no.pem'}: No such file or directory"
    (tmp_path / "key.pem").write_text("-----BEGIN PRIVATE KEY-----\nAAAA\n")
    proc = _cli("generate", "--server", server.target, "--tls-ca", str(tmp_path / "key.pem"), "x")
    assert proc.returncode == 1 and "not a PEM certificate" in proc.stderr


def test_an_http_port_gets_a_hint_not_start_a_server():
    import http.server
    import threading

    httpd = http.server.HTTPServer(("127.0.0.1", 0), http.server.BaseHTTPRequestHandler)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    try:
        proc = _cli("generate", "--server", f"127.0.0.1:{httpd.server_port}", "--timeout", "20",
                    "x")
    finally:
        httpd.shutdown()
    assert proc.returncode == 1
    assert "not gRPC" in proc.stderr and "start one with" not in proc.stderr
