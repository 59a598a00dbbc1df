#!/usr/bin/env bash
# Deviceless H100 compile tier for pallas_kernels (pytest marker `h100`).
#
# Builds an optional, git-ignored virtual environment with the CUDA plugin
# (it must never leak into the main .venv: with the plugin present, jax looks
# for a GPU) and jaxserve's dependencies, then runs the `h100` tests with
# JAX_PLATFORMS=cpu. Measured on a 2-core machine under load: the plugin part
# 2 min 50 s, jaxserve's dependencies 2 min 40 s more, 1.5 GB in all (the full
# `jax[cuda12]` extra would download 3.2 GB of wheels: cuDNN, cuBLAS, NCCL, ...,
# none of which a deviceless compile needs). XLA compiles
# the Pallas Triton kernels for an H100 topology built from
# pallas_kernels/h100_target_config.pbtxt; ptxas comes from the
# nvidia-cuda-nvcc-cu12 wheel unless the machine has a CUDA toolkit.
#
# Usage: scripts/h100_compile_env.sh [--setup-only] [extra pytest args]
# Env:   H100_VENV (default: <repo>/.h100-venv), PYTHON (default: python3.11)
set -euo pipefail

repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
venv="${H100_VENV:-$repo/.h100-venv}"
python="${PYTHON:-python3.11}"
jax_version="$(sed -n 's/.*"jax==\([0-9.]*\)".*/\1/p' "$repo/pyproject.toml" | head -1)"

if [[ ! -x "$venv/bin/python" ]]; then
  echo "creating $venv (jax $jax_version + CUDA plugin)"
  "$python" -m venv "$venv"
fi
if ! "$venv/bin/python" -c "import jax_plugins.xla_cuda12, pytest_timeout, flax" 2>/dev/null; then
  "$venv/bin/pip" install --quiet --upgrade pip
  "$venv/bin/pip" install --quiet \
    "jax==$jax_version" "jaxlib==$jax_version" \
    "jax-cuda12-plugin==$jax_version" "jax-cuda12-pjrt==$jax_version" \
    absl-py flatbuffers nvidia-cuda-nvcc-cu12 numpy pytest pytest-timeout
  # jaxserve's own dependencies (flax, transformers, grpc, ...): the served-step test
  # builds the worker's executables.
  "$venv/bin/pip" install --quiet -e "$repo"
fi

# ptxas: the machine's toolkit first, else the wheel's.
if ! command -v ptxas >/dev/null; then
  nvcc_dir="$("$venv/bin/python" -c 'import nvidia.cuda_nvcc, os; print(os.path.dirname(nvidia.cuda_nvcc.__path__[0] + "/"))')"
  export PATH="$nvcc_dir/bin:$PATH"
fi
echo "ptxas: $(command -v ptxas) ($(ptxas --version | tail -1))"

if [[ "${1:-}" == "--setup-only" ]]; then
  exit 0
fi

cd "$repo"
export JAX_PLATFORMS=cpu
export JAX_ENABLE_COMPILATION_CACHE=false
export PYTHONPATH="$repo${PYTHONPATH:+:$PYTHONPATH}"
exec "$venv/bin/python" -m pytest -m h100 -s -q tests/pallas_kernels/test_h100_compile.py \
  -p no:cacheprovider "$@"
