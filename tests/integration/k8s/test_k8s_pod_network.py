"""The process kubelet's pod network: a pod that goes must not cut the others off from the host (where the Service
proxy listens), as it did when the bridge took the lowest MAC address of its ports and changed it whenever the port
holding it left, leaving every other pod's ARP entry for the gateway pointing nowhere for seconds."""

from __future__ import annotations

import socket
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from k8s_env import require_process_kubelet

from tests.support.pod_network import PodNetwork, ip

CONNECT = "import socket, sys; socket.create_connection((sys.argv[1], int(sys.argv[2])), timeout=2).close()"


@pytest.fixture
def network() -> Iterator[PodNetwork]:
    require_process_kubelet()
    network = PodNetwork()
    network.start()
    yield network
    network.close()


def bridge_mac(network: PodNetwork) -> str:
    return Path(f"/sys/class/net/{network.bridge}/address").read_text().strip()


def connects(network: PodNetwork, uid: str, host: str, port: int) -> bool:
    """Whether a process in the pod's network namespace reaches host:port within 2 s."""
    name = Path(network.netns_path(uid)).name
    done = subprocess.run(["ip", "netns", "exec", name, sys.executable, "-c", CONNECT, host, str(port)],
                          capture_output=True, text=True, timeout=30)
    return done.returncode == 0


def test_a_pod_leaving_the_bridge_leaves_the_others_reaching_the_host(network: PodNetwork) -> None:
    mac = bridge_mac(network)
    with socket.create_server((network.gateway, 0)) as server:  # where Service proxies listen: on the host
        port = server.getsockname()[1]
        network.add_pod("leaves", 1)
        # the leaving pod's port gets the lowest address a port could have: a bridge that follows its ports' MACs
        # takes it as its own now, and gives it up when the pod goes
        [leaving_port] = [p.name for p in Path(f"/sys/class/net/{network.bridge}/brif").iterdir()]
        ip("link", "set", leaving_port, "address", "02:00:00:00:00:01")
        network.add_pod("stays", 2)
        assert connects(network, "stays", network.gateway, port)  # its ARP cache now holds the bridge's MAC
        network.remove_pod("leaves")
        assert connects(network, "stays", network.gateway, port)
        assert bridge_mac(network) == mac
