#!/usr/bin/env bash
# The first GPU run (benchmarks/gpu/gpu_check.py; docs/benchmarks.md, "GPU check"): under 8 minutes
# on one H100/H200. Runs from this source tree with the machine's own CUDA PyTorch: no venv is
# made and nothing is installed. Wheels brought for missing pure-Python packages go into
# .gpu_check_site (the check prints the commands), which is put on the path here.
# Without CUDA it stops with one line; --cpu-smoke runs the reduced CPU mode.
set -euo pipefail
cd "$(dirname "$0")/../.."
PYTHON=${PYTHON:-python3}
export PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}"
if [ -d .gpu_check_site ]; then
  PYTHONPATH="$PYTHONPATH:$PWD/.gpu_check_site"
fi
# cuBLAS needs this before CUDA starts for the deterministic resume check.
export CUBLAS_WORKSPACE_CONFIG=${CUBLAS_WORKSPACE_CONFIG:-:4096:8}
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-4}
exec "$PYTHON" benchmarks/gpu/gpu_check.py "$@"
