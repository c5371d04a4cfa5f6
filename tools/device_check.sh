#!/usr/bin/env bash
# One prepared device check, for the rare minutes a GPU is lent (sized for <= 8.5 minutes on one H200):
#   1. the suite on the GPU: the device-threaded tests' quick tier in fp32 (VISAR_TEST_DEVICE=cuda),
#      the conformance suite in bf16, and the exact-law claims with fewer draws; every raster method on
#      tiny random Lumina-mGPT 1.0 and 2.0 models in bf16 (lumina-bf16);
#   2. `visar bench` (tools/device_bench.py) on the embedded default and on GPT-B- and GPT-XL-size
#      random-weight LlamaGen folders at batch 1, 8 and 32: eager first for every model, then
#      compiled (reduce-overhead: CUDA graphs; torch.compile's default mode) for the smaller ones;
#      ms per pass, window pass / AR pass, latency / AR, peak memory, read-backs per pass;
#   2b. tools/deterministic_check.py on the GPT-B-size random folder: how many images of a batch of 8
#      differ from their decodes alone with and without deterministic=True, and what it costs
#      (OUT_DIR/deterministic.json);
#   3. tools/pass_split.py on the embedded default (eager): each pass's model call against the rest,
#      and each method's floor (OUT_DIR/pass_split.md and .json: whether the floors drop on a GPU);
#   4. OUT_DIR/device_check.json and OUT_DIR/device_check.md (plus each step's log).
# Every step has a time limit and the bench starts no cell past the deadline, so the check ends in
# time and keeps what it measured. It needs only what the GPU machine has (PyTorch, Triton, pytest,
# scipy, safetensors, tqdm, Pillow): visar runs from this checkout through PYTHONPATH, not installed.
#
#   tools/device_check.sh [--dry-run] OUT_DIR
#
# --dry-run: the same steps on the CPU at tiny sizes (a 0.04 M random model, batch 1 and 2, one
# compiled cell with the eager backend, a few tests of each run), in about two minutes on a busy
# 2-core CPU; tests/tools/test_device_check.py runs it (slow tier).
set -uo pipefail

DRY=0
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
    DEVICE=cpu BUDGET=400 # generous: the dry run checks the steps, not their time, on a CPU others may share
else
    DEVICE=cuda BUDGET=480
fi
DEADLINE=$((START + BUDGET))
: >"$OUT/suite.jsonl"
: >"$OUT/rows.jsonl"

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

# run_bench DEADLINE_S ARGS ...: tools/device_bench.py, killed 20 s past its deadline at the latest
run_bench() {
    local until=$1
    shift
    local limit=$((until - $(date +%s) + 20))
    if [ "$limit" -le 25 ]; then
        echo "bench $*: not run, no time left"
        return
    fi
    timeout "$limit" python3 tools/device_bench.py --device "$DEVICE" --rows "$OUT/rows.jsonl" --deadline "$until" "$@" \
        >>"$OUT/bench.log" 2>&1
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

# run_split DEADLINE_S ARGS ...: tools/pass_split.py, killed at its deadline
run_split() {
    local limit=$(($1 - $(date +%s)))
    shift
    if [ "$limit" -le 10 ]; then
        echo "pass_split: not run, no time left"
        return
    fi
    timeout "$limit" python3 tools/pass_split.py --json "$OUT/pass_split.json" "$@" >"$OUT/pass_split.md" 2>"$OUT/pass_split.log"
    echo "pass_split: rc $?"
}

XDIST=()
if [ $DRY -eq 0 ] && python3 -c "import xdist" 2>/dev/null; then XDIST=(-n 4); fi

if [ $DRY -eq 1 ]; then
    run_tests suite-fp32 120 VISAR_TEST_DEVICE=cpu -- -m "not slow" tests/accel/core/test_device.py \
        tests/eval/test_readbacks.py -k "counter or randomness or uniforms or keys or noise"
    run_tests suite-bf16 120 VISAR_TEST_DEVICE=cpu VISAR_TEST_DTYPES=bf16 -- tests/accel/test_method_conformance.py \
        -k "test_method_on_every_family and llamagen and mc-sjd"
    run_tests exact-law 120 VISAR_TEST_DEVICE=cpu VISAR_TEST_LAW_SAMPLES=2000 -- -m slow \
        tests/accel/test_method_conformance.py -k "exact_settings and gsd"
    run_tests lumina-bf16 120 VISAR_TEST_DEVICE=cpu VISAR_TEST_DTYPES=bf16 -- tests/accel/test_method_conformance.py \
        -k "test_method_on_every_family and lumina and mc-sjd"
    run_bench $(($(date +%s) + 60)) --model tiny --modes eager --batches 1,2 --methods sjd,mc-sjd,mc-sjd:8,auto,zipar
    run_bench $(($(date +%s) + 60)) --model tiny --modes reduce-overhead --batches 1 --methods sjd \
        --compile-backend eager
    run_split $(($(date +%s) + 60)) --model visar-tiny-random --methods mc-sjd --n 2
    run_deterministic 60 --model tiny --n 4 --batch-size 2
else
    nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv >"$OUT/nvidia-smi.txt" 2>&1
    run_tests suite-fp32 100 VISAR_TEST_DEVICE=cuda -- "${XDIST[@]}" -m "not slow" tests/accel/core/test_device.py \
        tests/eval/test_readbacks.py tests/accel/raster/test_compile.py tests/accel/test_method_conformance.py \
        tests/accel/raster/test_jacobi.py tests/models/test_llamagen_fixtures.py tests/eval/test_eval_cli.py
    run_tests suite-bf16 50 VISAR_TEST_DEVICE=cuda VISAR_TEST_DTYPES=bf16 -- "${XDIST[@]}" -m "not slow" \
        tests/accel/test_method_conformance.py
    run_tests exact-law 40 VISAR_TEST_DEVICE=cuda VISAR_TEST_LAW_SAMPLES=10000 -- "${XDIST[@]}" -m slow \
        tests/accel/test_method_conformance.py -k exact_settings
    # Lumina-mGPT 1.0 and 2.0 (tiny random weights, bf16): every raster method on both versions
    run_tests lumina-bf16 30 VISAR_TEST_DEVICE=cuda VISAR_TEST_DTYPES=bf16 -- "${XDIST[@]}" -m "not slow" \
        tests/accel/test_method_conformance.py -k lumina
    run_deterministic 70 --model gpt-b --n 16 --batch-size 8
    # eager rows of every model first (cheap, and the ones that matter most), then the compiled modes
    run_bench $((START + 300)) --model default --modes eager --methods sjd,mc-sjd,mc-sjd:8,tree-mc-sjd,tree-mc-sjd:32,auto,zipar
    run_bench $((START + 300)) --model gpt-b --modes eager --methods sjd,mc-sjd,mc-sjd:8,mc-sjd:32,tree-mc-sjd,auto
    run_bench $((START + 300)) --model gpt-xl --modes eager
    run_split $((START + 330)) --model default --methods mc-sjd,tree-mc-sjd,auto --n 4
    run_bench $((START + 420)) --model default --modes reduce-overhead,default --methods sjd,mc-sjd,zipar
    run_bench $((START + 460)) --model gpt-b --modes reduce-overhead --batches 1,8
fi

META=$(python3 - "$DRY" "$START" <<'PY'
import json, platform, subprocess, sys, time
import torch
dry, start = sys.argv[1] == "1", float(sys.argv[2])
commit = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True).stdout.strip() or None
print(json.dumps({
    "device_name": torch.cuda.get_device_name() if torch.cuda.is_available() and not dry else "cpu (dry run)",
    "dry_run": dry,
    "torch": torch.__version__,
    "cuda": torch.version.cuda,
    "python": platform.python_version(),
    "commit": commit,
    "seconds": round(time.time() - start),
}))
PY
)
python3 tools/device_bench.py --report "$OUT" --meta "$META"
echo "report: $OUT/device_check.md, $OUT/device_check.json ($(($(date +%s) - START)) s)"
