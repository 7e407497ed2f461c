#!/usr/bin/env bash
# One command for a bare GPU machine, run from anywhere in the repo (`make gpu-check`):
#   build  build pccheck's native core against the preinstalled torch (pip --target /tmp/pccheck-site)
#          and put the built extension into the source tree's pccheck/native/
#   test   the gpu-marked tests (tests/test_gpu.py), from tests/, importing the source tree
#   bench  python3 -m bench.gpu --out "$RES" $BENCH_ARGS
# env.txt (nvidia-smi, torch and its device) is always written. A failing step does not stop the
# later ones; the exit status is non-zero if any step failed.
#
# Environment: OUT (results folder; default bench/results/gpu), GPU_CHECK_STEPS (comma-separated,
# default build,test,bench), BENCH_ARGS (extra arguments for bench.gpu, default none).
# Results are kept flat, at most 8 files: build.log env.txt pytest.log pytest.xml bench.log and
# whatever bench.gpu writes.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
RES="${OUT:-bench/results/gpu}"
mkdir -p "$RES"
RES="$(cd "$RES" && pwd)"
STEPS="${GPU_CHECK_STEPS:-build,test,bench}"
BENCH_ARGS="${BENCH_ARGS:-}"
SITE=/tmp/pccheck-site
MAX_FILES=8
# Tests and bench import the source tree (with the built extension copied in); the tests' child
# processes inherit this.
export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}"

for s in ${STEPS//,/ }; do
    case "$s" in
        build | test | bench) ;;
        *) echo "gpu-check: unknown step '$s' in GPU_CHECK_STEPS (build, test, bench)" >&2; exit 2 ;;
    esac
done
want() { [[ ",$STEPS," == *",$1,"* ]]; }

step_build() {
    echo "python3: $(command -v python3) ($(python3 --version 2>&1))"
    export CMAKE_BUILD_PARALLEL_LEVEL="${CMAKE_BUILD_PARALLEL_LEVEL:-$(nproc)}"
    rm -rf "$SITE"
    python3 -m pip install --no-deps --no-build-isolation --target "$SITE" .
    shopt -s nullglob
    local built=("$SITE"/pccheck/native/_native*.so)
    if ((${#built[@]} == 0)); then
        echo "gpu-check: the install left no pccheck/native/_native*.so under $SITE" >&2
        return 1
    fi
    cp -f "${built[@]}" pccheck/native/
    echo "copied ${built[*]} -> pccheck/native/"
    (cd tests && python3 -c 'import pccheck.native._native as m; print("tests import the core from", m.__file__)')
}

step_env() {
    echo "== date"; date -u
    echo "== nvidia-smi"; nvidia-smi || echo "(nvidia-smi failed: $?)"
    echo "== torch"
    python3 -c 'import torch; print(torch.__version__, torch.cuda.get_device_name())' || echo "(torch failed: $?)"
    echo "== cupy"
    python3 -c 'import cupy; print(cupy.__version__, cupy.cuda.runtime.runtimeGetVersion())' || echo "(no cupy)"
    echo "== host"; uname -a; nproc; free -g || true; df -h /tmp . || true
}

step_test() {
    cd tests
    # test_gpu.py by name: the CPU suite needs packages the device lacks (crc32c) to be collected
    python3 -m pytest -m gpu -q -p no:cacheprovider -rA --junitxml="$RES/pytest.xml" test_gpu.py
}

step_bench() {
    # shellcheck disable=SC2086  # BENCH_ARGS is split into words on purpose
    python3 -m bench.gpu --out "$RES" $BENCH_ARGS
}

failed=()
# run NAME LOG: runs step_NAME in a subshell with errexit in force, output tee'd to LOG.
run() {
    local name=$1 log=$2 rc
    echo "== gpu-check: $name -> $log"
    set +e
    (set -euo pipefail; "step_$name") 2>&1 | tee "$log"
    rc=${PIPESTATUS[0]}
    set -e
    if ((rc != 0)); then
        echo "== gpu-check: $name FAILED (exit $rc)"
        failed+=("$name")
    fi
}

if want build; then run build "$RES/build.log"; fi
run env "$RES/env.txt"
if want test; then run test "$RES/pytest.log"; fi
if want bench; then run bench "$RES/bench.log"; fi

# The results folder must stay flat and small.
subdirs=$(find "$RES" -mindepth 1 -type d | wc -l)
files=$(find "$RES" -mindepth 1 -type f | wc -l)
if ((subdirs > 0 || files > MAX_FILES)); then
    echo "gpu-check: $RES holds $files files and $subdirs folders (allowed: $MAX_FILES files, no folders):" >&2
    find "$RES" -mindepth 1 >&2
    failed+=("results")
fi

echo "== gpu-check: results in $RES:"
ls -l "$RES"
if ((${#failed[@]})); then
    echo "== gpu-check: FAILED: ${failed[*]}"
    exit 1
fi
echo "== gpu-check: all steps passed ($STEPS)"
