"""The CPU transport: one POSIX shared-memory segment (/dev/shm/NAME), written once, mapped read-only by attachers.

The owner creates the file, maps it writable only while filling it, then unmaps it (`seal`): from then on it holds
no mapping at all, so the segment's pages are accounted to the processes that use them. Attachers map it with
PROT_READ: a write through a view faults (SIGSEGV) in the writing process and nowhere else.
"""

from __future__ import annotations

import contextlib
import logging
import mmap
import os
import warnings
from pathlib import Path

from lorafaas.cuda_ipc.layout import check_manifest, segment_contains, tensor_views
from lorafaas.cuda_ipc.messages import SegmentManifest, ShmLocation, TensorEntry
from lorafaas.errors import SegmentError

log = logging.getLogger(__name__)

SHM_DIR = Path("/dev/shm")
SEGMENT_MODE = 0o644  # readable by function processes of other users, writable by nobody but the owner
# torch warns once that a read-only buffer gives tensors it considers writable; that is the point here (a write
# faults), so this one warning is silenced where the views are made.
_READ_ONLY_WARNING = "The given buffer is not writable"


def segment_path(name: str) -> Path:
    if not name or "/" in name or name.startswith(".") or len(name) > 255:
        raise SegmentError(f"{name!r} is not a valid shared-memory segment name")
    return SHM_DIR / name


def list_segments(prefix: str) -> list[str]:
    """Names of the segments in /dev/shm starting with `prefix`."""
    try:
        return sorted(n for n in os.listdir(SHM_DIR) if n.startswith(prefix))
    except FileNotFoundError:
        return []


def unlink_segment(name: str) -> bool:
    """Remove a segment's name; processes that map it keep their mapping. True if it existed."""
    try:
        segment_path(name).unlink()
    except FileNotFoundError:
        return False
    return True


class ShmExport:
    """The owner's side of one segment: create, fill through writable views or straight from files, seal, destroy."""

    def __init__(self, name: str, entries: tuple[TensorEntry, ...], size: int, alignment: int) -> None:
        path = segment_path(name)
        try:
            fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_RDWR, SEGMENT_MODE)
        except FileExistsError as exc:
            raise SegmentError(f"shared-memory segment {path} already exists") from exc
        try:
            os.fchmod(fd, SEGMENT_MODE)  # the umask may have narrowed it
            os.ftruncate(fd, size)
            self._mmap: mmap.mmap | None = mmap.mmap(fd, size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        except OSError as exc:
            os.close(fd)
            path.unlink(missing_ok=True)
            raise SegmentError(f"cannot create a {size}-byte segment {path}: {exc}") from exc
        os.close(fd)
        self.name = name
        self.manifest = SegmentManifest(
            device="cpu", location=ShmLocation(name=name), size=size, alignment=alignment, tensors=entries
        )
        self._destroyed = False

    def writable_views(self) -> dict:
        """Writable tensors over the segment, for filling it; drop them before `seal`."""
        import torch

        if self._mmap is None:
            raise SegmentError(f"segment {self.name} is sealed; it cannot be written any more")
        return tensor_views(torch.frombuffer(self._mmap, dtype=torch.uint8), self.manifest.tensors)

    def read_from_file(self, segment_offset: int, nbytes: int, fd: int, file_offset: int) -> None:
        """Read `nbytes` of an open file straight into the segment (no intermediate buffer)."""
        if self._mmap is None:
            raise SegmentError(f"segment {self.name} is sealed; it cannot be written any more")
        if segment_offset < 0 or segment_offset + nbytes > self.manifest.size:
            raise SegmentError(f"write of {nbytes} bytes at {segment_offset} is outside segment {self.name}")
        with memoryview(self._mmap) as view:
            done = 0
            while done < nbytes:
                n = os.preadv(fd, [view[segment_offset + done:segment_offset + nbytes]], file_offset + done)
                if n == 0:
                    raise SegmentError(f"file ended {nbytes - done} bytes early while filling segment {self.name}")
                done += n

    def seal(self) -> None:
        """Unmap the owner's writable mapping; the segment stays, read-only to everyone who attaches."""
        if self._mmap is None:
            return
        try:
            self._mmap.close()
        except BufferError as exc:
            raise SegmentError(f"writable views of segment {self.name} are still alive; drop them first") from exc
        self._mmap = None

    def destroy(self) -> None:
        """Seal and unlink: the name goes away now, the memory when the last attacher unmaps it."""
        if self._destroyed:
            return
        if self._mmap is not None:
            try:
                self._mmap.close()
            except BufferError:
                log.warning("segment %s: writable views still alive at destroy; unlinking anyway", self.name)
            self._mmap = None
        unlink_segment(self.name)
        self._destroyed = True


class ShmAttachment:
    """An attacher's read-only mapping of a segment and the tensors viewing it."""

    def __init__(self, manifest: SegmentManifest) -> None:
        import torch

        check_manifest(manifest)
        if not isinstance(manifest.location, ShmLocation):
            raise SegmentError(f"manifest is for transport {manifest.transport}, not shm")
        path = segment_path(manifest.location.name)
        try:
            fd = os.open(path, os.O_RDONLY)
        except FileNotFoundError as exc:
            raise SegmentError(f"shared-memory segment {path} does not exist (its daemon has stopped?)") from exc
        try:
            actual = os.fstat(fd).st_size
            if actual != manifest.size:
                raise SegmentError(f"segment {path} has {actual} bytes; its manifest says {manifest.size}")
            self._mmap: mmap.mmap | None = mmap.mmap(fd, manifest.size, mmap.MAP_SHARED, mmap.PROT_READ)
        finally:
            os.close(fd)
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=_READ_ONLY_WARNING, category=UserWarning)
            base = torch.frombuffer(self._mmap, dtype=torch.uint8)
        self.manifest = manifest
        self.device = "cpu"
        self.base_ptr = base.data_ptr()
        self.size = manifest.size
        self.tensors = tensor_views(base, manifest.tensors)

    def contains(self, tensor) -> bool:
        return segment_contains(self.base_ptr, self.size, tensor)

    def close(self) -> None:
        """Drop this attachment's views; the mapping goes when the last tensor viewing it is freed."""
        self.tensors = {}
        if self._mmap is None:
            return
        with contextlib.suppress(BufferError):  # a bound model still holds views: the mapping goes with the last
            self._mmap.close()
        self._mmap = None
