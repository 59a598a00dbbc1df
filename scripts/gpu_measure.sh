#!/usr/bin/env bash
# One GPU measurement in under 8 minutes, in ONE JSON: the attention kernel's achieved
# bandwidth, the served Llama-3-8B-shaped decode step against the weight-streaming floor,
# a random-weight Llama-3-8B-shaped model written on the device, jaxserve.LLM offline
# throughput on 1,000 ShareGPT-like requests, and `jaxserve serve` at concurrency 1, 64
# and 256 over gRPC and HTTP. Each section has its own time budget (--budget-SECTION).
#
#   scripts/gpu_measure.sh [OUT_DIR] [extra benchmarks.gpu_measure options]
#
# It checks its imports first and names the wheels to bring (scripts/gpu_wheels.sh
# downloads them into .whl/ and the demo tokenizer into .gpu-tokenizer/).
# Writes OUT_DIR/gpu.json (rewritten after each section), OUT_DIR/gpu_measure.log and
# OUT_DIR/serve_server.log.
# OUT_DIR defaults to $OUT, else results/. PYTHON picks the interpreter (default python3).
# See docs/benchmarks.md ("One GPU command").
set -euo pipefail
out="${1:-${OUT:-results}}"
shift || true
mkdir -p "$out"
out="$(cd "$out" && pwd)"  # absolute: the run below starts in the repository root
cd "$(dirname "$0")/.."
# The sections' budgets sum to 460 s; 475 s for the run, then SIGTERM; SIGKILL 5 s later:
# the JSON keeps every finished section.
PYTHONPATH="${PYTHONPATH:+$PYTHONPATH:}$PWD" timeout --kill-after=5 "${GPU_MEASURE_TIMEOUT:-475}" \
    "${PYTHON:-python3}" -m benchmarks.gpu_measure --json "$out/gpu.json" "$@" \
    2>&1 | tee "$out/gpu_measure.log"
exit "${PIPESTATUS[0]}"
