"""A machine lost while its Node object stays: the chart on the process kubelet's three nodes (the helm end-to-end
test's `helm_cluster`), a function at `min_instances` 3, then one machine goes (its kubelet stops, and every process
of its pods with it) with its Node left in place and Ready, as the API server sees a node in its grace period. The
controller hears its node agent stop answering, takes the node out of placement and abandons a launch bound to it:
the function is back at its minimum on the other nodes well before the node lifecycle controller would react.
"""

from __future__ import annotations

from pathlib import Path

import openai
from helm_env import BACKBONE, install, shared_home  # noqa: F401
from k8s_env import wait_until
from test_k8s_helm_e2e import PROMPT, HelmCluster, helm_cluster, pod_ready  # noqa: F401

from lorafaas.platform.api_client import ApiClient

MIN_INSTANCES = 3
BACK_WITHIN_S = 30  # the node stays Ready 40 s (--node-monitor-grace-period); a launch on it waits 120 s


def node_ready(cluster: HelmCluster, name: str) -> bool:
    node = cluster.core.read_node(name)
    return any(c.type == "Ready" and c.status == "True" for c in node.status.conditions or [])


def test_a_lost_machine_whose_node_stays_ready_is_left_and_the_function_is_back_at_its_minimum(
        helm_cluster: HelmCluster, shared_home: Path, tiny_dense_dir: Path, tiny_adapter_dir: Path, cli) -> None:  # noqa: F811
    cluster = helm_cluster
    installed = install(cluster, shared_home, cli, tiny_dense_dir)
    keep = {installed.controller.spec.node_name, installed.redis.spec.node_name}

    def serving(away_from: str = "") -> list:
        return [p for p in cluster.function_pods("beta") if p.spec.node_name != away_from and pod_ready(p)]

    with ApiClient(installed.url, installed.admin_key) as api:
        api.deploy({"name": "beta", "backbone": BACKBONE, "min_instances": MIN_INSTANCES, "keep_alive_s": 600},
                   tiny_adapter_dir)
        pods = wait_until(lambda: len(serving()) >= MIN_INSTANCES and serving(), "beta at its minimum", 240,
                          explain=cluster.account)
        # a machine without the controller or Redis (their own recovery is not this test's)
        lost = next((p.spec.node_name for p in pods if p.spec.node_name not in keep), None)
        assert lost is not None, f"every instance on {keep}: {[p.spec.node_name for p in pods]}"

        cluster.kubelet.remove_node(lost, delete=False)
        wait_until(lambda: len(serving(away_from=lost)) >= MIN_INSTANCES, "beta back at its minimum elsewhere",
                   BACK_WITHIN_S, explain=cluster.account)
        assert node_ready(cluster, lost)  # the Node said nothing yet: the agent's silence was enough
        client = openai.OpenAI(base_url=f"{installed.url}/v1", api_key=installed.admin_key, max_retries=0)
        assert client.completions.create(model="beta", prompt=PROMPT, max_tokens=4, temperature=0).choices[0].text
