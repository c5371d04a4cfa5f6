#!/usr/bin/env bash
# One prepared device check, for the rare minutes a GPU is lent (sized for <= 9 minutes on one H100 or
# H200), what only a GPU shows first:
#   0. the Hugging Face wheels, where tools/fetch_device_wheels.py packed them into .device_wheels (name it
#      in the device call's carry): installed into a temp folder put first on PYTHONPATH, so that Janus,
#      Emu3, the Lumina adapters and aMUSEd run on the GPU too; without the folder the image's own packages;
#   1. about the first six minutes: the proxies in bf16 (visar-proxy-gpt-b: visar-tiny-c2i's trained law
#      at LlamaGen GPT-B's pass cost): AR, mc-sjd, sjd-pac, tree-mc-sjd and auto (tuning, in a fresh
#      VISAR_CACHE) at batch 1, 8 and a running batch of 32 slots (64 images, so slots refill), each cell
#      compiled (Pipeline.compile(whole_passes=True, mode="reduce-overhead"): CUDA graphs) and then eager
#      (tools/device_bench.py): ms a pass, passes, latency / AR, compiled / eager, images/s, read-backs a
#      pass, inductor's CUDA-graph notes, graphs still compiled in a timed call; then visar-proxy-gpt-xl's
#      eager rows at batch 1 where time is left;
#   2. the suite on the GPU: the device-threaded tests' quick tier in fp32 (VISAR_TEST_DEVICE=cuda), the
#      conformance suite in bf16, the exact-law claims with fewer draws, every raster method on tiny random
#      Lumina-mGPT 1.0 and 2.0 models in bf16 (lumina-bf16);
#   3. where time is left: tools/deterministic_check.py on a GPT-B-size random folder (how many images of
#      a batch of 8 differ from their decodes alone, with and without deterministic=True, and what it
#      costs: OUT_DIR/deterministic.json), tools/pass_split.py on the embedded default (each pass's model
#      call against the rest: OUT_DIR/pass_split.md and .json), and eager rows of GPT-B- and GPT-XL-size
#      random-weight folders (pass cost only: a random law's drafts pass far more often than a trained one's);
#   4. OUT_DIR/device_check.json and OUT_DIR/device_check.md (the compiled proxy table first; each step's log beside).
# Every step has a time limit, and the bench starts no row past its deadline and stops a row after two
# minutes, so the check ends in time and keeps what it measured. Beside the wheels it needs only what the
# GPU machine has (PyTorch, Triton, pytest, scipy, safetensors, tqdm, Pillow): visar runs from this
# checkout through PYTHONPATH, not installed.
#
#   tools/device_check.sh [--dry-run] OUT_DIR
#
# --dry-run: the same steps on the CPU at tiny sizes (a 1.2 M proxy over a 4 x 4-token random law,
# compiled with the eager backend, batch 1 and 2 and a running batch of 2 slots; the wheels, where
# packed, installed for the device's platform and left unused; a few tests of each run; one CPU thread),
# in about two and a half minutes on a busy 2-core CPU; tests/tools/test_device_check.py runs it (slow tier).
set -uo pipefail

DRY=0
if [ "${1:-}" = "--help" ] || [ "${1:-}" = "-h" ]; then
    sed -n '2,/^set -uo/p' "$0" | sed '$d; s/^# \{0,1\}//' # the comment above
    exit 0
fi
if [ "${1:-}" = "--dry-run" ]; then
    DRY=1
    shift
fi
if [ $# -ne 1 ]; then
    echo "usage: tools/device_check.sh [--dry-run] OUT_DIR" >&2
    exit 2
fi
mkdir -p "$1" || exit 2
OUT=$(cd "$1" && pwd)
cd "$(dirname "$0")/.." || exit 2
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1
START=$(date +%s)
if [ $DRY -eq 1 ]; then
    DEVICE=cpu DTYPE=fp32 BUDGET=600 # generous: the dry run checks the steps, not their time, on a CPU others may share
    # one thread: on a CPU others share, OpenMP's threads wait for one another longer than a tiny model computes
    # (a 4 x 4-token decode: 0.03 s at one thread, 0.5 s at two on a busy 2-core machine)
    export OMP_NUM_THREADS=1
else
    DEVICE=cuda DTYPE=bf16 BUDGET=540
fi
DEADLINE=$((START + BUDGET - 10)) # the report is written in the last 10 s
TMP=$(mktemp -d)
trap 'rm -rf "$TMP"' EXIT
: >"$OUT/suite.jsonl"
: >"$OUT/rows.jsonl"
: >"$OUT/bench.log"

left() { echo $((DEADLINE - $(date +%s))); }

# run_tests NAME SECONDS [KEY=VALUE ...] -- PYTEST_ARGS ...: one pytest run, its summary line to suite.jsonl
run_tests() {
    local name=$1 limit=$2
    shift 2
    local envs=()
    while [ "$1" != "--" ]; do
        envs+=("$1")
        shift
    done
    shift
    if [ "$(left)" -lt "$limit" ]; then limit=$(left); fi
    local t0 rc summary
    t0=$(date +%s)
    if [ "$limit" -le 5 ]; then
        rc=124 summary="not run: no time left"
    else
        env "${envs[@]}" timeout "$limit" python3 -m pytest -q -p no:cacheprovider "$@" >"$OUT/$name.log" 2>&1
        rc=$?
        summary=$(grep -E "[0-9]+ (passed|failed|error|skipped|deselected)|no tests ran" "$OUT/$name.log" | tail -n 1)
        summary=$(echo "$summary" | tr -d '=' | sed 's/^ *//; s/ *$//')
        if [ $rc -eq 124 ]; then summary="timed out after $limit s; $summary"; fi
    fi
    python3 -c 'import json, sys; print(json.dumps(dict(name=sys.argv[1], rc=int(sys.argv[2]), summary=sys.argv[3], seconds=int(sys.argv[4]))))' \
        "$name" "$rc" "$summary" $(($(date +%s) - t0)) >>"$OUT/suite.jsonl"
    echo "$name: rc $rc, $summary"
}

# run_bench DEADLINE_S ARGS ...: tools/device_bench.py (no row started past DEADLINE_S), killed 20 s past it
# at the latest (a row cut off is lost, the rows before it kept) and never past the check's own deadline;
# auto tunes in the check's fresh VISAR_CACHE
run_bench() {
    local until=$1
    shift
    local limit=$((until - $(date +%s) + 20))
    if [ "$(left)" -lt "$limit" ]; then limit=$(left); fi
    if [ "$limit" -le 25 ]; then
        echo "bench $*: not run, no time left"
        return
    fi
    VISAR_CACHE="$TMP/visar-cache" timeout "$limit" python3 tools/device_bench.py --device "$DEVICE" \
        --rows "$OUT/rows.jsonl" --deadline "$until" "$@" >>"$OUT/bench.log" 2>&1
    echo "bench $*: rc $?"
}

# run_deterministic SECONDS ARGS ...: tools/deterministic_check.py, killed at its limit
run_deterministic() {
    local limit=$1
    shift
    if [ "$(left)" -lt "$limit" ]; then limit=$(left); fi
    if [ "$limit" -le 10 ]; then
        echo "deterministic: not run, no time left"
        return
    fi
    timeout "$limit" python3 tools/deterministic_check.py --device "$DEVICE" --json "$OUT/deterministic.json" "$@" \
        >"$OUT/deterministic.log" 2>&1
    echo "deterministic: rc $?"
    cat "$OUT/deterministic.log"
}

# run_split SECONDS ARGS ...: tools/pass_split.py, killed at its limit
run_split() {
    local limit=$1
    shift
    if [ "$(left)" -lt "$limit" ]; then limit=$(left); fi
    if [ "$limit" -le 10 ]; then
        echo "pass_split: not run, no time left"
        return
    fi
    timeout "$limit" python3 tools/pass_split.py --json "$OUT/pass_split.json" "$@" >"$OUT/pass_split.md" 2>"$OUT/pass_split.log"
    echo "pass_split: rc $?"
}

# install_wheels SECONDS: .device_wheels' archive (tools/fetch_device_wheels.py) installed into $TMP/site with
# pip install --no-deps --no-index --target, then first on PYTHONPATH (installed with unmet requirements too:
# exit 3, listed in wheels.log). The dry run installs them for the device's platform and leaves them unused,
# so that an archive that does not install shows before a loan.
WHEELS="none: no .device_wheels/wheels.tar.xz in the checkout (tools/fetch_device_wheels.py); the image's own packages"
install_wheels() {
    if [ ! -f .device_wheels/wheels.tar.xz ]; then
        echo "wheels: $WHEELS"
        return
    fi
    local for_device=()
    if [ $DRY -eq 1 ]; then for_device=(--for-fetched-platform); fi
    timeout "$1" python3 tools/fetch_device_wheels.py --install "$TMP/site" "${for_device[@]}" >"$OUT/wheels.log" 2>&1
    local rc=$?
    WHEELS="rc $rc: $(tail -n 1 "$OUT/wheels.log")"
    if [ $DRY -eq 0 ] && { [ $rc -eq 0 ] || [ $rc -eq 3 ]; }; then
        export PYTHONPATH="$TMP/site:$PYTHONPATH"
    fi
    echo "wheels: $WHEELS"
}

XDIST=()
if [ $DRY -eq 0 ] && python3 -c "import xdist" 2>/dev/null; then XDIST=(-n 4); fi
PROXY_METHODS=mc-sjd,sjd-pac,tree-mc-sjd,auto # tree-mc-sjd and auto compile the most shapes: last

if [ $DRY -eq 1 ]; then
    install_wheels 120
    # 1. the proxy table: a tiny proxy, compiled whole passes (eager backend: no C++ compiler needed), then eager
    run_bench $(($(date +%s) + 300)) --model tiny-proxy --dtype "$DTYPE" --whole-passes --compile-backend eager \
        --modes reduce-overhead,eager --batches 1,2 --running 2 --methods "$PROXY_METHODS"
    # 2. the suite
    run_tests suite-fp32 120 VISAR_TEST_DEVICE=cpu -- -m "not slow" tests/accel/core/test_device.py \
        tests/eval/test_readbacks.py -k "counter or randomness or uniforms or keys or noise"
    run_tests suite-bf16 120 VISAR_TEST_DEVICE=cpu VISAR_TEST_DTYPES=bf16 -- tests/accel/test_method_conformance.py \
        -k "test_method_on_every_family and llamagen and mc-sjd"
    run_tests exact-law 120 VISAR_TEST_DEVICE=cpu VISAR_TEST_LAW_SAMPLES=2000 -- -m slow \
        tests/accel/test_method_conformance.py -k "exact_settings and gsd"
    run_tests lumina-bf16 120 VISAR_TEST_DEVICE=cpu VISAR_TEST_DTYPES=bf16 -- tests/accel/test_method_conformance.py \
        -k "test_method_on_every_family and lumina and mc-sjd"
    # 3. the rest
    run_deterministic 60 --model tiny --n 4 --batch-size 2
    run_split 60 --model visar-tiny-random --methods mc-sjd --n 2
    run_bench $(($(date +%s) + 60)) --model tiny --modes eager --batches 1 --methods mc-sjd,zipar
else
    nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv >"$OUT/nvidia-smi.txt" 2>&1
    install_wheels 90
    # 1. the proxies (about six minutes): GPT-B's cells, compiled then eager, starting rows until START+290;
    # then GPT-XL's eager rows at batch 1 until START+335 (its compiles would not fit)
    run_bench $((START + 290)) --model visar-proxy-gpt-b --dtype "$DTYPE" --whole-passes \
        --modes reduce-overhead,eager --batches 1,8 --running 32 --images-per-slot 2 --methods "$PROXY_METHODS"
    run_bench $((START + 335)) --model visar-proxy-gpt-xl --dtype "$DTYPE" --modes eager --batches 1 \
        --methods "$PROXY_METHODS"
    # 2. the suite
    run_tests suite-fp32 80 VISAR_TEST_DEVICE=cuda -- "${XDIST[@]}" -m "not slow" tests/accel/core/test_device.py \
        tests/eval/test_readbacks.py tests/accel/raster/test_compile.py tests/accel/test_method_conformance.py \
        tests/accel/raster/test_jacobi.py tests/models/test_llamagen_fixtures.py tests/eval/test_eval_cli.py
    run_tests suite-bf16 40 VISAR_TEST_DEVICE=cuda VISAR_TEST_DTYPES=bf16 -- "${XDIST[@]}" -m "not slow" \
        tests/accel/test_method_conformance.py
    run_tests exact-law 30 VISAR_TEST_DEVICE=cuda VISAR_TEST_LAW_SAMPLES=10000 -- "${XDIST[@]}" -m slow \
        tests/accel/test_method_conformance.py -k exact_settings
    # Lumina-mGPT 1.0 and 2.0 (tiny random weights, bf16): every raster method on both versions
    run_tests lumina-bf16 25 VISAR_TEST_DEVICE=cuda VISAR_TEST_DTYPES=bf16 -- "${XDIST[@]}" -m "not slow" \
        tests/accel/test_method_conformance.py -k lumina
    # 3. where time is left
    run_deterministic 45 --model gpt-b --n 16 --batch-size 8
    run_split 30 --model default --methods mc-sjd,tree-mc-sjd,auto --n 4
    run_bench $((DEADLINE - 30)) --model gpt-b --modes eager --methods sjd,mc-sjd,mc-sjd:8,tree-mc-sjd,auto
    run_bench $((DEADLINE - 30)) --model gpt-xl --modes eager --methods mc-sjd,tree-mc-sjd
fi

META=$(python3 - "$DRY" "$START" "$WHEELS" <<'PY'
import json, platform, subprocess, sys, time
import torch
dry, start, wheels = sys.argv[1] == "1", float(sys.argv[2]), sys.argv[3]
commit = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True).stdout.strip() or None
print(json.dumps({
    "device_name": torch.cuda.get_device_name() if torch.cuda.is_available() and not dry else "cpu (dry run)",
    "dry_run": dry,
    "torch": torch.__version__,
    "cuda": torch.version.cuda,
    "python": platform.python_version(),
    "commit": commit,
    "wheels": wheels,
    "seconds": round(time.time() - start),
}))
PY
)
python3 tools/device_bench.py --report "$OUT" --meta "$META"
echo "report: $OUT/device_check.md, $OUT/device_check.json ($(($(date +%s) - START)) s)"
