"""The backbone daemon as a real process on tiny-dense: protocol, leases, reaping, faults, adopting or removing a
killed daemon's segment, stop.

Daemons and probes are real child processes, bounded by timeouts and always killed. Segments are sealed memfds passed
over the socket: nothing of ours ever appears in /dev/shm.
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from lorafaas import cuda_ipc
from lorafaas.backbone_daemon.server import BackboneDaemon
from lorafaas.cuda_ipc.shm import list_segments
from lorafaas.errors import DaemonAlreadyRunning, DaemonUnavailable, InvalidInput, LeaseNotFound, LeasesHeld
from lorafaas.formats.model_store import ModelStore
from lorafaas.models.reference import load_backbone
from lorafaas.protocols import daemon_messages as m
from lorafaas.protocols.daemon_client import DaemonClient, spawn_daemon, stop_daemon
from lorafaas.protocols.daemon_config import DaemonConfig
from lorafaas.testing.attach_probe import PROBE_THREADS, ProbeProcess, logits_digest, tensors_digest
from lorafaas.wire import FRAME_HEADER_BYTES, encode_frame
from tests.support.packed_reference import packed_like_the_daemon

BACKBONE = "tiny-dense"
READY_TIMEOUT_S = 120.0


class Daemons:
    """Starts daemons for a test and guarantees they are gone afterwards, with their segments."""

    def __init__(self, factory: pytest.TempPathFactory, tiny_dense_dir: Path) -> None:
        self._factory = factory
        self._source = tiny_dense_dir
        self._started: list[tuple[DaemonConfig, object]] = []

    def home(self) -> Path:
        home = self._factory.mktemp("dh")  # short: the socket path must fit in sun_path
        ModelStore(home / "models").import_dir(BACKBONE, self._source)
        return home

    def start(self, home: Path, adopt_fd: int | None = None, cpu_linear: str | None = None):
        config = DaemonConfig(home=home, backbone=BACKBONE, reap_interval_s=0.2, cpu_linear=cpu_linear)
        log = (home / "daemon.log").open("ab")
        process = spawn_daemon(config, timeout_s=READY_TIMEOUT_S, stderr=log, adopt_fd=adopt_fd)
        log.close()
        self._started.append((config, process))
        return config, process

    def close(self) -> None:
        for _config, process in self._started:
            if process.poll() is None:
                process.kill()
            process.wait()


@pytest.fixture(scope="module")
def module_daemons(tmp_path_factory, tiny_dense_dir):
    daemons = Daemons(tmp_path_factory, tiny_dense_dir)
    yield daemons
    daemons.close()


@pytest.fixture
def daemons(tmp_path_factory, tiny_dense_dir):
    daemons = Daemons(tmp_path_factory, tiny_dense_dir)
    yield daemons
    daemons.close()


@pytest.fixture(scope="module")
def running(module_daemons):
    """One daemon shared by the tests that leave it running."""
    return module_daemons.start(module_daemons.home())


@pytest.fixture(scope="module")
def reference_digest(tiny_dense_dir) -> str:
    """Logits digest of a private from_pretrained, computed with the probes' thread count."""
    threads = torch.get_num_threads()
    torch.set_num_threads(PROBE_THREADS)
    try:
        model, _ = load_backbone(tiny_dense_dir)
        return logits_digest(packed_like_the_daemon(model))  # the daemon packs by default
    finally:
        torch.set_num_threads(threads)


def _probe(config: DaemonConfig, function: str) -> ProbeProcess:
    return ProbeProcess(["daemon", str(config.paths.socket), function], timeout_s=READY_TIMEOUT_S)


def _leases(config: DaemonConfig) -> dict[str, int]:
    with DaemonClient.connect(config.paths.socket) as client:
        return {lease.function: lease.pid for lease in client.status().leases}


def _wait_for(predicate, timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, "condition not reached in time"
        time.sleep(0.05)


def test_attach_heartbeat_status_detach(running) -> None:
    config, process = running
    with DaemonClient.connect(config.paths.socket, client="test") as client:
        assert client.welcome.daemon_pid == process.pid and client.welcome.backbone == BACKBONE
        attached = client.attach("fn-status")
        assert attached.manifest.transport == "memfd" and attached.backbone.name == BACKBONE
        assert os.fstat(attached.segment_fd).st_ino == attached.manifest.location.inode  # the descriptor came along
        attached.close_fd()
        status = client.status()
        assert status.bytes == attached.manifest.tensor_bytes > 0 and status.uptime_s > 0
        assert status.segment == attached.manifest.location.label == config.paths.segment_name(process.pid)
        assert {x.function: x.pid for x in status.leases}["fn-status"] == os.getpid()  # from SO_PEERCRED
        client.heartbeat(attached.lease_id)
        client.detach(attached.lease_id)
        assert "fn-status" not in {x.function for x in client.status().leases}
        with pytest.raises(LeaseNotFound):
            client.heartbeat(attached.lease_id)


def _attached_kernel(config: DaemonConfig) -> tuple[str, set[str]]:
    """The kernel the daemon hands an attacher, and the weights its segment holds packed for oneDNN."""
    with DaemonClient.connect(config.paths.socket, client="test") as client:
        attached = client.attach("fn-kernel")
        attached.close_fd()
        client.detach(attached.lease_id)
        return attached.backbone.cpu_linear, {e.name for e in attached.manifest.tensors if e.onednn_md is not None}


@pytest.mark.parametrize("setting", ["torch", "onednn"])
def test_the_float32_kernel_set_for_the_daemon_is_handed_to_every_attacher(daemons, setting) -> None:
    home = daemons.home()
    config, _ = daemons.start(home, cpu_linear=setting)
    assert _attached_kernel(config) == (setting, set())  # the plain layout: nothing packed
    assert f"float32 products by {setting} ({setting}: set)" in (home / "daemon.log").read_text()


def test_auto_packs_the_linear_weights_in_the_segment_and_says_so(running) -> None:
    config, _ = running
    kernel, packed = _attached_kernel(config)
    # tiny-dense's q/o/MLP weights pack without padding; k/v (32 rows) would need it and the embedding is tied to
    # the LM head (read by a lookup): those stay plain
    assert kernel == "onednn"
    assert packed == {f"model.layers.{i}.{name}.weight" for i in range(2)
                      for name in ("self_attn.q_proj", "self_attn.o_proj", "mlp.gate_proj", "mlp.up_proj",
                                   "mlp.down_proj")}
    assert "10 linear weights packed for oneDNN in the segment" in (config.home / "daemon.log").read_text()


def test_a_bad_kernel_setting_in_the_environment_stops_the_daemon_naming_it(daemons, monkeypatch) -> None:
    monkeypatch.setenv("LORAFAAS_CPU_LINEAR", "mkl")
    with pytest.raises(InvalidInput, match=r"\$LORAFAAS_CPU_LINEAR is 'mkl'; it must be one of auto, packed, torch"):
        daemons.start(daemons.home())
    with pytest.raises(InvalidInput, match="cpu_linear is 'fast'"):
        DaemonConfig(home=Path("/nonexistent"), backbone=BACKBONE, cpu_linear="fast")


def test_a_client_of_another_protocol_version_is_refused(running) -> None:
    config, _ = running
    with socket.socket(socket.AF_UNIX) as sock:
        sock.settimeout(10)
        sock.connect(str(config.paths.socket))
        sock.sendall(encode_frame(m.Hello(protocol_version=m.PROTOCOL_VERSION + 1)))
        reply = m.response_decoder.decode(sock.recv(1 << 16)[FRAME_HEADER_BYTES:])
    assert isinstance(reply, m.ErrorReply) and reply.code == "protocol_error"


def test_a_second_daemon_for_the_same_backbone_is_refused_and_harms_nothing(running) -> None:
    config, _ = running
    with pytest.raises(DaemonAlreadyRunning, match="already running"):
        BackboneDaemon(config).start()
    assert list_segments(config.paths.segment_prefix) == []  # memfds: no name in /dev/shm, ever
    assert _leases(config) is not None  # the first one still serves


def test_a_write_into_the_backbone_kills_the_writer_only(running, reference_digest) -> None:
    config, _ = running
    with _probe(config, "fn-writer") as writer, _probe(config, "fn-reader") as reader:
        first_writer, first_reader = writer.wait_report(), reader.wait_report()
        for report in (first_writer, first_reader):
            assert report.params_in_segment and report.num_parameters > 0
            assert report.logits_sha256 == reference_digest  # bitwise equal to a private load
        writer.send("write")
        assert writer.wait_exit() == -signal.SIGSEGV
        again = reader.request("report")
        assert again.logits_sha256 == reference_digest  # the reader's backbone is untouched
        _wait_for(lambda: "fn-writer" not in _leases(config))  # the dead writer's lease is reaped
        assert _leases(config)["fn-reader"] == reader.pid
        with DaemonClient.connect(config.paths.socket) as client:  # and the daemon still leases
            client.detach(client.attach("fn-late").lease_id)


def test_the_lease_of_a_sigkilled_function_is_reaped(running) -> None:
    config, _ = running
    with _probe(config, "fn-doomed") as probe:
        probe.wait_report()
        assert _leases(config)["fn-doomed"] == probe.pid
        os.kill(probe.pid, signal.SIGKILL)  # not waited for yet: a zombie must count as dead too
        _wait_for(lambda: "fn-doomed" not in _leases(config))
    with DaemonClient.connect(config.paths.socket) as client:
        assert client.status().num_reaped >= 1


def test_shutdown_is_refused_while_leases_are_held_unless_forced(daemons) -> None:
    config, process = daemons.start(daemons.home())
    with DaemonClient.connect(config.paths.socket) as client:
        client.attach("fn-holder").close_fd()
        with pytest.raises(LeasesHeld, match="fn-holder"):
            client.shutdown()
        time.sleep(0.3)
        assert process.poll() is None and len(client.status().leases) == 1
        assert client.shutdown(force=True).num_leases_dropped == 1
    assert process.wait(30) == 0
    assert not config.paths.socket.exists() and not config.paths.record.exists()
    with pytest.raises(DaemonUnavailable):
        DaemonClient.connect(config.paths.socket)


def _segment_digest(config: DaemonConfig) -> tuple[int, str]:
    """(inode of the segment, digest of its tensors) as a new attacher sees them."""
    with DaemonClient.connect(config.paths.socket) as client:
        attached = client.attach("fn-digest")
        inode = os.fstat(attached.segment_fd).st_ino
        attachment = attached.map()
        try:
            return inode, tensors_digest(attachment.tensors)
        finally:
            attachment.close()
            client.detach(attached.lease_id)


def _hold(config: DaemonConfig) -> int:
    """What the launcher does: keep a duplicate of the daemon's sealed segment."""
    with DaemonClient.connect(config.paths.socket) as client:
        return client.hold_segment()[1]


def test_a_killed_daemons_segment_and_leases_are_adopted_by_a_successor_handed_its_descriptor(daemons) -> None:
    home = daemons.home()
    config, first = daemons.start(home)
    inode, contents = _segment_digest(config)
    held = _hold(config)
    with _probe(config, "fn-survivor") as survivor, _probe(config, "fn-leaver") as leaver:
        before = survivor.wait_report()
        leaver.wait_report()
        with DaemonClient.connect(config.paths.socket) as client:
            leases = {x.function: (x.lease_id, x.pid) for x in client.status().leases}
        first.kill()
        first.wait()
        leaver.kill()  # dies while no daemon watches: its lease must not come back
        assert survivor.request("report").logits_sha256 == before.logits_sha256  # the mapping outlives the daemon
        try:
            _config, second = daemons.start(home, adopt_fd=held)
        finally:
            os.close(held)  # the successor has its own
        with DaemonClient.connect(config.paths.socket) as client:
            status = client.status()
        assert status.adopted_from_pid == first.pid and status.num_leases_adopted == 1
        assert {x.function: (x.lease_id, x.pid) for x in status.leases} == {"fn-survivor": leases["fn-survivor"]}
        assert survivor.request("report").logits_sha256 == before.logits_sha256
        assert _segment_digest(config) == (inode, contents)  # a new attach maps the same file: not a second copy
        with pytest.raises(LeasesHeld, match="fn-survivor"):  # an adopted lease holds the daemon like any other
            stop_daemon(second, config.paths.socket)
    _wait_for(lambda: _leases(config) == {})
    assert stop_daemon(second, config.paths.socket) == 0
    assert not config.paths.record.exists()  # a clean stop leaves nothing


def test_a_descriptor_that_is_not_the_recorded_sealed_segment_is_refused_and_the_backbone_loaded_again(
    daemons,
) -> None:
    home = daemons.home()
    config, first = daemons.start(home)
    inode, _contents = _segment_digest(config)
    first.kill()
    first.wait()
    impostor = cuda_ipc.export({"w": torch.zeros(4)}, "cpu")  # sealed, but another file
    unsealed = os.memfd_create("unsealed", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
    try:
        for fd in (impostor.fd, unsealed, None):
            successor = BackboneDaemon(DaemonConfig(home=home, backbone=BACKBONE,
                                                    adopt_fd=None if fd is None else os.dup(fd)))
            try:
                successor.start()  # in this process: fast, and it holds the lock like any daemon
                assert successor.adopted_from_pid is None
                assert successor.segment.manifest.location.inode != inode  # loaded anew
            finally:
                successor.cleanup()
            assert not config.paths.record.exists()
    finally:
        impostor.destroy()
        os.close(unsealed)


def test_stopping_a_daemon_whose_socket_is_already_gone_waits_for_it_instead_of_raising(daemons) -> None:
    """Ctrl-C on `lorafaas up` reaches the daemon too: it removes its socket and exits while the launcher stops it."""
    config, process = daemons.start(daemons.home())
    os.kill(process.pid, signal.SIGSTOP)  # caught between removing its socket and exiting
    config.paths.socket.unlink()
    assert stop_daemon(process, config.paths.socket, force=True, timeout_s=1.0) == -signal.SIGKILL


def _held_inodes(pid: int, prefix: str) -> set[int]:
    """The inodes of the segments process `pid` holds a descriptor of."""
    inodes = set()
    for fd in Path(f"/proc/{pid}/fd").iterdir():
        with contextlib.suppress(FileNotFoundError):
            if os.readlink(fd).startswith(f"/memfd:{prefix}"):
                inodes.add(os.stat(fd).st_ino)
    return inodes


def test_a_daemon_restarted_with_no_descriptor_adopts_the_one_the_node_agents_holder_keeps(daemons) -> None:
    """On Kubernetes the kubelet restarts a killed daemon's container and hands it nothing: the node agent's segment
    holder (`lorafaas backbone hold`, another container of its pod) keeps the segment and hands it over, so the
    restarted daemon maps the same copy. The holder also answers the controller's liveness probe."""
    home = daemons.home()
    config, first = daemons.start(home)
    inode, contents = _segment_digest(config)
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    with (home / "holder.log").open("ab") as log:
        holder = subprocess.Popen([sys.executable, "-m", "lorafaas", "--home", str(home), "backbone", "hold", BACKBONE,
                                   "--port", str(port)], stdout=log, stderr=log)
    try:
        _wait_for(lambda: holder.poll() is not None or _held_inodes(holder.pid, config.paths.segment_prefix) == {inode},
                  READY_TIMEOUT_S)
        assert holder.poll() is None, (home / "holder.log").read_text()
        with socket.create_connection(("127.0.0.1", port), timeout=5) as alive:
            assert alive.recv(8) == b"ok\n"
        with _probe(config, "fn-survivor") as survivor:
            before = survivor.wait_report()
            first.kill()
            first.wait()
            _config, second = daemons.start(home)  # no --adopt-fd: as the kubelet starts it
            with DaemonClient.connect(config.paths.socket) as client:
                status = client.status()
            assert status.adopted_from_pid == first.pid and status.num_leases_adopted == 1
            assert _segment_digest(config) == (inode, contents)  # the same memfd: one copy, not a second load
            assert survivor.request("report").logits_sha256 == before.logits_sha256
        _wait_for(lambda: _leases(config) == {})
        assert stop_daemon(second, config.paths.socket) == 0
    finally:
        holder.terminate()
        holder.wait(30)
    assert holder.returncode == 0, (home / "holder.log").read_text()
    assert not config.paths.holder.exists()
