"""A node agent's segment holder (on Kubernetes): it keeps a duplicate of each CPU backbone daemon's sealed segment
descriptor, as the local launcher does for the daemons it supervises, so that a daemon restarted after a crash adopts
the same copy instead of loading a second one; and it answers the controller's liveness probe.

The kubelet, not the holder, restarts a daemon's container, so the descriptor cannot be inherited (`--adopt-fd`):
the holder hands it over on a Unix socket beside the daemon's (`DaemonPaths.holder`), and a starting daemon that
finds the record of a killed predecessor but was given no descriptor asks there (`fetch_held_segment`); adoption.py
then checks it as it checks an inherited one. Every `interval_s` the holder asks each daemon for its segment
(`HoldSegment`) and keeps the newest: the same inode after an adoption, a new one after a reload. While a daemon is
down the holder keeps what it held.

Liveness: on `port` it answers every connection with `ok` and closes it. The controller probes it there, so that a
node whose agent stopped answering (the machine is gone, its Node object not yet) leaves placement at once
(lorafaas/platform/backends/node_agents.py).

    SegmentHolder([DaemonConfig(home, "smollm2-135m")], port=9100).serve()     # until stop()
"""

from __future__ import annotations

import contextlib
import logging
import os
import socket
import threading
from pathlib import Path

from lorafaas.errors import LorafaasError
from lorafaas.protocols.daemon_client import DaemonClient
from lorafaas.protocols.daemon_config import DaemonConfig

log = logging.getLogger(__name__)

HELD = b"1"  # a descriptor follows (SCM_RIGHTS)
NOTHING_HELD = b"0"
ALIVE = b"ok\n"


class SegmentHolder:
    def __init__(self, configs: list[DaemonConfig], port: int | None = None, interval_s: float = 1.0) -> None:
        self.configs = [c for c in configs if c.device == "cpu"]  # a GPU daemon's bound instances restart instead
        self.port = port
        self.interval_s = interval_s
        self._held: dict[str, int] = {}  # backbone -> our duplicate of its daemon's segment
        self._lock = threading.Lock()
        self._stopped = threading.Event()
        self._listeners: list[socket.socket] = []

    def serve(self) -> None:
        """Listen (the hand-over sockets, the liveness port), then hold the segments until `stop()`."""
        for config in self.configs:
            path = config.paths.holder
            path.parent.mkdir(parents=True, exist_ok=True)
            path.unlink(missing_ok=True)  # a killed holder's
            listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            listener.bind(str(path))
            os.chmod(path, 0o600)  # the daemons run as the holder's user
            self._listen(listener, lambda conn, backbone=config.backbone: self._hand_over(conn, backbone))
        if self.port is not None:
            self._listen(socket.create_server(("0.0.0.0", self.port)), lambda conn: conn.sendall(ALIVE))
        log.info("segment holder %d: holding the segments of %s%s", os.getpid(),
                 ", ".join(c.backbone for c in self.configs) or "no CPU daemon",
                 f"; answering on port {self.port}" if self.port is not None else "")
        while not self._stopped.is_set():
            for config in self.configs:
                self._refresh(config)
            self._stopped.wait(self.interval_s)

    def stop(self) -> None:
        self._stopped.set()
        for listener in self._listeners:
            with contextlib.suppress(OSError):
                listener.shutdown(socket.SHUT_RDWR)
            listener.close()
        with self._lock:
            held, self._held = list(self._held.values()), {}
        for fd in held:
            os.close(fd)
        for config in self.configs:
            config.paths.holder.unlink(missing_ok=True)

    def held_inode(self, backbone: str) -> int | None:
        with self._lock:
            fd = self._held.get(backbone)
            return os.fstat(fd).st_ino if fd is not None else None

    def _refresh(self, config: DaemonConfig) -> None:
        try:
            with DaemonClient.connect(config.paths.socket, timeout_s=2.0) as client:
                _manifest, fd = client.hold_segment()
        except (LorafaasError, OSError):
            return  # not serving (starting, or restarting): keep what we hold
        with self._lock:
            old = self._held.get(config.backbone)
            if old is not None and os.fstat(old).st_ino == os.fstat(fd).st_ino:
                os.close(fd)  # the same segment (adopted): keep the one we have
                return
            self._held[config.backbone] = fd
        if old is not None:
            os.close(old)
        log.info("segment holder %d: holding the segment of %s (inode %d)", os.getpid(), config.backbone,
                 os.fstat(fd).st_ino)

    def _hand_over(self, conn: socket.socket, backbone: str) -> None:
        with self._lock:
            fd = self._held.get(backbone)
            if fd is None:
                conn.sendall(NOTHING_HELD)
            else:
                socket.send_fds(conn, [HELD], [fd])  # under the lock: a refresh cannot close it meanwhile

    def _listen(self, listener: socket.socket, answer) -> None:
        listener.listen(16)
        self._listeners.append(listener)

        def accept_forever() -> None:
            while not self._stopped.is_set():
                try:
                    conn, _ = listener.accept()
                except OSError:
                    return  # closed by stop()
                with conn, contextlib.suppress(OSError):
                    conn.settimeout(2.0)
                    answer(conn)

        threading.Thread(target=accept_forever, name="segment-holder", daemon=True).start()


def fetch_held_segment(path: Path, timeout_s: float = 2.0) -> int | None:
    """The segment descriptor a holder keeps at `path` (the caller owns it), or None: no holder, or nothing held."""
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
            sock.settimeout(timeout_s)
            sock.connect(str(path))
            message, fds, _flags, _address = socket.recv_fds(sock, 1, 1)
    except OSError:
        return None
    if message == HELD and len(fds) == 1:
        return fds[0]
    for fd in fds:
        os.close(fd)
    return None
