#!/usr/bin/env bash
# One-shot check for a machine with a CUDA GPU (about 5-8 minutes on one H200):
#   1. builds dartree with the CUDA kernels (reusing .venv when present, else installing it),
#   2. runs every test, the CUDA cases included, against the PyTorch references,
#   3. times every CUDA kernel against its reference (tree attention also against SDPA with a
#      dense mask and FlexAttention with a block mask) and prints one table last.
# Usage: bash bench/gpu_check.sh [results.md]   (the table is also written to that file)
set -euo pipefail
cd "$(dirname "$0")/.."
out=${1:-bench/results/gpu_check.md}
python -c "import torch; assert torch.cuda.is_available(), 'no CUDA GPU visible'" 2>/dev/null \
  || [ -x .venv/bin/python ] || { echo "gpu_check: needs a CUDA GPU"; exit 1; }
if [ ! -x .venv/bin/python ]; then DARTREE_FORCE_CUDA=1 MAX_JOBS=${MAX_JOBS:-8} bash scripts/install.sh; fi
PY=.venv/bin/python
$PY -c "import torch; assert torch.cuda.is_available(), 'no CUDA GPU visible'"
DARTREE_FORCE_CUDA=1 MAX_JOBS=${MAX_JOBS:-8} $PY -m pip install -q --no-build-isolation -e .
$PY -c "import dartree.ops as o; assert o.HAS_CUDA_KERNELS, 'CUDA kernels not built'"

echo "== CUDA tests"
$PY -m pytest -q -x tests -k "cuda" 2>&1 | tail -20
echo "== all tests"
$PY -m pytest -q tests --deselect tests/test_sampling.py 2>&1 | tail -5

echo "== kernel timings"
$PY bench/kernels.py --device cuda --iters 50 | tee "$out.tmp"
{ echo "# GPU check, $(date -u +%Y-%m-%d), $(nvidia-smi --query-gpu=name,driver_version --format=csv,noheader)"; \
  echo; sed -n '/^###/,$p' "$out.tmp"; } > "$out"
rm -f "$out.tmp"
echo; cat "$out"
