#!/usr/bin/env bash
# One GPU measurement in under 8 minutes: the attention kernel's achieved bandwidth
# (batch 1 / 64 / 256 at 2k and 8k context, timed on the device) and the served
# Llama-3-8B-shaped decode step against the weight-streaming floor, in ONE JSON.
#
#   scripts/gpu_measure.sh [OUT_DIR] [extra benchmarks.gpu_measure options]
#
# Writes OUT_DIR/gpu.json (rewritten after each section) and OUT_DIR/gpu_measure.log.
# OUT_DIR defaults to $OUT, else results/. PYTHON picks the interpreter (default python3).
# See docs/benchmarks.md ("One GPU command").
set -euo pipefail
out="${1:-${OUT:-results}}"
shift || true
mkdir -p "$out"
out="$(cd "$out" && pwd)"  # absolute: the run below starts in the repository root
cd "$(dirname "$0")/.."
# 450 s for the run, then SIGTERM; SIGKILL 20 s later: the JSON keeps every finished section.
PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" timeout --kill-after=20 450 \
    "${PYTHON:-python3}" -m benchmarks.gpu_measure --json "$out/gpu.json" "$@" \
    2>&1 | tee "$out/gpu_measure.log"
exit "${PIPESTATUS[0]}"
