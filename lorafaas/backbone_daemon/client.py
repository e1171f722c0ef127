"""The one wrapper every caller uses to talk to a backbone daemon, and to start or stop one as a process.

    with DaemonClient.connect(paths.socket, client="fn-a") as daemon:
        attached = daemon.attach("fn-a")               # lease + manifest
        model = bind_backbone(attached.manifest, Path(attached.backbone.model_dir))

Blocking sockets (a function worker attaches once at start); every failure to reach the daemon is a
DaemonUnavailable, every error the daemon answers is re-raised as the same LorafaasError class it raised.
"""

from __future__ import annotations

import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import TypeVar

import msgspec

from lorafaas.backbone_daemon import messages as m
from lorafaas.backbone_daemon.config import DaemonConfig
from lorafaas.errors import DaemonUnavailable, ProtocolError
from lorafaas.wire import encode_frame, error_class, recv_message

T = TypeVar("T")
DEFAULT_TIMEOUT_S = 10.0


class DaemonClient:
    def __init__(self, sock: socket.socket, socket_path: Path, welcome: m.Welcome) -> None:
        self._sock = sock
        self.socket_path = socket_path
        self.welcome = welcome

    @classmethod
    def connect(cls, socket_path: Path, *, client: str = "", timeout_s: float = DEFAULT_TIMEOUT_S) -> DaemonClient:
        socket_path = Path(socket_path)
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.settimeout(timeout_s)
        try:
            sock.connect(str(socket_path))
        except (FileNotFoundError, ConnectionRefusedError) as exc:
            sock.close()
            raise DaemonUnavailable(f"no backbone daemon is listening at {socket_path} ({exc.strerror})") from exc
        except OSError as exc:
            sock.close()
            raise DaemonUnavailable(f"cannot connect to the backbone daemon at {socket_path}: {exc}") from exc
        client_ = cls(sock, socket_path, welcome=None)  # type: ignore[arg-type]
        try:
            client_.welcome = client_._call(m.Hello(protocol_version=m.PROTOCOL_VERSION, client=client), m.Welcome)
        except BaseException:
            sock.close()
            raise
        return client_

    def __enter__(self) -> DaemonClient:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def close(self) -> None:
        self._sock.close()

    def attach(self, function: str) -> m.Attached:
        return self._call(m.Attach(function=function), m.Attached)

    def heartbeat(self, lease_id: str) -> m.HeartbeatAck:
        return self._call(m.Heartbeat(lease_id=lease_id), m.HeartbeatAck)

    def detach(self, lease_id: str) -> m.Detached:
        return self._call(m.Detach(lease_id=lease_id), m.Detached)

    def status(self) -> m.DaemonStatus:
        return self._call(m.Status(), m.DaemonStatus)

    def shutdown(self, force: bool = False) -> m.ShuttingDown:
        return self._call(m.Shutdown(force=force), m.ShuttingDown)

    def _call(self, request: m.Request, expected: type[T]) -> T:
        try:
            self._sock.sendall(encode_frame(request))
            response = recv_message(self._sock, m.response_decoder)
        except OSError as exc:
            raise DaemonUnavailable(f"the backbone daemon at {self.socket_path} stopped answering: {exc}") from exc
        except (msgspec.DecodeError, msgspec.ValidationError, ValueError) as exc:
            raise ProtocolError(f"the backbone daemon at {self.socket_path} sent a malformed reply: {exc}") from exc
        if isinstance(response, m.ErrorReply):
            raise error_class(response.code)(response.message)
        if not isinstance(response, expected):
            raise ProtocolError(f"expected {expected.__name__} from the daemon, got {type(response).__name__}")
        return response


def spawn_daemon(config: DaemonConfig, *, timeout_s: float = 300.0, stderr=None) -> subprocess.Popen:
    """Start a daemon process for `config` and return it once it answers on its socket."""
    command = [
        sys.executable,
        "-m",
        "lorafaas.backbone_daemon",
        config.backbone,
        "--device",
        config.device,
        "--home",
        str(config.home),
        "--reap-interval",
        str(config.reap_interval_s),
    ]
    if config.lease_ttl_s is not None:
        command += ["--lease-ttl", str(config.lease_ttl_s)]
    process = subprocess.Popen(command, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=stderr)
    try:
        wait_until_ready(config.paths.socket, timeout_s, process)
    except BaseException:
        process.kill()
        process.wait()
        raise
    return process


def wait_until_ready(socket_path: Path, timeout_s: float, process: subprocess.Popen | None = None) -> m.DaemonStatus:
    """Poll until the daemon (of `process`, if given) answers Status; raise DaemonUnavailable on exit or timeout."""
    deadline = time.monotonic() + timeout_s
    while True:
        if process is not None and process.poll() is not None:
            raise DaemonUnavailable(f"the backbone daemon exited with code {process.returncode} before serving")
        try:
            with DaemonClient.connect(socket_path, timeout_s=5.0) as client:
                status = client.status()
            if process is None or status.daemon_pid == process.pid:
                return status
        except DaemonUnavailable:
            pass
        if time.monotonic() > deadline:
            raise DaemonUnavailable(f"no backbone daemon answered at {socket_path} within {timeout_s:.0f} s")
        time.sleep(0.05)


def stop_daemon(process: subprocess.Popen, socket_path: Path, *, force: bool = False, timeout_s: float = 30.0) -> int:
    """Ask the daemon to shut down (LeasesHeld unless forced or no leases), wait for it; SIGKILL after the timeout."""
    if process.poll() is None:
        with DaemonClient.connect(socket_path) as client:
            client.shutdown(force=force)
    try:
        return process.wait(timeout_s)
    except subprocess.TimeoutExpired:
        process.kill()
        return process.wait()
