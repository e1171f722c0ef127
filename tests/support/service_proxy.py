"""Services for the process kubelet's pods: what kube-proxy and the cluster DNS do, for TCP.

Each Service gets a virtual address on the host (its ClusterIP; a headless Service, which real DNS would answer with
its pods' IPs, a stand-in address of the pod network) and, for each of its ports, a TCP forwarder there that connects
every accepted connection to one ready endpoint (from the Endpoints object the endpoints controller maintains,
round robin), as kube-proxy does. Names resolve through a per-pod `/etc/hosts` (`svc`, `svc.ns`, `svc.ns.svc`,
`svc.ns.svc.cluster.local`), rewritten in place whenever Services change, since the file is bind-mounted into the pod.
The `kubernetes` Service forwards to the API server `api` talks to (its Endpoints stay empty here: the API server
advertises 127.0.0.1, which Endpoints may not hold), so in-cluster configuration works as in a real pod.
"""

from __future__ import annotations

import asyncio
import ipaddress
import itertools
import logging
import threading
import urllib.parse
from dataclasses import dataclass
from pathlib import Path

from kubernetes import client as k8s

from lorafaas.platform.backends.pod_cache import Reflector
from tests.support.pod_network import PodNetwork

log = logging.getLogger(__name__)

CLUSTER_DOMAIN = "cluster.local"
KUBERNETES = ("default", "kubernetes")


@dataclass
class HostsFile:
    path: Path
    namespace: str
    pod_name: str
    pod_ip: str


class ServiceProxy:
    def __init__(self, api: k8s.ApiClient, network: PodNetwork, work_dir: Path) -> None:
        self.core = k8s.CoreV1Api(api)
        server = urllib.parse.urlsplit(api.configuration.host)
        self.api_server = (server.hostname, server.port or 443)
        self.network = network
        self.work_dir = Path(work_dir)
        self.addresses: dict[tuple[str, str], str] = {}  # (namespace, service) -> virtual address
        self._ports: dict[tuple[str, str], list[k8s.V1ServicePort]] = {}
        self._endpoints: dict[tuple[str, str], k8s.V1Endpoints] = {}
        self._servers: dict[tuple[str, int], asyncio.AbstractServer] = {}
        self._hosts: dict[str, HostsFile] = {}  # by pod uid
        self._open: set[asyncio.StreamWriter] = set()  # both ends of every connection being forwarded
        self._stand_ins = itertools.count(network.subnet.num_addresses - 2, -1)  # headless: from the top down
        self._round_robin = itertools.count()
        self._lock = threading.RLock()
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="service-proxy", daemon=True)
        self._services = Reflector("proxy services", self.core.list_service_for_all_namespaces,
                                   on_list=self._on_services, on_event=self._on_service)
        self._endpoint_watch = Reflector("proxy endpoints", self.core.list_endpoints_for_all_namespaces,
                                         on_list=self._on_endpoints_list, on_event=self._on_endpoints)

    def start(self, timeout_s: float = 30.0) -> None:
        self._thread.start()
        for reflector in (self._endpoint_watch, self._services):
            reflector.start()
            if not reflector.synced.wait(timeout_s):
                raise TimeoutError(f"{reflector.name}: could not list")

    def stop(self) -> None:
        self._services.stop()
        self._endpoint_watch.stop()
        if self._thread.is_alive():
            asyncio.run_coroutine_threadsafe(self._close(), self._loop).result(10)
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(5)
        self._loop.close()

    async def _close(self) -> None:
        """The listeners, then the connections still open (their pipes end at once)."""
        for server in self._servers.values():
            server.close()
        for writer in list(self._open):
            writer.transport.abort()
        tasks = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
        if tasks:
            await asyncio.wait(tasks, timeout=5)

    def kubernetes_service(self) -> tuple[str, int]:
        """Where a pod finds the API server: KUBERNETES_SERVICE_HOST and _PORT."""
        with self._lock:
            return self.addresses[KUBERNETES], self._ports[KUBERNETES][0].port

    # -- /etc/hosts ----------------------------------------------------------------------------------------------------

    def hosts_file(self, uid: str, namespace: str, pod_name: str, pod_ip: str) -> Path:
        """The pod's /etc/hosts, kept current until `forget(uid)`."""
        entry = HostsFile(self.work_dir / f"hosts-{uid}", namespace, pod_name, pod_ip)
        entry.path.touch()
        with self._lock:
            self._hosts[uid] = entry
            self._write(entry)
        return entry.path

    def forget(self, uid: str) -> None:
        with self._lock:
            entry = self._hosts.pop(uid, None)
        if entry is not None:
            entry.path.unlink(missing_ok=True)

    def _write(self, entry: HostsFile) -> None:
        lines = ["127.0.0.1\tlocalhost", "::1\tlocalhost ip6-localhost ip6-loopback",
                 f"{entry.pod_ip}\t{entry.pod_name}"]
        for (namespace, name), address in sorted(self.addresses.items()):
            names = [f"{name}.{namespace}", f"{name}.{namespace}.svc", f"{name}.{namespace}.svc.{CLUSTER_DOMAIN}"]
            lines.append("\t".join([address, *([name] if namespace == entry.namespace else []), *names]))
        with open(entry.path, "r+") as handle:  # in place: the pod's bind mount holds this inode
            handle.truncate()
            handle.write("\n".join(lines) + "\n")

    # -- services ------------------------------------------------------------------------------------------------------

    def _on_services(self, services: list[k8s.V1Service]) -> None:
        for service in services:
            self._on_service("ADDED", service)

    def _on_service(self, kind: str, service: k8s.V1Service) -> None:
        key = (service.metadata.namespace, service.metadata.name)
        if kind == "DELETED":
            with self._lock:
                address = self.addresses.pop(key, None)
                ports = self._ports.pop(key, [])
            for port in ports:
                server = self._servers.pop((address, port.port), None)
                if server is not None:
                    self._loop.call_soon_threadsafe(server.close)
            self._rewrite_hosts()
            return
        if service.spec.type == "ExternalName":
            return
        with self._lock:
            address = self.addresses.get(key)
            if address is None:
                address = service.spec.cluster_ip
                if not address or address == "None":
                    address = str(self.network.subnet.network_address + next(self._stand_ins))
                self.network.add_address(address)
                self.addresses[key] = address
            self._ports[key] = [p for p in service.spec.ports or [] if (p.protocol or "TCP") == "TCP"]
            new = [p.port for p in self._ports[key] if (address, p.port) not in self._servers]
        for port in new:
            future = asyncio.run_coroutine_threadsafe(self._listen(key, address, port), self._loop)
            self._servers[(address, port)] = future.result(10)
        self._rewrite_hosts()

    def _rewrite_hosts(self) -> None:
        with self._lock:
            for entry in self._hosts.values():
                self._write(entry)

    def _on_endpoints_list(self, items: list[k8s.V1Endpoints]) -> None:
        with self._lock:
            self._endpoints = {(e.metadata.namespace, e.metadata.name): e for e in items}

    def _on_endpoints(self, kind: str, endpoints: k8s.V1Endpoints) -> None:
        key = (endpoints.metadata.namespace, endpoints.metadata.name)
        with self._lock:
            if kind == "DELETED":
                self._endpoints.pop(key, None)
            else:
                self._endpoints[key] = endpoints

    # -- forwarding ----------------------------------------------------------------------------------------------------

    def endpoint(self, key: tuple[str, str], port: int) -> tuple[str, int] | None:
        """A ready endpoint of the Service's `port`: (pod IP, target port), or None."""
        with self._lock:
            service_port = next((p for p in self._ports.get(key, []) if p.port == port), None)
            endpoints = self._endpoints.get(key)
        if key == KUBERNETES and service_port is not None:
            return self.api_server
        if service_port is None or endpoints is None:
            return None
        choices = []
        for subset in endpoints.subsets or []:
            target = next((p.port for p in subset.ports or []
                           if p.name == service_port.name or len(subset.ports) == 1), None)
            if target is not None:
                choices += [(address.ip, target) for address in subset.addresses or []]
        return choices[next(self._round_robin) % len(choices)] if choices else None

    async def _listen(self, key: tuple[str, str], address: str, port: int) -> asyncio.AbstractServer:
        async def connect(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            target = self.endpoint(key, port)
            if target is None:  # no ready endpoint: refused, as kube-proxy's REJECT rule does
                log.info("service %s/%s:%d has no ready endpoint", *key, port)
                writer.close()
                return
            try:
                upstream_reader, upstream_writer = await asyncio.open_connection(*target)
            except OSError as exc:
                log.info("service %s/%s:%d: %s:%d refused (%s)", *key, port, *target, exc)
                writer.close()
                return
            self._open |= {writer, upstream_writer}
            try:
                await asyncio.gather(_pipe(reader, upstream_writer), _pipe(upstream_reader, writer))
            finally:
                self._open -= {writer, upstream_writer}
                for end in (writer, upstream_writer):
                    end.close()

        ipaddress.ip_address(address)  # a malformed address fails here, not inside the loop
        return await asyncio.start_server(connect, address, port)


async def _pipe(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    """One direction, until its end of file, which is passed on (a half close, as TCP allows). A reset is passed on
    as a reset, as it reaches the client through kube-proxy's NAT: a client whose gateway reset the connection must
    not wait on the proxy's other half for an answer that cannot come."""
    try:
        while data := await reader.read(65536):
            writer.write(data)
            await writer.drain()
        if writer.can_write_eof():
            writer.write_eof()
    except OSError:
        writer.transport.abort()
