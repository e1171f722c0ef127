"""The backbone daemon: load one backbone into one segment on one device, lease it to functions, clean up after.

Life: take the (home, backbone, device) lock -> adopt the sealed segment of a killed predecessor if the supervisor
handed it over (`adopt_fd`) and it holds the same weights (re-creating the leases of the functions still attached to
it; see adoption.py) -> if nothing was adopted, read the backbone from the store straight into a new segment and
seal it -> serve the protocol on a Unix socket (asyncio; the lease table is owned by the event loop), passing the
segment's descriptor with every lease and keeping the segment record up to date for a successor -> on Shutdown,
SIGTERM or SIGINT: stop, close the segment, remove its record and the socket, release the lock. Functions attached
when the daemon stops or dies keep their mapping; only new attaches need a daemon.
"""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import logging
import os
import signal
import threading
import time
from collections.abc import Callable
from pathlib import Path

import msgspec

from lorafaas import cuda_ipc
from lorafaas.backbone_daemon import adoption
from lorafaas.backbone_daemon.base_pass import BasePassExecutor
from lorafaas.backbone_daemon.loader import load_into_segment
from lorafaas.backbone_daemon.segment_holder import fetch_held_segment
from lorafaas.config import LorafaasConfig
from lorafaas.cuda_ipc.shm import list_segments, unlink_segment
from lorafaas.errors import (
    DaemonAlreadyRunning,
    DaemonUnavailable,
    LeaseRefused,
    LeasesHeld,
    LorafaasError,
    ProtocolError,
)
from lorafaas.formats.model_store import ModelStore
from lorafaas.models.base_pass_groups import backbone_groups
from lorafaas.models.binding import bind_backbone
from lorafaas.models.cpu_linear import LINEAR_KERNELS, choose_cpu_linear
from lorafaas.models.packed_weights import packed_views
from lorafaas.protocols import daemon_messages as m
from lorafaas.protocols.daemon_config import (
    CPU_LINEAR_ENV,
    PACKING_SETTINGS,
    DaemonConfig,
    DaemonPaths,
    check_cpu_linear,
)
from lorafaas.protocols.fdpass import send_with_fds
from lorafaas.protocols.leases import LeaseTable, process_alive, socket_peer_pid
from lorafaas.protocols.priority import take_data_plane_niceness
from lorafaas.protocols.process_guard import forbid_dumping, is_dumpable
from lorafaas.wire import FRAME_HEADER_BYTES, encode_frame, frame_length

log = logging.getLogger(__name__)


def serve(config: DaemonConfig, on_ready: Callable[[DaemonPaths], None] | None = None) -> None:
    """Run a daemon in the foreground until it is shut down or signalled; always cleans up what it created."""
    forbid_dumping()  # its base pass maps every member's buffer: no /proc/PID/fd or ptrace way in (process_guard)
    take_data_plane_niceness()  # its base pass is model compute: below the control plane (protocols/priority.py)
    daemon = BackboneDaemon(config)
    if threading.current_thread() is threading.main_thread():  # SIGTERM while loading: clean up too
        signal.signal(signal.SIGTERM, _exit_on_signal)
    try:
        daemon.start()
        asyncio.run(daemon.serve(on_ready))
    finally:
        daemon.cleanup()


def _exit_on_signal(signum: int, _frame: object) -> None:
    raise SystemExit(128 + signum)


class BackboneDaemon:
    def __init__(self, config: DaemonConfig) -> None:
        self.config = config
        self.paths = config.paths
        self.store = ModelStore(LorafaasConfig(home=config.home).models_dir)
        self.leases = LeaseTable(ttl_s=config.lease_ttl_s)
        self.segment: cuda_ipc.Export | None = None
        self.info: m.BackboneInfo | None = None
        self._lock_fd: int | None = None
        self._started_s = time.monotonic()
        self._stopping = False
        self._stop: asyncio.Event | None = None
        self._writers: set[asyncio.StreamWriter] = set()
        self._owns_socket = False
        self.adopted_from_pid: int | None = None
        self.num_leases_adopted = 0
        self.base_pass: BasePassExecutor | None = None

    def start(self) -> None:
        """Lock, clean up after a predecessor, load the backbone. Blocking; runs before the event loop serves."""
        manifest = self.store.get(self.config.backbone)  # BackboneNotFound before anything is created
        cuda_ipc.check_transport(self.config.device)  # no GPU or driver: say so before loading anything
        cpu_linear = self.config.cpu_linear or os.environ.get(CPU_LINEAR_ENV) or "auto"
        check_cpu_linear(cpu_linear, f"${CPU_LINEAR_ENV}")
        lock_fd = self._acquire_lock()
        name = self.paths.segment_name(os.getpid())
        self._adopt(manifest)
        self._remove_stale_segments()
        if self.segment is None:
            self.paths.record.unlink(missing_ok=True)  # it describes a segment that is gone now
            log.info(
                "daemon %d: loading backbone %s (%d bytes) onto %s",
                os.getpid(),
                manifest.name,
                manifest.bytes,
                self.config.device,
            )
            self.segment = load_into_segment(
                self.store.path(manifest.name), manifest.weight_files, self.config.device, name,
                pack_linears=self.config.device == "cpu" and cpu_linear in PACKING_SETTINGS,
            )
        self.info = m.BackboneInfo(
            name=manifest.name,
            model_dir=str(self.store.path(manifest.name)),
            architecture=manifest.architecture,
            weights_sha256=manifest.weights_sha256,
            cpu_linear=self._choose_cpu_linear(cpu_linear),
        )
        self._save_record()
        os.ftruncate(lock_fd, 0)
        os.pwrite(lock_fd, f"{os.getpid()} {name}\n".encode(), 0)

    def _choose_cpu_linear(self, setting: str) -> str:
        """The kernel of the float32 products of every function attached here (lorafaas/models/cpu_linear.py)."""
        if self.config.device != "cpu":
            return "torch"
        attachment = cuda_ipc.attach(self._segment().manifest, self._segment_fd())  # read-only views, no copy
        packed = {e.name for e in attachment.manifest.tensors if e.onednn_md is not None}
        try:  # the weights left plain (a tied LM head) go to the kernel measured faster here
            plain = [t for name, t in attachment.tensors.items() if name not in packed]
            choice = choose_cpu_linear("auto" if setting == "packed" else setting, plain)
        finally:
            attachment.close()
        log.info("daemon %d: %d linear weights packed for oneDNN in the segment; other float32 products by %s "
                 "(%s: %s)", os.getpid(), len(packed), choice.kernel, setting, choice.reason)
        return "onednn" if packed else choice.kernel

    def _adopt(self, manifest) -> None:
        """Take over the sealed segment a killed predecessor recorded and the supervisor handed over (`adopt_fd`), if
        it holds these weights; the descriptor is closed otherwise."""
        record = adoption.read_record(self.paths.record)
        fd = self.config.adopt_fd
        if fd is None and record is not None:  # restarted by a kubelet: a node agent's holder may keep it
            fd = fetch_held_segment(self.paths.holder)
            if fd is not None:
                log.info("daemon %d: the segment holder handed over daemon %d's segment", os.getpid(),
                         record.daemon_pid)
        if fd is None:
            if record is not None:
                log.info("daemon %d: daemon %d's segment was not handed over; loading the backbone again",
                         os.getpid(), record.daemon_pid)
            return
        reason = "no segment record" if record is None else adoption.refusal(record, self.config, manifest, fd)
        if record is None or reason is not None:
            os.close(fd)
            log.info("daemon %d: not adopting the segment handed over: %s", os.getpid(), reason)
            return
        self.segment, attached = adoption.adopt(record, fd)
        restored = self.leases.restore(attached)
        self.adopted_from_pid = record.daemon_pid
        self.num_leases_adopted = len(restored)
        log.info(
            "daemon %d: adopted segment %s of killed daemon %d (%d bytes, not loaded again); %d lease(s) "
            "re-created for functions still attached: %s",
            os.getpid(),
            self._segment_label(),
            record.daemon_pid,
            record.manifest.size,
            len(restored),
            ", ".join(f"{x.function} (pid {x.pid})" for x in restored) or "none",
        )

    async def serve(self, on_ready: Callable[[DaemonPaths], None] | None = None) -> None:
        self._stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for signum in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(signum, self._on_signal, signum)
        socket_path = self.paths.socket
        socket_path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
        socket_path.unlink(missing_ok=True)  # a killed predecessor's; we hold the lock, so nobody serves it
        server = await asyncio.start_unix_server(self._connection, path=str(socket_path))
        socket_path.chmod(0o600)  # leases are for the platform's own processes
        self._owns_socket = True
        reaper = asyncio.create_task(self._reap_forever())
        if self.config.device == "cpu":
            self._start_base_pass(loop)
        log.info(
            "daemon %d: serving backbone %s on %s at %s (segment %s, %d bytes)",
            os.getpid(),
            self.config.backbone,
            self.config.device,
            socket_path,
            self._segment_label(),
            self._segment().manifest.size,
        )
        if on_ready is not None:
            on_ready(self.paths)
        try:
            await self._stop_event().wait()
        finally:
            reaper.cancel()
            if self.base_pass is not None:
                self.base_pass.stop()
                self.base_pass = None
            server.close()
            for writer in list(self._writers):
                writer.close()
            await server.wait_closed()

    def _start_base_pass(self, loop: asyncio.AbstractEventLoop) -> None:
        """Serve the shared base pass for the functions attached here (a thread; idle until one connects)."""
        attachment = cuda_ipc.attach(self._segment().manifest, self._segment_fd())  # read-only views, no copy

        async def holds_lease(pid: int) -> bool:
            return any(lease.pid == pid for lease in self.leases.snapshot())

        def may_join(pid: int) -> bool:  # asked on the executor's thread; the lease table is the loop's
            return asyncio.run_coroutine_threadsafe(holds_lease(pid), loop).result(timeout=5)

        # the groups are the backbone's, derived here from the model bound to the segment: no member decides them
        groups = backbone_groups(bind_backbone(attachment, Path(self._backbone().model_dir)), attachment.tensors)
        tensors = {**attachment.tensors, **packed_views(attachment)}  # products from the packed layout, if any
        self.base_pass = BasePassExecutor(self.paths.base_pass, tensors, groups, may_join,
                                          threads=os.cpu_count(), linear=LINEAR_KERNELS[self._backbone().cpu_linear])
        self.base_pass.start()
        self._base_pass_attachment = attachment  # the executor's views live as long as their mapping

    def cleanup(self) -> None:
        """Close the segment, remove the socket, release the lock. Idempotent; attached functions keep their mapping."""
        if self.segment is not None:
            if self.info is not None:  # this run recorded it; a daemon that failed to start leaves the record be
                self.paths.record.unlink(missing_ok=True)
            self.segment.destroy()
            log.info(
                "daemon %d: segment %s closed (%d lease(s) still attached keep their mapping)",
                os.getpid(),
                self._segment_label(),
                len(self.leases),
            )
            self.segment = None
        if self._owns_socket:
            self.paths.socket.unlink(missing_ok=True)
            self._owns_socket = False
        if self._lock_fd is not None:
            os.close(self._lock_fd)  # releases the flock
            self._lock_fd = None

    # --- protocol

    def handle(self, request: m.Request, peer_pid: int) -> m.Response:
        try:
            return self._dispatch(request, peer_pid)
        except LorafaasError as exc:
            return m.ErrorReply(code=exc.code, message=exc.message)

    def _dispatch(self, request: m.Request, peer_pid: int) -> m.Response:
        if isinstance(request, m.Attach):
            if self._stopping:
                raise LeaseRefused(f"the daemon of {self.config.backbone} on {self.config.device} is stopping")
            lease = self.leases.grant(request.function, peer_pid)
            self._save_record()
            log.info(
                "lease %s granted to function %s (pid %d); %d lease(s)",
                lease.lease_id,
                lease.function,
                lease.pid,
                len(self.leases),
            )
            return m.Attached(
                lease_id=lease.lease_id,
                manifest=self._segment().manifest,
                backbone=self._backbone(),
                lease_ttl_s=self.leases.ttl_s,
            )
        if isinstance(request, m.HoldSegment):
            log.info("daemon %d: pid %d holds a duplicate of segment %s", os.getpid(), peer_pid, self._segment_label())
            return m.SegmentHeld(manifest=self._segment().manifest)
        if isinstance(request, m.Heartbeat):
            return m.HeartbeatAck(lease_id=self.leases.renew(request.lease_id).lease_id)
        if isinstance(request, m.Detach):
            lease = self.leases.release(request.lease_id)
            self._save_record()
            log.info(
                "lease %s of function %s (pid %d) released; %d lease(s)",
                lease.lease_id,
                lease.function,
                lease.pid,
                len(self.leases),
            )
            return m.Detached(lease_id=lease.lease_id)
        if isinstance(request, m.Status):
            self._reap()
            return self._status()
        if isinstance(request, m.Shutdown):
            self._reap()
            held = len(self.leases)
            if held and not request.force:
                functions = sorted({x.function for x in self.leases.snapshot()})
                raise LeasesHeld(
                    f"{held} lease(s) are held by function(s) {', '.join(functions)}; detach them or force the shutdown"
                )
            log.info("daemon %d: shutdown requested (%d lease(s) dropped)", os.getpid(), held)
            self._stopping = True
            return m.ShuttingDown(num_leases_dropped=held)
        raise ProtocolError(f"unexpected request {type(request).__name__} after the handshake")

    def _status(self) -> m.DaemonStatus:
        manifest = self._segment().manifest
        return m.DaemonStatus(
            backbone=self.config.backbone,
            device=self.config.device,
            transport=manifest.transport,
            segment=self._segment_label(),
            daemon_pid=os.getpid(),
            bytes=manifest.tensor_bytes,
            segment_bytes=manifest.size,
            uptime_s=time.monotonic() - self._started_s,
            leases=self.leases.snapshot(),
            num_reaped=self.leases.num_reaped,
            adopted_from_pid=self.adopted_from_pid,
            num_leases_adopted=self.num_leases_adopted,
            dumpable=is_dumpable(),
        )

    async def _connection(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self._writers.add(writer)
        peer_pid = _peer_pid(writer)
        try:
            hello = await _read_request(reader)
            if not isinstance(hello, m.Hello) or hello.protocol_version != m.PROTOCOL_VERSION:
                got = hello.protocol_version if isinstance(hello, m.Hello) else type(hello).__name__
                await _send(
                    writer,
                    m.ErrorReply(
                        code=ProtocolError.code,
                        message=(f"the daemon speaks protocol {m.PROTOCOL_VERSION} and expects Hello first; got {got}"),
                    ),
                )
                return
            await _send(
                writer,
                m.Welcome(
                    protocol_version=m.PROTOCOL_VERSION,
                    backbone=self.config.backbone,
                    device=self.config.device,
                    daemon_pid=os.getpid(),
                ),
            )
            while not self._stop_event().is_set():
                request = await _read_request(reader)
                response = self.handle(request, peer_pid)
                if isinstance(response, (m.Attached, m.SegmentHeld)):  # the segment's descriptor goes with it
                    await send_with_fds(writer, response, [self._segment_fd()])
                else:
                    await _send(writer, response)
                if isinstance(response, m.ShuttingDown):
                    self._stop_event().set()
        except (asyncio.IncompleteReadError, ConnectionError):
            pass  # the peer went away
        except (msgspec.DecodeError, msgspec.ValidationError, ValueError) as exc:
            log.warning("pid %d sent a malformed message: %s", peer_pid, exc)
            with contextlib.suppress(ConnectionError):
                await _send(writer, m.ErrorReply(code=ProtocolError.code, message=f"malformed message: {exc}"))
        finally:
            self._writers.discard(writer)
            writer.close()

    # --- housekeeping

    async def _reap_forever(self) -> None:
        while True:
            await asyncio.sleep(self.config.reap_interval_s)
            self._reap()

    def _reap(self) -> None:
        reaped = self.leases.reap()
        for lease, reason in reaped:
            log.info(
                "lease %s of function %s (pid %d) reaped: %s; %d lease(s)",
                lease.lease_id,
                lease.function,
                lease.pid,
                reason,
                len(self.leases),
            )
        if reaped:
            self._save_record()

    def _save_record(self) -> None:
        """What a successor needs to adopt the segment (cpu only: on a GPU the bound instances are restarted)."""
        if not isinstance(self._segment().manifest.location, cuda_ipc.MemfdLocation):
            return
        adoption.write_record(
            self.paths.record,
            m.SegmentRecord(
                daemon_pid=os.getpid(),
                device=self.config.device,
                backbone=self._backbone(),
                manifest=self._segment().manifest,
                leases=self.leases.records(),
            ),
        )

    def _on_signal(self, signum: int) -> None:
        log.info(
            "daemon %d: %s, stopping (%d lease(s) held keep their mapping)",
            os.getpid(),
            signal.Signals(signum).name,
            len(self.leases),
        )
        self._stopping = True
        self._stop_event().set()

    def _acquire_lock(self) -> int:
        self.paths.run_dir.mkdir(mode=0o700, parents=True, exist_ok=True)
        fd = os.open(self.paths.lock, os.O_RDWR | os.O_CREAT, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            owner = os.pread(fd, 200, 0).decode(errors="replace").strip() or "unknown"
            os.close(fd)
            raise DaemonAlreadyRunning(
                f"a daemon for backbone {self.config.backbone} on {self.config.device} is already running "
                f"(pid and segment: {owner}); its socket is {self.paths.socket}"
            ) from None
        self._lock_fd = fd
        return fd

    def _remove_stale_segments(self) -> None:
        """Segments of earlier versions (files in /dev/shm) whose owner is dead."""
        for name in list_segments(self.paths.segment_prefix):
            owner = self.paths.segment_owner(name)
            if owner is None or owner == os.getpid():
                continue
            if process_alive(owner, None):
                log.warning("segment %s belongs to live pid %d outside this daemon's lock; left alone", name, owner)
                continue
            unlink_segment(name)
            log.info("removed stale segment %s of dead daemon pid %d", name, owner)

    def _segment(self) -> cuda_ipc.Export:
        """The backbone's segment (loaded or adopted by `start`)."""
        if self.segment is None:
            raise DaemonUnavailable(f"the daemon of {self.config.backbone} has no segment (not started, or closed)")
        return self.segment

    def _segment_fd(self) -> int:
        fd = self._segment().fd
        if fd is None:
            raise DaemonUnavailable(f"the segment of {self.config.backbone}'s daemon is closed")
        return fd

    def _backbone(self) -> m.BackboneInfo:
        """What attachers are told of the backbone (set by `start`)."""
        if self.info is None:
            raise DaemonUnavailable(f"the daemon of {self.config.backbone} has not loaded its backbone")
        return self.info

    def _stop_event(self) -> asyncio.Event:
        """Set to stop serving (made by `serve`)."""
        if self._stop is None:
            raise RuntimeError("the daemon is not serving")
        return self._stop

    def _segment_label(self) -> str:
        location = self._segment().manifest.location if self.segment is not None else None
        if isinstance(location, cuda_ipc.MemfdLocation):
            return location.label
        return location.device_uuid if location is not None else ""


def _peer_pid(writer: asyncio.StreamWriter) -> int:
    pid = socket_peer_pid(writer.get_extra_info("socket"))
    if pid is None:
        raise OSError("the connection's peer cannot be identified (SO_PEERCRED)")
    return pid


async def _read_request(reader: asyncio.StreamReader) -> m.Request:
    length = frame_length(await reader.readexactly(FRAME_HEADER_BYTES))
    return m.request_decoder.decode(await reader.readexactly(length))


async def _send(writer: asyncio.StreamWriter, response: m.Response) -> None:
    writer.write(encode_frame(response))
    await writer.drain()
