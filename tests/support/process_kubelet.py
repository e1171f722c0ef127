"""A `PodRuntime` for the fake kubelet that runs each bound pod's containers as local processes, as a real kubelet
would run them in containers, well enough for the Helm chart to run unmodified.

- **Network**: each pod has its own network namespace on a bridge (`tests.support.pod_network`), its own pod IP
  and ports; Services work as kube-proxy and the cluster DNS make them work (`tests.support.service_proxy`), and
  KUBERNETES_SERVICE_HOST/PORT point at the `kubernetes` Service.
- **Volumes**: each container runs in a mount namespace of its own where its volumeMounts are bind mounts
  (`tests.support.pod_volumes`: emptyDir, hostPath under the node's own root, configMap, secret, downwardAPI,
  projected with service-account tokens, PVCs bound to hostPath/local/nfs volumes; `readOnly` honoured), and
  `/etc/hosts` is the pod's.
- **Images**: no image is pulled. A container without `command` runs `entrypoints[image repository] + args` (what the
  image's ENTRYPOINT would run, given by the test); an image it does not know fails the pod (RunContainerError).
  `python` as the first word is this interpreter.
- **Processes**: init containers run to completion, in order, before the containers (one that fails fails the pod
  under restartPolicy Never, its message the log's tail under FallbackToLogsOnError, else is run again with
  restartCount raised); `env` values, `secretKeyRef`, `configMapKeyRef` and the downward API (metadata.*,
  spec.nodeName, status.podIP, status.hostIP), `$(VAR)` expansion as the kubelet does it. Readiness comes from the
  readiness probe (tcpSocket, httpGet, exec inside the container's namespaces) every `periodSeconds`, with its
  `timeoutSeconds`, `successThreshold` and `failureThreshold`. A container that exits ends the pod (restartPolicy
  Never: Failed or Succeeded with its exit code; SIGKILL reports 137, as the OOM killer's victims do) or is started
  again (Always, OnFailure) after a back-off, with restartCount raised.

Not emulated, and not faked: the container image's filesystem (pods share this machine's root filesystem; missing
mount points are created on it), `securityContext` but with `run_as_users` its runAsUser, runAsGroup, fsGroup and
supplementalGroups (otherwise every process runs as root; capabilities, readOnlyRootFilesystem, seccomp and
allowPrivilegeEscalation never apply), resource requests and limits (nothing is limited or OOM-killed), liveness and
startup probes (not run), IPC and UTS namespaces (each container has a PID namespace of its own, as without
shareProcessNamespace), `envFrom`, image pull policies and pull secrets, NetworkPolicies (every pod reaches every pod),
UDP Services, NodePorts. Needs root: network, mount and PID namespaces, bind mounts (`ip`, `nsenter`, `unshare`,
`mount`, `setpriv`).
"""

from __future__ import annotations

import base64
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx
from kubernetes import client as k8s
from kubernetes.client.exceptions import ApiException

from tests.support.fake_kubelet import FakeKubelet, PodRecord, conditions, container_status, now
from tests.support.pod_network import PodNetwork
from tests.support.pod_volumes import PodVolumes, field_value, run_as, sandbox_script
from tests.support.service_proxy import ServiceProxy

MONITOR_INTERVAL_S = 0.5
MAX_BACKOFF_S = 10.0


def missing_tools() -> list[str]:
    """What the process kubelet needs and this machine lacks: root and the namespace tools."""
    missing = [tool for tool in ("ip", "nsenter", "unshare", "mount", "bash", "setpriv") if shutil.which(tool) is None]
    return missing + (["root (uid 0)"] if os.geteuid() != 0 else [])


@dataclass
class PodRun:
    """The runtime's state of one pod."""

    pod: k8s.V1Pod
    volumes: PodVolumes
    hosts: Path
    processes: dict[str, subprocess.Popen] = field(default_factory=dict)  # running container -> process
    restarts: dict[str, int] = field(default_factory=dict)
    init_done: int = 0
    stopping: bool = False
    started_at: str = field(default_factory=now)


class ProcessRuntime:
    def __init__(self, api: k8s.ApiClient, work_dir: Path, entrypoints: dict[str, list[str]] | None = None,
                 run_as_users: bool = False) -> None:
        self.core = k8s.CoreV1Api(api)
        self.run_as_users = run_as_users  # each container as its securityContext's uid (pod_volumes.run_as)
        self.work_dir = Path(work_dir)
        self.entrypoints = entrypoints or {}
        self.network = PodNetwork()
        self.proxy = ServiceProxy(api, self.network, self.work_dir)
        self._pods: dict[str, PodRun] = {}  # by uid
        self._lock = threading.Lock()
        self._started = False

    def _start_services(self) -> None:
        with self._lock:
            if self._started:
                return
            self._started = True
        self.network.start()
        self.proxy.start()

    def start(self, kubelet: FakeKubelet, pod: k8s.V1Pod, record: PodRecord) -> None:
        self._start_services()
        pod_dir = self.work_dir / "pods" / f"{record.namespace}.{record.name}.{record.uid[:8]}"
        pod_dir.mkdir(parents=True, exist_ok=True)
        volumes = PodVolumes(self.core, pod, self.work_dir / "nodes" / record.node, pod_dir, self.run_as_users)
        record.pod_ip = self.network.add_pod(record.uid, kubelet.nodes[record.node])
        run = PodRun(pod, volumes, self.proxy.hosts_file(record.uid, record.namespace, record.name, record.pod_ip))
        with self._lock:
            self._pods[record.uid] = run
        try:
            volumes.prepare()
        except (OSError, ApiException) as exc:
            self.stop(record, 0)
            raise OSError(f"volumes: {exc}") from exc
        # posted here, before the pod's thread posts anything: a later post of this first status would undo its
        kubelet.patch_status(record.namespace, record.name, self._status(run, record, ready=False))
        threading.Thread(target=self._run_pod, args=(kubelet, run, record), daemon=True,
                         name=f"pod-{record.name}").start()
        return None

    def stop(self, record: PodRecord, grace_s: float) -> None:
        with self._lock:
            run = self._pods.pop(record.uid, None)
        if run is None:
            return
        run.stopping = True
        processes = list(run.processes.values())
        for process in processes:
            if process.poll() is None:
                os.killpg(process.pid, signal.SIGTERM if grace_s else signal.SIGKILL)
        deadline = time.monotonic() + grace_s
        for process in processes:
            try:
                process.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                os.killpg(process.pid, signal.SIGKILL)
                process.wait()
        run.volumes.remove()
        self.proxy.forget(record.uid)
        self.network.remove_pod(record.uid)

    def close(self) -> None:
        for uid in list(self._pods):
            self.stop(PodRecord("", "", uid, "", ""), 0)
        if self._started:
            self.proxy.stop()
            self.network.close()

    def pids(self, uid: str) -> dict[str, int]:
        run = self._pods.get(uid)
        return {name: p.pid for name, p in (run.processes if run else {}).items()}

    # -- one container -------------------------------------------------------------------------------------------------

    def _env(self, run: PodRun, container: k8s.V1Container, record: PodRecord) -> dict[str, str]:
        env = {"PATH": os.environ.get("PATH", ""), "HOME": "/root", "PYTHONPATH": os.environ.get("PYTHONPATH", ""),
               "HOSTNAME": record.name}
        host, port = self.proxy.kubernetes_service()
        env |= {"KUBERNETES_SERVICE_HOST": host, "KUBERNETES_SERVICE_PORT": str(port)}
        if container.env_from:
            raise OSError(f"container {container.name}: envFrom is not emulated")
        namespace = record.namespace
        for var in container.env or []:
            source = var.value_from
            if source is None:
                env[var.name] = _expand(var.value or "", env)
            elif source.field_ref is not None:
                path = source.field_ref.field_path
                status = {"status.podIP": record.pod_ip, "status.hostIP": "127.0.0.1"}
                env[var.name] = status[path] if path in status else field_value(run.pod, path)
            elif source.secret_key_ref is not None:
                ref = source.secret_key_ref
                data = self.core.read_namespaced_secret(ref.name, namespace).data or {}
                if ref.key in data:
                    env[var.name] = base64.b64decode(data[ref.key]).decode()
                elif not ref.optional:
                    raise OSError(f"env {var.name}: secret {ref.name} has no key {ref.key!r}")
            elif source.config_map_key_ref is not None:
                ref = source.config_map_key_ref
                data = self.core.read_namespaced_config_map(ref.name, namespace).data or {}
                if ref.key in data:
                    env[var.name] = data[ref.key]
                elif not ref.optional:
                    raise OSError(f"env {var.name}: configMap {ref.name} has no key {ref.key!r}")
            else:
                raise OSError(f"container {container.name}: env {var.name}: resourceFieldRef is not emulated")
        return env

    def _launch(self, run: PodRun, container: k8s.V1Container, record: PodRecord) -> subprocess.Popen:
        if run.stopping:
            raise OSError(f"pod {record.name} is stopping")
        env = self._env(run, container, record)
        repository = container.image.rsplit("@", 1)[0]
        if ":" in repository.rsplit("/", 1)[-1]:
            repository = repository.rsplit(":", 1)[0]
        if container.command:
            command = container.command
        elif repository in self.entrypoints:
            command = self.entrypoints[repository]
        else:
            raise OSError(f"container {container.name}: no command, and no entrypoint known for {container.image}")
        argv = [_expand(a, env) for a in [*command, *(container.args or [])]]
        if argv and argv[0] == "python":  # the image's interpreter is this one
            argv[0] = sys.executable
        if not argv:
            raise OSError(f"container {container.name}: nothing to run (no command, no args)")
        identity = run_as(run.pod, container) if self.run_as_users else []
        if identity and not any(var.name == "HOME" for var in container.env or []):
            env["HOME"] = "/"  # what a runtime sets for a uid the image's /etc/passwd does not name
        pod_dir = run.volumes.pod_dir
        script = pod_dir / f"{container.name}.sh"
        script.write_text(sandbox_script(run.volumes.mounts(container), run.hosts, container.working_dir))
        # a PID namespace per container, as Kubernetes gives without shareProcessNamespace; unshare (the process the
        # kubelet holds) ignores SIGTERM, waits for the container and exits as it did
        sandbox = ["nsenter", f"--net={self.network.netns_path(record.uid)}", "--",
                   "unshare", "--mount", "--propagation", "private", "--pid", "--fork", "--kill-child",
                   "--mount-proc", "--", "bash", str(script)]
        log = open(self.work_dir / f"{record.name}.{container.name}.log", "ab")  # noqa: SIM115 (the child holds it)
        with log:
            process = subprocess.Popen([*sandbox, *identity, *argv], env=env, stdout=log, stderr=subprocess.STDOUT,
                                       stdin=subprocess.DEVNULL, start_new_session=True)
        if run.stopping:  # stop() came while it started, and did not see it
            os.killpg(process.pid, signal.SIGKILL)
            process.wait()
            raise OSError(f"pod {record.name} is stopping")
        return process

    # -- the pod's life ------------------------------------------------------------------------------------------------

    def _run_pod(self, kubelet: FakeKubelet, run: PodRun, record: PodRecord) -> None:
        try:
            if self._run_init_containers(kubelet, run, record):
                for container in run.pod.spec.containers:
                    run.processes[container.name] = self._launch(run, container, record)
                self._monitor(kubelet, run, record)
        except (OSError, ApiException) as exc:
            if not run.stopping:
                waiting = {"waiting": {"reason": "RunContainerError", "message": str(exc)}}
                kubelet.patch_status(record.namespace, record.name, {
                    "phase": "Pending", "conditions": conditions(False),
                    "containerStatuses": [container_status(c, waiting, False) for c in run.pod.spec.containers]})

    def _run_init_containers(self, kubelet: FakeKubelet, run: PodRun, record: PodRecord) -> bool:
        """Each to completion, in order; False if the pod failed or is stopping."""
        inits = run.pod.spec.init_containers or []
        while run.init_done < len(inits) and not run.stopping:
            container = inits[run.init_done]
            process = run.processes[container.name] = self._launch(run, container, record)
            code = _exit_code(process.wait())
            del run.processes[container.name]
            if run.stopping:
                return False
            if code == 0:
                run.init_done += 1
                kubelet.patch_status(record.namespace, record.name, self._status(run, record, ready=False))
                continue
            failed = {"terminated": {"exitCode": code, "reason": "Error", "startedAt": now(), "finishedAt": now(),
                                     "message": self._termination_message(container, record)}}
            if run.pod.spec.restart_policy == "Never":
                kubelet.patch_status(record.namespace, record.name, self._status(run, record, False, failed))
                kubelet.patch_status(record.namespace, record.name, {"phase": "Failed"})
                return False
            run.restarts[container.name] = restarts = run.restarts.get(container.name, 0) + 1
            kubelet.patch_status(record.namespace, record.name, self._status(run, record, False, failed))
            time.sleep(_backoff(restarts))
        return not run.stopping

    def _termination_message(self, container: k8s.V1Container, record: PodRecord) -> str | None:
        """FallbackToLogsOnError: the log's last 2048 bytes, as the kubelet takes them (no /dev/termination-log)."""
        if container.termination_message_policy != "FallbackToLogsOnError":
            return None
        log = self.work_dir / f"{record.name}.{container.name}.log"
        return log.read_bytes()[-2048:].decode(errors="replace") if log.is_file() else None

    def _monitor(self, kubelet: FakeKubelet, run: PodRun, record: PodRecord) -> None:
        last: tuple | None = None
        ready: dict[str, bool] = {}
        probed_at: dict[str, float] = {}
        streaks: dict[str, tuple[bool, int]] = {}  # container -> (last probe result, how many in a row)
        exited_at: dict[str, float] = {}
        policy = run.pod.spec.restart_policy
        while not run.stopping:
            exited = {name: _exit_code(p.returncode) for name, p in run.processes.items() if p.poll() is not None}
            if exited and policy in ("Always", "OnFailure"):
                for name, code in exited.items():
                    if policy == "OnFailure" and code == 0:
                        continue
                    ready[name] = False
                    streaks.pop(name, None)
                    at = exited_at.setdefault(name, time.monotonic())
                    if time.monotonic() - at >= _backoff(run.restarts.get(name, 0) + 1):
                        container = next(c for c in run.pod.spec.containers if c.name == name)
                        run.processes[name] = self._launch(run, container, record)
                        run.restarts[name] = run.restarts.get(name, 0) + 1
                        del exited_at[name]
                exited = {n: c for n, c in exited.items() if policy == "OnFailure" and c == 0}
                if len(exited) < len(run.processes):
                    exited = {}
            if exited:
                code = next((c for c in exited.values() if c != 0), 0)
                kubelet.patch_status(record.namespace, record.name, self._terminated(run, record, code))
                return
            for container in run.pod.spec.containers:
                probe = container.readiness_probe
                process = run.processes.get(container.name)
                if process is None or process.poll() is not None:
                    continue
                period = (probe.period_seconds or 10) if probe else 0
                if time.monotonic() - probed_at.get(container.name, 0.0) >= period:
                    probed_at[container.name] = time.monotonic()
                    passed = self._probe(container, record, process.pid)
                    # as the kubelet does: successThreshold passes in a row make it ready, failureThreshold fails
                    # in a row unready
                    same, count = streaks.get(container.name, (passed, 0))
                    count = count + 1 if same == passed else 1
                    streaks[container.name] = (passed, count)
                    if count >= _threshold(probe, passed):
                        ready[container.name] = passed
            all_ready = all(ready.get(c.name, False) for c in run.pod.spec.containers)
            state = (all_ready, tuple(sorted(run.restarts.items())))
            if state != last:
                kubelet.patch_status(record.namespace, record.name, self._status(run, record, all_ready))
                last = state
            time.sleep(MONITOR_INTERVAL_S)

    def _probe(self, container: k8s.V1Container, record: PodRecord, pid: int) -> bool:
        probe = container.readiness_probe
        if probe is None:
            return True
        if probe.tcp_socket is not None:
            try:
                with socket.create_connection((record.pod_ip, _port(container, probe.tcp_socket.port)),
                                              timeout=probe.timeout_seconds or 1):
                    return True
            except OSError:
                return False
        if probe.http_get is not None:
            url = f"http://{record.pod_ip}:{_port(container, probe.http_get.port)}{probe.http_get.path or '/'}"
            try:
                return 200 <= httpx.get(url, timeout=probe.timeout_seconds or 1).status_code < 400
            except httpx.HTTPError:
                return False
        command = getattr(probe, "var_exec", None)  # `exec` in the API; the client's model renames it
        if command is not None:  # inside the container: its network and its mounts
            try:
                return subprocess.run(["nsenter", "--target", str(pid), "--net", "--mount", "--", *command.command],
                                      capture_output=True, timeout=probe.timeout_seconds or 1).returncode == 0
            except subprocess.TimeoutExpired:
                return False
        return True

    # -- status --------------------------------------------------------------------------------------------------------

    def _status(self, run: PodRun, record: PodRecord, ready: bool, init_failure: dict | None = None) -> dict:
        inits = run.pod.spec.init_containers or []
        initialized = run.init_done >= len(inits)
        done = {"terminated": {"exitCode": 0, "reason": "Completed", "startedAt": now(), "finishedAt": now()}}
        init_statuses = []
        for i, container in enumerate(inits):
            if i < run.init_done:
                state = done
            elif i == run.init_done and init_failure is not None:
                state = init_failure
            elif i == run.init_done:
                state = {"running": {"startedAt": now()}}
            else:
                state = {"waiting": {"reason": "PodInitializing"}}
            init_statuses.append(container_status(container, state, i < run.init_done,
                                                  run.restarts.get(container.name, 0)))
        state = {"running": {"startedAt": now()}} if initialized else {"waiting": {"reason": "PodInitializing"}}
        return {"phase": "Running" if initialized else "Pending", "hostIP": "127.0.0.1", "podIP": record.pod_ip,
                "podIPs": [{"ip": record.pod_ip}], "startTime": run.started_at, "qosClass": "Burstable",
                "conditions": conditions(ready, initialized), "initContainerStatuses": init_statuses,
                "containerStatuses": [container_status(c, state, ready, run.restarts.get(c.name, 0))
                                      for c in run.pod.spec.containers]}

    def _terminated(self, run: PodRun, record: PodRecord, code: int) -> dict:
        done = {"terminated": {"exitCode": code, "reason": "Completed" if code == 0 else "Error",
                               "startedAt": now(), "finishedAt": now()}}
        return {"phase": "Succeeded" if code == 0 else "Failed", "hostIP": "127.0.0.1", "podIP": record.pod_ip,
                "podIPs": [{"ip": record.pod_ip}], "conditions": conditions(False),
                "containerStatuses": [container_status(c, done, False) for c in run.pod.spec.containers]}


def _threshold(probe: k8s.V1Probe | None, passed: bool) -> int:
    """How many results in a row change readiness: successThreshold passes (default 1), failureThreshold fails (3)."""
    if probe is None:
        return 1
    return (probe.success_threshold or 1) if passed else (probe.failure_threshold or 3)


def _exit_code(returncode: int) -> int:
    return 128 - returncode if returncode < 0 else returncode  # killed by signal N: 128 + N


def _backoff(restarts: int) -> float:
    return min(MAX_BACKOFF_S, 0.5 * 2 ** (restarts - 1))


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
