"""A backbone daemon's settings and the places it owns: socket, lock file and shared-memory segment names.

One daemon per (home, backbone, device). Its lock file (held with flock for the daemon's life, released by the kernel
even on SIGKILL) says who owns the pair; its segment (a memfd, no file anywhere) is labelled with the home, backbone,
device and owner pid:

    /memfd:lorafaas-<home tag>.<backbone>.<device>.<pid>      (as /proc/PID/maps shows it)

Earlier versions kept segments as files of that name in /dev/shm; a starting daemon still removes those of dead
owners. Next to the lock, the daemon keeps a record of its sealed segment and its leases (`<stem>.segment`), so that
a successor handed the segment's descriptor can adopt it instead of loading a second copy.
"""

from __future__ import annotations

import hashlib
import os
import tempfile
from dataclasses import dataclass
from pathlib import Path

from lorafaas.cuda_ipc import check_device
from lorafaas.errors import InvalidInput
from lorafaas.formats.model_store import check_name

SEGMENT_PREFIX = "lorafaas-"
MAX_SOCKET_PATH_BYTES = 107  # sun_path holds 108 bytes, the terminating NUL included
# The kernel of a backbone's linear products on a CPU: "auto" packs the weights for oneDNN in the segment where this
# torch can (lorafaas/models/packed_weights.py), else measures torch's BLAS against oneDNN on the plain layout
# (lorafaas/models/cpu_linear.py); "packed" is auto's first choice; "torch" or "onednn" computes from the plain layout.
CPU_LINEAR_SETTINGS = ("auto", "packed", "torch", "onednn")
PACKING_SETTINGS = ("auto", "packed")
CPU_LINEAR_ENV = "LORAFAAS_CPU_LINEAR"  # the daemon's default for --cpu-linear


@dataclass(frozen=True)
class DaemonConfig:
    home: Path
    backbone: str
    device: str = "cpu"
    # A lease not renewed by a heartbeat within this many seconds is reaped; None: leases live as long as their pid.
    lease_ttl_s: float | None = None
    reap_interval_s: float = 0.5
    # A killed predecessor's sealed segment, handed over by the supervisor (`--adopt-fd`); adopted if the record
    # still describes it, closed otherwise.
    adopt_fd: int | None = None
    # CPU_LINEAR_SETTINGS; None: the daemon's environment says ($LORAFAAS_CPU_LINEAR, else "auto")
    cpu_linear: str | None = None

    def __post_init__(self) -> None:
        check_name(self.backbone)
        check_device(self.device)
        check_cpu_linear(self.cpu_linear)
        if self.lease_ttl_s is not None and not 0.1 <= self.lease_ttl_s <= 86400:
            raise InvalidInput(f"lease TTL is {self.lease_ttl_s} s; it must lie between 0.1 s and one day")
        if not 0.01 <= self.reap_interval_s <= 60:
            raise InvalidInput(f"reap interval is {self.reap_interval_s} s; it must lie between 0.01 s and 60 s")

    @property
    def paths(self) -> DaemonPaths:
        return DaemonPaths.of(self.home, self.backbone, self.device)


def check_cpu_linear(setting: str | None, source: str = "cpu_linear") -> None:
    if setting is not None and setting not in CPU_LINEAR_SETTINGS:
        raise InvalidInput(f"{source} is {setting!r}; it must be one of {', '.join(CPU_LINEAR_SETTINGS)}")


@dataclass(frozen=True)
class DaemonPaths:
    run_dir: Path
    socket: Path
    lock: Path
    record: Path  # the sealed segment and its leases, for a successor to adopt (see adoption.py)
    base_pass: Path  # a CPU daemon's base-pass executor (`lorafaas.protocols.base_pass`), beside the socket
    holder: Path  # where a node agent's holder hands a restarted daemon its segment (segment_holder.py)
    segment_prefix: str  # every segment of this (home, backbone, device) starts with it, followed by a pid

    @classmethod
    def of(cls, home: Path, backbone: str, device: str) -> DaemonPaths:
        home = Path(home).expanduser().resolve()
        run_dir = home / "run"
        stem = f"{check_name(backbone)}@{check_device(device).replace(':', '-')}"
        home_tag = hashlib.sha256(str(home).encode()).hexdigest()[:10]
        socket = run_dir / f"{stem}.sock"
        # a deep home: keep the sockets somewhere short (the base pass's, beside the daemon's, is the longer one)
        if len(os.fsencode(base_pass_socket(socket))) > MAX_SOCKET_PATH_BYTES:
            socket = Path(tempfile.gettempdir()) / f"lorafaas-{home_tag}" / f"{stem}.sock"
        return cls(
            run_dir=run_dir,
            socket=socket,
            lock=run_dir / f"{stem}.lock",
            record=run_dir / f"{stem}.segment",
            base_pass=base_pass_socket(socket),
            holder=socket.with_name(f"{stem}.holder.sock"),
            segment_prefix=f"{SEGMENT_PREFIX}{home_tag}.{backbone}.{device.replace(':', '-')}.",
        )

    def segment_name(self, pid: int) -> str:
        return f"{self.segment_prefix}{pid}"

    def segment_owner(self, name: str) -> int | None:
        """The pid recorded in one of this daemon's segment names, or None if `name` is not one."""
        rest = name.removeprefix(self.segment_prefix)
        return int(rest) if rest != name and rest.isdigit() else None


def base_pass_socket(daemon_socket: Path) -> Path:
    """Where the daemon serving `daemon_socket` serves its shared base pass (on a CPU)."""
    return daemon_socket.with_name(daemon_socket.name.removesuffix(".sock") + ".base.sock")
