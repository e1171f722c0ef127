"""The process kubelet: pods bound to its nodes run as local processes in their own network and mount namespaces, are
ready when their probe says so, report how their process ended, run their init containers first, see their volumes
and reach Services by name and the API server with their service account's token."""

from __future__ import annotations

import os
import signal
import sys
from pathlib import Path

import httpx
from k8s_env import PROCESS_NODE as NODE
from k8s_env import Release, wait_until


def python_pod(name: str, script: str, **spec) -> dict:
    return {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": name, "labels": {"app": name}},
            "spec": {"nodeName": NODE, "restartPolicy": "Never", "automountServiceAccountToken": False,
                     "containers": [{"name": "main", "image": "python:3", "command": [sys.executable, "-c", script]}],
                     **spec}}


def phase_of(release: Release, name: str, phases: tuple[str, ...] = ("Succeeded", "Failed")):
    return wait_until(lambda: (p := release.pod(name)) is not None and p.status.phase in phases and p,
                      f"pod {name} to end", 60)


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
    assert pod_ip.startswith(str(runtime.network.subnet.network_address)[:-3])
    assert httpx.get(f"http://{pod_ip}:8000/", timeout=5).status_code == 200  # the process, on the pod's address
    [pid] = runtime.pids(ready.metadata.uid).values()
    os.killpg(pid, signal.SIGKILL)
    failed = phase_of(release, "web")
    terminated = failed.status.container_statuses[0].state.terminated
    assert (failed.status.phase, terminated.exit_code, terminated.reason) == ("Failed", 137, "Error")


def test_init_containers_run_first_and_volumes_are_mounted_as_declared(release: Release, process_kubelet,
                                                                       tmp_path: Path) -> None:
    admin = release.admin
    admin.create_namespaced_config_map(release.namespace, {"metadata": {"name": "settings"},
                                                           "data": {"greeting": "ahoy"}})
    admin.create_namespaced_secret(release.namespace, {"metadata": {"name": "key"}, "stringData": {"key": "s3cret"}})
    check = """
import os, pathlib, sys
assert pathlib.Path('/run/lf-work/from-init').read_text() == 'first', 'init output'
assert pathlib.Path('/run/lf-settings/greeting').read_text() == 'ahoy'
assert pathlib.Path('/run/lf-key/key').read_text() == 's3cret'
for ro in ('/run/lf-settings/x', '/run/lf-key/x', '/run/lf-node/x'):
    try:
        open(ro, 'w')
        sys.exit(f'{ro} is writable')
    except OSError:
        pass
assert pathlib.Path('/run/lf-node/mark').read_text() == 'on the node'
assert os.listdir('/tmp') == [], 'the emptyDir on /tmp starts empty'
assert pathlib.Path('/run/lf-projected/name').read_text() == 'volumes'
assert pathlib.Path('/run/lf-projected/token').read_text().count('.') == 2, 'a JWT from the TokenRequest API'
"""
    node_dir = tmp_path / "nodes" / NODE / "srv" / "data"
    node_dir.mkdir(parents=True)
    (node_dir / "mark").write_text("on the node")
    pod = python_pod("volumes", check, initContainers=[
        {"name": "first", "image": "busybox", "command": ["sh", "-c", "printf first > /run/lf-work/from-init"],
         "volumeMounts": [{"name": "work", "mountPath": "/run/lf-work"}]}],
        volumes=[{"name": "work", "emptyDir": {}}, {"name": "settings", "configMap": {"name": "settings"}},
                 {"name": "key", "secret": {"secretName": "key"}},
                 {"name": "node", "hostPath": {"path": "/srv/data", "type": "Directory"}},
                 {"name": "projected", "projected": {"sources": [
                     {"serviceAccountToken": {"path": "token", "expirationSeconds": 3600}},
                     {"downwardAPI": {"items": [{"path": "name", "fieldRef": {"fieldPath": "metadata.name"}}]}}]}}])
    pod["spec"]["volumes"].append({"name": "scratch", "emptyDir": {}})
    pod["spec"]["containers"][0]["volumeMounts"] = [  # /tmp hides the kubelet's directories: mounted all the same
        {"name": "scratch", "mountPath": "/tmp"},
        {"name": "work", "mountPath": "/run/lf-work"}, {"name": "settings", "mountPath": "/run/lf-settings"},
        {"name": "projected", "mountPath": "/run/lf-projected"},
        {"name": "key", "mountPath": "/run/lf-key"}, {"name": "node", "mountPath": "/run/lf-node", "readOnly": True}]
    admin.create_namespaced_pod(release.namespace, pod)
    done = phase_of(release, "volumes")
    log = (tmp_path / "volumes.main.log").read_text() if (tmp_path / "volumes.main.log").exists() else ""
    assert done.status.phase == "Succeeded", log
    assert not Path("/run/lf-work/from-init").exists()  # the emptyDir was the pod's, not this machine's

    failing = python_pod("init-fails", "print('never')", initContainers=[
        {"name": "broken", "image": "busybox", "command": ["sh", "-c", "exit 3"]}])
    admin.create_namespaced_pod(release.namespace, failing)
    failed = phase_of(release, "init-fails")
    init = failed.status.init_container_statuses[0].state.terminated
    assert (failed.status.phase, init.exit_code, init.reason) == ("Failed", 3, "Error")
    assert not (tmp_path / "init-fails.main.log").exists()  # the container never started

    # restartPolicy OnFailure: a failed init container runs again, then the pod goes on
    retried = python_pod("init-retried", "print('ran')", restartPolicy="OnFailure", initContainers=[
        {"name": "flaky", "image": "busybox", "volumeMounts": [{"name": "state", "mountPath": "/run/lf-state"}],
         "command": ["sh", "-c", "[ -e /run/lf-state/tried ] || { touch /run/lf-state/tried; exit 1; }"]}],
        volumes=[{"name": "state", "emptyDir": {}}])
    admin.create_namespaced_pod(release.namespace, retried)
    done = phase_of(release, "init-retried")
    assert done.status.phase == "Succeeded"
    assert done.status.init_container_statuses[0].restart_count == 1


def test_services_resolve_by_name_and_in_cluster_config_reaches_the_api_server(release: Release,
                                                                               process_kubelet, tmp_path: Path) -> None:
    admin = release.admin
    web = python_pod("web", "import http.server as h; h.test(h.SimpleHTTPRequestHandler, port=8000, bind='0.0.0.0')")
    web["spec"]["containers"][0]["ports"] = [{"name": "http", "containerPort": 8000}]
    web["spec"]["containers"][0]["readinessProbe"] = {"tcpSocket": {"port": "http"}, "periodSeconds": 1}
    admin.create_namespaced_pod(release.namespace, web)
    admin.create_namespaced_service(release.namespace, {
        "metadata": {"name": "web"}, "spec": {"selector": {"app": "web"}, "ports": [
            {"name": "http", "port": 80, "targetPort": "http"}]}})
    namespace = release.namespace
    client = f"""
import urllib.request
from kubernetes import client, config
for name in ('web', 'web.{namespace}', 'web.{namespace}.svc.cluster.local'):
    assert urllib.request.urlopen(f'http://{{name}}/', timeout=10).status == 200, name
config.load_incluster_config()
print('api server', client.VersionApi().get_code().git_version)
"""
    pod = python_pod("client", client, automountServiceAccountToken=True)
    _, runtime = process_kubelet
    wait_until(lambda: runtime.proxy.endpoint((namespace, "web"), 80), "web's endpoint ready at its Service", 60)
    admin.create_namespaced_pod(namespace, pod)
    done = phase_of(release, "client")
    log = (tmp_path / "client.main.log").read_text()
    assert done.status.phase == "Succeeded", log
    assert "api server v1.20.2" in log
