#!/usr/bin/env bash
# One short GPU window (the device machine: one H200, 16 cores, Python 3.12, torch 2.11.0+cu130,
# nvcc 13.0, no network) returns what is needed to judge our CUDA kernels. From the repository root:
#
#   bash bench/gpu_check.sh OUT_DIR            (OUT_DIR: default $OUT, then ./out)
#
# Stages, in this order, each time-boxed, each recording its result in OUT_DIR before the next one
# starts (a run killed midway still returns what it did). The GPU stages run when a GPU is there and
# the built extension registers its CUDA kernels (has_cuda_kernels()), whatever else failed:
#   env           GPU, clocks, driver, kernel, torch / CUDA / Triton / nvcc / pytest versions, cores
#   build         the extension rebuilt in place (sglang_dflash/_C*.so) with its CUDA kernels for sm_90
#                 only (MAX_JOBS = cores); when that fails, each .cu alone
#                 (scripts/check_device_build.py --installed-torch) for its own first errors
#   packaging     tests/test_packaging.py: the build links torch's libstdc++.so and raises cleanly
#   index-errors  the cuda cases of tests/test_ops_index_errors.py and tests/test_ops_error_watch.py:
#                 a kernel's bad index raised with the CPU's text (numbers formatted in the message,
#                 which a private libstdc++ crashed on) and read through the per-step snapshot
#   smoke         bench/gpu/smoke.py: each op in its own process, CUDA_LAUNCH_BLOCKING=1, max error vs
#                 the pure-PyTorch reference on the CPU
#   tests         the cuda-marked op tests (CUDA_TEST_FILES; every kernel variant against the reference),
#                 one pytest process per op family, a time limit per test (pytest-timeout), one xdist
#                 worker each (a test that crashes it is reported as failed and the rest still run)
#                 and a JUnit XML each
#   engine        the engine on the GPU: tests/test_engine_devices.py's cuda cases (chains, trees,
#                 adaptive against plain decoding), then bench/bench_engine.py on SmolLM2-135M's
#                 architecture with random weights (its GGUF cannot travel) and the shipped drafter:
#                 greedy identical to plain, tok/s against plain in the same run
#   memcheck      compute-sanitizer memcheck over bench/gpu/sanitize_kernels.py, our kernels only
#   sweep         bench/bench_kernels.py --variants: every compiled kernel variant timed on the
#                 benchmark's shapes, a table per shape class (the data to pick sglang_dflash/ops/
#                 variants.py's TUNED entries from, without another GPU run)
#   profile       Nsight Compute on one warm block_attention call and one top-k/top-p verify_block
#                 call (bench/gpu/profile_kernels.py)
#   racecheck     compute-sanitizer racecheck, our kernels only
#   bench         the full kernel benchmark with the time left (its JSON grows case by case)
# Files in OUT_DIR (7; the device tool returns at most 8):
#   summary.json                per stage: status (passed / failed / timeout / skipped: cannot run here
#                               / cut: budget spent), seconds, limit, note; the environment; the commit
#   logs.tar.gz                 every stage's log (the profiles too), env.json and the stage table
#   junit.tar.gz                the test stages' JUnit XML
#   smoke.json, engine_gpu.json, bench_kernels_variants.json, bench_kernels.json
# GPU_CHECK_BUDGET_S caps the whole run (default 420 s, so one 10-minute call has room for a rerun of
# a stage): a stage starts only when its minimum fits in what is left and is stopped at its own limit
# or the budget's end. Rerunning it on the same machine rebuilds incrementally and overwrites OUT_DIR.
# Exit status 0 when a GPU was there and no stage failed or timed out (the last benchmark may run into
# the budget's end).
# PYTHON picks the interpreter (default python3); SGLANG_DFLASH_COMMIT names the commit where the
# copy has no .git.
# shellcheck disable=SC2329  # the stage functions are called by name: "stage_$NAME"
set -uo pipefail

# ------------------------------------------------------------------------------------------------
# Stages. Each runs in a process of its own (`bash gpu_check.sh --stage NAME`), so that `timeout`
# stops it with everything it started. Output goes to $LOGS/NAME.log; lines "NOTE: ..." go into the
# summary. Exit 0: passed, 3: skipped (cannot run here), anything else: failed.

stage_env() {
  "$PY" - "$LOGS/env.json" <<'EOF'
import importlib.metadata, json, os, platform, shutil, subprocess, sys

def run(*cmd):
    try:
        return subprocess.run(cmd, capture_output=True, text=True, timeout=20).stdout.strip()
    except (OSError, subprocess.TimeoutExpired) as exc:
        return f"unavailable: {exc}"

env = dict(python=sys.version.split()[0], cores=os.cpu_count(), kernel=platform.release(),
           nvidia_smi=run("nvidia-smi", "--query-gpu=name,driver_version,memory.total,clocks.sm,clocks.max.sm,"
                          "clocks.mem,clocks.max.mem,power.limit", "--format=csv"),
           nvcc=run("nvcc", "--version").splitlines()[-2:], compute_sanitizer=shutil.which("compute-sanitizer"),
           ncu=shutil.which("ncu"))
for dist in ("torch", "triton", "ninja", "pytest", "pytest-timeout", "pytest-xdist"):
    try:
        env[dist] = importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        env[dist] = None
try:
    import torch
    env.update(torch_cuda=torch.version.cuda, cuda_available=torch.cuda.is_available())
    if env["cuda_available"]:
        p = torch.cuda.get_device_properties(0)
        env.update(gpu=p.name, capability=f"{p.major}.{p.minor}", sms=p.multi_processor_count,
                   memory_gib=round(p.total_memory / 2**30, 1))
    else:
        env["no_gpu_reason"] = "torch.cuda.is_available() is False"
except Exception as exc:  # a broken torch is a fact to report, not a crash
    env.update(cuda_available=False, no_gpu_reason=f"import torch failed: {exc!r}")
json.dump(env, open(sys.argv[1], "w"), indent=1)
print(json.dumps(env, indent=1))
if not env["cuda_available"]:
    print(f"NOTE: no GPU: {env['no_gpu_reason']}")
EOF
}

stage_build() {
  rm -f "$ROOT"/sglang_dflash/_C*.so
  if ! SGLANG_DFLASH_CUDA=1 TORCH_CUDA_ARCH_LIST=9.0 MAX_JOBS="$(nproc)" "$PY" setup.py build_ext --inplace; then
    echo "NOTE: build failed: $(grep -m1 -E '\berror:' "$LOGS/build.log" | cut -c1-300)"
    echo "== each CUDA source alone, against this torch"
    "$PY" scripts/check_device_build.py --installed-torch --arch 90
    return 1
  fi
}

stage_packaging() {
  "$PY" -m pytest -q -p no:cacheprovider tests/test_packaging.py
}

stage_index_errors() {
  mkdir -p "$LOGS/junit"
  "$PY" -m pytest -v -rs -m cuda -p no:cacheprovider --junitxml="$LOGS/junit/index-errors.xml" \
    tests/test_ops_index_errors.py tests/test_ops_error_watch.py
}

stage_smoke() {
  "$PY" -m bench.gpu.smoke --out "$OUT_DIR/smoke.json" --timeout 50
}

# Every file with `cuda`-marked op cases (most also run their CPU cases in CI).
CUDA_TEST_FILES=(tests/test_cuda_*.py tests/test_ops_exactness.py)

stage_tests() {
  local timeout_opt=() worker_opt=()
  if "$PY" -c "import pytest_timeout" 2>/dev/null; then
    timeout_opt=(--timeout=60)
  else
    echo "NOTE: pytest-timeout missing: no per-test time limit"
  fi
  # In one xdist worker a test that crashes the process is reported as failed and the family's
  # other tests still run (without it, the first GPU run lost a family's remaining tests to one
  # segfault).
  if "$PY" -c "import xdist" 2>/dev/null; then
    worker_opt=(-n 1)
  else
    echo "NOTE: pytest-xdist missing: a crashing test ends its family's run"
  fi
  # One process per op family: a kernel fault ends one family's process, not the others'.
  local names=(block_attention verify gumbel_argmax materialize_context_kv other)
  local exprs=(block_attention verify gumbel_argmax materialize_context_kv
    "not (block_attention or verify or gumbel_argmax or materialize_context_kv)")
  local threads=$(($(nproc) / ${#names[@]})) pids=() failed=() i rc files
  mkdir -p "$LOGS/junit"
  for i in "${!names[@]}"; do
    OMP_NUM_THREADS=$((threads > 0 ? threads : 1)) "$PY" -m pytest -v -rs -m cuda "${CUDA_TEST_FILES[@]}" \
      ${exprs[i]:+-k "${exprs[i]}"} -p no:cacheprovider --junitxml="$LOGS/junit/${names[i]}.xml" \
      "${timeout_opt[@]}" "${worker_opt[@]}" >"$LOGS/tests-${names[i]}.log" 2>&1 &
    pids+=($!)
  done
  for i in "${!names[@]}"; do
    wait "${pids[i]}"
    rc=$?
    echo "${names[i]}: exit $rc, $(tail -n 1 "$LOGS/tests-${names[i]}.log")"
    ((rc == 0)) || failed+=("${names[i]}")
  done
  if ((${#failed[@]})); then
    echo "NOTE: failed: ${failed[*]} (logs tests-FAMILY.log)"
    return 1
  fi
}

stage_engine() {
  local rc=0
  mkdir -p "$LOGS/junit"
  "$PY" -m pytest -v -rs -m cuda -p no:cacheprovider --junitxml="$LOGS/junit/engine.xml" \
    tests/test_engine_devices.py || { echo "NOTE: engine tests failed"; rc=1; }
  "$PY" -m bench.bench_engine --random-target bench/gpu/smollm2-135m-config.json --device cuda \
    --draft smollm2-135m-dflash-b8 --batch-sizes 1,8 --block-sizes 4,8 --out "$OUT_DIR/engine_gpu.json" ||
    { echo "NOTE: bench_engine failed"; rc=1; }
  return "$rc"
}

# sanitize TOOL ARGS...: compute-sanitizer TOOL over bench/gpu/sanitize_kernels.py, checking only our
# kernels (mangled names hold the namespace sglang_dflash): much faster than instrumenting torch's.
sanitize() {
  local san
  san=$(command -v compute-sanitizer || echo /usr/local/cuda/bin/compute-sanitizer)
  if [ ! -x "$san" ]; then
    echo "NOTE: compute-sanitizer not found"
    return 3
  fi
  "$san" --tool "$1" --kernel-name kns=sglang_dflash --error-exitcode 9 --print-limit 20 \
    "$PY" -m bench.gpu.sanitize_kernels "${@:2}"
  local rc=$?
  if grep -q "Device not supported" "$LOGS/$STAGE.log"; then  # seen under gVisor
    echo "NOTE: compute-sanitizer does not support this device here"
    return 3
  fi
  ((rc == 9)) && echo "NOTE: $1 reported errors"
  return "$rc"
}

stage_memcheck() {
  # Without the caching allocator every tensor is its own allocation, so an access past a tensor's
  # end is reported instead of landing inside a cached segment.
  PYTORCH_NO_CUDA_MEMORY_CACHING=1 sanitize memcheck
}

stage_racecheck() {
  sanitize racecheck --small
}

# Nsight Compute's counters for one warm call of each kernel the first GPU run found slow:
# block_attention (every variant's kernel name holds "block_attention") and the sampled verify
# kernel at top-k/top-p: DRAM throughput, occupancy and its limiter, warp stall reasons.
stage_profile() {
  local ncu rc=0
  ncu=$(command -v ncu || echo /usr/local/cuda/bin/ncu)
  if [ ! -x "$ncu" ]; then
    echo "NOTE: ncu not found"
    return 3
  fi
  local sections=(--section SpeedOfLight --section Occupancy --section LaunchStats --section WarpStateStats
    --section MemoryWorkloadAnalysis)
  echo "== block_attention"
  "$ncu" --clock-control none --kernel-name regex:block_attention --launch-skip 2 --launch-count 1 "${sections[@]}" \
    "$PY" -m bench.gpu.profile_kernels --op block_attention || rc=1
  echo "== verify_block, top-k / top-p"
  "$ncu" --clock-control none --kernel-name regex:sample --launch-skip 2 --launch-count 1 "${sections[@]}" \
    "$PY" -m bench.gpu.profile_kernels --op verify_top_k_top_p || rc=1
  return "$rc"
}

stage_sweep() {
  "$PY" -m bench.bench_kernels --variants --quick --out "$OUT_DIR/bench_kernels_variants.json"
}

stage_bench() {
  "$PY" -m bench.bench_kernels --out "$OUT_DIR/bench_kernels.json"
}

if [ "${1:-}" = --stage ]; then
  cd "$ROOT" || exit 1
  "stage_${2//-/_}"
  exit
fi

# ------------------------------------------------------------------------------------------------
# The run.

OUT_DIR=${1:-${OUT:-out}}
mkdir -p "$OUT_DIR" && OUT_DIR=$(cd "$OUT_DIR" && pwd) || exit 2
cd "$(dirname "$0")/.." || exit 2
ROOT=$PWD
WORK=$(mktemp -d "${TMPDIR:-/tmp}/gpu_check.XXXXXX")
LOGS=$WORK/logs  # outside OUT_DIR: only the tarballs come back, so the file limit holds
mkdir -p "$LOGS"
: >"$LOGS/stages.tsv"
PY=${PYTHON:-python3}
BUDGET=${GPU_CHECK_BUDGET_S:-420}
RESERVE=5 # seconds kept for the last summary and tarballs
START=$SECONDS
STARTED=$(date -u +%Y-%m-%dT%H:%M:%SZ)
COMMIT=${SGLANG_DFLASH_COMMIT:-$(git rev-parse HEAD 2>/dev/null || echo unknown)}
if [ "$COMMIT" != unknown ] && [ -n "$(git status --porcelain 2>/dev/null)" ]; then
  COMMIT="$COMMIT+dirty"
fi
export ROOT LOGS OUT_DIR PY PYTHONUNBUFFERED=1 PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}"
export SGLANG_DFLASH_COMMIT=$COMMIT # bench_kernels.py records it
HAS_GPU=0
BUILT=0
FAILED=0

# summary.json from the stage table; $1: whether the run is over.
write_summary() {
  "$PY" - "$LOGS" "$OUT_DIR/summary.json" "$1" "$BUDGET" "$((SECONDS - START))" "$COMMIT" "$STARTED" <<'EOF'
import json, os, sys

logs, path, finished, budget, elapsed, commit, started = sys.argv[1:]
stages = []
with open(os.path.join(logs, "stages.tsv")) as f:
    for line in f:
        name, status, seconds, limit, note = line.rstrip("\n").split("\t")
        stages.append(dict(name=name, status=status, seconds=int(seconds), limit_s=int(limit), note=note))
try:
    with open(os.path.join(logs, "env.json")) as f:
        env = json.load(f)
except (OSError, ValueError):
    env = None
summary = dict(script="bench/gpu_check.sh", commit=commit, started=started, finished=finished == "true",
               budget_s=int(budget), elapsed_s=int(elapsed), environment=env, stages=stages)
for status in ("passed", "failed", "timeout", "skipped", "cut"):
    summary[status] = [s["name"] for s in stages if s["status"] == status]
with open(path, "w") as f:
    json.dump(summary, f, indent=1)
EOF
}

# The summary and the tarballs in OUT_DIR, refreshed after every stage.
save_outputs() {
  write_summary "$1"
  tar -czf "$WORK/logs.tar.gz" -C "$LOGS" --exclude=./junit . && mv -f "$WORK/logs.tar.gz" "$OUT_DIR/"
  if [ -n "$(ls -A "$LOGS/junit" 2>/dev/null)" ]; then
    tar -czf "$WORK/junit.tar.gz" -C "$LOGS" junit && mv -f "$WORK/junit.tar.gz" "$OUT_DIR/"
  fi
}

# record NAME STATUS SECONDS LIMIT NOTE
record() {
  printf '%s\t%s\t%s\t%s\t%s\n' "$1" "$2" "$3" "$4" "${5//$'\t'/ }" >>"$LOGS/stages.tsv"
  printf '%-12s %-8s %4s s  %s\n' "$1" "$2" "$3" "$5"
  save_outputs false
}

# run_stage NAME MIN_S LIMIT_S [built|gpu]: the stage within its limit and the budget left; "built"
# stages need an extension with CUDA kernels, "gpu" stages a GPU too.
run_stage() {
  local name=$1 min=$2 limit=$3 needs=${4:-}
  if [ "$needs" = gpu ] && ((!HAS_GPU)); then
    record "$name" skipped 0 "$limit" "no GPU (see environment)"
    return 1
  fi
  if [ -n "$needs" ] && ((!BUILT)); then
    record "$name" skipped 0 "$limit" "the extension has no CUDA kernels (see build)"
    return 1
  fi
  local left=$((BUDGET - RESERVE - (SECONDS - START)))
  if ((left < min)); then
    record "$name" cut 0 "$limit" "needs at least $min s, $left s of the budget left"
    return 1
  fi
  ((limit > left)) && limit=$left
  echo "== $name (limit $limit s)"
  local t0=$SECONDS status note
  STAGE=$name timeout --kill-after=5 "$limit" bash "$ROOT/bench/gpu_check.sh" --stage "$name" >"$LOGS/$name.log" 2>&1
  case $? in
    0) status=passed ;;
    3) status=skipped ;;
    124 | 137) status=timeout ;;
    *) status=failed ;;
  esac
  note=$(grep '^NOTE: ' "$LOGS/$name.log" | cut -c7- | paste -sd ';' -)
  if [ $status = timeout ]; then
    note="stopped at its $limit s limit${note:+; $note}"
    [ "$name" = bench ] || FAILED=1  # the last benchmark is meant to use up the budget
  fi
  [ $status = failed ] && FAILED=1
  tail -n 12 "$LOGS/$name.log"
  record "$name" "$status" $((SECONDS - t0)) "$limit" "$note"
  [ $status = passed ]
}

trap 'echo "interrupted: outputs as of the last stage are in $OUT_DIR"; save_outputs false; exit 143' TERM INT
echo "gpu_check: commit $COMMIT, budget $BUDGET s, results in $OUT_DIR, logs in $LOGS"

run_stage env 0 30
grep -q '"cuda_available": true' "$LOGS/env.json" 2>/dev/null && HAS_GPU=1
# Without a GPU the build still says whether the CUDA sources build here.
run_stage build 60 180
"$PY" -c "from sglang_dflash._extension import has_cuda_kernels as h; raise SystemExit(0 if h() else 1)" \
  >>"$LOGS/build.log" 2>&1 && BUILT=1
run_stage packaging 10 60 built
run_stage index-errors 15 60 gpu
run_stage smoke 20 60 gpu
run_stage tests 40 150 gpu
run_stage engine 30 120 gpu
run_stage memcheck 30 90 gpu
run_stage sweep 30 120 gpu
run_stage profile 30 90 gpu
run_stage racecheck 30 60 gpu
run_stage bench 30 "$BUDGET" gpu

save_outputs true
((HAS_GPU)) || FAILED=1
echo "gpu_check: $((SECONDS - START)) s, $( ((FAILED)) && echo 'something failed or could not run' || echo 'all stages that ran passed'); see $OUT_DIR/summary.json"
exit $FAILED
