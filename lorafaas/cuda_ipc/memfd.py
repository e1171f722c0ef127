"""The CPU transport: one sealed memfd, filled once by its owner, passed by descriptor, mapped read-only by attachers.

The owner creates an anonymous memory file (`memfd_create`, no name in any filesystem), reserves all of its pages up
front (`posix_fallocate`: a node without the memory says so at once, with the bytes needed and free, instead of a
fault halfway through the load), fills it (from files by the kernel's copy, `read_spans`, or through a writable
mapping), unmaps that and seals the file:

    F_SEAL_WRITE | F_SEAL_GROW | F_SEAL_SHRINK | F_SEAL_SEAL

From then on the kernel refuses every write to those bytes, whoever asks and whatever their uid: `write()` and
`ftruncate` fail with EPERM, a shared writable mapping cannot be made, and a read-only shared mapping cannot be made
writable with `mprotect`. F_SEAL_SEAL keeps the seals from being changed. Attachers get the descriptor over a Unix
socket (SCM_RIGHTS), check that it is the file the manifest names (inode, size) and that it is sealed, map it
PROT_READ and close the descriptor: the mapping keeps the file alive, and the file goes when the last descriptor and
the last mapping do.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import logging
import mmap
import os
import warnings
from collections.abc import Sequence
from pathlib import Path

from lorafaas.cuda_ipc.layout import check_manifest, segment_contains, tensor_views
from lorafaas.cuda_ipc.messages import MemfdLocation, SegmentManifest, TensorEntry
from lorafaas.errors import InsufficientMemory, SegmentError

log = logging.getLogger(__name__)

SEALS = fcntl.F_SEAL_WRITE | fcntl.F_SEAL_GROW | fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_SEAL
# torch warns once that a read-only buffer gives tensors it considers writable; that is the point here (a write
# faults), so this one warning is silenced where the views are made.
_READ_ONLY_WARNING = "The given buffer is not writable"
_CGROUP_ROOT = Path("/sys/fs/cgroup")
_UNLIMITED = 1 << 62  # cgroup v1 writes "no limit" as a huge number near 2**63


def available_memory_bytes(proc: Path = Path("/proc"), cgroup_root: Path = _CGROUP_ROOT) -> int:
    """Bytes this process can still fill with memfd pages: the node's MemAvailable, lowered by the headroom of the
    memory cgroup it is charged to (v2 memory.max - memory.current, v1 limit_in_bytes - usage_in_bytes)."""
    free = _meminfo_available(proc / "meminfo")
    headroom = _cgroup_headroom(proc / "self" / "cgroup", cgroup_root)
    return free if headroom is None else min(free, headroom)


def _meminfo_available(path: Path) -> int:
    for line in path.read_text().splitlines():
        if line.startswith("MemAvailable:"):
            return int(line.split()[1]) * 1024
    return _UNLIMITED


def _cgroup_headroom(self_cgroup: Path, root: Path) -> int | None:
    try:
        lines = self_cgroup.read_text().splitlines()
    except OSError:
        return None
    for line in lines:
        _id, controllers, path = line.split(":", 2)
        relative = path.lstrip("/")
        if controllers == "" and (root / relative / "memory.max").exists():  # cgroup v2
            v2_limit = (root / relative / "memory.max").read_text().strip()
            if v2_limit == "max":
                return None
            return int(v2_limit) - int((root / relative / "memory.current").read_text())
        if "memory" in controllers.split(","):  # cgroup v1
            group = root / "memory" / relative
            try:
                limit = int((group / "memory.limit_in_bytes").read_text())
                usage = int((group / "memory.usage_in_bytes").read_text())
            except OSError:
                return None
            return None if limit >= _UNLIMITED else limit - usage
    return None


def reserve(fd: int, size: int, what: str) -> None:
    """Allocate every page of `fd` now, or raise InsufficientMemory naming the bytes needed and free."""
    free = available_memory_bytes()
    if size > free:
        raise InsufficientMemory(f"{what} needs {size} bytes of memory; {free} bytes are free on this node")
    try:
        os.posix_fallocate(fd, 0, size)
    except OSError as exc:
        if exc.errno in (errno.ENOSPC, errno.ENOMEM, errno.EFBIG):
            raise InsufficientMemory(
                f"{what} needs {size} bytes of memory; reserving them failed ({exc.strerror}) with "
                f"{available_memory_bytes()} bytes free on this node"
            ) from exc
        raise SegmentError(f"cannot reserve {size} bytes for {what}: {exc}") from exc


class MemfdExport:
    """The owner's side of one segment: create and reserve, fill through writable views or from files, seal, destroy.

    `fd` is the sealed file's descriptor (owned here, closed by `destroy`); pass it to attachers.
    """

    def __init__(self, label: str, entries: tuple[TensorEntry, ...], size: int, alignment: int) -> None:
        fd = os.memfd_create(label, os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
        try:
            reserve(fd, size, f"backbone segment {label}")
            self._mmap: mmap.mmap | None = mmap.mmap(fd, size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        except BaseException:
            os.close(fd)
            raise
        self.fd: int | None = fd
        self.label = label
        self.manifest = SegmentManifest(
            device="cpu",
            location=MemfdLocation(label=label, inode=os.fstat(fd).st_ino),
            size=size,
            alignment=alignment,
            tensors=entries,
        )

    @classmethod
    def adopt(cls, manifest: SegmentManifest, fd: int) -> MemfdExport:
        """Own an already sealed segment (a predecessor's, handed over by its supervisor); checks it first."""
        check_segment_fd(manifest, fd)
        self = cls.__new__(cls)
        if not isinstance(manifest.location, MemfdLocation):  # (check_segment_fd refuses one, as a SegmentError)
            raise SegmentError(f"the segment to adopt is a {manifest.transport} segment, not a memfd")
        self.fd, self._mmap, self.manifest = fd, None, manifest
        self.label = manifest.location.label
        return self

    def writable_views(self) -> dict:
        """Writable tensors over the segment, for filling it; drop them before `seal`."""
        import torch

        if self._mmap is None:
            raise SegmentError(f"segment {self.label} is sealed; it cannot be written any more")
        return tensor_views(torch.frombuffer(self._mmap, dtype=torch.uint8), self.manifest.tensors)

    def read_spans(self, fd: int, file_offset: int, spans: Sequence[tuple[int, int]]) -> None:
        """Copy the bytes of file `fd` from `file_offset` on into the segment's `spans` ((segment offset, nbytes),
        filled in turn from consecutive file bytes). Calls on disjoint spans may run on several threads at once.

        The copy is the kernel's (`sendfile` into a description of the memfd of this call's own, so each call has its
        own file position): no user buffer, and the segment's reserved pages are filled by the write path, which
        does not clear them first as a fault through the mapping would (that doubled the memory traffic)."""
        if self._mmap is None or self.fd is None:
            raise SegmentError(f"segment {self.label} is sealed; it cannot be written any more")
        for segment_offset, nbytes in spans:
            if segment_offset < 0 or nbytes < 0 or segment_offset + nbytes > self.manifest.size:
                raise SegmentError(f"write of {nbytes} bytes at {segment_offset} is outside segment {self.label}")
        try:
            writer = os.open(f"/proc/self/fd/{self.fd}", os.O_WRONLY | os.O_CLOEXEC)
        except OSError:  # no /proc: read through the writable mapping instead
            self._read_into_mapping(fd, file_offset, spans)
            return
        try:
            for segment_offset, nbytes in spans:
                os.lseek(writer, segment_offset, os.SEEK_SET)
                done = 0
                while done < nbytes:
                    n = os.sendfile(writer, fd, file_offset, nbytes - done)
                    if n == 0:
                        raise SegmentError(f"file ended {nbytes - done} bytes early while filling segment {self.label}")
                    done += n
                    file_offset += n
        finally:
            os.close(writer)

    def _read_into_mapping(self, fd: int, file_offset: int, spans: Sequence[tuple[int, int]]) -> None:
        assert self._mmap is not None
        with memoryview(self._mmap) as view:
            for segment_offset, nbytes in spans:
                done = 0
                while done < nbytes:
                    with view[segment_offset + done:segment_offset + nbytes] as target:
                        n = os.preadv(fd, [target], file_offset)
                    if n == 0:
                        raise SegmentError(f"file ended {nbytes - done} bytes early while filling segment {self.label}")
                    done += n
                    file_offset += n

    def seal(self) -> None:
        """Unmap the owner's writable mapping and seal the file: nobody can write it from now on."""
        if self._mmap is None:
            return
        try:
            self._mmap.close()
        except BufferError as exc:
            raise SegmentError(f"writable views of segment {self.label} are still alive; drop them first") from exc
        self._mmap = None
        if self.fd is None:  # (destroy unmaps first: a destroyed segment returned above)
            raise SegmentError(f"segment {self.label} is destroyed")
        fcntl.fcntl(self.fd, fcntl.F_ADD_SEALS, SEALS)

    def destroy(self) -> None:
        """Close the owner's descriptor: the memory goes when the last attacher unmaps it."""
        if self._mmap is not None:
            try:
                self._mmap.close()
            except BufferError:
                log.warning("segment %s: writable views still alive at destroy", self.label)
            self._mmap = None
        if self.fd is not None:
            os.close(self.fd)
            self.fd = None


def check_segment_fd(manifest: SegmentManifest, fd: int) -> None:
    """Refuse a descriptor that is not the manifest's file, of its size, with every seal set."""
    location = manifest.location
    if not isinstance(location, MemfdLocation):
        raise SegmentError(f"manifest is for transport {manifest.transport}, not memfd")
    try:
        st = os.fstat(fd)
        seals = fcntl.fcntl(fd, fcntl.F_GET_SEALS)
    except OSError as exc:
        raise SegmentError(f"the descriptor passed for segment {location.label} is not a sealable file: {exc}") from exc
    if st.st_ino != location.inode:
        raise SegmentError(f"the descriptor passed is inode {st.st_ino}; segment {location.label} is {location.inode}")
    if st.st_size != manifest.size:
        raise SegmentError(f"segment {location.label} has {st.st_size} bytes; its manifest says {manifest.size}")
    if seals & SEALS != SEALS:
        raise SegmentError(f"segment {location.label} is not sealed against writes (seals {seals:#x})")


class MemfdAttachment:
    """An attacher's read-only mapping of a sealed segment and the tensors viewing it."""

    def __init__(self, manifest: SegmentManifest, fd: int) -> None:
        """Maps the file of `fd` (checked against `manifest`); the caller keeps `fd` and may close it at once."""
        import torch

        check_manifest(manifest)
        check_segment_fd(manifest, fd)
        self._mmap: mmap.mmap | None = mmap.mmap(fd, manifest.size, mmap.MAP_SHARED, mmap.PROT_READ)
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
