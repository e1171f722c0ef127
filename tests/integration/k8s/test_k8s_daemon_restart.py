"""A backbone daemon killed on Kubernetes comes back with the same copy of the weights: the chart on the process
kubelet's nodes (the helm end-to-end test's `helm_cluster`), a function serving, then its node's daemon SIGKILLed. The
kubelet restarts the container and hands it nothing; the node agent's holder (another container of the pod) kept the
segment's descriptor and hands it over, so the restarted daemon maps the same memfd (one copy in memory, not two)
and the function keeps answering from the same pod.
"""

from __future__ import annotations

import contextlib
import os
import signal
from pathlib import Path

from helm_env import BACKBONE, install, shared_home  # noqa: F401
from k8s_env import wait_until
from test_k8s_helm_e2e import PROMPT, HelmCluster, helm_cluster  # noqa: F401

from lorafaas.platform.api_client import ApiClient

CONTAINER = f"daemon-{BACKBONE}"


def process_tree(pid: int) -> list[int]:
    """`pid` and its descendants: a container's process is the child of its PID namespace's `unshare`."""
    tree, todo = [], [pid]
    while todo:
        tree.append(current := todo.pop())
        with contextlib.suppress(FileNotFoundError, ProcessLookupError):
            for task in Path(f"/proc/{current}/task").iterdir():
                todo += [int(child) for child in (task / "children").read_text().split()]
    return tree


def segment_inodes(pid: int) -> set[int]:
    """The inodes of the backbone segments (memfds) the container process `pid` (or its children) has open."""
    inodes = set()
    for process in process_tree(pid):
        with contextlib.suppress(FileNotFoundError):  # the process is gone
            for fd in Path(f"/proc/{process}/fd").iterdir():
                with contextlib.suppress(FileNotFoundError):
                    link = os.readlink(fd)
                    if link.startswith("/memfd:lorafaas-") and f".{BACKBONE}.cpu." in link:
                        inodes.add(os.stat(fd).st_ino)
    return inodes


def test_a_daemon_killed_on_a_node_is_restarted_by_the_kubelet_and_maps_the_same_segment(
        helm_cluster: HelmCluster, shared_home: Path, tiny_dense_dir: Path, tiny_adapter_dir: Path, cli) -> None:  # noqa: F811
    cluster, runtime = helm_cluster, helm_cluster.runtime
    installed = install(cluster, shared_home, cli, tiny_dense_dir)
    with ApiClient(installed.url, installed.admin_key) as api:
        api.deploy({"name": "alpha", "backbone": BACKBONE, "keep_alive_s": 600}, tiny_adapter_dir)
        first = api.invoke("alpha", {"prompt": PROMPT, "max_tokens": 4})
        [pod] = cluster.function_pods("alpha")
        [agent] = [p for p in cluster.ready("node-agent") if p.spec.node_name == pod.spec.node_name]
        killed = runtime.pids(agent.metadata.uid)[CONTAINER]
        [inode] = wait_until(lambda: segment_inodes(killed), "the daemon's segment", 60)
        holder = runtime.pids(agent.metadata.uid).get("holder")
        if holder is not None:  # (a chart without one: the restarted daemon has nothing to adopt)
            wait_until(lambda: inode in segment_inodes(holder), "the holder holding the segment", 60)

        os.killpg(killed, signal.SIGKILL)
        restarted = wait_until(lambda: (pid := runtime.pids(agent.metadata.uid).get(CONTAINER)) != killed and pid,
                               "the daemon restarted by the kubelet", 60)
        assert wait_until(lambda: segment_inodes(restarted), "the restarted daemon's segment", 120) == {inode}
        wait_until(lambda: agent.metadata.name in [p.metadata.name for p in cluster.ready("node-agent")],
                   "the agent ready again", 60)
        assert api.invoke("alpha", {"prompt": PROMPT, "max_tokens": 4})["text"] == first["text"]
        [same] = cluster.function_pods("alpha")
        assert same.metadata.uid == pod.metadata.uid
