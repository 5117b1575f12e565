#!/usr/bin/env bash
# One run on a GPU machine (an H200 here): build the extension with its CUDA kernels, run the
# cuda tests, compute-sanitizer over every kernel path, then the kernel benchmark.
#
#   OUT=/some/dir bash bench/gpu_check.sh        (from anywhere; OUT defaults to ./out)
#
# Writes under $OUT: summary.log, build.log, tests.log, memcheck.log, racecheck.log, bench.log
# and bench_kernels.json (also copied to bench/results/). Each step has a time limit and the
# whole run a budget (GPU_CHECK_BUDGET_S, default 480 s), so it ends inside ~8 minutes; a step
# left without time is skipped and says so. Exit status: 0 when every step that ran passed.
set -uo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
OUT="${OUT:-$ROOT/out}"
mkdir -p "$OUT" "$ROOT/bench/results"
export PYTHONUNBUFFERED=1
export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}"
PY="${PYTHON:-python3}"
BUDGET="${GPU_CHECK_BUDGET_S:-480}"
START=$SECONDS
status=0
summary="$OUT/summary.log"

note() { echo "$*" | tee -a "$summary"; }

# step NAME LIMIT_S CMD...: runs CMD with its output in $OUT/NAME.log, within the time left.
step() {
  local name=$1 limit=$2
  shift 2
  local left=$((BUDGET - (SECONDS - START)))
  if ((left < 20)); then
    note "$name: SKIPPED (budget spent)"
    status=1
    return 1
  fi
  ((limit > left)) && limit=$left
  local t0=$SECONDS
  timeout --kill-after=10 "$limit" "$@" >"$OUT/$name.log" 2>&1
  local rc=$?
  note "$name: rc=$rc in $((SECONDS - t0)) s (limit $limit s)"
  tail -n 30 "$OUT/$name.log"
  ((rc == 0)) || status=1
  return $rc
}

{
  date -u +"%Y-%m-%dT%H:%M:%SZ"
  nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.sm,clocks.mem --format=csv || true
  "$PY" -c "import torch, sys; print('python', sys.version.split()[0], 'torch', torch.__version__, 'cuda', torch.version.cuda)"
  command -v nvcc && nvcc --version | tail -n 2
  echo "cores: $(nproc)"
} >"$summary" 2>&1
cat "$summary"

# The commit, for the results file (the device copy may have no .git).
if [ -z "${SGLANG_DFLASH_COMMIT:-}" ]; then
  SGLANG_DFLASH_COMMIT=$(git -C "$ROOT" rev-parse HEAD 2>/dev/null || echo unknown)
  if [ "$SGLANG_DFLASH_COMMIT" != unknown ] && [ -n "$(git -C "$ROOT" status --porcelain 2>/dev/null)" ]; then
    SGLANG_DFLASH_COMMIT="$SGLANG_DFLASH_COMMIT+dirty"
  fi
fi
export SGLANG_DFLASH_COMMIT

rm -f "$ROOT"/sglang_dflash/_C*.so
if ! step build 300 env SGLANG_DFLASH_CUDA=1 TORCH_CUDA_ARCH_LIST=9.0 MAX_JOBS="$(nproc)" \
  "$PY" setup.py build_ext --inplace; then
  note "build failed: nothing else runs"
  exit 1
fi
"$PY" -c "from sglang_dflash._extension import has_cuda_kernels as h; print('CUDA kernels registered:', h())" \
  2>&1 | tee -a "$summary"

step tests 170 "$PY" -m pytest -q -rs -m cuda tests/test_cuda_ops.py -p no:cacheprovider

SAN=$(command -v compute-sanitizer || echo /usr/local/cuda/bin/compute-sanitizer)
if [ -x "$SAN" ]; then
  # Without the caching allocator every tensor is its own cudaMalloc, so memcheck sees an
  # out-of-bounds access past a tensor's end instead of a read inside a cached segment.
  step memcheck 100 env PYTORCH_NO_CUDA_MEMORY_CACHING=1 \
    "$SAN" --tool memcheck --error-exitcode 9 "$PY" bench/sanitize_kernels.py
  step racecheck 70 "$SAN" --tool racecheck --error-exitcode 9 "$PY" bench/sanitize_kernels.py --small
else
  note "compute-sanitizer: not found, skipped"
fi

# The benchmark rewrites its JSON after every case ("complete": false until the end), so a run
# cut short by the budget still returns the cases it measured.
step bench 220 "$PY" bench/bench_kernels.py --out "$OUT/bench_kernels.json"
[ -f "$OUT/bench_kernels.json" ] && cp "$OUT/bench_kernels.json" "$ROOT/bench/results/bench_kernels.json"

note "total: $((SECONDS - START)) s, status $status"
exit $status
