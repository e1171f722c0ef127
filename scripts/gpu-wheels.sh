#!/usr/bin/env bash
# Download, here, the wheels the GPU machine lacks into .whl/ (ignored): CPython 3.12, manylinux x86-64, no torch.
# Usage: bash scripts/gpu-wheels.sh [DIR]
#
# The GPU machine has Python 3.12 with torch (CUDA), numpy, safetensors, tokenizers, httpx, pytest, cuda-bindings and
# nvidia-ml-py, and no network. Each wheel below is pinned to the version installed in this environment (the one the
# test suite ran with), so the GPU run uses the same transformers, PEFT and server stack as CI. scripts/gpu-check.sh
# installs them there offline with --no-deps.
set -euo pipefail
cd "$(dirname "$0")/.."
dest="${1:-.whl}"
packages=(
  msgspec fastapi starlette uvicorn pydantic pydantic-core annotated-types annotated-doc typing-inspection
  typing-extensions opentelemetry-api python-multipart httpx-sse google-re2 redis gguf llguidance
  transformers peft regex typer rich
)
pins=()
for name in "${packages[@]}"; do
  version="$(python -c "import importlib.metadata as m, sys; print(m.version(sys.argv[1]))" "$name")" \
    || { echo "gpu-wheels: $name is not installed here; run scripts/install.sh --dev first" >&2; exit 1; }
  pins+=("$name==$version")
done
mkdir -p "$dest"
rm -f "$dest"/*.whl
platforms=()
for tag in manylinux_2_39 manylinux_2_35 manylinux_2_34 manylinux_2_31 manylinux_2_28 manylinux_2_27 manylinux_2_24 \
    manylinux_2_17 manylinux2014 manylinux1; do
  platforms+=(--platform "${tag}_x86_64")
done
python -m pip download --disable-pip-version-check -q --no-deps --only-binary=:all: --python-version 3.12 \
  --implementation cp "${platforms[@]}" -d "$dest" "${pins[@]}"
echo "gpu-wheels: $(ls "$dest"/*.whl | wc -l) wheels, $(du -sh "$dest" | cut -f1), in $dest"
