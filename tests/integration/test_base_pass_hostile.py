"""Hostile members against the real backbone daemon's shared base pass (issue 36): a member is a process holding a
lease, here this test process speaking the member protocol by hand (`RawMember`), beside honest members that are
function-like processes decoding through the pass (`lorafaas.testing.base_pass_probe`). The honest members' outputs
must equal their outputs alone, and the attacker alone is hung up on."""

from __future__ import annotations

import json
import statistics
import subprocess
import sys
import threading

import pytest

from lorafaas.formats.model_store import ModelStore
from lorafaas.models.base_pass_groups import backbone_groups
from lorafaas.protocols import base_pass as bp
from lorafaas.protocols.daemon_client import DaemonClient, spawn_daemon
from lorafaas.protocols.daemon_config import DaemonConfig, DaemonPaths
from lorafaas.testing.base_pass_member import RawMember
from lorafaas.testing.child_process import stop_child

PROMPTS = ([1, 5, 9, 13, 17, 21, 3, 7], [2, 4, 6, 8, 10, 12])
STEPS = 12


@pytest.fixture(scope="module")
def daemon(tmp_path_factory, tiny_dense_dir):
    home = tmp_path_factory.mktemp("bph")
    ModelStore(home / "models").import_dir("tiny-dense", tiny_dense_dir)
    config = DaemonConfig(home=home, backbone="tiny-dense", reap_interval_s=0.2)
    with (home / "daemon.log").open("ab") as log:
        process = spawn_daemon(config, timeout_s=120, stderr=log)
    paths = DaemonPaths.of(home, "tiny-dense", "cpu")
    yield paths, home / "daemon.log"
    stop_child(process, 30)


def members(paths: DaemonPaths, alone: bool) -> list[dict]:
    """Both prompts decoded at once by two honest member processes (each its own lease)."""
    probes = [subprocess.Popen([sys.executable, "-m", "lorafaas.testing.base_pass_probe", str(paths.socket),
                                str(paths.base_pass), str(STEPS), *map(str, prompt), *(["--alone"] if alone else [])],
                               stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True) for prompt in PROMPTS]
    try:
        for probe in probes:
            assert json.loads(probe.stdout.readline())["ready"]
        for probe in probes:
            probe.stdin.write("go\n")
            probe.stdin.flush()
        return [json.loads(probe.stdout.readline()) for probe in probes]
    finally:
        for probe in probes:
            probe.kill()
            probe.wait()


def lm_head_flood(paths: DaemonPaths, groups, stop: threading.Event, seen: dict) -> None:
    """Finding 1's attack: LM-head calls of 1024 rows in a loop, out of any round, for as long as the honest
    members run; hung up on, it joins again and goes on."""
    last = len(groups) - next(i for i, g in enumerate(reversed(groups)) if not g.tail) - 1  # the LM head group
    seen.update(served=0, hung_up=0, welcomed=0, refused=0)
    while not stop.is_set():
        attacker = RawMember(str(paths.base_pass), groups, max_rows=1024, timeout_s=60)
        try:
            seen["welcomed"] += attacker.welcome().accepted
        except OSError:  # refused at once: evicted lately
            seen["refused"] += 1
            attacker.close()
            continue
        while not stop.is_set():
            if attacker.call(last, 1024) != bp.DONE:
                seen["hung_up"] += 1
                break
            seen["served"] += 1
        attacker.close()


def test_a_member_flooding_alone_calls_is_evicted_and_the_others_get_their_outputs(daemon, tiny_dense_dir) -> None:
    paths, log = daemon
    alone = members(paths, alone=True)
    calm = members(paths, alone=False)  # in the pass, nobody attacking: the TPOT to compare with
    with DaemonClient.connect(paths.socket, client="attacker") as lease_holder:
        lease_holder.attach("attacker")  # a member: it holds a lease on the backbone, as a function does
        from lorafaas import cuda_ipc  # the groups a real member of this backbone sends
        from lorafaas.models.binding import bind_backbone

        attached = lease_holder.attach("attacker-groups")
        attachment = cuda_ipc.attach(attached.manifest, attached.segment_fd)
        groups = list(backbone_groups(bind_backbone(attachment, tiny_dense_dir), attachment.tensors))
        stop, seen = threading.Event(), {}
        flood = threading.Thread(target=lm_head_flood, args=(paths, groups, stop, seen))
        flood.start()
        try:
            shared = members(paths, alone=False)
        finally:
            stop.set()
            flood.join(timeout=120)
    tpot_alone = [statistics.median(r["step_s"]) for r in alone]
    tpot_calm = [statistics.median(r["step_s"]) for r in calm]
    tpot_shared = [statistics.median(r["step_s"]) for r in shared]
    print(f"TPOT (median s) alone {tpot_alone}, in the pass {tpot_calm}, in the pass under the flood "
          f"{tpot_shared}; the attacker: {seen}")
    assert seen["welcomed"] == 1 and seen["hung_up"] == 1, seen  # hung up on, then not admitted again
    assert seen["served"] == 0, seen  # not one of its out-of-order calls computed
    assert "out of its pass's order" in log.read_text()
    for mine, theirs in zip(shared, alone, strict=True):
        assert mine["tokens"] == theirs["tokens"]
        assert max(abs(a - b) for a, b in zip(mine["logits"], theirs["logits"], strict=True)) < 1e-4
        assert not mine["broken"] and mine["calls"] > 0  # they stayed in the pass
