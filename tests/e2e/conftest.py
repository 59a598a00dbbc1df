"""Package fixtures of the HTTP API's end-to-end modules (``test_http_api``, ``test_http_tools``).

``api_server``: one ``jaxserve serve`` of the demo model for both modules, with
``--api-key``, a self-signed certificate (``http_server.self_signed``) and
``--enable-auto-tool-choice --tool-call-parser hermes``; ``grpc_client``,
``http`` (httpx) and ``oai`` (the ``openai`` client) talk to it over TLS with
the key. Package-scoped, so it starts once, when a test first asks for it.
"""

from __future__ import annotations

import ssl

import httpx
import openai
import pytest

from jaxserve.client import Client
from jaxserve.procutil import free_port
from tests.e2e.helpers import serve
from tests.e2e.http_server import API_KEY, ENGINE, MODEL, self_signed


@pytest.fixture(scope="package")
def api_server(demo_model_dir, tmp_path_factory):
    cert, key = self_signed(tmp_path_factory.mktemp("tls"))
    flags = tuple(x for k, v in ENGINE.items() for x in ("--" + k.replace("_", "-"), str(v)))
    with serve(demo_model_dir, flags, http_port=free_port(), served_model_name=MODEL,
               api_key=API_KEY, ssl_certfile=str(cert), ssl_keyfile=str(key),
               tool_call_parser="hermes") as launcher:
        launcher.cert = cert
        launcher.tls = ssl.create_default_context(cafile=str(cert))
        launcher.base_url = f"https://localhost:{launcher.options.http_port}"
        yield launcher


@pytest.fixture(scope="package")
def grpc_client(api_server):
    address = f"localhost:{api_server.options.port}"
    with Client(address, timeout=300, api_key=API_KEY,
                root_certificates=api_server.cert.read_bytes()) as client:
        yield client


@pytest.fixture(scope="package")
def http(api_server):
    with httpx.Client(base_url=api_server.base_url, verify=api_server.tls, timeout=300,
                      headers={"Authorization": f"Bearer {API_KEY}"}) as client:
        yield client


@pytest.fixture(scope="package")
def oai(api_server):
    client = openai.OpenAI(base_url=api_server.base_url + "/v1", api_key=API_KEY,
                           http_client=httpx.Client(verify=api_server.tls, timeout=300))
    yield client
    client.close()
