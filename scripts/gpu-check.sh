#!/usr/bin/env bash
# The GPU path on a real card, every check in one command (lorafaas/bench/gpu_check.py says what each step does).
#
#   on the GPU machine:  bash scripts/gpu-check.sh [--mps] [--device cuda:0] [--only STEP,...] [--json FILE]
#   here (CI too):       bash scripts/gpu-check.sh --dry-run
#
# --mps runs the whole check under NVIDIA's Multi-Process Service (a control daemon started for the run and stopped
# after it): function processes then share the GPU's compute instead of time-slicing it context by context. An A/B
# of the same check with and without it says what MPS is worth to isolated function processes.
#
# First install the wheels the GPU machine lacks, offline, from .whl/ (made here by scripts/gpu-wheels.sh) into a
# scratch site directory ahead of the machine's own packages; the repository itself is imported from the checkout.
# --dry-run also installs the wheels (for CPython 3.12, into a scratch directory, as pip would there) to check that
# they are complete and installable, then runs every step on this machine's CPU with tiny shapes.
set -euo pipefail
cd "$(dirname "$0")/.."
wheels="${LORAFAAS_GPU_WHEELS:-.whl}"
site="$(mktemp -d "${TMPDIR:-/tmp}/lorafaas-gpu-site.XXXXXX")"
trap 'rm -rf "$site"' EXIT
dry_run=0
mps=0
args=()
for arg in "$@"; do
  case "$arg" in
    --dry-run) dry_run=1; args+=("$arg") ;;
    --mps) mps=1 ;;
    *) args+=("$arg") ;;
  esac
done
if [[ $mps -eq 1 ]]; then
  export CUDA_MPS_PIPE_DIRECTORY="$site/mps-pipe" CUDA_MPS_LOG_DIRECTORY="$site/mps-log"
  mkdir -p "$CUDA_MPS_PIPE_DIRECTORY" "$CUDA_MPS_LOG_DIRECTORY"
  nvidia-cuda-mps-control -d || { echo "gpu-check: the MPS control daemon did not start" >&2; exit 1; }
  trap 'echo quit | nvidia-cuda-mps-control; rm -rf "$site"' EXIT
fi
if ! ls "$wheels"/*.whl >/dev/null 2>&1; then
  echo "gpu-check: no wheels in $wheels; run scripts/gpu-wheels.sh first (here, with network)" >&2
  exit 2
fi
pip_install=(python3 -m pip install --disable-pip-version-check -q --no-index --no-deps --no-compile --no-cache-dir
             --upgrade --target "$site")
if [[ $dry_run -eq 1 ]]; then
  # CPython 3.12 wheels may not install into this interpreter: check them as pip would for 3.12, then run on the
  # packages already installed here (the same versions: gpu-wheels.sh pins what is installed).
  "${pip_install[@]}" --only-binary=:all: --python-version 3.12 --implementation cp "$wheels"/*.whl
  python3 - "$site" <<'PY'
import pathlib, sys
site = pathlib.Path(sys.argv[1])
need = {"msgspec", "fastapi", "starlette", "uvicorn", "pydantic", "pydantic_core", "transformers", "peft", "llguidance",
        "re2", "redis", "gguf", "multipart", "httpx_sse", "typer", "rich"}
missing = sorted(n for n in need if not (site / n).exists() and not (site / f"{n}.py").exists())
if missing:
    sys.exit(f"gpu-check: the wheels lack {', '.join(missing)}")
print(f"gpu-check: {len(list(site.glob('*.dist-info')))} wheels install for CPython 3.12")
PY
  export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
else
  "${pip_install[@]}" "$wheels"/*.whl
  export PYTHONPATH="$PWD:$site${PYTHONPATH:+:$PYTHONPATH}"
fi
export PYTHONUNBUFFERED=1
python3 -m lorafaas.bench.gpu_check "${args[@]}"
