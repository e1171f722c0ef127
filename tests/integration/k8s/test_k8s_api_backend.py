"""The Kubernetes backend against a real API server, scheduler and garbage collector (1.20), with two and three nodes
serving the backbone, authenticated as the chart's service account (its Role is what allows or forbids each call).

The fake kubelet runs no containers: pods bound to its nodes become Running and Ready with a pod IP, images named
"does-not-exist" cannot be pulled, and tests make pods fail (OOMKilled) or evict them through it.
"""

from __future__ import annotations

import signal
import ssl

import httpx
import pytest
from k8s_env import BACKBONE, NODES, RELEASE, TEMPLATE, UNPULLABLE, Release, wait_until
from kubernetes import client as k8s
from kubernetes.client.exceptions import ApiException

from lorafaas.errors import DaemonUnavailable, InstanceUnavailable
from lorafaas.platform.backends.kubernetes import KubernetesBackend

START_S = 30.0


@pytest.fixture(params=[2, 3], ids=lambda n: f"{n}-serving-nodes")
def serving(request: pytest.FixtureRequest, release: Release) -> list[str]:
    """Agents serving the backbone on the first N nodes; with two, the third node's agent serves another backbone
    (so no function of ours may land there)."""
    nodes = list(NODES[: request.param])
    for node in nodes:
        release.add_agent(node)
    if len(nodes) < len(NODES):
        release.add_agent(NODES[-1], backbones="other")
    return nodes


def launch(backend: KubernetesBackend, function: str, timeout_s: float = START_S):
    return backend.launch(backend.spec(function, BACKBONE, None), timeout_s=timeout_s)


def test_pods_land_on_serving_nodes_become_ready_and_are_deleted(release: Release, serving: list[str]) -> None:
    backend = release.backend()
    instances = [launch(backend, f"fn-{i}") for i in range(4)]
    for instance in instances:
        pod = release.pod(instance.pod_name)
        assert pod.spec.node_name in serving
        assert pod.status.phase == "Running"
        assert instance.address == f"tcp://{pod.status.pod_ip}:9000"
        assert instance.alive()
    assert backend.instances == instances
    first = instances[0]
    first.kill(signal.SIGTERM, timeout_s=5)
    assert release.pod(first.pod_name) is None  # kill returns once the kubelet confirmed the deletion
    assert not first.alive()
    assert first not in backend.instances
    first.kill(signal.SIGKILL)  # already gone: not an error
    backend.delete_instances()
    wait_until(lambda: not release.function_pods(), "every function pod deleted")


def test_a_pod_whose_image_cannot_be_pulled_fails_the_launch_and_is_recorded(release: Release, serving) -> None:
    release.set_template(lambda pod: pod["spec"]["containers"][0].update(image=f"lorafaas/{UNPULLABLE}:1"))
    backend = release.backend()
    spec = backend.spec("pirate", BACKBONE, None)
    with pytest.raises(InstanceUnavailable, match="ImagePullBackOff"):
        backend.launch(spec, timeout_s=START_S)
    wait_until(lambda: release.pod(backend.pod_name(spec)) is None, "the failed pod deleted")
    [failure] = backend.describe_failures("pirate")
    assert failure.reason == "ImagePullBackOff" and failure.instance_id == spec.instance_id
    assert UNPULLABLE in failure.message
    assert backend.instances == []


def test_an_unschedulable_pod_fails_with_the_schedulers_reason(release: Release, serving) -> None:
    release.set_template(lambda pod: pod["spec"]["containers"][0]["resources"].update(
        requests={"cpu": "250m", "memory": "900Gi"}, limits={"memory": "900Gi"}))
    backend = release.backend()
    spec = backend.spec("pirate", BACKBONE, None)
    with pytest.raises(InstanceUnavailable, match="Insufficient memory"):
        backend.launch(spec, timeout_s=8)
    assert [f.reason for f in backend.describe_failures("pirate")] == ["Unschedulable"]
    wait_until(lambda: not release.function_pods(), "the pending pod deleted")


def test_no_ready_agent_serving_the_backbone_creates_no_pod(release: Release, serving) -> None:
    backend = release.backend()
    with pytest.raises(DaemonUnavailable, match=r"nodeAgent\.backbones"):
        backend.spec("pirate", "missing", None)
    assert backend.running_backbones() == (["other", BACKBONE] if len(serving) < 3 else [BACKBONE])
    assert release.function_pods() == []


def test_failures_of_running_pods_reach_describe_through_the_watch(release: Release, serving) -> None:
    backend = release.backend()
    oom, evicted = launch(backend, "oom"), launch(backend, "evicted")
    release.kubelet.fail(release.namespace, oom.pod_name, reason="OOMKilled", exit_code=137)
    release.kubelet.evict(release.namespace, evicted.pod_name)
    wait_until(lambda: backend.describe_failures("oom") and backend.describe_failures("evicted"),
               "both failures seen by the watch")
    [killed] = backend.describe_failures("oom")
    assert (killed.reason, killed.exit_code) == ("OOMKilled", 137)
    [gone] = backend.describe_failures("evicted")
    assert gone.reason == "Evicted" and "low on resource" in gone.message
    assert not oom.alive() and not evicted.alive()


def test_a_restarted_controller_adopts_healthy_pods_and_deletes_failed_and_orphaned_ones(
        release: Release, serving) -> None:
    before = release.backend()
    specs = {name: before.spec(name, BACKBONE, None) for name in ("kept", "crashed", "orphan", "missing")}
    pods = {name: before.launch(specs[name], timeout_s=START_S).pod_name for name in ("kept", "crashed", "orphan")}
    release.kubelet.fail(release.namespace, pods["crashed"], reason="OOMKilled", exit_code=137)
    wait_until(lambda: release.pod(pods["crashed"]).status.phase == "Failed", "the crashed pod failed")
    before.stop()  # the controller dies: its pods stay

    after = release.backend()
    after.start()  # failed pods go at once
    wait_until(lambda: release.pod(pods["crashed"]) is None, "the crashed pod deleted")
    wanted = [specs["kept"], specs["crashed"], specs["missing"]]
    result = after.adoption.reconcile(wanted, timeout_s=START_S)
    assert result.adopted == (specs["kept"].instance_id,)
    assert result.deleted == (pods["orphan"],)
    assert set(result.created) == {specs["crashed"].instance_id, specs["missing"].instance_id}
    assert sorted(i.spec.instance_id for i in after.instances) == sorted(s.instance_id for s in wanted)
    assert [f.reason for f in after.describe_failures("crashed")] == ["OOMKilled"]
    wait_until(lambda: {p.metadata.name for p in release.function_pods()}
               == {after.pod_name(s) for s in wanted}, "only the wanted pods left")

    again = after.adoption.reconcile(wanted, timeout_s=START_S)  # idempotent
    assert (again.adopted, again.created, again.deleted) == ((), (), ())


def test_a_restarted_controller_hands_a_healthy_pod_to_the_next_launch_of_the_same_instance(
        release: Release, serving) -> None:
    """What the node agent does after a restart: it asks for instances afresh (new ids); a healthy pod running the
    same function, backbone and adapter is adopted instead of started again, and pods nobody claims go after the
    adoption window."""
    before = release.backend()
    kept = launch(before, "kept")
    forgotten = launch(before, "forgotten")
    before.close()  # the controller's SIGTERM (an upgrade): its pods stay

    after = release.backend(adopt_window_s=3.0)
    after.start()
    assert sorted(s.instance_id for s in after.adoptable()) == sorted([kept.spec.instance_id,
                                                                        forgotten.spec.instance_id])
    again = after.launch(after.spec("kept", BACKBONE, None), timeout_s=START_S)
    assert again.pod_name == kept.pod_name and again.spec.instance_id == kept.spec.instance_id and again.adopted
    assert [s.instance_id for s in after.adoptable()] == [forgotten.spec.instance_id]
    assert {p.metadata.name for p in release.function_pods()} >= {kept.pod_name}
    wait_until(lambda: [p.metadata.name for p in release.function_pods()] == [kept.pod_name],
               "the unclaimed pod deleted after the adoption window")


def test_deleting_the_template_config_map_garbage_collects_every_function_pod(release: Release, serving) -> None:
    backend = release.backend()
    instances = [launch(backend, f"fn-{i}") for i in range(3)]
    owner = release.pod(instances[0].pod_name).metadata.owner_references[0]
    assert (owner.kind, owner.name, owner.controller) == ("ConfigMap", TEMPLATE, True)  # drain treats it as managed
    release.admin.delete_namespaced_config_map(TEMPLATE, release.namespace)  # what helm uninstall does
    wait_until(lambda: not release.function_pods(), "the garbage collector deleting the function pods", 60)


def test_an_evicted_pod_by_the_eviction_api_is_seen_gone_like_kubectl_drain_does_it(release: Release, serving):
    backend = release.backend()
    instance = launch(backend, "drained")
    evicted = httpx.post(  # what kubectl drain asks for each pod (policy/v1beta1 on 1.20)
        f"{release.plane.server}/api/v1/namespaces/{release.namespace}/pods/{instance.pod_name}/eviction",
        json={"apiVersion": "policy/v1beta1", "kind": "Eviction",
              "metadata": {"name": instance.pod_name, "namespace": release.namespace}},
        headers={"Authorization": f"Bearer {release.plane.admin_token}"},
        verify=ssl.create_default_context(cafile=str(release.plane.ca_file)))
    assert evicted.status_code == 201, evicted.text
    wait_until(lambda: not instance.alive(), "the instance no longer alive")
    wait_until(lambda: release.pod(instance.pod_name) is None, "the pod gone")
    [failure] = wait_until(lambda: backend.describe_failures("drained"), "the deletion recorded")
    assert instance not in backend.instances
    assert failure.reason == "Deleted"


def test_the_service_account_may_make_every_call_the_backend_makes_and_nothing_else(release: Release, serving):
    backend = release.backend()
    launch(backend, "pirate").kill()  # list, watch, create, get, delete pods; get the template: all allowed
    token = release.plane.service_account_token(release.namespace, "lorafaas-controller")
    api = release.plane.api_client(token)
    core, apps = k8s.CoreV1Api(api), k8s.AppsV1Api(api)
    namespace = release.namespace
    forbidden = {
        "list secrets": lambda: core.list_namespaced_secret(namespace),
        "read the admin key": lambda: core.read_namespaced_secret(f"{RELEASE}-admin-key", namespace),
        "create a config map": lambda: core.create_namespaced_config_map(
            namespace, {"metadata": {"name": "x"}, "data": {}}),
        "edit the pod template": lambda: core.patch_namespaced_config_map(TEMPLATE, namespace, {"data": {}}),
        "delete the pod template": lambda: core.delete_namespaced_config_map(TEMPLATE, namespace),
        "read another config map": lambda: core.read_namespaced_config_map("kube-root-ca.crt", namespace),
        "patch a pod": lambda: core.patch_namespaced_pod("x", namespace, {"metadata": {"labels": {"a": "b"}}}),
        "exec into a pod": lambda: core.connect_get_namespaced_pod_exec("x", namespace, command=["sh"]),
        "list nodes": lambda: core.list_node(),
        "list pods in kube-system": lambda: core.list_namespaced_pod("kube-system"),
        "list deployments": lambda: apps.list_namespaced_deployment(namespace),
        "create a service account": lambda: core.create_namespaced_service_account(
            namespace, {"metadata": {"name": "x"}}),
    }
    for what, call in forbidden.items():
        with pytest.raises(ApiException) as caught:
            call()
        assert caught.value.status == 403, what


def test_placement_liveness_and_backbones_are_read_from_the_watch_without_api_calls(release: Release, serving):
    backend = release.backend()
    instance = launch(backend, "pirate")
    rest = backend.core.api_client.rest_client
    requests: list[str] = []
    send = rest.request

    def counting(method, url, *args, **kwargs):
        requests.append(f"{method} {url}")
        return send(method, url, *args, **kwargs)

    rest.request = counting
    for _ in range(50):  # what the gateway asks per invocation and per planning tick
        assert backend.running_backbones()
        assert backend.agents.backbone_nodes(BACKBONE) == serving
        assert instance.alive()
        backend.daemon_socket(BACKBONE)
    assert requests == []
    added = release.add_agent(NODES[0], backbones="late")  # a new agent is seen by the watch, not by a call
    wait_until(lambda: "late" in backend.running_backbones(), f"agent {added} seen")
    assert requests == []
