#!/usr/bin/env bash
# Regenerates the Python code for proto/jaxserve/*.proto into jaxserve/proto/
# (or into the directory given as $1; tests/test_proto_sync.py uses that to
# check the committed code is in sync). Needs grpcio-tools (pip install -e '.[test]').
#
# protoc names a module after its .proto path (jaxserve/generate.proto ->
# jaxserve.generate_pb2); the modules live in the jaxserve.proto package, so
# their imports and module names are rewritten to jaxserve.proto.*.
set -euo pipefail
repo="$(cd "$(dirname "$0")/.." && pwd)"
out="$(mkdir -p "${1:-$repo/jaxserve/proto}" && cd "${1:-$repo/jaxserve/proto}" && pwd)"
python="${PYTHON:-python}"
tmp="$(mktemp -d)"
trap 'rm -rf "$tmp"' EXIT

cd "$repo/proto"
"$python" -m grpc_tools.protoc -I . \
  --python_out="$tmp" --pyi_out="$tmp" --grpc_python_out="$tmp" jaxserve/*.proto
sed -i -E \
  -e 's/^from jaxserve import ([A-Za-z0-9_]+_pb2)/from jaxserve.proto import \1/' \
  -e "s/'jaxserve\.([A-Za-z0-9_]+_pb2)'/'jaxserve.proto.\1'/g" \
  "$tmp"/jaxserve/*
cp "$tmp"/jaxserve/* "$out"/
