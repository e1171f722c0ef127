"""smollm2-135m shared by four function processes: bitwise-equal logits, one copy of the weights in memory."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from lorafaas.cuda_ipc.shm import list_segments, unlink_segment
from lorafaas.formats.model_store import ModelStore
from lorafaas.models.reference import load_backbone
from lorafaas.protocols.daemon_client import DaemonClient, spawn_daemon, stop_daemon
from lorafaas.protocols.daemon_config import DaemonConfig
from lorafaas.testing.attach_probe import PROBE_THREADS, ProbeProcess, logits_digest
from tests.support.packed_reference import packed_like_the_daemon

BACKBONE = "smollm2-135m"
NUM_FUNCTIONS = 4


def pss_shmem_bytes(pid: int) -> int:
    for line in Path(f"/proc/{pid}/smaps_rollup").read_text().splitlines():
        if line.startswith("Pss_Shmem:"):
            return int(line.split()[1]) * 1024
    raise AssertionError(f"/proc/{pid}/smaps_rollup has no Pss_Shmem line")


@pytest.fixture(scope="module")
def daemon(tmp_path_factory, smollm2_store: ModelStore):
    # A home of our own (its models/ entry a symlink to the store's), so the daemon's lock, socket and segment
    # cannot collide with another run using the same store.
    home = tmp_path_factory.mktemp("sm")
    (home / "models").mkdir()
    (home / "models" / BACKBONE).symlink_to(smollm2_store.path(BACKBONE))
    config = DaemonConfig(home=home, backbone=BACKBONE, reap_interval_s=0.2)
    with (home / "daemon.log").open("ab") as log:
        process = spawn_daemon(config, timeout_s=300, stderr=log)
    yield config, process
    if process.poll() is None:
        process.kill()
    process.wait()
    for name in list_segments(config.paths.segment_prefix):
        unlink_segment(name)


@pytest.fixture(scope="module")
def functions(daemon):
    config, _ = daemon
    probes = [ProbeProcess(["daemon", str(config.paths.socket), f"fn-{i}"], timeout_s=300)
              for i in range(NUM_FUNCTIONS)]
    try:
        reports = [p.wait_report() for p in probes]  # each has bound the model and run a forward
        yield probes, reports
    finally:
        for probe in probes:
            probe.kill()


@pytest.fixture(scope="module")
def private_model(smollm2_store: ModelStore):
    model, _ = load_backbone(smollm2_store.path(BACKBONE))
    return packed_like_the_daemon(model)  # as the daemon lays the weights out by default


def test_bound_models_give_logits_bitwise_equal_to_a_private_load(functions, private_model) -> None:
    _probes, reports = functions
    threads = torch.get_num_threads()
    torch.set_num_threads(PROBE_THREADS)
    try:
        reference = logits_digest(private_model)
    finally:
        torch.set_num_threads(threads)
    assert [r.logits_sha256 for r in reports] == [reference] * NUM_FUNCTIONS


def test_every_parameter_of_every_function_lies_in_the_one_segment(functions, private_model) -> None:
    _probes, reports = functions
    assert all(r.params_in_segment for r in reports)
    assert {r.num_parameters for r in reports} == {len(list(private_model.parameters()))}


def test_four_functions_hold_one_copy_of_the_weights(daemon, functions) -> None:
    config, process = daemon
    probes, _reports = functions
    with DaemonClient.connect(config.paths.socket) as client:
        status = client.status()
    assert sorted(x.pid for x in status.leases) == sorted(p.pid for p in probes)
    shared = [pss_shmem_bytes(p.pid) for p in probes]
    total = sum(shared)
    assert abs(total - status.bytes) <= 0.10 * status.bytes, (total, status.bytes, shared)
    assert pss_shmem_bytes(process.pid) < 0.01 * status.bytes  # the daemon itself maps nothing after loading


def test_the_daemon_stops_cleanly_once_its_functions_are_gone(daemon, functions) -> None:
    config, process = daemon
    probes, _reports = functions
    for probe in probes:
        probe.kill()
    assert stop_daemon(process, config.paths.socket) == 0  # their leases were reaped, so no force is needed
    assert list_segments(config.paths.segment_prefix) == []
