"""A whole test cluster on this machine, for a person to use (`scripts/k8s-testenv.sh start [NODES]`): the control
plane (`tests.support.k8s_cluster`), NODES nodes of the process kubelet (`tests.support.process_kubelet`: every pod's
containers run as processes, Services work by ClusterIP and name), `kubectl port-forward` (`kubelet_server`),
PersistentVolumeClaims bound to volumes made on demand (`volume_provisioner`: the chart's Redis), and the chart's
images mapped to this checkout's code (`IMAGE_ENTRYPOINTS`).

    python -m tests.support.process_cluster start --nodes 3 --env-file run/env   # until SIGTERM or Ctrl-C

When ready it writes the shell exports to use it (KUBECONFIG, and a PATH with a `helm` of the repository's Helm library
when no `helm` is installed) to stdout and to the env file; stopping removes the env file and ends every process the
cluster started (pods, control plane).
"""

from __future__ import annotations

import argparse
import logging
import os
import shlex
import shutil
import signal
import sys
import tempfile
import threading
from pathlib import Path

from tests.support.fake_kubelet import FakeKubelet
from tests.support.k8s_cluster import ControlPlane, default_bin_dir
from tests.support.kubelet_server import KubeletServer
from tests.support.process_kubelet import ProcessRuntime, missing_tools
from tests.support.volume_provisioner import HostPathProvisioner

REPOSITORY = Path(__file__).resolve().parents[2]
IMAGE_ENTRYPOINTS = {  # each image's ENTRYPOINT (manifests/images/*/Dockerfile), as this checkout's code
    "lorafaas/gateway": ["python", "-m", "lorafaas"],
    "lorafaas/node-agent": ["python", "-m", "lorafaas"],
    "lorafaas/function": ["python", "-m", "lorafaas.function_runtime.worker"],
    # the official image's docker-entrypoint.sh runs its arguments, turning off protected mode for a redis-server
    # without a config file (the container's network is its own); this machine's redis-server has it on
    "redis": ["sh", "-c", '[ "$1" = redis-server ] && set -- "$@" --protected-mode no; exec "$@"', "entrypoint"],
}


class ProcessCluster:
    """The control plane and process nodes `nodes`, started and stopped together."""

    def __init__(self, work_dir: Path, nodes: list[str], bin_dir: Path | None = None) -> None:
        self.work_dir = Path(work_dir)
        self.plane = ControlPlane(bin_dir or default_bin_dir(), self.work_dir / "control-plane")
        self.node_names = nodes
        self.kubelet: FakeKubelet | None = None
        self.server: KubeletServer | None = None
        self.provisioner: HostPathProvisioner | None = None

    def __enter__(self) -> ProcessCluster:
        self.start()
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.stop()

    def start(self) -> None:
        self.plane.start()
        try:
            api = self.plane.api_client()
            self.server = KubeletServer(self._pod_ip, *self.plane.kubelet_certificate)
            self.server.start()
            runtime = ProcessRuntime(api, self.work_dir / "kubelet", IMAGE_ENTRYPOINTS, run_as_users=True)
            self.kubelet = FakeKubelet(api, self.node_names, runtime=runtime, kubelet_port=self.server.port)
            self.kubelet.start()
            self.provisioner = HostPathProvisioner(api)
            self.provisioner.start()
        except BaseException:
            self.stop()
            raise

    def stop(self) -> None:
        if self.provisioner is not None:
            self.provisioner.stop()
        if self.kubelet is not None:
            self.kubelet.stop()  # every pod's processes
        if self.server is not None:
            self.server.stop()
        self.plane.stop()

    def exports(self) -> dict[str, str]:
        exports = {"KUBECONFIG": str(self.plane.kubeconfig)}
        if shutil.which("helm") is None:  # the repository's Helm library as `helm`
            bin_dir = self.work_dir / "bin"
            bin_dir.mkdir(exist_ok=True)
            helm = bin_dir / "helm"
            helm.write_text(f"#!/bin/sh\nPYTHONPATH={shlex.quote(str(REPOSITORY))}${{PYTHONPATH:+:$PYTHONPATH}} "
                            f"exec {shlex.quote(sys.executable)} -m tests.support.helm_cli \"$@\"\n")
            helm.chmod(0o755)
            exports["PATH"] = f"{bin_dir}:{os.environ.get('PATH', '')}"
        return exports

    def _pod_ip(self, namespace: str, name: str) -> str | None:
        records = list(self.kubelet.records.values()) if self.kubelet is not None else []
        return next((r.pod_ip for r in records if (r.namespace, r.name) == (namespace, name)), None)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tests.support.process_cluster")
    sub = parser.add_subparsers(dest="command", required=True)
    start = sub.add_parser("start", help="run a control plane and process nodes in the foreground until stopped")
    start.add_argument("--nodes", type=int, default=3)
    start.add_argument("--work-dir", type=Path, default=None)
    start.add_argument("--env-file", type=Path, default=None, help="where to write the exports once ready")
    args = parser.parse_args(argv)
    if args.nodes < 1:
        parser.error("--nodes must be at least 1")
    missing = missing_tools()
    if missing:
        print(f"process nodes need {', '.join(missing)}", file=sys.stderr)
        return 1
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    logging.getLogger("httpx").setLevel(logging.WARNING)  # the readiness probes, every few seconds
    work_dir = args.work_dir or Path(tempfile.mkdtemp(prefix="lorafaas-k8s-"))
    stopping = threading.Event()
    for signum in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        signal.signal(signum, lambda *_: stopping.set())
    if args.env_file is not None:
        args.env_file.unlink(missing_ok=True)
    with ProcessCluster(work_dir, [f"node-{i}" for i in range(1, args.nodes + 1)]) as cluster:
        exports = "".join(f"export {k}={shlex.quote(v)}\n" for k, v in cluster.exports().items())
        if args.env_file is not None:
            args.env_file.parent.mkdir(parents=True, exist_ok=True)
            args.env_file.write_text(exports)
        print(exports, end="", flush=True)
        try:
            while not stopping.wait(1.0):
                cluster.plane.check_alive()
        finally:
            if args.env_file is not None:
                args.env_file.unlink(missing_ok=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
