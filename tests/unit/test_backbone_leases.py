"""The daemon's lease table (fake clock, fake liveness) and its protocol framing."""

from __future__ import annotations

import os
import socket as socket_module

import msgspec
import pytest

from lorafaas.cuda_ipc.messages import MemfdLocation, SegmentManifest
from lorafaas.errors import InvalidInput, InvalidName, LeaseNotFound
from lorafaas.protocols import daemon_messages as m
from lorafaas.protocols.daemon_config import MAX_SOCKET_PATH_BYTES, DaemonConfig, DaemonPaths
from lorafaas.protocols.leases import LeaseTable, process_alive, process_start_ticks
from lorafaas.wire import MAX_FRAME_BYTES, encode_frame, frame_length


class FakeClock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_leases_are_granted_renewed_and_released() -> None:
    clock = FakeClock()
    table = LeaseTable(clock=clock, is_alive=lambda pid, ticks: True)
    a, b = table.grant("fn-a", 11), table.grant("fn-b", 12)
    assert a.lease_id != b.lease_id and len(table) == 2
    clock.now += 5
    table.renew(a.lease_id)
    idle = {x.function: x.idle_s for x in table.snapshot()}
    assert idle == {"fn-a": 0.0, "fn-b": 5.0}
    table.release(a.lease_id)
    assert [x.function for x in table.snapshot()] == ["fn-b"]
    with pytest.raises(LeaseNotFound, match=a.lease_id):
        table.renew(a.lease_id)


def test_leases_of_dead_processes_are_reaped_and_live_ones_kept() -> None:
    dead = {12}
    table = LeaseTable(clock=FakeClock(), is_alive=lambda pid, ticks: pid not in dead)
    table.grant("fn-a", 11)
    table.grant("fn-b", 12)
    reaped = table.reap()
    assert [(lease.function, reason) for lease, reason in reaped] == [("fn-b", "process 12 exited")]
    assert [x.function for x in table.snapshot()] == ["fn-a"] and table.num_reaped == 1
    assert table.reap() == []


def test_with_a_ttl_silent_leases_are_reaped_and_heartbeats_keep_them() -> None:
    clock = FakeClock()
    table = LeaseTable(ttl_s=10.0, clock=clock, is_alive=lambda pid, ticks: True)
    quiet, chatty = table.grant("quiet", 11), table.grant("chatty", 12)
    clock.now += 8
    table.renew(chatty.lease_id)
    clock.now += 8  # quiet: 16 s silent, chatty: 8 s
    reaped = table.reap()
    assert [lease.lease_id for lease, _ in reaped] == [quiet.lease_id]
    assert "no heartbeat for 16.0 s" in reaped[0][1]


def test_process_liveness_sees_pid_reuse() -> None:
    me = os.getpid()
    ticks = process_start_ticks(me)
    assert ticks is not None and process_alive(me, ticks)
    assert not process_alive(me, ticks + 1)  # same pid, later start: another process
    assert process_alive(0, None)  # a pid from another namespace: unknown, left to the TTL


def test_requests_and_responses_round_trip_in_frames() -> None:
    manifest = SegmentManifest(device="cpu", location=MemfdLocation(label="s", inode=7), size=256, alignment=256,
                               tensors=())
    info = m.BackboneInfo(name="b", model_dir="/x", architecture="LlamaForCausalLM", weights_sha256="0" * 64)
    for request in (
        m.Hello(protocol_version=m.PROTOCOL_VERSION),
        m.Attach(function="f"),
        m.Heartbeat(lease_id="l"),
        m.Detach(lease_id="l"),
        m.Status(),
        m.HoldSegment(),
        m.Shutdown(force=True),
    ):
        frame = encode_frame(request)
        assert frame_length(frame[:4]) == len(frame) - 4
        assert m.request_decoder.decode(frame[4:]) == request
    attached = m.Attached(lease_id="l", manifest=manifest, backbone=info, lease_ttl_s=None)
    assert m.response_decoder.decode(encode_frame(attached)[4:]) == attached
    held = m.SegmentHeld(manifest=manifest)
    assert m.response_decoder.decode(encode_frame(held)[4:]) == held
    with pytest.raises(msgspec.ValidationError):
        m.request_decoder.decode(msgspec.msgpack.encode({"type": "attach"}))  # no function
    with pytest.raises(ValueError, match="exceeds"):
        frame_length((MAX_FRAME_BYTES + 1).to_bytes(4, "big"))


def test_paths_keep_backbones_apart_and_recognise_their_own_segments(tmp_path) -> None:
    a = DaemonPaths.of(tmp_path, "a", "cpu")
    a_cpu = DaemonPaths.of(tmp_path, "a-cpu", "cpu")
    other_home = DaemonPaths.of(tmp_path / "elsewhere", "a", "cpu")
    name = a_cpu.segment_name(123)
    assert a_cpu.segment_owner(name) == 123
    assert a.segment_owner(name) is None  # 'a' never mistakes 'a-cpu''s segment for its own
    assert other_home.segment_owner(a.segment_name(5)) is None
    assert DaemonPaths.of(tmp_path, "a", "cuda:1").socket.name == "a@cuda-1.sock"


def test_every_socket_of_a_daemon_fits_a_unix_socket_path_under_a_deep_home(tmp_path) -> None:
    # a home where the daemon's socket would just fit and its base pass's (5 bytes longer) would not
    stem = "/run/llama-1b-bf16@cpu.sock"
    home = tmp_path / ("h" * (MAX_SOCKET_PATH_BYTES - len(stem) - 2 - len(os.fsencode(tmp_path.resolve()))))
    assert len(os.fsencode(f"{home.resolve()}{stem}")) == MAX_SOCKET_PATH_BYTES - 1
    paths = DaemonPaths.of(home, "llama-1b-bf16", "cpu")
    for socket in (paths.socket, paths.base_pass):
        assert len(os.fsencode(socket)) <= MAX_SOCKET_PATH_BYTES, socket
    with socket_module.socket(socket_module.AF_UNIX) as listener:  # binds: the kernel agrees
        paths.base_pass.parent.mkdir(parents=True, exist_ok=True)
        listener.bind(str(paths.base_pass))


def test_daemon_config_refuses_bad_values(tmp_path) -> None:
    with pytest.raises(InvalidName):
        DaemonConfig(home=tmp_path, backbone="Bad_Name")
    with pytest.raises(InvalidInput, match="lease TTL"):
        DaemonConfig(home=tmp_path, backbone="b", lease_ttl_s=0.0)


def test_a_successor_restores_the_leases_of_live_processes_under_the_same_ids() -> None:
    predecessor = LeaseTable(clock=FakeClock(), is_alive=lambda pid, ticks: True)
    kept, gone = predecessor.grant("fn-a", 11), predecessor.grant("fn-b", 12)
    records = msgspec.msgpack.decode(msgspec.msgpack.encode(predecessor.records()), type=tuple[m.LeaseRecord, ...])
    successor = LeaseTable(clock=FakeClock(), is_alive=lambda pid, ticks: pid != gone.pid)
    restored = successor.restore(records)
    assert [(x.lease_id, x.function, x.pid) for x in restored] == [(kept.lease_id, "fn-a", 11)]
    assert successor.num_reaped == 1  # the lease of the process that died meanwhile
    assert successor.release(kept.lease_id).attached_at == kept.attached_at  # its holder detaches as before
