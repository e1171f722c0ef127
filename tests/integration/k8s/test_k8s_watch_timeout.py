"""The pod watch survives a half-open connection: the backend reaches the real API server through a TCP proxy whose
connections are then stalled (no byte passes, none is closed), and the pod cache still catches up with a change made
meanwhile, because every list and watch call carries a client-side timeout and the reflector lists again after it."""

from __future__ import annotations

from k8s_env import NODES, RELEASE, SERVICE_ACCOUNT, TEMPLATE, Release, wait_until
from kubernetes import client as k8s

from lorafaas.platform.backends.kubernetes import KubernetesBackend, KubernetesConfig
from lorafaas.testing.slow_proxy import SlowProxy

WATCH_TIMEOUT_S = 2  # the server ends each watch after this; the client gives up on a silent one a few seconds later


def test_a_stalled_watch_connection_times_out_and_the_cache_lists_again(release: Release) -> None:
    first = release.add_agent(NODES[0])
    proxy = SlowProxy(release.plane.port)
    api = release.plane.api_client(release.plane.service_account_token(release.namespace, SERVICE_ACCOUNT))
    api.configuration.host = f"https://127.0.0.1:{proxy.port}"
    backend = KubernetesBackend(KubernetesConfig(namespace=release.namespace, release=RELEASE, pod_template=TEMPLATE,
                                                 home=release.home, watch_timeout_s=WATCH_TIMEOUT_S),
                                core=k8s.CoreV1Api(api))
    release.backends.append(backend)
    try:
        backend.start()
        assert backend.cache.get(first) is not None
        stalled = proxy.stall()  # the watch's connection among them: from now on it is silent, and never closed
        assert stalled
        second = release.add_agent(NODES[1])  # a change the stalled watch cannot deliver
        wait_until(lambda: backend.cache.get(second) is not None, "the pod cache to see the second agent",
                   timeout_s=60)
        assert any(c.closed_by_client.is_set() for c in stalled), "the client never gave up a stalled connection"
        third = release.add_agent(NODES[2])  # and it follows again: the new watch delivers this one
        wait_until(lambda: backend.cache.get(third) is not None, "the pod cache to see the third agent",
                   timeout_s=60)
    finally:
        backend.stop()
        proxy.close()
