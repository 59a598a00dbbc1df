#!/usr/bin/env bash
# Deviceless H100 compile tier for pallas_kernels and fp8 (pytest marker `h100`).
#
# Builds an optional, git-ignored virtual environment with the CUDA plugin
# (it must never leak into the main .venv: with the plugin present, jax looks
# for a GPU) over jaxserve's dependencies, then runs the `h100` tests with
# JAX_PLATFORMS=cpu. The plugin (jax-cuda12-plugin + jax-cuda12-pjrt, or the
# cuda13 pair) is pinned to the jax that is installed, whichever release of
# pyproject's range that is; the full `jax[cuda12]` extra would bring cuDNN,
# cuBLAS, NCCL, ... which a deviceless compile does not need. XLA compiles the
# Pallas Triton kernels for an H100 topology built from
# pallas_kernels/h100_target_config.pbtxt; ptxas comes from the
# nvidia-cuda-nvcc wheel unless the machine has a CUDA toolkit.
#
# With H100_BASE naming a virtual environment that already holds jaxserve's
# dependencies (CI's .venv-ci), the new environment reads that one's packages
# (a .pth file) and installs only the plugin and nvcc; otherwise it installs
# jaxserve's dependencies itself (`pip install -e <repo>`).
#
# Usage: scripts/h100_compile_env.sh [--setup-only] [extra pytest args]
# Env:   H100_VENV (default: <repo>/.h100-venv), H100_BASE (default: none),
#        H100_CUDA (12 or 13, default 12), PYTHON (default: python3.12)
set -euo pipefail

repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
venv="${H100_VENV:-$repo/.h100-venv}"
python="${PYTHON:-python3.12}"
cuda="${H100_CUDA:-12}"
if [[ "$cuda" != 12 && "$cuda" != 13 ]]; then
  echo "H100_CUDA must be 12 or 13, not $cuda" >&2
  exit 2
fi
# The CUDA 12 toolkit's nvcc wheel carries its major version in the name; CUDA 13's does not.
nvcc_wheel="nvidia-cuda-nvcc-cu12"
[[ "$cuda" == 13 ]] && nvcc_wheel="nvidia-cuda-nvcc>=13,<14"

if [[ ! -x "$venv/bin/python" ]]; then
  echo "creating $venv (CUDA $cuda plugin)"
  "$python" -m venv "$venv"
fi
vpython="$venv/bin/python"
if [[ -n "${H100_BASE:-}" ]]; then
  base_site="$("$H100_BASE/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')"
  site="$("$vpython" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')"
  echo "$base_site" > "$site/h100_base.pth"
fi
if ! "$vpython" -c "import flax, transformers, grpc, pytest_timeout" 2>/dev/null; then
  # jaxserve's own dependencies (flax, transformers, grpc, ...): the served-step test
  # builds the worker's executables.
  "$vpython" -m pip install --quiet -e "$repo" pytest pytest-timeout
fi
jax_version="$("$vpython" -c 'import jax; print(jax.__version__)')"
if ! "$vpython" -c "import jax_plugins.xla_cuda$cuda" 2>/dev/null; then
  # The plugin can lag a jax release by days. Then this environment gets its own jax
  # and jaxlib at the newest release the plugin has (its site-packages come before
  # the base environment's on sys.path), and the tier compiles with that release.
  available="$("$vpython" -m pip index versions "jax-cuda$cuda-plugin" 2>/dev/null \
    | sed -n 's/^Available versions: //p')"
  if [[ -n "$available" && ", $available," != *", $jax_version,"* ]]; then
    newest="${available%%,*}"
    echo "no CUDA $cuda plugin for jax $jax_version yet: this environment uses jax $newest"
    "$vpython" -m pip install --quiet --no-deps "jax==$newest" "jaxlib==$newest"
    jax_version="$newest"
  fi
  echo "installing the CUDA $cuda plugin for jax $jax_version"
  "$vpython" -m pip install --quiet --no-deps \
    "jax-cuda$cuda-plugin==$jax_version" "jax-cuda$cuda-pjrt==$jax_version"
  "$vpython" -m pip install --quiet --no-deps "$nvcc_wheel"
fi

# ptxas: the machine's toolkit first, else the wheel's (nvidia/cuda_nvcc/bin for CUDA 12,
# nvidia/cu13/bin for CUDA 13).
if ! command -v ptxas >/dev/null; then
  ptxas="$("$vpython" - <<'EOF'
import pathlib, nvidia
for root in nvidia.__path__:
    found = sorted(pathlib.Path(root).glob("*/bin/ptxas"))
    if found:
        print(found[0])
        break
EOF
)"
  if [[ -z "$ptxas" ]]; then
    echo "no ptxas: neither a CUDA toolkit on PATH nor the $nvcc_wheel wheel" >&2
    exit 1
  fi
  export PATH="$(dirname "$ptxas"):$PATH"
fi
echo "jax $jax_version, CUDA $cuda plugin; ptxas: $(command -v ptxas) ($(ptxas --version | tail -1))"

if [[ "${1:-}" == "--setup-only" ]]; then
  exit 0
fi

cd "$repo"
export JAX_PLATFORMS=cpu
export JAX_ENABLE_COMPILATION_CACHE=false
export PYTHONPATH="$repo${PYTHONPATH:+:$PYTHONPATH}"
exec "$vpython" -m pytest -m h100 -s -q tests/pallas_kernels/test_h100_compile.py \
  tests/model/test_fp8_h100.py \
  -p no:cacheprovider "$@"
