"""A `PodRuntime` for the fake kubelet that runs each bound pod's containers as local processes.

Each pod gets its own loopback address as pod IP (127.<node>.<n>.<m>); a container runs `command + args` (or, when the
pod leaves `command` to the image, the entrypoint `entrypoints[image repository]` names) with its `env` values and the
downward API (metadata.name, metadata.namespace, spec.nodeName, status.podIP, status.hostIP), `$(VAR)` references in
command and args expanded as the kubelet does. Readiness comes from the readiness probe (tcpSocket, httpGet, exec);
a container that exits ends the pod (restartPolicy Never: Failed or Succeeded with its exit code; a process killed by
SIGKILL reports 137, as the OOM killer's victims do) or is started again (Always, OnFailure) with restartCount raised.

Volumes are not emulated: processes see the host's filesystem, so a test makes mount paths and host paths the same.
"""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
from kubernetes import client as k8s

from lorafaas.testing.fake_kubelet import FakeKubelet, PodRecord, conditions, container_status, now

PROBE_INTERVAL_S = 0.5


class ProcessRuntime:
    def __init__(self, work_dir: Path, entrypoints: dict[str, list[str]] | None = None) -> None:
        self.work_dir = Path(work_dir)
        self.entrypoints = entrypoints or {}
        self._processes: dict[str, dict[str, subprocess.Popen]] = {}  # pod uid -> container -> process
        self._stopping: set[str] = set()
        self._next = 0
        self._lock = threading.Lock()

    def start(self, kubelet: FakeKubelet, pod: k8s.V1Pod, record: PodRecord) -> dict:
        with self._lock:
            self._next += 1
            record.pod_ip = f"127.{kubelet.nodes[record.node] % 256}.{self._next // 250}.{self._next % 250 + 2}"
        processes = {c.name: self._run(pod, c, record) for c in pod.spec.containers}
        self._processes[record.uid] = processes
        threading.Thread(target=self._monitor, args=(kubelet, pod, record), daemon=True,
                         name=f"pod-{record.name}").start()
        return self._status(pod, record, ready=False, restarts={})

    def stop(self, record: PodRecord, grace_s: float) -> None:
        self._stopping.add(record.uid)
        processes = self._processes.pop(record.uid, {})
        for process in processes.values():
            if process.poll() is None:
                os.killpg(process.pid, signal.SIGTERM if grace_s else signal.SIGKILL)
        deadline = time.monotonic() + grace_s
        for process in processes.values():
            try:
                process.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                os.killpg(process.pid, signal.SIGKILL)
                process.wait()

    def close(self) -> None:
        for uid in list(self._processes):
            self.stop(PodRecord("", "", uid, "", ""), 0)

    def pids(self, uid: str) -> dict[str, int]:
        return {name: p.pid for name, p in self._processes.get(uid, {}).items()}

    # -- one container -------------------------------------------------------------------------------------------------

    def _env(self, pod: k8s.V1Pod, container: k8s.V1Container, record: PodRecord) -> dict[str, str]:
        fields = {"metadata.name": record.name, "metadata.namespace": record.namespace,
                  "spec.nodeName": record.node, "status.podIP": record.pod_ip, "status.hostIP": "127.0.0.1"}
        env = {"PATH": os.environ.get("PATH", ""), "HOME": str(self.work_dir), "PYTHONPATH":
               os.environ.get("PYTHONPATH", ""), "KUBERNETES_POD_IP": record.pod_ip}
        for var in container.env or []:
            if var.value is not None:
                env[var.name] = _expand(var.value, env)
            elif var.value_from is not None and var.value_from.field_ref is not None:
                env[var.name] = fields.get(var.value_from.field_ref.field_path, "")
        return env

    def _run(self, pod: k8s.V1Pod, container: k8s.V1Container, record: PodRecord) -> subprocess.Popen:
        env = self._env(pod, container, record)
        repository = container.image.rsplit(":", 1)[0].rsplit("@", 1)[0]
        command = container.command or self.entrypoints.get(repository, [])
        argv = [_expand(a, env) for a in [*command, *(container.args or [])]]
        if argv and argv[0] == "python":  # the image's interpreter is this one
            argv[0] = sys.executable
        if not argv:
            raise OSError(f"container {container.name}: no command, and no entrypoint known for {container.image}")
        log = open(self.work_dir / f"{record.name}.{container.name}.log", "ab")  # noqa: SIM115 (the child holds it)
        with log:
            return subprocess.Popen(argv, env=env, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                    start_new_session=True)

    # -- status --------------------------------------------------------------------------------------------------------

    def _monitor(self, kubelet: FakeKubelet, pod: k8s.V1Pod, record: PodRecord) -> None:
        restarts: dict[str, int] = {}
        last: tuple | None = None
        while record.uid not in self._stopping:
            processes = self._processes.get(record.uid)
            if not processes:
                return
            exited = {name: p.returncode for name, p in processes.items() if p.poll() is not None}
            if exited and pod.spec.restart_policy in ("Always", "OnFailure"):
                for name, code in exited.items():
                    if pod.spec.restart_policy == "Always" or code != 0:
                        container = next(c for c in pod.spec.containers if c.name == name)
                        processes[name] = self._run(pod, container, record)
                        restarts[name] = restarts.get(name, 0) + 1
                exited = {}
            if exited:
                code = next(iter(exited.values()))
                code = 128 - code if code < 0 else code  # killed by signal N: 128 + N
                kubelet.patch_status(record.namespace, record.name, self._terminated(pod, record, code))
                return
            ready = all(self._probe(c, record) for c in pod.spec.containers)
            state = (ready, tuple(sorted(restarts.items())))
            if state != last:
                kubelet.patch_status(record.namespace, record.name, self._status(pod, record, ready, restarts))
                last = state
            time.sleep(PROBE_INTERVAL_S)

    def _probe(self, container: k8s.V1Container, record: PodRecord) -> bool:
        probe = container.readiness_probe
        if probe is None:
            return True
        if probe.tcp_socket is not None:
            try:
                with socket.create_connection((record.pod_ip, _port(container, probe.tcp_socket.port)), timeout=1):
                    return True
            except OSError:
                return False
        if probe.http_get is not None:
            url = f"http://{record.pod_ip}:{_port(container, probe.http_get.port)}{probe.http_get.path or '/'}"
            try:
                return 200 <= httpx.get(url, timeout=1).status_code < 400
            except httpx.HTTPError:
                return False
        command = getattr(probe, "var_exec", None)  # `exec` in the API; the client's model renames it
        if command is not None:
            return subprocess.run(command.command, capture_output=True, timeout=5).returncode == 0
        return True

    def _status(self, pod: k8s.V1Pod, record: PodRecord, ready: bool, restarts: dict[str, int]) -> dict:
        running = {"running": {"startedAt": now()}}
        return {"phase": "Running", "hostIP": "127.0.0.1", "podIP": record.pod_ip, "podIPs": [{"ip": record.pod_ip}],
                "startTime": now(), "qosClass": "Burstable", "conditions": conditions(ready),
                "containerStatuses": [container_status(c, running, ready, restarts.get(c.name, 0))
                                      for c in pod.spec.containers]}

    def _terminated(self, pod: k8s.V1Pod, record: PodRecord, code: int) -> dict:
        done = {"terminated": {"exitCode": code, "reason": "Completed" if code == 0 else "Error",
                               "startedAt": now(), "finishedAt": now()}}
        return {"phase": "Succeeded" if code == 0 else "Failed", "hostIP": "127.0.0.1", "podIP": record.pod_ip,
                "podIPs": [{"ip": record.pod_ip}], "conditions": conditions(False),
                "containerStatuses": [container_status(c, done, False) for c in pod.spec.containers]}


def _port(container: k8s.V1Container, port: int | str) -> int:
    if isinstance(port, int) or str(port).isdigit():
        return int(port)
    for declared in container.ports or []:
        if declared.name == port:
            return declared.container_port
    raise OSError(f"container {container.name} declares no port named {port!r}")


def _expand(text: str, env: dict[str, str]) -> str:
    """The kubelet's $(VAR) expansion; $$ escapes, unknown references stay as written."""
    return re.sub(r"\$\$|\$\(([A-Za-z_][A-Za-z0-9_]*)\)",
                  lambda m: "$" if m.group(0) == "$$" else env.get(m.group(1), m.group(0)), text)
