#!/usr/bin/env bash
# GPU check: calibrate and sweep random-weight models with real geometries (Qwen2.5-0.5B and -3B, from
# benchmarks/configs; no download), bf16, SDPA, on one NVIDIA GPU; JSON + table + plot into OUT_DIR.
#
#   benchmarks/gpu_check.sh OUT_DIR
#
# Sized to finish within 8 minutes on one H100/H200-class GPU (elapsed time is printed after each step).
# On a machine without a CUDA GPU it prints "no CUDA GPU: skipping" and exits 0.
# Python: $PYTHON, else the first of python3 / .venv/bin/python that has torch with CUDA. Only when none
# imports torch and transformers is a venv created (.venv-gpu, system site packages, `pip install -e .`;
# TORCH_SPEC overrides the torch requirement, default "torch").
# Per model, 4 files: <name>-costs.json, <name>-sweep.json, <name>-sweep.png, <name>-log.txt.
set -euo pipefail

OUT_DIR=${1:?usage: benchmarks/gpu_check.sh OUT_DIR}
REPO=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
START=$(date +%s)
say() { echo "[gpu_check +$(( $(date +%s) - START ))s] $*"; }

if ! command -v nvidia-smi >/dev/null 2>&1 || ! nvidia-smi -L >/dev/null 2>&1; then
    echo "no CUDA GPU: skipping (nvidia-smi is missing or lists no GPU)"
    exit 0
fi

has_torch() { "$1" -c "import torch, transformers" >/dev/null 2>&1; }
has_cuda() { "$1" -c "import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)" >/dev/null 2>&1; }

pick_python() {
    local candidate
    for candidate in ${PYTHON:-} python3 "$REPO/.venv/bin/python"; do
        if command -v "$candidate" >/dev/null 2>&1 && has_torch "$candidate" && has_cuda "$candidate"; then
            echo "$candidate"
            return 0
        fi
    done
    for candidate in ${PYTHON:-} python3 "$REPO/.venv/bin/python"; do
        if command -v "$candidate" >/dev/null 2>&1 && has_torch "$candidate"; then
            echo "$candidate"  # torch without CUDA: reported and skipped below
            return 0
        fi
    done
    return 1
}

if ! PY=$(pick_python); then
    say "no python with torch + transformers: creating $REPO/.venv-gpu (pip install -e .)"
    python3 -m venv --system-site-packages "$REPO/.venv-gpu"
    PY="$REPO/.venv-gpu/bin/python"
    "$PY" -m pip install -q "${TORCH_SPEC:-torch}"
    "$PY" -m pip install -q -e "$REPO"
fi
if ! has_cuda "$PY"; then
    echo "no CUDA GPU: skipping (torch in $PY sees no CUDA device)"
    exit 0
fi
export PYTHONPATH="$REPO/src${PYTHONPATH:+:$PYTHONPATH}"
"$PY" -c "import scipy, rich, matplotlib, numpy" || { echo "gpu_check: $PY lacks scipy/rich/matplotlib/numpy" >&2; exit 1; }
mkdir -p "$OUT_DIR"
say "python $PY; $("$PY" -c "import torch, transformers; print('torch', torch.__version__, 'transformers', transformers.__version__, torch.cuda.get_device_name())")"

run_model() {
    local name=$1 config="$REPO/benchmarks/configs/$1.json" log="$OUT_DIR/$1-log.txt"
    say "$name: calibrate"
    "$PY" -m autobucket.cli calibrate --model "$config" --dtype bfloat16 --device cuda \
        --attn-implementation sdpa --repeats 3 --out "$OUT_DIR/$name-costs.json" 2>&1 | tee "$log"
    say "$name: sweep"
    "$PY" -m autobucket.cli sweep --model "$config" --dtype bfloat16 --device cuda --attn-implementation sdpa \
        --costs "$OUT_DIR/$name-costs.json" --repeats 3 --out "$OUT_DIR/$name-sweep.json" \
        --plot "$OUT_DIR/$name-sweep.png" 2>&1 | tee -a "$log"
    say "$name: done"
}

status=0
for name in qwen2.5-0.5b qwen2.5-3b; do
    run_model "$name" || { status=1; say "$name: FAILED (see $OUT_DIR/$name-log.txt); continuing"; }
done
say "all done; results in $OUT_DIR"
exit "$status"
