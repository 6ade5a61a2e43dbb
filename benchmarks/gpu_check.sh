#!/usr/bin/env bash
# One prepared device check (<= 5 minutes on one H100/H200): emulator sync vs 2bw vs 2bw+EF on
# smollm-135m in bf16 (tokens/s, MFU, peak memory). Without CUDA it runs the reduced CPU mode.
# Installs only from the package registries (into .venv, if it is not there yet).
set -euo pipefail
cd "$(dirname "$0")/.."
if [ ! -x .venv/bin/python ]; then
  python3 -m venv .venv
  .venv/bin/pip install -q torch==2.13.0
  .venv/bin/pip install -q -e .
fi
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-4}
.venv/bin/python benchmarks/gpu_check.py "$@"
