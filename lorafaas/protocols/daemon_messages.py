"""The backbone daemon's protocol: typed requests and responses, msgpack in length-prefixed frames.

A connection opens with `Hello` (the client's protocol version); the daemon answers `Welcome` or an `ErrorReply`
and closes. Then any number of requests, each answered by one response, in order:

    Attach(function)        -> Attached(lease_id, manifest, backbone, lease_ttl_s)  + the segment's descriptor
    HoldSegment()           -> SegmentHeld(manifest)                              + the segment's descriptor
    Heartbeat(lease_id)     -> HeartbeatAck
    Detach(lease_id)        -> Detached
    Status()                -> DaemonStatus(leases, bytes, uptime, ...)
    Shutdown(force)         -> ShuttingDown, or ErrorReply(code="leases_held") while leases are held unless forced

Frame: 4-byte big-endian payload length, then the msgpack payload (a tagged struct, tag field "type"). `Attached`
and `SegmentHeld` carry the sealed segment's file descriptor as SCM_RIGHTS ancillary data on their first byte
(`fdpass.py`): attaching needs no name in /dev/shm, only this socket. `HoldSegment` is for the supervisor that
starts the daemon: it keeps the duplicate and hands it to a successor (`--adopt-fd`) if the daemon dies.

`SegmentRecord` is what a daemon leaves for its successor (a file next to its lock, msgpack, own version): the sealed
segment's manifest and the leases held. A daemon restarted after a crash with the segment's descriptor (from its
supervisor) adopts the segment and re-creates those leases under the same ids, so attached functions detach from it
as from the one they attached to.
"""

from __future__ import annotations

import msgspec

from lorafaas.cuda_ipc.messages import SegmentManifest

PROTOCOL_VERSION = 2  # 2: segments passed as descriptors (memfd, CUDA VMM), HoldSegment


class _Message(msgspec.Struct, frozen=True, kw_only=True, tag_field="type"):
    pass


# Requests
class Hello(_Message, frozen=True, tag="hello"):
    protocol_version: int
    client: str = ""  # free text for logs, e.g. the function name


class Attach(_Message, frozen=True, tag="attach"):
    function: str


class Heartbeat(_Message, frozen=True, tag="heartbeat"):
    lease_id: str


class Detach(_Message, frozen=True, tag="detach"):
    lease_id: str


class Status(_Message, frozen=True, tag="status"):
    pass


class HoldSegment(_Message, frozen=True, tag="hold_segment"):
    """The supervisor asks for a duplicate of the sealed segment's descriptor, to hand to a successor."""


class Shutdown(_Message, frozen=True, tag="shutdown"):
    force: bool = False


Request = Hello | Attach | Heartbeat | Detach | Status | HoldSegment | Shutdown


# Responses
class BackboneInfo(msgspec.Struct, frozen=True, kw_only=True):
    name: str
    model_dir: str  # the store entry: config.json and tokenizer for the attaching function
    architecture: str
    weights_sha256: str
    # the kernel of float32 linear products on a CPU, chosen by the daemon at load (lorafaas/models/cpu_linear.py)
    cpu_linear: str = "torch"


class LeaseInfo(msgspec.Struct, frozen=True, kw_only=True):
    lease_id: str
    function: str
    pid: int
    attached_at: float  # unix time
    idle_s: float  # since the lease was granted or last renewed


class Welcome(_Message, frozen=True, tag="welcome"):
    protocol_version: int
    backbone: str
    device: str
    daemon_pid: int


class Attached(_Message, frozen=True, tag="attached"):
    """Sent with the segment's descriptor (SCM_RIGHTS); the client owns it from then on."""

    lease_id: str
    manifest: SegmentManifest
    backbone: BackboneInfo
    lease_ttl_s: float | None  # renew with Heartbeat more often than this; None: the lease lives with the pid


class SegmentHeld(_Message, frozen=True, tag="segment_held"):
    """Sent with a duplicate of the segment's descriptor (SCM_RIGHTS)."""

    manifest: SegmentManifest


class HeartbeatAck(_Message, frozen=True, tag="heartbeat_ack"):
    lease_id: str


class Detached(_Message, frozen=True, tag="detached"):
    lease_id: str


class DaemonStatus(_Message, frozen=True, tag="daemon_status"):
    backbone: str
    device: str
    transport: str
    segment: str  # the segment's label (the memfd's name on cpu; the GPU's UUID on cuda)
    daemon_pid: int
    bytes: int  # tensor bytes in the segment
    segment_bytes: int  # with alignment padding
    uptime_s: float
    leases: tuple[LeaseInfo, ...]
    num_reaped: int  # leases reaped since start (their functions died or went silent)
    adopted_from_pid: int | None = None  # the killed daemon whose segment this one adopted instead of loading
    num_leases_adopted: int = 0  # leases of functions still attached to the adopted segment, re-created at start
    dumpable: bool | None = None  # prctl(PR_GET_DUMPABLE): False, the daemon forbids it (protocols.process_guard)


class ShuttingDown(_Message, frozen=True, tag="shutting_down"):
    num_leases_dropped: int


class ErrorReply(_Message, frozen=True, tag="error"):
    code: str  # a LorafaasError code
    message: str


Response = Welcome | Attached | SegmentHeld | HeartbeatAck | Detached | DaemonStatus | ShuttingDown | ErrorReply

# What a daemon records for its successor
RECORD_VERSION = 2  # 2: the segment is a memfd handed over by descriptor


class LeaseRecord(msgspec.Struct, frozen=True, kw_only=True):
    lease_id: str
    function: str
    pid: int
    start_ticks: int | None  # with the pid: the process, even if the pid is reused later
    attached_at: float  # unix time


class SegmentRecord(msgspec.Struct, frozen=True, kw_only=True):
    record_version: int = RECORD_VERSION
    daemon_pid: int
    device: str
    backbone: BackboneInfo  # its weights_sha256 must still be the store entry's
    manifest: SegmentManifest  # of the sealed segment; its location names the memfd's inode
    leases: tuple[LeaseRecord, ...]


request_decoder = msgspec.msgpack.Decoder(Request)
response_decoder = msgspec.msgpack.Decoder(Response)
