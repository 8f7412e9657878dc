#!/usr/bin/env bash
# One prepared run for a lent GPU (an H200): a pre-flight (what SDPA saves for backward,
# pinned-upload bandwidth), environment, the GPU tests, and protrain against FSDP2 offload
# (and DeepSpeed ZeRO-3 offload when carried) on gpt2-xl and a reduced-depth llama-7b
# under a 24 GiB cap, with predicted vs measured peak memory and iteration time; after each
# model's first comparison, host bytes per offloaded parameter (tools.bench host --device, gpt2-medium
# and gpt2-large homeless). Must finish in under 8 minutes of device time: every step runs
# under `timeout`, no step may start past the overall deadline, and a failed step is
# recorded while the rest go on.
#
#   BENCH_COMMIT=$(git rev-parse --short HEAD) tools/gpu_check.sh   # on the GPU machine (OUT
#                                           # set by the device tool; the copy there has no .git)
#   tools/gpu_check.sh --device cpu --tiny  # rehearsal on a CPU box: tiny models, same files
#
# The pre-flight comes first and needs torch only (no protrain, no msgspec), so its data
# comes back even if everything after it fails: tools/gpu_preflight.py records, for bf16
# and fp32, every SDPA back-end that runs here and a few causal shapes with and without
# dropout, the device, dtype and size of each tensor SDPA saves for backward (flash and
# efficient SDPA save philox seed/offset as CPU scalars, which the swap hooks must leave
# alone), and times a cudaHostRegister of 1 GiB and its non-blocking upload against a
# pageable one. Under 60 s; on CPU it runs the census and records the pinned part skipped.
#
# A CPU rehearsal exports PROTRAIN_ASYNC_CPU=1 for the bench runs: the executor's CPU
# copy engine then completes copies later on a worker thread (an emulation of CUDA's
# asynchronous streams), so a missing wait shows up before the GPU run, not during it.
#
# Why llama-7b[8L] and not llama-7b: all 32 blocks need ~6.7e9 x 12-14 B (fp32 master and
# Adam moments, with or without a bf16 home) ~ 80-94 GB of host memory for what a 24 GiB card
# must offload, most of the H200 machine's 128 GiB, and one step of CPU Adam over ~6e9
# parameters would take most of the time box. 8 of its blocks (same width, heads and
# MLP; 1.88e9 parameters) exercise the same shapes.
#
# What comes back under $OUT (8 files, flat: the device tool returns at most 8):
#   preflight.json    the pre-flight's record: SDPA saved-tensor census, pinned vs pageable upload
#   env.txt           nvidia-smi, python, torch, CUDA, what was installed and how
#   steps.tsv         step, status, exit code, seconds, time limit
#   pytest-gpu.txt    pytest -x -q tests/gpu
#   bench.jsonl       one tools.bench train record per run (tokens/s, peaks, predicted vs measured)
#   summary.md        the pre-flight's summary, the tools.bench train report table, the host bytes
#                     per offloaded parameter (tools.bench host --report) and the step table
#   artifacts.tar.gz  hardware spec, profiles and plans protrain made and used; host.jsonl
#   log.txt           everything every step printed
set -uo pipefail
cd "$(dirname "$0")/.."

DEVICE=cuda
TINY=0
WITH_DS=0
DEADLINE_S=450          # no step starts after this many seconds; 8 min = 480 s
while [ $# -gt 0 ]; do
  case "$1" in
    --device) DEVICE="$2"; shift 2 ;;
    --tiny) TINY=1; shift ;;
    --deadline) DEADLINE_S="$2"; shift 2 ;;
    --with-deepspeed) WITH_DS=1; shift ;;
    *) echo "usage: $0 [--device cuda|cpu] [--tiny] [--deadline SECONDS] [--with-deepspeed]" >&2; exit 2 ;;
  esac
done
if [ -z "${OUT:-}" ]; then
  OUT="$(mktemp -d -t gpu_check.XXXXXX)"
fi
mkdir -p "$OUT"
WORK="$(mktemp -d -t gpu_check_work.XXXXXX)"   # profiles, plans, spec: tarred into $OUT at the end
ART="$WORK/artifacts"
mkdir -p "$ART"
LOG="$OUT/log.txt"
STEPS="$OUT/steps.tsv"
JSONL="$OUT/bench.jsonl"
: >"$LOG"; : >"$JSONL"
printf 'step\tstatus\texit\tseconds\tlimit_s\n' >"$STEPS"
export PYTHONUNBUFFERED=1
COMMIT="${BENCH_COMMIT:-$(git rev-parse --short HEAD 2>/dev/null || echo unknown)}"
export BENCH_COMMIT="$COMMIT"   # tools.bench train records it in every JSON line
START=$(date +%s)
PY=python3

if [ "$TINY" = 1 ]; then
  # Tiny shapes: the same steps on gpt2-tiny and llama-tiny, a budget that makes the
  # planner offload (gpt2-tiny at micro-batch 4 x 64 needs ~3.7 MiB with everything kept).
  MODELS=("gpt2-tiny::2 4" "llama-tiny::2 4")
  SEQ=64; BUDGET=3MiB; STEPS_N=4; WARMUP=1; RUN_LIMIT=90; PROBE_LIMIT=60
  EXTRA=(--threads 1)
  HOST_ROWS=(--row gpt2-tiny,bfloat16,1,1,0); HOST_STEPS=1; HOST_LIMIT=60
else
  MODELS=("gpt2-xl::4 8" "llama-7b:8:2 4")
  SEQ=1024; BUDGET=24GiB; STEPS_N=4; WARMUP=1; RUN_LIMIT=150; PROBE_LIMIT=90
  EXTRA=()
  # the two homeless rows of BENCHMARKS.md's CPU table (355M, 774M), each in two processes
  HOST_ROWS=(--row gpt2-medium,bfloat16,1,1,0 --row gpt2-large,bfloat16,1,1,0); HOST_STEPS=3; HOST_LIMIT=150
fi

# step NAME LIMIT_S CMD...: run CMD under timeout unless the deadline has passed; record it.
step() {
  local name="$1" limit="$2"; shift 2
  local now elapsed left t0 rc status
  now=$(date +%s); elapsed=$((now - START)); left=$((DEADLINE_S - elapsed))
  if [ "$left" -le 5 ]; then
    printf '%s\tskipped (deadline)\t-\t0\t%s\n' "$name" "$limit" >>"$STEPS"
    echo "=== $name: skipped, ${elapsed}s elapsed of the ${DEADLINE_S}s deadline" | tee -a "$LOG"
    return 0
  fi
  [ "$limit" -gt "$left" ] && limit=$left
  echo "=== $name (limit ${limit}s, ${elapsed}s elapsed)" | tee -a "$LOG"
  t0=$(date +%s)
  timeout -k 10 "$limit" "$@" >>"$LOG" 2>&1
  rc=$?
  case $rc in
    0) status=ok ;;
    124|137) status="timed out" ;;
    *) status=failed ;;
  esac
  printf '%s\t%s\t%s\t%s\t%s\n' "$name" "$status" "$rc" "$(( $(date +%s) - t0 ))" "$limit" >>"$STEPS"
  echo "=== $name: $status (exit $rc, $(( $(date +%s) - t0 ))s)" | tee -a "$LOG"
  return 0
}

env_report() {
  echo "date: $(date -u '+%Y-%m-%d %H:%M:%S UTC')"
  echo "host: $(uname -a)"
  echo "commit: $COMMIT"
  echo "device: $DEVICE tiny: $TINY deadline: ${DEADLINE_S}s"
  echo "--- nvidia-smi"
  nvidia-smi 2>&1 || echo "(no nvidia-smi)"
  echo "--- python"
  $PY - <<'EOF'
import platform, sys
print("python", sys.version.replace("\n", " "), "at", sys.executable)
import torch
print("torch", torch.__version__, "cuda build", torch.version.cuda, "cuda available", torch.cuda.is_available())
if torch.cuda.is_available():
    p = torch.cuda.get_device_properties(0)
    print("gpu", p.name, f"{p.total_memory / 2**30:.1f} GiB", "sm", f"{p.major}.{p.minor}", "count", torch.cuda.device_count())
    print("nccl", ".".join(map(str, torch.cuda.nccl.version())))
print("cpus", __import__("os").cpu_count(), platform.processor() or platform.machine())
try:
    import psutil
    print("host memory", f"{psutil.virtual_memory().total / 2**30:.1f} GiB")
except ImportError:
    pass
for mod in ("msgspec", "scipy", "networkx", "click", "rich", "pytest", "deepspeed"):
    try:
        m = __import__(mod)
        print(mod, getattr(m, "__version__", "?"), "at", m.__file__)
    except Exception as e:
        print(mod, "not importable:", type(e).__name__, e)
EOF
}

# Carried wheels (.whl/, see the device README): install only what does not import here,
# so a rehearsal on another Python never shadows its own packages with cp312 builds.
install_wheels() {
  local whl mod missing=()
  shopt -s nullglob
  for whl in .whl/*.whl; do
    mod=$(basename "$whl" | cut -d- -f1 | tr 'A-Z' 'a-z')
    if $PY -c "import $mod" 2>/dev/null; then
      echo "have $mod; not installing $(basename "$whl")"
    else
      missing+=("$whl")
    fi
  done
  if [ ${#missing[@]} -gt 0 ]; then
    $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
      --target /tmp/gpu_check_site "${missing[@]}" || return 1
    echo "installed into /tmp/gpu_check_site: ${missing[*]}"
  fi
}

# protrain from this working tree: an editable install when pip can make one offline,
# else a namespace shim on PYTHONPATH (protrain/planner -> planner/, protrain/executor ->
# executor/, protrain/plans -> plans/). GPU_CHECK_NO_INSTALL=1 (the CPU rehearsal in the tests)
# goes straight to the shim: an editable install would re-point the environment's protrain,
# the developer's own, at whatever checkout ran the rehearsal.
install_protrain() {
  if $PY -c "import protrain.planner as p, sys; sys.exit(0 if p.__file__.startswith('$PWD/') else 1)" 2>/dev/null; then
    echo "protrain already imports from $PWD"
    return 0
  fi
  if [ "${GPU_CHECK_NO_INSTALL:-0}" != 1 ] \
      && $PY -m pip install -q --no-deps --no-build-isolation --no-index -e . ; then
    echo "pip install -e . done"
  else
    echo "no editable install (GPU_CHECK_NO_INSTALL=1, or pip failed); using a PYTHONPATH shim"
    mkdir -p /tmp/gpu_check_shim/protrain
    ln -sfn "$PWD/planner" /tmp/gpu_check_shim/protrain/planner
    ln -sfn "$PWD/executor" /tmp/gpu_check_shim/protrain/executor
    ln -sfn "$PWD/plans" /tmp/gpu_check_shim/protrain/plans
  fi
}

# ---------------------------------------------------------------------------- the steps

# `timeout` runs programs, not shell functions: export the functions and what they read.
export -f env_report install_wheels install_protrain
export PY DEVICE TINY DEADLINE_S COMMIT
step "pre-flight" 60 $PY tools/gpu_preflight.py --device "$DEVICE" --out "$OUT/preflight.json"
step "environment" 60 bash -c env_report
sed -n '/^=== environment/,$p' "$LOG" >"$OUT/env.txt"
step "install carried wheels" 60 bash -c install_wheels
[ -d /tmp/gpu_check_site ] && export PYTHONPATH="/tmp/gpu_check_site${PYTHONPATH:+:$PYTHONPATH}"
step "install protrain" 120 bash -c install_protrain
[ -d /tmp/gpu_check_shim ] && export PYTHONPATH="/tmp/gpu_check_shim${PYTHONPATH:+:$PYTHONPATH}"
step "import protrain" 60 $PY -c "import protrain.planner.search.planning, protrain.executor.engine; print('protrain imports')"
{ echo "--- after installs"; echo "PYTHONPATH=${PYTHONPATH:-}"; sed -n '/^=== install/,$p' "$LOG"; } >>"$OUT/env.txt"

step "pytest tests/gpu" 120 bash -c "set -o pipefail; $PY -m pytest -o addopts=-ra -x -q tests/gpu 2>&1 | tee '$OUT/pytest-gpu.txt'"

step "probe hardware" "$PROBE_LIMIT" $PY -c "
from protrain.planner.hardware.probe import probe_to_file
probe_to_file('$ART/spec-$DEVICE.json', '$DEVICE', quick=True)"
SPEC=()
[ -f "$ART/spec-$DEVICE.json" ] && SPEC=(--hardware "$ART/spec-$DEVICE.json")

BACKENDS=(--backend protrain --backend fsdp2-offload)
# CPU rehearsal: protrain's copies complete later on a worker thread, as on CUDA streams.
[ "$DEVICE" = cpu ] && export PROTRAIN_ASYNC_CPU=1

# First the smaller micro-batch of every model, then the larger ones: if the deadline
# cuts the run short, each model has at least one comparison.
for pass in 0 1; do
  for entry in "${MODELS[@]}"; do
    model="${entry%%:*}"; rest="${entry#*:}"; layers="${rest%%:*}"; mbs=(${rest#*:})
    mb="${mbs[$pass]}"
    depth=(); [ -n "$layers" ] && depth=(--layers "$layers")
    label="$model${layers:+[${layers}L]}"
    step "bench $label mb $mb" "$RUN_LIMIT" $PY -m tools.bench train --device "$DEVICE" \
      --model "$model" "${depth[@]}" --micro-batch "$mb" --seq "$SEQ" --budget "$BUDGET" \
      --steps "$STEPS_N" --warmup "$WARMUP" "${BACKENDS[@]}" "${SPEC[@]}" "${EXTRA[@]}" \
      --artifacts "$ART" --jsonl "$JSONL" --timeout "$RUN_LIMIT"
  done
  # After the first pass (each model compared once): host bytes per offloaded parameter with
  # the device's memory off the host (issue 17). On a CPU run the device's freed temporaries
  # share glibc's heap with the host states and lift its high-water; on a GPU they do not.
  # Rows land in $ART/host.jsonl one by one.
  [ "$pass" = 0 ] && step "host bytes" "$HOST_LIMIT" $PY -m tools.bench host --device "$DEVICE" \
    --steps "$HOST_STEPS" "${HOST_ROWS[@]}" --jsonl "$ART/host.jsonl"
done
# Plain PyTorch under the same cap: a clean "does not fit" record is the expected answer
# for gpt2-xl at 24 GiB (16 B per parameter of states alone is 23 GiB).
first="${MODELS[0]}"; model="${first%%:*}"; rest="${first#*:}"; mbs=(${rest#*:})
step "bench $model torch-plain mb ${mbs[0]}" 60 $PY -m tools.bench train --device "$DEVICE" \
  --model "$model" --micro-batch "${mbs[0]}" --seq "$SEQ" --budget "$BUDGET" --steps "$STEPS_N" \
  --warmup "$WARMUP" --backend torch-plain "${EXTRA[@]}" --jsonl "$JSONL" --timeout 50

# DeepSpeed last: it is carried, not on the image, and its first use JIT-compiles the
# CPU Adam op (about a minute on 16 cores; six on a busy 2-core box), so it runs only
# where time is left. On CPU rehearsals only with --with-deepspeed.
if { [ "$DEVICE" != cpu ] || [ "$WITH_DS" = 1 ]; } && $PY -c "import deepspeed" 2>/dev/null; then
  step "bench $model deepspeed mb ${mbs[0]}" 240 $PY -m tools.bench train --device "$DEVICE" \
    --model "$model" --micro-batch "${mbs[0]}" --seq "$SEQ" --budget "$BUDGET" --steps "$STEPS_N" \
    --warmup "$WARMUP" --backend deepspeed-zero3-offload "${EXTRA[@]}" --jsonl "$JSONL" --timeout 230
else
  printf '%s\t%s\t-\t0\t0\n' "bench deepspeed" "skipped (not importable, or CPU without --with-deepspeed)" >>"$STEPS"
fi

# ---------------------------------------------------------------------------- results

{
  echo "# gpu_check: protrain against FSDP2 / DeepSpeed offload ($DEVICE$([ "$TINY" = 1 ] && echo ', tiny rehearsal'))"
  echo
  echo "Commit $COMMIT, $(date -u '+%Y-%m-%d %H:%M UTC'), budget $BUDGET, seq $SEQ, $STEPS_N steps ($WARMUP warm-up) per run."
  echo "$([ "$DEVICE" = cpu ] && echo "PROTRAIN_ASYNC_CPU=${PROTRAIN_ASYNC_CPU:-unset} for the bench runs.")"
  echo
  if [ -s "$OUT/preflight.json" ]; then
    $PY tools/gpu_preflight.py --report "$OUT/preflight.json" 2>&1 || echo "(pre-flight report failed)"
  else
    echo "(no pre-flight record)"
  fi
  echo
  if [ -s "$JSONL" ]; then
    $PY -m tools.bench train --report "$JSONL" 2>&1 || echo "(report failed)"
  else
    echo "(no bench records)"
  fi
  echo
  if [ -s "$ART/host.jsonl" ]; then
    $PY -m tools.bench host --report "$ART/host.jsonl" 2>&1 || echo "(host bytes report failed)"
  else
    echo "(no host bytes rows)"
  fi
  echo
  echo "## Steps"
  echo
  echo "| step | status | exit | seconds | limit s |"
  echo "|---|---|---:|---:|---:|"
  tail -n +2 "$STEPS" | awk -F'\t' '{printf "| %s | %s | %s | %s | %s |\n", $1, $2, $3, $4, $5}'
} >"$OUT/summary.md"
[ -f "$OUT/pytest-gpu.txt" ] || echo "pytest step did not run (see steps.tsv)" >"$OUT/pytest-gpu.txt"
tar -czf "$OUT/artifacts.tar.gz" -C "$WORK" artifacts
rm -rf "$WORK"
echo "gpu_check done in $(( $(date +%s) - START ))s; files in $OUT:" | tee -a "$LOG"
ls -la "$OUT" | tee -a "$LOG"
