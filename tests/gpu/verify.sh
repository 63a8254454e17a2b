#!/usr/bin/env bash
# The checks to run on a CUDA machine after any change to the kernels (or to what launches them), from the
# checkout, with the dev extra's packages importable:
#
#   bash tests/gpu/verify.sh OUT_DIR [CHECK ...]     (CHECK: suite, stress, accuracy; default all three)
#
# 1. the whole test suite, whose kernel tests then run on the GPU (OUT_DIR/suite.txt);
# 2. the randomised stress test against a float64 oracle for STRESS_SECONDS (default 200: about 50,000
#    cases on an H200; OUT_DIR/stress.csv, stress.txt);
# 3. the accuracy sweep of docs/accuracy.md, N = 1K and 4K at d = 128 and 64, 16K at d = 128
#    (OUT_DIR/accuracy.csv, accuracy.txt).
# It prints one summary line per check and exits non-zero on any failure. Environment: WORKERS (pytest-xdist processes,
# default 8), STRESS_SECONDS, ACCURACY_LENGTHS (default "1024 4096"; 16384 runs on its own at d = 128
# unless SKIP_16K=1), FLASHBOB_AUTOTUNE (default 0: the shipped table's configs, no tuning).
set -uo pipefail
out=${1:?usage: bash tests/gpu/verify.sh OUT_DIR [suite] [stress] [accuracy]}
shift
checks=" ${*:-suite stress accuracy} "
out=$(mkdir -p "$out" && cd "$out" && pwd) || exit
cd "$(dirname "$0")/../.."
export PYTHONPATH=.${PYTHONPATH:+:$PYTHONPATH} FLASHBOB_AUTOTUNE=${FLASHBOB_AUTOTUNE:-0}
suite=0 stress=0 accuracy=0 others=0 failures=0
if [[ $checks == *" suite "* ]]; then
    python3 -m pytest -q -n "${WORKERS:-8}" -p no:cacheprovider --tb=short -rfE tests >"$out/suite.txt" 2>&1
    suite=$?
    echo "suite (exit $suite): $(tail -n 1 "$out/suite.txt")"
fi
if [[ $checks == *" stress "* ]]; then
    python3 tests/gpu/stress.py --seconds "${STRESS_SECONDS:-200}" --out "$out/stress.csv" >"$out/stress.txt" 2>&1
    stress=$?
    echo "stress (exit $stress): $(grep -m1 -E '^[0-9]+ cases in' "$out/stress.txt")"
    failures=$(grep -m1 -oE 'failures: [0-9]+' "$out/stress.txt")
    failures=${failures#failures: }
    failures=${failures:-1}
fi
if [[ $checks == *" accuracy "* ]]; then
    rm -f "$out/accuracy.csv"  # accuracy.py appends
    python3 tests/gpu/accuracy.py --n ${ACCURACY_LENGTHS:-1024 4096} --head-dims 128 64 \
        --out "$out/accuracy.csv" >"$out/accuracy.txt" 2>&1
    accuracy=$?
    if [ "${SKIP_16K:-0}" != 1 ]; then
        python3 tests/gpu/accuracy.py --n 16384 --head-dims 128 --out "$out/accuracy.csv" >>"$out/accuracy.txt" 2>&1
        accuracy=$((accuracy || $?))
    fi
    rows=$(tr -d '\r' <"$out/accuracy.csv" | tail -n +2)
    others=$(grep -vc ',PASS$' <<<"$rows")
    echo "accuracy (exit $accuracy): $(grep -c ',PASS$' <<<"$rows") PASS, $others other rows"
fi
exit $((suite || stress || accuracy || others || failures))
