"""The HTTP API's end-to-end server: its engine flags, key, served name and certificate.

Shared by ``tests/e2e/test_http_api.py`` and ``tests/e2e/test_http_tools.py``
through the package fixtures of ``tests/e2e/conftest.py`` (one server start for
both).
"""

from __future__ import annotations

import datetime
import ipaddress
import pathlib

ENGINE = dict(max_num_seqs=64, max_num_batched_tokens=256, num_kv_blocks=512,
              max_model_len=1024)
API_KEY = "test-key-1234"
MODEL = "smol"
PROMPT = "The history of the printing press"
CHAT = [{"role": "user", "content": "What is the capital of France?"}]
# Two functions for the tool-calling tests and the bad-request table.
TOOLS = [
    {"type": "function", "function": {
        "name": "get_weather", "description": "The current weather in a city",
        "parameters": {"type": "object", "properties": {
            "city": {"type": "string", "maxLength": 20},
            "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
            "required": ["city", "unit"], "additionalProperties": False}}},
    {"type": "function", "function": {
        "name": "get_time", "description": "The local time in a time zone",
        "parameters": {"type": "object", "properties": {
            "timezone": {"type": "string", "maxLength": 20}},
            "required": ["timezone"], "additionalProperties": False}}},
]


def self_signed(folder: pathlib.Path) -> tuple[pathlib.Path, pathlib.Path]:
    """A certificate for localhost / 127.0.0.1 and its key (PEM files)."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "localhost")])
    now = datetime.datetime.now(datetime.timezone.utc)
    cert = (x509.CertificateBuilder().subject_name(name).issuer_name(name)
            .public_key(key.public_key()).serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(hours=1))
            .not_valid_after(now + datetime.timedelta(days=1))
            .add_extension(x509.SubjectAlternativeName([
                x509.DNSName("localhost"), x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]),
                critical=False)
            .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
            .sign(key, hashes.SHA256()))
    cert_path, key_path = folder / "cert.pem", folder / "key.pem"
    cert_path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    key_path.write_bytes(key.private_bytes(serialization.Encoding.PEM,
                                           serialization.PrivateFormat.PKCS8,
                                           serialization.NoEncryption()))
    return cert_path, key_path
