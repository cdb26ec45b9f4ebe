#!/usr/bin/env bash
# GPU check of the production engines, one prepared script:
#   1. installs the GPU extras (vllm, deepspeed) into $VENV,
#   2. vLLM engine: generation, behaviour logprobs against the learner's, weight reload of a
#      new version in place with the greedy-token check against the transformers engine,
#   3. one DeepSpeed ZeRO-2 bf16 learner step next to the torch backend,
#   4. a short end-to-end run with vLLM rollouts and the DeepSpeed learner,
# printing tokens/s of both engines and of the learner, one JSON line per step.
#
#   bench/gpu_check.sh          on a machine with CUDA
#   bench/gpu_check.sh --cpu    the parts that need no GPU, in .venv (what the tests run)
#
# Environment: OUT (results, default bench/_work/gpu_check), VENV (default .venv-gpu),
# WHEELS (a folder of wheels: install from it with no index, for machines without network).
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-bench/_work/gpu_check}
mkdir -p "$OUT"
export PYTHONPATH="$PWD/src:$PWD${PYTHONPATH:+:$PYTHONPATH}"
export TORCH_EXTENSIONS_DIR=${TORCH_EXTENSIONS_DIR:-$PWD/.shardrl/torch_extensions}
export PYTHONUNBUFFERED=1

if [[ "${1:-}" == "--cpu" ]]; then
    DEVICE=cpu
    PY=${PY:-.venv/bin/python}
    export DS_ACCELERATOR=cpu OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
else
    DEVICE=cuda
    VENV=${VENV:-.venv-gpu}
    # the machine's CUDA torch stays visible; vllm brings the torch it pins if that differs
    [[ -x "$VENV/bin/python" ]] || python3 -m venv --system-site-packages "$VENV"
    PY="$VENV/bin/python"
    PIP=("$PY" -m pip install --quiet --ignore-requires-python)
    if [[ -n "${WHEELS:-}" ]]; then PIP+=(--no-index --find-links "$WHEELS"); fi
    "${PIP[@]}" -e ".[vllm,dev]"
    DS_BUILD_OPS=0 "${PIP[@]}" --no-build-isolation -e ".[deepspeed]"
    "$PY" -c "import torch; assert torch.cuda.is_available(), 'no CUDA device'; \
print('gpu:', torch.cuda.get_device_name(0), 'torch', torch.__version__)"
fi

for step in engines learner e2e; do
    echo "== $step ($DEVICE)"
    extra=()
    if [[ "$DEVICE" == cpu && "$step" == e2e ]]; then extra=(--dry-run); fi
    "$PY" -m bench.gpu_check "$step" --device "$DEVICE" --out "$OUT" "${extra[@]}"
done
echo "results: $OUT/*/result.json"
