"""A restarted daemon adopting the segment of the daemon it replaces, instead of loading a second copy.

A daemon records its sealed segment and its leases in a file next to its lock (`SegmentRecord`, rewritten when a
lease comes or goes, removed on a clean stop). Its successor, holding the same lock, adopts the segment only if all
of these hold; otherwise the segment is stale and removed, as before:

- the record decodes and has this version; its device is this daemon's and is `cpu` (a CUDA allocation dies with
  the process that made it, so there is nothing to adopt);
- it names this backbone and its weights digest is the store entry's now (a re-import changes it);
- the segment is the recorded daemon's (name = prefix + that pid), and the file at that name is the one recorded:
  same inode, size and last-write time (sealed segments are never written again);
- the manifest passes the checks an attacher makes.

Adopting renames the segment to the new daemon's name (mappings follow the inode, so attached functions notice
nothing) and re-creates the leases of the recorded functions that still live and still map it.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path

import msgspec

from lorafaas.backbone_daemon import messages as m
from lorafaas.backbone_daemon.config import DaemonConfig, DaemonPaths
from lorafaas.cuda_ipc import SegmentManifest, ShmLocation
from lorafaas.cuda_ipc.layout import check_manifest
from lorafaas.cuda_ipc.shm import segment_path, unlink_segment
from lorafaas.errors import SegmentError
from lorafaas.platform.model_store import BackboneManifest

log = logging.getLogger(__name__)
_record_decoder = msgspec.msgpack.Decoder(m.SegmentRecord)


class AdoptedSegment:
    """The owner's side of a segment taken over from a killed daemon: already filled and sealed."""

    def __init__(self, manifest: SegmentManifest) -> None:
        self.manifest = manifest
        self.name = manifest.location.name
        self._destroyed = False

    def seal(self) -> None:
        pass

    def destroy(self) -> None:
        if not self._destroyed:
            unlink_segment(self.name)
            self._destroyed = True


def segment_identity(name: str) -> tuple[int, int, int] | None:
    """(inode, size, mtime_ns) of the segment file, None if there is none."""
    try:
        st = os.stat(segment_path(name))
    except FileNotFoundError:
        return None
    return st.st_ino, st.st_size, st.st_mtime_ns


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


def refusal(
    record: m.SegmentRecord, config: DaemonConfig, paths: DaemonPaths, backbone: BackboneManifest
) -> str | None:
    """Why the recorded segment cannot be adopted, or None if it can."""
    if record.record_version != m.RECORD_VERSION:
        return f"record version {record.record_version}, this daemon reads {m.RECORD_VERSION}"
    if record.device != config.device or config.device != "cpu":
        return f"the segment is on {record.device}; only cpu segments outlive their daemon"
    if record.backbone.name != config.backbone or record.backbone.weights_sha256 != backbone.weights_sha256:
        return (
            f"the segment holds {record.backbone.name} {record.backbone.weights_sha256[:12]}, the store has "
            f"{backbone.name} {backbone.weights_sha256[:12]}"
        )
    location = record.manifest.location
    if not isinstance(location, ShmLocation) or paths.segment_owner(location.name) != record.daemon_pid:
        return f"the record's segment {location!r} is not daemon {record.daemon_pid}'s"
    identity = segment_identity(location.name)
    if identity != (record.inode, record.manifest.size, record.mtime_ns):
        return f"/dev/shm/{location.name} is {'gone' if identity is None else 'not the segment recorded'}"
    try:
        check_manifest(record.manifest)
    except SegmentError as exc:
        return exc.message
    return None


def maps_inode(pid: int, inode: int) -> bool:
    """Does `pid` map the /dev/shm file with this inode? True when its maps cannot be read (keep its lease)."""
    try:
        with open(f"/proc/{pid}/maps", "rb") as f:
            lines = f.read().splitlines()
    except FileNotFoundError:
        return False
    except OSError:
        return True
    for line in lines:
        fields = line.split(maxsplit=5)
        if len(fields) == 6 and fields[4] == str(inode).encode() and fields[5].startswith(b"/dev/shm/"):
            return True
    return False


def adopt(record: m.SegmentRecord, new_name: str) -> tuple[AdoptedSegment, tuple[m.LeaseRecord, ...]]:
    """Rename the recorded segment to `new_name`; returns it and the recorded leases whose processes still map it."""
    old_name = record.manifest.location.name
    os.rename(segment_path(old_name), segment_path(new_name))
    manifest = msgspec.structs.replace(record.manifest, location=ShmLocation(name=new_name))
    attached = tuple(lease for lease in record.leases if maps_inode(lease.pid, record.inode))
    return AdoptedSegment(manifest), attached
