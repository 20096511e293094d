#!/usr/bin/env bash
# GPU check of the Triton kernel set and the engine on one NVIDIA GPU, at most ~8 minutes, each phase
# time-boxed so a slow one cannot eat the rest (phases: benchmarks/gpu_check.py):
#   (a) env  (b) kernels: batch invariance fp32 + bf16, TF32 off, negative controls  (c) mismatch:
#   random-weight Qwen2.5-0.5B geometry, bf16, n = 8, T = 1, invariant vs default kernels  (d) speed,
#   contenders interleaved in one process (eager and CUDA-graph decode), and the decode step alone (64 rows,
#   context 1,024) eager vs graph. JSON per phase + summary.json + a table into OUT_DIR.
#
#   benchmarks/gpu_check.sh [--rehearse] OUT_DIR
#
# --rehearse: the same phases and code on the CPU at toy sizes, the Triton kernels under the interpreter
# (CI runs it, so no GPU minute is lost to a typo); its time boxes are GPU_CHECK_TIME_SCALE (default 3) times
# the GPU's. Without --rehearse on a machine without a CUDA GPU it prints "no CUDA GPU: skipping" and exits 0.
# Python: $PYTHON, else python3. First it says what it runs: the versions it finds (python, torch, triton,
# transformers, numpy), the device, and whether they meet pyproject.toml's floors and triton >= 3.6; where they
# do not, it stops before the other phases (GPU_CHECK_ANY_VERSIONS=1 runs them anyway). Exit status: 0 when
# env, kernels and mismatch pass (speed is reported, not judged).
set -uo pipefail

REHEARSE=""
if [[ "${1:-}" == "--rehearse" ]]; then
    REHEARSE="--rehearse"
    shift
fi
OUT_DIR=${1:?usage: benchmarks/gpu_check.sh [--rehearse] OUT_DIR}
REPO=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
PY=${PYTHON:-python3}
START=$(date +%s)
say() { echo "[gpu_check +$(( $(date +%s) - START ))s] $*"; }

if [[ -z "$REHEARSE" ]] && { ! command -v nvidia-smi >/dev/null 2>&1 || ! nvidia-smi -L >/dev/null 2>&1; }; then
    echo "no CUDA GPU: skipping (nvidia-smi is missing or lists no GPU)"
    exit 0
fi

mkdir -p "$OUT_DIR"
export PYTHONPATH="$REPO/src${PYTHONPATH:+:$PYTHONPATH}"
if [[ -n "$REHEARSE" ]]; then
    export TRITON_INTERPRET=1  # before triton is imported: the kernels run on CPU tensors
    SCALE=${GPU_CHECK_TIME_SCALE:-3}
    MODE="rehearsal on the CPU (Triton's interpreter, toy sizes)"
else
    unset TRITON_INTERPRET
    SCALE=${GPU_CHECK_TIME_SCALE:-1}
    MODE="GPU run ($(nvidia-smi -L | head -n 1))"
fi
say "$MODE with $(command -v "$PY") from $REPO into $OUT_DIR; phases env, kernels, mismatch, speed, step," \
    "time boxes $((45 * SCALE)) / $((100 * SCALE)) / $((100 * SCALE)) / $((165 * SCALE)) / $((60 * SCALE)) s"

run_phase() {  # name, seconds
    say "phase $1 (at most $2 s)"
    timeout --kill-after=10 "$2" "$PY" "$REPO/benchmarks/gpu_check.py" "$1" "$OUT_DIR" $REHEARSE \
        >"$OUT_DIR/$1.log" 2>&1
    local status=$?
    if [[ $status -ne 0 ]]; then
        say "phase $1 failed or timed out (exit $status); last lines of $OUT_DIR/$1.log:"
        tail -n 15 "$OUT_DIR/$1.log"
    fi
    return $status
}

run_phase env $((45 * SCALE))
grep -v '^{' "$OUT_DIR/env.log" | sed 's/^/    /'
if ! "$PY" -c 'import json, sys; sys.exit(0 if json.load(open(sys.argv[1]))["ok"] else 1)' "$OUT_DIR/env.json" 2>/dev/null \
    && [[ "${GPU_CHECK_ANY_VERSIONS:-0}" != 1 ]]; then
    say "the environment does not meet the floors above (or has no CUDA device): stopping before the other phases"
    say "(GPU_CHECK_ANY_VERSIONS=1 runs them anyway)"
    "$PY" "$REPO/benchmarks/gpu_check.py" table "$OUT_DIR" >"$OUT_DIR/table.txt"
    exit 1
fi
run_phase kernels $((100 * SCALE))
run_phase mismatch $((100 * SCALE))
run_phase speed $((165 * SCALE))
run_phase step $((60 * SCALE))
say "table"
"$PY" "$REPO/benchmarks/gpu_check.py" table "$OUT_DIR" | tee "$OUT_DIR/table.txt"
status=${PIPESTATUS[0]}
say "done (exit $status)"
exit "$status"
