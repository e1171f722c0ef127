"""The process kubelet: pods bound to its nodes run as local processes with their own loopback address, are ready when
their probe says so, and report how their process ended."""

from __future__ import annotations

import os
import signal
import sys
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from k8s_env import Release, wait_until

from lorafaas.testing.fake_kubelet import FakeKubelet
from lorafaas.testing.process_kubelet import ProcessRuntime

NODE = "proc-1"


@pytest.fixture
def process_kubelet(release: Release, tmp_path: Path) -> Iterator[tuple[FakeKubelet, ProcessRuntime]]:
    runtime = ProcessRuntime(tmp_path)
    kubelet = FakeKubelet(release.plane.api_client(), [NODE], runtime=runtime)
    kubelet.start()
    yield kubelet, runtime
    kubelet.stop()
    kubelet.remove_node(NODE)


def test_a_pod_runs_as_a_process_on_its_own_address_and_its_sigkill_fails_the_pod(release: Release,
                                                                                  process_kubelet) -> None:
    _, runtime = process_kubelet
    pod = {
        "apiVersion": "v1", "kind": "Pod", "metadata": {"name": "web"},
        "spec": {
            "nodeName": NODE, "restartPolicy": "Never", "automountServiceAccountToken": False,
            "containers": [{
                "name": "web", "image": "python:3", "command": [sys.executable, "-m", "http.server"],
                "args": ["--bind", "$(POD_IP)", "8000"],
                "env": [{"name": "POD_IP", "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}},
                        {"name": "GREETING", "value": "hello $(POD_IP)"}],
                "ports": [{"name": "http", "containerPort": 8000}],
                "readinessProbe": {"tcpSocket": {"port": "http"}, "periodSeconds": 1},
            }],
        },
    }
    release.admin.create_namespaced_pod(release.namespace, pod)
    ready = wait_until(lambda: (p := release.pod("web")) is not None and p.status.conditions
                       and any(c.type == "Ready" and c.status == "True" for c in p.status.conditions) and p,
                       "the pod ready from its probe", 30)
    pod_ip = ready.status.pod_ip
    assert pod_ip.startswith("127.") and pod_ip != "127.0.0.1"
    assert httpx.get(f"http://{pod_ip}:8000/", timeout=5).status_code == 200  # the process, on the pod's address
    [pid] = runtime.pids(ready.metadata.uid).values()
    os.killpg(pid, signal.SIGKILL)
    failed = wait_until(lambda: (p := release.pod("web")).status.phase == "Failed" and p, "the pod failed", 30)
    terminated = failed.status.container_statuses[0].state.terminated
    assert (terminated.exit_code, terminated.reason) == (137, "Error")
