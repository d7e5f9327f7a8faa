#!/usr/bin/env bash
# One-call recipe for the lent GPU machine (the `run` tool): build, GPU tests, benchmarks, logs under $OUT.
#
#   scripts/device-run.sh [-t "tests/test_a.py tests/test_b.py"] [-k PYTEST_K] [-b "exl3 moe"] [-B "bench args"]
#                         [--no-build] [--archs 90a]
#
#   -t  test files/node ids for `pytest -m gpu` (default: none; "all" = tests/test_*.py)
#   -k  pytest -k expression          -b  benchmark names for bench/run.py (default: none)
#   -B  extra args for the bench files (run directly, not through bench/run.py; e.g. "--quick")
# Logs: $OUT/build.log, $OUT/tests.log, $OUT/bench.log; bench results (JSON, PNG, report.md) in $OUT/bench/.
# The `run` tool returns at most 8 files from $OUT (2 folders deep): keep what you write there few.
# Every step runs even if an earlier one failed (one device call should tell as much as possible); the exit
# status is the first failure's.
set -o pipefail
export PYTHONUNBUFFERED=1
cd "$(dirname "$0")/.."
OUT="${OUT:-/tmp/twinspark-out}"
mkdir -p "$OUT"
TESTS="" KEXPR="" BENCH="" BENCH_ARGS="" BUILD=1 ARCHS="${TWINSPARK_CUDA_ARCHS:-90a}"
while [ $# -gt 0 ]; do
  case "$1" in
    -t) TESTS="$2"; shift 2 ;;
    -k) KEXPR="$2"; shift 2 ;;
    -b) BENCH="$2"; shift 2 ;;
    -B) BENCH_ARGS="$2"; shift 2 ;;
    --no-build) BUILD=0; shift ;;
    --archs) ARCHS="$2"; shift 2 ;;
    *) echo "device-run.sh: unknown argument $1 (see the header of this script)" >&2; exit 2 ;;
  esac
done
status=0
fail() { [ $status -eq 0 ] && status=$1; }

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

if [ -n "$BENCH" ]; then
  mkdir -p "$OUT/bench"
  if [ -n "$BENCH_ARGS" ]; then
    for b in $BENCH; do
      for f in bench/bench_${b}*.py; do
        # shellcheck disable=SC2086
        TWINSPARK_BENCH_OUT="$OUT/bench" PYTHONPATH=python python3 "$f" $BENCH_ARGS 2>&1 | tee -a "$OUT/bench.log" || fail 30
      done
    done
  else
    # shellcheck disable=SC2086
    python3 bench/run.py $BENCH --out-dir "$OUT/bench" 2>&1 | tee "$OUT/bench.log" || fail 30
  fi
fi
exit $status
