"""`helm upgrade` keeps functions warm: the chart installed on the process kubelet's nodes (the helm end-to-end test's
cluster, `helm_cluster`), a function serving, then an upgrade that changes a value of the controller's pod: the old
controller stops (SIGTERM) and leaves the function's pod running, the new one adopts it. A client invoking all along
sees no failed request and no cold start: the same pod serves before and after.

The controller is one pod replaced with the Recreate strategy, so for a moment no gateway listens: the Service
refuses the connection (no ready endpoint) and the client sends the request again, as HTTP clients retry a refused
connection. That no refused request had reached a gateway is checked on the other side: the platform's usage counts
exactly the invocations the client saw answered, and every answer is a success.
"""

from __future__ import annotations

import threading
import time
from pathlib import Path

import httpx
from helm_env import BACKBONE, VALUES, helm_apply, install, shared_home  # noqa: F401
from k8s_env import wait_until
from test_k8s_helm_e2e import PROMPT, HelmCluster, helm_cluster  # noqa: F401

from lorafaas.platform.api_client import ApiClient


class Invoker(threading.Thread):
    """Invokes `function` back to back until stopped; records each answer (the pod that served it is in the
    usage) and every failure."""

    def __init__(self, url: str, key: str, function: str) -> None:
        super().__init__(daemon=True)
        self.url, self.key, self.function = url, key, function
        self.stopped = threading.Event()
        self.answered = 0
        self.refused = 0  # closed without an answer: no gateway took it (the usage says), sent again
        self.failures: list[str] = []

    def run(self) -> None:
        body = {"model": self.function, "prompt": PROMPT, "max_tokens": 4, "temperature": 0}
        headers = {"Authorization": f"Bearer {self.key}"}
        with httpx.Client(timeout=120) as client:
            while not self.stopped.is_set():
                try:
                    reply = client.post(f"{self.url}/v1/completions", json=body, headers=headers)
                except (httpx.ConnectError, httpx.ReadError, httpx.RemoteProtocolError):
                    self.refused += 1
                    time.sleep(0.2)
                    continue
                except httpx.HTTPError as exc:
                    self.failures.append(repr(exc))
                    continue
                if reply.status_code == 200 and reply.json()["choices"][0]["text"]:
                    self.answered += 1
                else:
                    self.failures.append(f"{reply.status_code} {reply.text[:300]}")


def test_helm_upgrade_leaves_function_pods_running_and_the_new_controller_adopts_them(
        helm_cluster: HelmCluster, shared_home: Path, tiny_dense_dir: Path, tiny_adapter_dir: Path, cli) -> None:  # noqa: F811
    cluster = helm_cluster
    installed = install(cluster, shared_home, cli, tiny_dense_dir)
    old = installed.controller
    with ApiClient(installed.url, installed.admin_key) as api:
        api.deploy({"name": "alpha", "backbone": BACKBONE, "keep_alive_s": 600}, tiny_adapter_dir)
        api.invoke("alpha", {"prompt": PROMPT, "max_tokens": 4})  # the one cold start
        [pod] = cluster.function_pods("alpha")
        before = api.usage()["total"]["cold_starts"]
        assert before == 1

        invoker = Invoker(installed.url, installed.admin_key, "alpha")
        invoker.start()
        wait_until(lambda: invoker.answered >= 3, "invocations answered before the upgrade", 60)
        helm_apply(cluster, {**VALUES, "controller": {**VALUES["controller"],
                                                      "podAnnotations": {"lorafaas.test/rev": "2"}}}, upgrade=True)
        wait_until(lambda: [p for p in cluster.ready("controller") if p.metadata.name != old.metadata.name],
                   "the upgraded controller ready", 180)
        answered = invoker.answered
        wait_until(lambda: invoker.answered >= answered + 5 or invoker.failures,
                   "invocations answered by the upgraded controller", 120)
        invoker.stopped.set()
        invoker.join(130)

        assert invoker.failures == []
        assert cluster.pod(old.metadata.name) is None or cluster.pod(old.metadata.name).metadata.deletion_timestamp
        [serving] = cluster.function_pods("alpha")
        assert serving.metadata.uid == pod.metadata.uid  # the same pod: never deleted, adopted
        description = api.describe("alpha")
        assert description["cold_starts"] == {}  # the new controller started nothing
        [instance] = description["instances"]
        assert instance["state"] == "ready"
        assert invoker.answered > answered
        # what the platform ran is what the client saw answered (+1: the first invocation): no request a gateway
        # took went unanswered (usage is stored in the background: awaited)
        wait_until(lambda: api.usage()["total"]["invocations"] >= invoker.answered + 1, "the usage stored", 30)
        total = api.usage()["total"]
        assert total["invocations"] == invoker.answered + 1
        assert total["cold_starts"] == before  # no invocation waited for a start
