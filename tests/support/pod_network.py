"""Pod networking for the process kubelet: a network namespace per pod on a bridge of its own, as a CNI bridge plugin
makes it.

    host   bridge lf-XXXX  10.N.0.1/16   (+ each Service's virtual address, /32, where the service proxy listens)
    pod    netns  lf-XXXX-K  eth0 10.N.<node>.<k>/16, lo, default route via 10.N.0.1

Every pod has its own loopback and ports (two pods both listen on 0.0.0.0:9000), reaches the others on the bridge and
the Services through the host (`tests.support.service_proxy`); the host reaches every pod IP. N is drawn at random
from the 10.200-10.249 that no route of this machine uses yet; names carry the same random tag. Needs root
(CAP_NET_ADMIN) and `ip` (iproute2). Nothing is forwarded or NATed: pods reach nothing beyond this machine.
"""

from __future__ import annotations

import ipaddress
import logging
import secrets
import subprocess
import threading

log = logging.getLogger(__name__)


def ip(*args: str) -> None:
    """`ip ARGS`; a failure raises OSError with ip's message (the kubelet reports it as the pod's error)."""
    result = subprocess.run(["ip", *args], capture_output=True, text=True)
    if result.returncode != 0:
        raise OSError(f"ip {' '.join(args)}: {result.stderr.strip()}")


def free_subnet() -> ipaddress.IPv4Network:
    """A 10.N.0.0/16 (N in 200-249) that no route of this machine overlaps: a bridge left by a killed run keeps its
    subnet's route, and a new bridge on the same subnet would lose its pods' traffic to the stale one."""
    routes = subprocess.run(["ip", "-4", "route", "show"], capture_output=True, text=True, check=True).stdout
    used = [ipaddress.ip_network(line.split()[0], strict=False) for line in routes.splitlines() if line[:1].isdigit()]
    free = [subnet for subnet in (ipaddress.IPv4Network(f"10.{n}.0.0/16") for n in range(200, 250))
            if not any(subnet.overlaps(route) for route in used)]
    if not free:
        raise OSError("no free 10.200-249.0.0/16 for a pod network: remove the lf-* bridges of earlier runs")
    return free[secrets.randbelow(len(free))]


class PodNetwork:
    def __init__(self) -> None:
        self.tag = secrets.token_hex(2)
        self.bridge = f"lf-{self.tag}"
        self.subnet = free_subnet()
        self.gateway = str(self.subnet.network_address + 1)
        self._next: dict[int, int] = {}  # node index -> last host number used
        self._namespaces: dict[str, str] = {}  # pod uid -> netns name
        self._addresses: set[str] = set()
        self._count = 0
        self._lock = threading.Lock()
        self._up = False

    def start(self) -> None:
        ip("link", "add", self.bridge, "type", "bridge")
        self._up = True
        # Pin the bridge's MAC: left to itself it takes its ports' lowest and changes when that port's pod goes,
        # and every other pod's ARP entry for the gateway then points nowhere for seconds (connects time out).
        with open(f"/sys/class/net/{self.bridge}/address") as handle:
            ip("link", "set", self.bridge, "address", handle.read().strip())
        ip("addr", "add", f"{self.gateway}/{self.subnet.prefixlen}", "dev", self.bridge)
        ip("link", "set", self.bridge, "up")
        log.info("pod network %s on bridge %s", self.subnet, self.bridge)

    def close(self) -> None:
        for uid in list(self._namespaces):
            self.remove_pod(uid)
        if self._up:
            ip("link", "del", self.bridge)
            self._up = False

    def netns_path(self, uid: str) -> str:
        with self._lock:
            name = self._namespaces.get(uid)
        if name is None:
            raise OSError(f"pod {uid} has no network namespace (stopped)")
        return f"/run/netns/{name}"

    def add_pod(self, uid: str, node_index: int) -> str:
        """A network namespace for the pod, wired to the bridge; returns its IP."""
        with self._lock:
            n = self._next.get(node_index, 1) + 1
            if n > 254:
                raise OSError(f"node {node_index} has no pod address left in {self.subnet}")
            self._next[node_index] = n
            self._count += 1
            name, host_end = f"{self.bridge}-{self._count}", f"v{self.tag}-{self._count}"
            self._namespaces[uid] = name
        pod_ip = str(self.subnet.network_address + node_index * 256 + n)
        ip("netns", "add", name)
        ip("link", "add", host_end, "type", "veth", "peer", "name", "eth0", "netns", name)
        ip("link", "set", host_end, "master", self.bridge, "up")
        ip("-n", name, "addr", "add", f"{pod_ip}/{self.subnet.prefixlen}", "dev", "eth0")
        ip("-n", name, "link", "set", "eth0", "up")
        ip("-n", name, "link", "set", "lo", "up")
        ip("-n", name, "route", "add", "default", "via", self.gateway)
        return pod_ip

    def remove_pod(self, uid: str) -> None:
        """The namespace goes, and its veth pair with it."""
        with self._lock:
            name = self._namespaces.pop(uid, None)
        if name is not None:
            try:
                ip("netns", "del", name)
            except OSError as exc:
                log.warning("pod network: %s", exc)

    def add_address(self, address: str) -> None:
        """A Service's virtual address on the host, reached by pods through their default route."""
        with self._lock:
            if address in self._addresses:
                return
            self._addresses.add(address)
        ip("addr", "add", f"{address}/32", "dev", self.bridge)
