#!/usr/bin/env bash
# One-call recipe for the lent GPU machine (the `run` tool): build, GPU tests, benchmarks, logs under $OUT.
#
#   scripts/device-run.sh [-t "tests/test_a.py tests/test_b.py"] [-k PYTEST_K] [-b "exl3 moe"] [-B "bench args"]
#                         [--no-build] [--archs 90a] [--ab .ab/base | --env-ab KEY | --env-sets "A=1 B=2|A=0"]
#                         [--ab-rounds 2] [--trace "K,T K,T ..."]
#
#   -t  test files/node ids for `pytest -m gpu` (default: none; "all" = tests/test_*.py)
#   -k  pytest -k expression          -b  benchmark names for bench/run.py (default: none)
#   -B  extra args for the bench files (run directly, not through bench/run.py; e.g. "--quick")
#   --ab "DIR..."  same-machine A/B: each DIR is a source tree made here by scripts/ab-base.sh (carry ".ab");
#       they are built beside this tree in the same call, and each -b benchmark (needs -B) runs on every tree,
#       alternating "new" and each DIR for --ab-rounds rounds; all land in $OUT/bench.log under
#       "== new <round>" and "== <basename of DIR> <round>"
#   --env-ab KEY  same-build A/B of an on/off switch: KEY is a launch-plan key (twinspark.ops.plans, e.g.
#       exl3_moe.bytesum; run with TWINSPARK_PLAN=KEY=1 "new" and KEY=0 "base", appended to any TWINSPARK_PLAN
#       given) or an environment variable (upper case, set to 1 and 0); each -b benchmark (needs -B) alternates the
#       two for --ab-rounds rounds, under the same "== new|base <round>" headers
#   --env-sets "SETS"  same-build comparison of several environments: SETS is '|'-separated, each a space-separated
#       list of VAR=VALUE; every round runs each -b benchmark (needs -B) once per set, under "== set<i> <round> (SET)".
#       Plan keys go in TWINSPARK_PLAN, comma-separated: --env-sets "TWINSPARK_PLAN=exl3_moe.pdl=1|TWINSPARK_PLAN=
#       exl3_moe.pdl=0,exl3_moe.split_k=3" (without the line break); each set's plan is checked before the build
#   --trace "K,T ..."  last of all: rebuild with the per-block marks (TWINSPARK_TRACE=1; it replaces the release build
#       installed here), run the trace-marks GPU test, then bench/profile_exl3.py moe --trace at each (K, T): the
#       per-block timeline of one MoE layer, in $OUT/trace.log
# Logs: $OUT/build.log, $OUT/tests.log, $OUT/bench.log; bench results (JSON, PNG, report.md) in $OUT/bench/.
# The `run` tool returns at most 8 files from $OUT (2 folders deep): keep what you write there few.
# Every step runs even if an earlier one failed (one device call should tell as much as possible); the exit
# status is the first failure's.
set -o pipefail
export PYTHONUNBUFFERED=1
cd "$(dirname "$0")/.."
OUT="${OUT:-/tmp/twinspark-out}"
mkdir -p "$OUT"
TESTS="" KEXPR="" BENCH="" BENCH_ARGS="" BUILD=1 ARCHS="${TWINSPARK_CUDA_ARCHS:-90a}" AB="" ENV_AB="" ENV_SETS="" AB_ROUNDS=2 TRACE=""
while [ $# -gt 0 ]; do
  case "$1" in
    -t) TESTS="$2"; shift 2 ;;
    -k) KEXPR="$2"; shift 2 ;;
    -b) BENCH="$2"; shift 2 ;;
    -B) BENCH_ARGS="$2"; shift 2 ;;
    --no-build) BUILD=0; shift ;;
    --archs) ARCHS="$2"; shift 2 ;;
    --ab) AB="$2"; shift 2 ;;
    --ab-rounds) AB_ROUNDS="$2"; shift 2 ;;
    --env-ab) ENV_AB="$2"; shift 2 ;;
    --env-sets) ENV_SETS="$2"; shift 2 ;;
    --trace) TRACE="$2"; shift 2 ;;
    *) echo "device-run.sh: unknown argument $1 (see the header of this script)" >&2; exit 2 ;;
  esac
done
for kt in $TRACE; do
  if ! [[ "$kt" =~ ^[1-8],[0-9]+$ ]]; then
    echo "device-run.sh: --trace takes K,T pairs (K 1-8, T tokens) such as \"2,1 3,4\", got $kt" >&2
    exit 2
  fi
done
# Plan keys and TWINSPARK_PLAN values are checked here, before anything is built (the source tree's parser).
check_plan() {
  PYTHONPATH=python python3 -c "from twinspark.ops import plans
try:
    plans.from_env()
except ValueError as e:
    print(e)" 2>&1 | tail -1
}
if [[ "$ENV_AB" =~ ^[a-z0-9_]+\.[a-z0-9_]+$ ]]; then
  err=$(TWINSPARK_PLAN="${TWINSPARK_PLAN:+$TWINSPARK_PLAN,}$ENV_AB=1" check_plan)
  [ -z "$err" ] || { echo "device-run.sh: --env-ab $ENV_AB: $err" >&2; exit 2; }
elif [ -n "$ENV_AB" ] && ! [[ "$ENV_AB" =~ ^[A-Z_][A-Z0-9_]*$ ]]; then
  echo "device-run.sh: --env-ab takes a plan key such as exl3_moe.bytesum or an environment variable name, got $ENV_AB" >&2
  exit 2
fi
if [ -n "$ENV_SETS" ]; then
  IFS='|' read -r -a sets <<<"$ENV_SETS"
  for set in "${sets[@]}"; do
    # shellcheck disable=SC2086
    err=$(export $set; check_plan)
    [ -z "$err" ] || { echo "device-run.sh: --env-sets \"$set\": $err" >&2; exit 2; }
  done
fi
status=0
fail() { [ $status -eq 0 ] && status=$1; }

AB_PIDS=()
if [ -n "$AB" ]; then
  if [ -z "$BENCH" ] || [ -z "$BENCH_ARGS" ]; then
    echo "device-run.sh: --ab compares benchmarks: give -b NAMES and -B \"ARGS\" (the bench files are run directly)" >&2
    exit 2
  fi
  for d in $AB; do
    if [ ! -f "$d/CMakeLists.txt" ]; then
      echo "device-run.sh: --ab $d is not a source tree; make it with scripts/ab-base.sh REV and carry \".ab\"" >&2
      exit 2
    fi
  done
  # The other builds run beside this tree's build and tests (separate build dirs, --upgrade: a warm machine keeps
  # /tmp, and pip --target does not replace an existing package without it). build_<name>.log each.
  for d in $AB; do
    n=$(basename "$d")
    ( t0=$(date +%s) && cd "$d" && CMAKE_BUILD_PARALLEL_LEVEL=$(( $(nproc) / 2 + 1 )) TWINSPARK_CUDA_ARCHS="$ARCHS" \
        python3 -m pip install --no-build-isolation --no-deps --upgrade --target "/tmp/ab-$n-site" . >"$OUT/build_$n.log" 2>&1 \
      && cp "/tmp/ab-$n-site"/twinspark/_C*.so python/twinspark/ \
      && echo "$n build ($(cat AB_REV 2>/dev/null)): $(( $(date +%s) - t0 )) s" >>"$OUT/build_$n.log" ) &
    AB_PIDS+=($!)
  done
fi

nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem,temperature.gpu --format=csv,noheader | tee "$OUT/build.log"
if [ $BUILD -eq 1 ]; then
  t0=$(date +%s)
  # One arch is quicker on the device; CI compiles both (90a;121a).
  CMAKE_BUILD_PARALLEL_LEVEL=$(nproc) TWINSPARK_CUDA_ARCHS="$ARCHS" TWINSPARK_PTXAS_VERBOSE=1 \
    python3 -m pip install --no-build-isolation --no-deps -v . >>"$OUT/build.log" 2>&1 || fail 10
  # bench/run.py puts python/ first on PYTHONPATH: give the source tree the built module too.
  so=$(cd /tmp && python3 -c "import twinspark._C as c; print(c.__file__)") && cp "$so" python/twinspark/ || fail 11
  echo "build: $(( $(date +%s) - t0 )) s, status $status" | tee -a "$OUT/build.log"
  grep -E "spill stores|error" "$OUT/build.log" | grep -v " 0 bytes spill stores" | sort | uniq -c | head -20
fi

if [ -n "$TESTS" ]; then
  [ "$TESTS" = all ] && TESTS="tests/test_*.py"  # GPU tests live at the top level (tests/deploy needs the deploy extras)
  # shellcheck disable=SC2086
  python3 -m pytest -m gpu $TESTS ${KEXPR:+-k "$KEXPR"} -q -rfEs --durations=15 --timeout=300 -p no:cacheprovider \
    2>&1 | tee "$OUT/tests.log" || fail 20
fi

# The -b bench files of source tree $1, run directly with -B's args; results under $2, output appended to bench.log.
run_bench_files() {
  local dir=$1 out=$2 b f
  for b in $BENCH; do
    for f in "$dir"/bench/bench_${b}*.py; do
      # shellcheck disable=SC2086
      (cd "$dir" && TWINSPARK_BENCH_OUT="$out" PYTHONPATH=python python3 "bench/$(basename "$f")" $BENCH_ARGS) 2>&1 |
        tee -a "$OUT/bench.log" || fail 30
    done
  done
}

if [ -n "$BENCH" ]; then
  mkdir -p "$OUT/bench"
  if [ -n "$AB" ]; then
    for pid in "${AB_PIDS[@]}"; do
      wait "$pid" || { echo "an --ab build failed: see build_*.log" | tee -a "$OUT/bench.log"; fail 12; }
    done
    for d in $AB; do tail -1 "$OUT/build_$(basename "$d").log"; done
    for r in $(seq "$AB_ROUNDS"); do
      echo "== new $r ($BENCH)" | tee -a "$OUT/bench.log"
      run_bench_files . "$OUT/bench/new"
      for d in $AB; do
        echo "== $(basename "$d") $r ($BENCH, $(cat "$d/AB_REV" 2>/dev/null))" | tee -a "$OUT/bench.log"
        run_bench_files "$d" "$OUT/bench/$(basename "$d")"
      done
    done
  elif [ -n "$ENV_AB" ]; then
    [ -n "$BENCH_ARGS" ] || { echo "device-run.sh: --env-ab needs -B \"ARGS\"" >&2; exit 2; }
    if [[ "$ENV_AB" == *.* ]]; then  # a plan key: appended to the TWINSPARK_PLAN given (a later item wins)
      plan0="${TWINSPARK_PLAN:+$TWINSPARK_PLAN,}" had_plan="${TWINSPARK_PLAN+1}" keep_plan="${TWINSPARK_PLAN-}"
      ab_set() { export TWINSPARK_PLAN="$plan0$ENV_AB=$1"; }
      ab_unset() { if [ -n "$had_plan" ]; then export TWINSPARK_PLAN="$keep_plan"; else unset TWINSPARK_PLAN; fi; }
    else
      ab_set() { export "$ENV_AB=$1"; }
      ab_unset() { unset "$ENV_AB"; }
    fi
    for r in $(seq "$AB_ROUNDS"); do
      echo "== new $r ($BENCH, $ENV_AB=1)" | tee -a "$OUT/bench.log"
      ab_set 1; run_bench_files . "$OUT/bench/new"
      echo "== base $r ($BENCH, $ENV_AB=0)" | tee -a "$OUT/bench.log"
      ab_set 0; run_bench_files . "$OUT/bench/base"
    done
    ab_unset
  elif [ -n "$ENV_SETS" ]; then
    [ -n "$BENCH_ARGS" ] || { echo "device-run.sh: --env-sets needs -B \"ARGS\"" >&2; exit 2; }
    IFS='|' read -r -a sets <<<"$ENV_SETS"
    for r in $(seq "$AB_ROUNDS"); do
      for i in "${!sets[@]}"; do
        echo "== set$i $r (${sets[$i]})" | tee -a "$OUT/bench.log"
        # shellcheck disable=SC2086
        ( export ${sets[$i]}; run_bench_files . "$OUT/bench/set$i"; exit $status ) || fail 30
      done
    done
  elif [ -n "$BENCH_ARGS" ]; then
    run_bench_files . "$OUT/bench"
  else
    # shellcheck disable=SC2086
    python3 bench/run.py $BENCH --out-dir "$OUT/bench" 2>&1 | tee "$OUT/bench.log" || fail 30
  fi
fi

if [ -n "$TRACE" ]; then
  t0=$(date +%s)
  CMAKE_BUILD_PARALLEL_LEVEL=$(nproc) TWINSPARK_CUDA_ARCHS="$ARCHS" TWINSPARK_TRACE=1 \
    python3 -m pip install --no-build-isolation --no-deps . >"$OUT/build_trace.log" 2>&1 || fail 40
  so=$(cd /tmp && python3 -c "import twinspark._C as c; print(c.__file__)") && cp "$so" python/twinspark/ || fail 41
  echo "trace build: $(( $(date +%s) - t0 )) s, status $status" | tee -a "$OUT/build_trace.log"
  python3 -m pytest -m gpu tests/test_exl3_moe.py -k trace_marks -q -rs -p no:cacheprovider 2>&1 |
    tee "$OUT/trace.log" || fail 42
  for kt in $TRACE; do
    python3 bench/profile_exl3.py moe --K "${kt%,*}" --T "${kt#*,}" --trace 2>&1 | tee -a "$OUT/trace.log" || fail 43
  done
fi
exit $status
