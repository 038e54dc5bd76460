#!/usr/bin/env bash
# Here, where pip reaches PyPI: what bench/gpu_check.sh needs on a lent GPU machine that
# reaches nothing, sized for the device tool (the repository and what a call carries: 64 MiB).
#
#   bench/gpu_prepare.sh [PYTHON_VERSION]      # the GPU machine's Python, default 3.12
#
# Writes (both ignored by git):
#   .whl/   the project's packages that the GPU image lacks, at this .venv's versions, as
#           wheels for that Python (no dependencies: the image has the rest)
#   .gpu/   the embedded SmolLM2 GGUF (98 MB, more than one call carries) in two parts,
#           part_a and part_b, and model.sha256
#
# Then two device calls back to back (a machine stays warm ~30 s after a call, keeping what
# the first left in /tmp), each with its own carry:
#   carry .whl .gpu/part_a:                   bench/gpu_check.sh --stash .gpu/part_a
#   carry .whl .gpu/part_b .gpu/model.sha256: bench/gpu_check.sh --wheels .whl \
#                                                 --join .gpu/part_b --steps ... --out $OUT
# (--steps facts,tests need no model: one call with .whl alone.)
set -euo pipefail

REPO=$(cd "$(dirname "$0")/.." && pwd)
PY_VERSION=${1:-3.12}
cd "$REPO"
# Beside the image's packages (KINDS.md lists them), what engine, telemetry and the GPU tests
# import, and their own needs the image lacks.
PACKAGES="msgspec pyzmq gguf nvtx perfetto fastapi starlette uvicorn pydantic pydantic_core
annotated-types annotated-doc typing-inspection typing_extensions protobuf
googleapis-common-protos opentelemetry-api opentelemetry-sdk opentelemetry-proto
opentelemetry-semantic-conventions opentelemetry-exporter-otlp-proto-common
opentelemetry-exporter-otlp-proto-http opentelemetry-exporter-otlp-proto-grpc
opentelemetry-exporter-otlp-common opentelemetry-exporter-http-transport nvidia-nvtx-cu12"

[ -x .venv/bin/python ] || make .venv/.installed
FROZEN=$(.venv/bin/python -m pip freeze)
rm -rf .whl .gpu
mkdir -p .whl .gpu
for package in $PACKAGES; do
    pinned=$(grep -i -E "^${package//[-_]/[-_]}==" <<<"$FROZEN" || true)
    if [ -z "$pinned" ]; then
        echo "gpu_prepare: $package is not in .venv: make .venv/.installed first" >&2
        exit 1
    fi
    python3 -m pip download -q --no-deps --only-binary=:all: --python-version "$PY_VERSION" \
        --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 \
        --platform manylinux_2_26_x86_64 --platform manylinux_2_17_x86_64 \
        --platform manylinux2014_x86_64 --platform manylinux_2_5_x86_64 \
        --platform manylinux1_x86_64 -d .whl "$pinned"
done

GGUF=$(.venv/bin/python -c 'from engine.model.paths import resolve_model_path as r; print(r("smollm2"))')
HALF=$(( $(stat -c %s "$GGUF") / 2 ))
head -c "$HALF" "$GGUF" >.gpu/part_a
tail -c +"$((HALF + 1))" "$GGUF" >.gpu/part_b
(cd "$(dirname "$GGUF")" && sha256sum "$(basename "$GGUF")") >.gpu/model.sha256
echo "gpu_prepare: .whl $(du -sh .whl | cut -f1), .gpu/part_a $(du -sh .gpu/part_a | cut -f1)," \
    "part_b $(du -sh .gpu/part_b | cut -f1); the repository $(git ls-files -z | du -ch \
    --files0-from=- | tail -1 | cut -f1)"
