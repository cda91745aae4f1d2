#!/usr/bin/env bash
# The one-shot check for the lent GPU machine, as that machine is: one H200 (sm_90), 16 cores, no
# network, no venv; its own python3 holds torch, transformers, pytest, ninja, setuptools (nothing
# is installed or downloaded here). Only the repository travels. At most 8 minutes:
#   1. build dartree._C in place with that python3 (TORCH_CUDA_ARCH_LIST=9.0, MAX_JOBS=16)
#   2. the CUDA tests once, one pytest call per test file (a failing file does not stop the rest)
#   3. kernel timings: bench/op_bench.py --device cuda (SDPA baselines; FlexAttention last, step 5)
#   4. the engine end to end: bench/gpu_e2e.py (random-init SmolLM2-135M / Qwen3-4B shapes)
#   5. FlexAttention baselines of tree attention, with the time left (optional: a failure is noted)
#   6. the compiled verify against eager (bench/compile.py --device cuda), with the time left (optional)
#   7. SGLang with DARTREE against SGLang alone on a small random Llama (bench/sglang_dartree.py),
#      with the time left (optional; reported as "not run" where SGLang is not installed)
# Every step's output goes to bench/results/gpu_check/<step>.log and the tables and the summary
# to bench/results/gpu_check.md (gpu_check_rehearsal/ and .md with --rehearse); all of it is
# copied to $OUT (when set) after every step. The last
# thing printed is the summary table. Exit status: 0 all passed, 1 a required step failed, 2 no GPU
# (after a clean --rehearse, or at once without it).
#
#   bash bench/gpu_check.sh              # the GPU machine
#   bash bench/gpu_check.sh --rehearse   # any machine: step 1, the CPU rehearsal of step 4
#                                        # (gpu_e2e.py --device cpu --quick), then the GPU check
# Environment: PYTHON (default python3), MAX_JOBS (16), TORCH_CUDA_ARCH_LIST (9.0),
# GPU_CHECK_SCALE (every time limit times this; 1, or 10 with --rehearse: a small CPU machine is
# slower than the GPU machine's 16 cores), GPU_CHECK_SECONDS (the whole run's budget, 480 x scale).
set -u
cd "$(dirname "$0")/.."
ROOT=$PWD
PY=${PYTHON:-python3}
REHEARSE=0
[ "${1:-}" = "--rehearse" ] && REHEARSE=1
SCALE=${GPU_CHECK_SCALE:-$((REHEARSE ? 10 : 1))}
BUDGET=${GPU_CHECK_SECONDS:-$((480 * SCALE))}
START=$SECONDS
NAME=gpu_check$([ $REHEARSE = 1 ] && echo _rehearsal)  # a rehearsal never overwrites a GPU run
LOGS=bench/results/$NAME
REPORT=bench/results/$NAME.md
export PYTHONPATH=$ROOT${PYTHONPATH:+:$PYTHONPATH}
export PIP_NO_INDEX=1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 PYTHONUNBUFFERED=1
export TORCH_CUDA_ARCH_LIST=${TORCH_CUDA_ARCH_LIST:-9.0} MAX_JOBS=${MAX_JOBS:-16}

has_gpu() { "$PY" -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)" 2>/dev/null; }
if [ $REHEARSE = 0 ] && ! has_gpu; then
  echo "gpu_check: no CUDA GPU visible to $PY ($("$PY" -c 'import torch; print("torch", torch.__version__)' 2>&1 | tail -1)); nothing to check (--rehearse runs the CPU part)"
  exit 2
fi

mkdir -p "$LOGS"
rm -f "$LOGS"/*.log "$LOGS"/*.md
ROWS=()      # one "| step | status | seconds | note |" line per step
FAILED=0

left() { echo $((BUDGET - (SECONDS - START))); }
copy_out() {
  if [ -n "${OUT:-}" ]; then mkdir -p "$OUT/$NAME" && cp -f "$LOGS"/* "$OUT/$NAME/" 2>/dev/null; \
    [ -f "$REPORT" ] && cp -f "$REPORT" "$OUT/"; fi
  return 0
}
# step NAME REQUIRED(1|0) CAP_SECONDS COMMAND...: runs COMMAND with a timeout of min(CAP, time
# left - RESERVE: what the later steps keep), logs it to $LOGS/NAME.log and records a summary
# row; never exits.
RESERVE=$((10 * SCALE))
step() {
  local name=$1 required=$2 cap=$(($3 * SCALE)); shift 3
  local limit=$(( $(left) - RESERVE )); [ "$cap" -lt "$limit" ] && limit=$cap
  local log=$LOGS/$name.log t0=$SECONDS rc status note
  if [ "$limit" -lt 5 ]; then
    status=skipped; note="no time left"; rc=1
  else
    echo "== $name (limit ${limit}s): $*"
    timeout --kill-after=10 "$limit" "$@" >"$log" 2>&1
    rc=$?
    tail -n 3 "$log" | sed 's/^/   /'
    case $name:$rc in test_*:5) rc=0 ;; esac  # pytest: no CUDA test in this file
    case $name:$rc in
      sglang:3) status="not run"; note=$(tail -n 1 "$log" | cut -c1-150) ;;  # SGLang absent
      *:0) status=ok; note=$(step_note "$name" "$log") ;;
      *:124|*:137) status="TIMEOUT"; note="killed after ${limit}s" ;;
      *) status="FAILED"; note="rc $rc: $(grep -E 'Error|error:|FAILED|failed' "$log" | tail -n 1 | cut -c1-150)" ;;
    esac
  fi
  [ "$status" != ok ] && [ "$required" = 0 ] && status="$status (optional)"
  [ "$status" != ok ] && [ "$required" = 1 ] && FAILED=1
  ROWS+=("| $name | $status | $((SECONDS - t0)) | ${note//|//} |")
  copy_out
  return $rc
}
# the note of a passing step: pytest's closing counts, or the last line of a bench script
step_note() {
  case $1 in
    test_*) grep -E '[0-9]+ (passed|failed|skipped|deselected|error)' "$2" | tail -n 1 | tr -d '=' | xargs ;;
    build) grep -E '^dartree: building' "$2" | tail -n 1 ;;
    e2e*) grep '^gpu_e2e ' "$2" | tail -n 1 | cut -c1-400 ;;
    sglang) grep '^sglang_dartree ' "$2" | tail -n 1 ;;
    *) echo "" ;;
  esac
}
summary() {
  local title="GPU check$([ $REHEARSE = 1 ] && echo ' rehearsal'), $(date -u '+%Y-%m-%d %H:%M UTC'), $(nvidia-smi --query-gpu=name,driver_version --format=csv,noheader 2>/dev/null | head -n 1 || true)"
  {
    echo "# $title"
    echo
    echo "$("$PY" -c 'import sys, torch, transformers; print(f"python {sys.version.split()[0]}, torch {torch.__version__}, transformers {transformers.__version__}")' 2>&1 | tail -n 1); commit $(git rev-parse --short HEAD 2>/dev/null || echo '?'); $((SECONDS - START)) s in all"
    for f in "$LOGS"/e2e_cpu.md "$LOGS"/kernels.md "$LOGS"/e2e.md "$LOGS"/flex.md "$LOGS"/compile.md "$LOGS"/sglang.md; do [ -s "$f" ] && { echo; cat "$f"; }; done
    echo
    echo "### Summary"
    echo
    echo "| step | status | seconds | note |"
    echo "|---|---|---:|---|"
    printf '%s\n' "${ROWS[@]}"
  } > "$REPORT"
  copy_out
  echo
  echo "| step | status | seconds | note |"
  echo "|---|---|---:|---|"
  printf '%s\n' "${ROWS[@]}"
}

# 0. what this machine has
step stack 1 60 "$PY" -c "import sys, shutil, torch, transformers, pytest, numpy, setuptools
print('python', sys.version.split()[0], '| torch', torch.__version__, '(CUDA', torch.version.cuda, ') | transformers', transformers.__version__)
print('ninja', shutil.which('ninja'), '| nvcc', shutil.which('nvcc'), '| GPU', torch.cuda.get_device_name(0) if torch.cuda.is_available() else None)"

# 1. build in place (no pip, no index, nothing downloaded); the CUDA kernels are required
if [ $REHEARSE = 1 ] && ! has_gpu; then FORCE=${DARTREE_FORCE_CUDA:-0}; else FORCE=1; fi
step build 1 300 env DARTREE_FORCE_CUDA="$FORCE" "$PY" setup.py -q build_ext --inplace
step import 1 60 "$PY" -c "import dartree, dartree.ops as o
print(dartree.__file__, '| extension', o.HAS_EXTENSION, '| CUDA kernels', o.HAS_CUDA_KERNELS)
assert o.HAS_EXTENSION, 'dartree._C did not build'"

if [ $REHEARSE = 1 ]; then
  step e2e_cpu_rehearsal 1 90 "$PY" bench/gpu_e2e.py --device cpu --quick --out "$LOGS/e2e_cpu.md"
fi

# the GPU steps
if ! has_gpu; then
  ROWS+=("| gpu | none | 0 | no CUDA GPU visible: the GPU steps did not run |")
  echo "gpu_check: no CUDA GPU visible to $PY: stopping before the GPU steps"
  summary
  [ $FAILED = 1 ] && exit 1
  exit 2
fi
step cuda_kernels_built 1 60 "$PY" -c "import dartree.ops as o; assert o.HAS_CUDA_KERNELS, 'CUDA kernels not built'"

# 2. the CUDA tests, one file at a time (test ids carry the device: -k cuda); 200 s are kept for
# steps 3 and 4
RESERVE=$((200 * SCALE))
for file in tests/test_*.py; do
  step "$(basename "$file" .py)" 1 120 "$PY" -m pytest -q -k cuda -p no:cacheprovider "$file"
done

# 3. kernel timings (FlexAttention left to step 5)
RESERVE=$((120 * SCALE))
step kernels 1 150 "$PY" bench/op_bench.py --device cuda --iters 30 --no-flex
sed -n '/^###/,$p' "$LOGS/kernels.log" > "$LOGS/kernels.md"

# 4. the engine end to end
RESERVE=$((5 * SCALE))
step e2e 1 240 "$PY" bench/gpu_e2e.py --device cuda --out "$LOGS/e2e.md"

# 5. FlexAttention baselines, with what is left
step flex 0 150 "$PY" bench/op_bench.py --device cuda --iters 30 --filter "tree_attention bfloat16 T64"
sed -n '/^###/,$p' "$LOGS/flex.log" > "$LOGS/flex.md"

# 6. TargetModel(compile=True) against eager, with what is left: decides compile="auto" on CUDA
step compile 0 150 "$PY" bench/compile.py --device cuda --dtype bfloat16 --rows 1,64 --repeat 20
grep -E '^ *rows +compile|^ +[0-9]+ ' "$LOGS/compile.log" | sed '1i ### Compiled verify (bench/compile.py)\n\n```' | sed '$a ```' > "$LOGS/compile.md"

# 7. SGLang serving with DARTREE (dartree.integrations.sglang), with what is left
step sglang 0 240 "$PY" bench/sglang_dartree.py --out "$LOGS/sglang.md"

summary
exit $FAILED
