#!/usr/bin/env bash
# Everything scripts/gpu_measure.sh needs on a GPU machine without a package index, where
# Python 3.12, JAX with its CUDA plugin, flax, transformers, torch and numpy are preinstalled:
#
#   .whl/            the wheels that machine lacks (~11 MB), for CPython 3.12 manylinux x86_64,
#                    at versions that worked together there (/work/shared/GPU_RUNBOOK.md);
#   .gpu-tokenizer/  the demo model's tokenizer files (from `jaxserve download-demo`'s
#                    directory, built here), copied into the random-weight model there.
#
#   scripts/gpu_wheels.sh            (run here, where pip reaches PyPI)
#
# Both folders are git-ignored. On the GPU machine (docs/benchmarks.md, "One GPU command"):
#   python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl
#   PYTHONPATH=/tmp/site scripts/gpu_measure.sh "$OUT"
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON="${PYTHON:-python3}"
WHEELS=(
    fastapi==0.165.0 starlette==1.10.0 uvicorn==0.55.0
    pydantic==2.14.4 pydantic_core==2.50.5 annotated-types==0.8.0 typing-inspection==0.4.5
    annotated-doc==0.0.7 opentelemetry-api==1.45.2
    grpcio==1.85.3 protobuf==7.36.2 grpcio-health-checking==1.85.1 grpcio-reflection==1.85.1
    gguf==0.19.0
)
rm -rf .whl
"$PYTHON" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
    --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 \
    --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
    --platform manylinux1_x86_64 -d .whl "${WHEELS[@]}"
echo "$(ls .whl | wc -l) wheels, $(du -sh .whl | cut -f1) in .whl/"

tokenizer_src="${TOKENIZER_DIR:-$(PYTHONPATH="$PWD" "$PYTHON" -c \
    'from jaxserve.demo_model import demo_model_path; print(demo_model_path())')}"
if [[ ! -f "$tokenizer_src/tokenizer.json" ]]; then
    echo "no tokenizer.json in $tokenizer_src: run 'jaxserve download-demo' first" >&2
    exit 1
fi
rm -rf .gpu-tokenizer && mkdir .gpu-tokenizer
for name in tokenizer.json tokenizer_config.json special_tokens_map.json generation_config.json; do
    if [[ -f "$tokenizer_src/$name" ]]; then cp "$tokenizer_src/$name" .gpu-tokenizer/; fi
done
echo "tokenizer files from $tokenizer_src in .gpu-tokenizer/: $(ls .gpu-tokenizer | tr '\n' ' ')"
