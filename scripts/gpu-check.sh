#!/usr/bin/env bash
# One command for a bare GPU machine, run from anywhere in the repo (`make gpu-check`):
#   build  build pccheck's native core against the preinstalled torch (pip --target /tmp/pccheck-site)
#          and put the built extension into the source tree's pccheck/native/
#   test   the gpu-marked tests (tests/test_gpu.py), from tests/, importing the source tree
#   bench  python3 -m bench.gpu --out "$RES/gpu" $BENCH_ARGS
#   claims python3 -m bench.gpu_claims --out "$RES/gpu_claims" $CLAIMS_ARGS (lazy restore on cuda, spread
#          replay vs the CUDA optimizer, the integrations' extra device memory)
# env.txt (nvidia-smi, torch and its device) is always written. A failing step does not stop the
# later ones; the exit status is non-zero if any step failed.
#
# Environment: OUT (results root; default bench/results), GPU_CHECK_STEPS (comma-separated,
# default build,test,bench,claims), BENCH_ARGS / CLAIMS_ARGS (extra arguments, default none),
# GPU_TESTS (a pytest -k expression selecting gpu tests; default all), PY_SPY (py-spy's path, for
# bench.gpu --profile; else it is looked up on the PATH), TEST_TIMEOUT / BENCH_TIMEOUT /
# CLAIMS_TIMEOUT (seconds a step may run before it is killed; default 0, no limit). With .whl/remote/
# (scripts/pack-remote-deps.sh) the remote tier's server and client are unpacked and put on the paths.
# Results follow bench/results/<bench>/, at most 10 files in all: gpu/ what bench.gpu writes
# (latest.json latest.csv latest.png, with --profile profile.txt pyspy.txt), gpu_claims/ what
# bench.gpu_claims writes (latest.json; latest-<claims>.json for a --claims subset), and
# gpu-check/ the logs (gpu-check.log, every step's output, appended to; env.txt), untracked.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
RES="${OUT:-bench/results}"
mkdir -p "$RES/gpu" "$RES/gpu_claims" "$RES/gpu-check"
RES="$(cd "$RES" && pwd)"
FOLDERS=(gpu gpu_claims gpu-check)
STEPS="${GPU_CHECK_STEPS:-build,test,bench,claims}"
BENCH_ARGS="${BENCH_ARGS:-}"
CLAIMS_ARGS="${CLAIMS_ARGS:-}"
GPU_TESTS="${GPU_TESTS:-}"
SITE=/tmp/pccheck-site
MAX_FILES=10
# Tests and bench import the source tree (with the built extension copied in); the tests' child
# processes inherit this.
export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}"

for s in ${STEPS//,/ }; do
    case "$s" in
        build | test | bench | claims) ;;
        *) echo "gpu-check: unknown step '$s' in GPU_CHECK_STEPS (build, test, bench, claims)" >&2; exit 2 ;;
    esac
done
want() { [[ ",$STEPS," == *",$1,"* ]]; }

# The remote tier's server and client (scripts/pack-remote-deps.sh), when carried in .whl/remote/
if [[ -f "$ROOT/.whl/remote/weed.xz" && -f "$ROOT/.whl/remote/pysite.tar.xz" ]]; then
    REMOTE_DEPS=/tmp/pccheck-remote-deps
    if [[ ! -x "$REMOTE_DEPS/bin/weed" || ! -d "$REMOTE_DEPS/site" ]]; then
        mkdir -p "$REMOTE_DEPS/bin"
        xz -T0 -dc "$ROOT/.whl/remote/weed.xz" >"$REMOTE_DEPS/bin/weed" && chmod +x "$REMOTE_DEPS/bin/weed"
        tar xJf "$ROOT/.whl/remote/pysite.tar.xz" -C "$REMOTE_DEPS"
    fi
    export PATH="$REMOTE_DEPS/bin:$PATH" PYTHONPATH="$PYTHONPATH:$REMOTE_DEPS/site"
fi

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
    timeout -k 10 "${TEST_TIMEOUT:-0}" python3 -m pytest -m gpu -q -p no:cacheprovider -rA --durations=0 \
        ${GPU_TESTS:+-k "$GPU_TESTS"} test_gpu.py
}

step_bench() {
    # shellcheck disable=SC2086  # BENCH_ARGS is split into words on purpose
    timeout -k 10 "${BENCH_TIMEOUT:-0}" python3 -m bench.gpu --out "$RES/gpu" $BENCH_ARGS
}

step_claims() {
    # shellcheck disable=SC2086  # CLAIMS_ARGS is split into words on purpose
    timeout -k 10 "${CLAIMS_TIMEOUT:-0}" python3 -m bench.gpu_claims --out "$RES/gpu_claims" $CLAIMS_ARGS
}

failed=()
# run NAME LOG: runs step_NAME in a subshell with errexit in force, output appended to LOG.
run() {
    local name=$1 log=$2 rc
    echo "== gpu-check: $name -> $log" | tee -a "$log"
    set +e
    (set -euo pipefail; "step_$name") 2>&1 | tee -a "$log"
    rc=${PIPESTATUS[0]}
    set -e
    if ((rc != 0)); then
        echo "== gpu-check: $name FAILED (exit $rc)"
        failed+=("$name")
    fi
}

LOG="$RES/gpu-check/gpu-check.log"  # appended to: several invocations (e.g. one per step) share it
: >"$RES/gpu-check/env.txt"
if want build; then run build "$LOG"; fi
run env "$RES/gpu-check/env.txt"
if want test; then run test "$LOG"; fi
if want bench; then run bench "$LOG"; fi
if want claims; then run claims "$LOG"; fi

# The results folders must stay flat and small.
subdirs=$(for d in "${FOLDERS[@]}"; do find "$RES/$d" -mindepth 1 -type d; done | wc -l)
files=$(for d in "${FOLDERS[@]}"; do find "$RES/$d" -mindepth 1 -type f; done | wc -l)
if ((subdirs > 0 || files > MAX_FILES)); then
    echo "gpu-check: ${FOLDERS[*]} under $RES hold $files files and $subdirs folders" \
         "(allowed: $MAX_FILES files, no folders):" >&2
    for d in "${FOLDERS[@]}"; do find "$RES/$d" -mindepth 1 >&2; done
    failed+=("results")
fi

echo "== gpu-check: results in $RES:"
for d in "${FOLDERS[@]}"; do ls -l "$RES/$d"; done
if ((${#failed[@]})); then
    echo "== gpu-check: FAILED: ${failed[*]}"
    exit 1
fi
echo "== gpu-check: all steps passed ($STEPS)"
