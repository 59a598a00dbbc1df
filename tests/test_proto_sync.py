"""The committed generated proto code (jaxserve/proto/) is what scripts/gen_proto.sh makes.

Regenerates every ``proto/jaxserve/*.proto`` with grpcio-tools into a temporary
directory and compares file by file. Lines that only stamp the generator's
version are compared with the version masked out, so a newer grpcio-tools
alone does not fail the check; any other difference does: run
``scripts/gen_proto.sh`` and commit the result.
"""

from __future__ import annotations

import os
import pathlib
import re
import subprocess
import sys

import pytest

REPO = pathlib.Path(__file__).resolve().parents[1]
GENERATED = REPO / "jaxserve" / "proto"
_SUFFIXES = ("_pb2.py", "_pb2.pyi", "_pb2_grpc.py")
_VERSION_STAMPS = [
    (re.compile(r"^# Protobuf Python Version: .*$", re.M), "# Protobuf Python Version: X"),
    (re.compile(r"^GRPC_GENERATED_VERSION = .*$", re.M), "GRPC_GENERATED_VERSION = X"),
    (re.compile(r"ValidateProtobufRuntimeVersion\(\s*_runtime_version\.Domain\.PUBLIC,"
                r"\s*\d+,\s*\d+,\s*\d+,\s*'[^']*',"), "ValidateProtobufRuntimeVersion(X,"),
]


def _generated_files(directory: pathlib.Path) -> dict[str, str]:
    return {p.name: p.read_text() for p in sorted(directory.iterdir())
            if p.name.endswith(_SUFFIXES)}


def _mask_versions(text: str) -> str:
    for pattern, replacement in _VERSION_STAMPS:
        text = pattern.sub(replacement, text)
    return text


def test_generated_code_in_sync(tmp_path):
    pytest.importorskip("grpc_tools")
    env = dict(os.environ, PYTHON=sys.executable)
    subprocess.run(["bash", str(REPO / "scripts" / "gen_proto.sh"), str(tmp_path)],
                   check=True, env=env, capture_output=True, text=True)
    fresh = _generated_files(tmp_path)
    committed = _generated_files(GENERATED)
    protos = sorted(p.stem for p in (REPO / "proto" / "jaxserve").glob("*.proto"))
    assert protos and sorted({name.split("_pb2")[0] for name in fresh}) == protos
    assert sorted(committed) == sorted(fresh), "stale or missing generated files: run scripts/gen_proto.sh"
    for name, text in fresh.items():
        assert _mask_versions(committed[name]) == _mask_versions(text), (
            f"jaxserve/proto/{name} is out of date: run scripts/gen_proto.sh")


def test_generated_code_imports_within_the_package():
    """protoc writes ``from jaxserve import x_pb2``; the script rewrites it to jaxserve.proto."""
    for name, text in _generated_files(GENERATED).items():
        assert not re.search(r"^from jaxserve import ", text, re.M), name
        assert "'jaxserve.proto." in text or not name.endswith("_pb2.py"), name
    from jaxserve.proto import generate_pb2, generate_pb2_grpc

    assert generate_pb2.GenerateRequest.__module__ == "jaxserve.proto.generate_pb2"
    assert generate_pb2.DESCRIPTOR.name == "jaxserve/generate.proto"
    assert generate_pb2.DESCRIPTOR.package == "jaxserve"
    assert hasattr(generate_pb2_grpc, "GenerateServiceStub")
