"""A restarted daemon adopting the sealed segment of the daemon it replaces, instead of loading a second copy.

A memfd lives as long as a descriptor or a mapping of it: the supervisor that starts the daemon (the launcher) keeps
a duplicate of the sealed segment's descriptor (`HoldSegment`) and hands it to the successor (`--adopt-fd`). The
daemon records its segment and its leases in a file next to its lock (`SegmentRecord`, rewritten when a lease comes
or goes, removed on a clean stop). The successor adopts the descriptor only if all of these hold; otherwise it
closes it and loads the backbone again:

- the record decodes and has this version; its device is this daemon's and is `cpu` (on a GPU the supervisor
  restarts the bound instances instead: see launcher.py);
- it names this backbone and its weights digest is the store entry's now (a re-import changes it);
- the descriptor is the recorded segment: same inode and size, sealed against writes (nobody can have changed a
  byte since it was sealed); the manifest passes the checks an attacher makes.

The leases of the recorded functions that still live and still map that inode are re-created under the same ids.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path

import msgspec

from lorafaas.cuda_ipc import MemfdLocation
from lorafaas.cuda_ipc.layout import check_manifest
from lorafaas.cuda_ipc.memfd import MemfdExport, check_segment_fd
from lorafaas.errors import SegmentError
from lorafaas.formats.model_store import BackboneManifest
from lorafaas.protocols import daemon_messages as m
from lorafaas.protocols.daemon_config import DaemonConfig

log = logging.getLogger(__name__)
_record_decoder = msgspec.msgpack.Decoder(m.SegmentRecord)


def write_record(path: Path, record: m.SegmentRecord) -> None:
    """Replace the record atomically: a daemon killed mid-write leaves the previous record, never half of one."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        os.write(fd, msgspec.msgpack.encode(record))
    finally:
        os.close(fd)
    os.replace(tmp, path)


def read_record(path: Path) -> m.SegmentRecord | None:
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        return None
    try:
        return _record_decoder.decode(data)
    except (msgspec.DecodeError, msgspec.ValidationError) as exc:
        log.warning("segment record %s is unreadable (%s); nothing to adopt", path, exc)
        return None


def refusal(record: m.SegmentRecord, config: DaemonConfig, backbone: BackboneManifest, fd: int) -> str | None:
    """Why the recorded segment (descriptor `fd`) cannot be adopted, or None if it can."""
    if record.record_version != m.RECORD_VERSION:
        return f"record version {record.record_version}, this daemon reads {m.RECORD_VERSION}"
    if record.device != config.device or config.device != "cpu":
        return f"the segment is on {record.device}; only cpu segments are adopted"
    if record.backbone.name != config.backbone or record.backbone.weights_sha256 != backbone.weights_sha256:
        return (
            f"the segment holds {record.backbone.name} {record.backbone.weights_sha256[:12]}, the store has "
            f"{backbone.name} {backbone.weights_sha256[:12]}"
        )
    if not isinstance(record.manifest.location, MemfdLocation):
        return f"the record's segment is a {record.manifest.transport} segment"
    try:
        check_manifest(record.manifest)
        check_segment_fd(record.manifest, fd)
    except SegmentError as exc:
        return exc.message
    return None


def maps_inode(pid: int, inode: int) -> bool:
    """Does `pid` map the memfd with this inode? True when its maps cannot be read (keep its lease)."""
    try:
        with open(f"/proc/{pid}/maps", "rb") as f:
            lines = f.read().splitlines()
    except FileNotFoundError:
        return False
    except OSError:
        return True
    for line in lines:
        fields = line.split(maxsplit=5)
        if len(fields) == 6 and fields[4] == str(inode).encode() and fields[5].startswith(b"/memfd:"):
            return True
    return False


def adopt(record: m.SegmentRecord, fd: int) -> tuple[MemfdExport, tuple[m.LeaseRecord, ...]]:
    """Own the recorded segment (descriptor `fd`); returns it and the recorded leases whose processes still map it."""
    location = record.manifest.location
    if not isinstance(location, MemfdLocation):  # `refusal` refuses the record first
        raise SegmentError(f"the record's segment is a {record.manifest.transport} segment")
    segment = MemfdExport.adopt(record.manifest, fd)
    inode = location.inode
    attached = tuple(lease for lease in record.leases if maps_inode(lease.pid, inode))
    return segment, attached
