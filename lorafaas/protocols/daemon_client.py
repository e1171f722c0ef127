"""The one wrapper every caller uses to talk to a backbone daemon, and to start or stop one as a process.

    with DaemonClient.connect(paths.socket, client="fn-a") as daemon:
        attached = daemon.attach("fn-a")               # lease + manifest + the sealed segment's descriptor
        model = bind_backbone(attached.map(), Path(attached.backbone.model_dir))   # maps it read-only, closes the fd

Blocking sockets (a function worker attaches once at start); every failure to reach the daemon is a
DaemonUnavailable, every error the daemon answers is re-raised as the same LorafaasError class it raised.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TypeVar

import msgspec

from lorafaas import cuda_ipc
from lorafaas.errors import DaemonUnavailable, ProtocolError, SegmentError
from lorafaas.protocols import daemon_messages as m
from lorafaas.protocols.daemon_config import DaemonConfig
from lorafaas.protocols.fdpass import close_fds, recv_with_fds
from lorafaas.protocols.priority import DAEMON_NICENESS, child_env
from lorafaas.wire import encode_frame, error_class

T = TypeVar("T")
DEFAULT_TIMEOUT_S = 10.0


@dataclass
class AttachedLease:
    """A lease, the segment's manifest and its descriptor (`segment_fd`, owned here until `map` or `close_fd`)."""

    attached: m.Attached
    segment_fd: int | None

    @property
    def lease_id(self) -> str:
        return self.attached.lease_id

    @property
    def manifest(self) -> cuda_ipc.SegmentManifest:
        return self.attached.manifest

    @property
    def backbone(self) -> m.BackboneInfo:
        return self.attached.backbone

    @property
    def lease_ttl_s(self) -> float | None:
        return self.attached.lease_ttl_s

    def map(self) -> cuda_ipc.Attachment:
        """Map the segment read-only and close the descriptor (the mapping keeps the segment alive)."""
        if self.segment_fd is None:
            raise SegmentError(f"the descriptor of lease {self.lease_id} was closed already")
        try:
            return cuda_ipc.attach(self.manifest, self.segment_fd)
        finally:
            self.close_fd()

    def close_fd(self) -> None:
        if self.segment_fd is not None:
            os.close(self.segment_fd)
            self.segment_fd = None


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

    def attach(self, function: str) -> AttachedLease:
        attached, fds = self._call_with_fds(m.Attach(function=function), m.Attached)
        return AttachedLease(attached, fds[0])

    def hold_segment(self) -> tuple[cuda_ipc.SegmentManifest, int]:
        """A duplicate of the sealed segment's descriptor (the caller owns it), for a supervisor to keep."""
        held, fds = self._call_with_fds(m.HoldSegment(), m.SegmentHeld)
        return held.manifest, fds[0]

    def heartbeat(self, lease_id: str) -> m.HeartbeatAck:
        return self._call(m.Heartbeat(lease_id=lease_id), m.HeartbeatAck)

    def detach(self, lease_id: str) -> m.Detached:
        return self._call(m.Detach(lease_id=lease_id), m.Detached)

    def status(self) -> m.DaemonStatus:
        return self._call(m.Status(), m.DaemonStatus)

    def shutdown(self, force: bool = False) -> m.ShuttingDown:
        return self._call(m.Shutdown(force=force), m.ShuttingDown)

    def _call(self, request: m.Request, expected: type[T]) -> T:
        return self._call_with_fds(request, expected, num_fds=0)[0]

    def _call_with_fds(self, request: m.Request, expected: type[T], num_fds: int = 1) -> tuple[T, list[int]]:
        """Send `request`; the reply of type `expected` and exactly `num_fds` descriptors with it (owned by the
        caller), or the daemon's error raised as its class."""
        try:
            self._sock.sendall(encode_frame(request))
            response, fds = recv_with_fds(self._sock, m.response_decoder)
        except OSError as exc:
            raise DaemonUnavailable(f"the backbone daemon at {self.socket_path} stopped answering: {exc}") from exc
        except (msgspec.DecodeError, msgspec.ValidationError, ValueError) as exc:
            raise ProtocolError(f"the backbone daemon at {self.socket_path} sent a malformed reply: {exc}") from exc
        if isinstance(response, m.ErrorReply) or not isinstance(response, expected) or len(fds) != num_fds:
            close_fds(fds)
            if isinstance(response, m.ErrorReply):
                raise error_class(response.code)(response.message)
            raise ProtocolError(
                f"expected {expected.__name__} with {num_fds} descriptor(s) from the daemon, got "
                f"{type(response).__name__} with {len(fds)}"
            )
        return response, fds


def spawn_daemon(
    config: DaemonConfig, *, timeout_s: float = 300.0, stderr=None, adopt_fd: int | None = None
) -> subprocess.Popen:
    """Start a daemon process for `config` and return it once it answers on its socket.

    `adopt_fd`: the sealed segment of a daemon that died (kept by the supervisor); the new daemon adopts it instead
    of loading the backbone again, if its record still describes it. A daemon that fails to start reports its error
    over a pipe: it is raised here as the daemon raised it (e.g. InsufficientMemory, 507), else DaemonUnavailable.
    """
    status_read, status_write = os.pipe()
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
        "--status-fd",
        str(status_write),
    ]
    if config.lease_ttl_s is not None:
        command += ["--lease-ttl", str(config.lease_ttl_s)]
    if config.cpu_linear is not None:
        command += ["--cpu-linear", config.cpu_linear]
    pass_fds = [status_write]
    if adopt_fd is not None:
        command += ["--adopt-fd", str(adopt_fd)]
        pass_fds.append(adopt_fd)
    try:
        process = subprocess.Popen(
            command, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=stderr, pass_fds=pass_fds,
            env=child_env(DAEMON_NICENESS),
        )
    finally:
        os.close(status_write)
    try:
        try:
            wait_until_ready(config.paths.socket, timeout_s, process)
        except DaemonUnavailable:
            if process.poll() is not None:
                _raise_reported_error(status_read)
            raise
    except BaseException:
        process.kill()
        process.wait()
        raise
    finally:
        os.close(status_read)
    return process


def _raise_reported_error(status_read: int) -> None:
    """Raise the error a daemon that exited reported on its status pipe, if it reported one."""
    data = b""
    while chunk := os.read(status_read, 1 << 16):
        data += chunk
    if not data:
        return
    try:
        reply = msgspec.msgpack.decode(data, type=m.ErrorReply)
    except (msgspec.DecodeError, msgspec.ValidationError):
        return
    raise error_class(reply.code)(reply.message)


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
        try:
            with DaemonClient.connect(socket_path) as client:
                client.shutdown(force=force)
        except DaemonUnavailable:
            pass  # its socket is gone: it is shutting down already (Ctrl-C reaches the whole process group)
    try:
        return process.wait(timeout_s)
    except subprocess.TimeoutExpired:
        process.kill()
        return process.wait()
