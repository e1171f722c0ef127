"""Faults on a real platform process (tiny backbone), each bounded in time, each checking what the client sees and
that nothing the platform accepted is lost: an instance, a backbone daemon (restarted, re-adopting its segment) and
the gateway (its successor cleans up after it) SIGKILLed, Redis restarted under load, the disk filling up during a
deploy."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import subprocess
import time
from pathlib import Path

import httpx
import pytest

from lorafaas.cuda_ipc.shm import list_segments
from lorafaas.errors import DaemonUnavailable
from lorafaas.formats.model_store import ModelStore
from lorafaas.platform.adapter_upload import pack_adapter
from lorafaas.protocols.daemon_client import DaemonClient
from lorafaas.protocols.daemon_config import DaemonConfig
from lorafaas.testing.platform_process import PlatformProcess, processes_naming, wait_for
from lorafaas.testing.tiny_models import save_tiny_adapter

PROMPT = "Tell me about the ocean."


def body(max_tokens: int = 6, prompt: str = PROMPT, **extra) -> dict:
    return {"prompt": prompt, "max_tokens": max_tokens, **extra}


@pytest.fixture(scope="module")
def adapter(tmp_path_factory, tiny_dense_dir) -> Path:
    return save_tiny_adapter(tmp_path_factory.mktemp("faults-adapter"), tiny_dense_dir, base_model_name="tiny-dense")


@pytest.fixture
def home(tmp_path, tiny_dense_dir) -> Path:
    ModelStore(tmp_path / "models").import_dir("tiny-dense", tiny_dense_dir)
    return tmp_path


def test_an_instance_killed_mid_stream_ends_the_stream_with_an_error_and_requests_not_started_are_retried(
    home, adapter
) -> None:
    with PlatformProcess(home) as platform, platform.client() as admin:
        admin.deploy({"name": "alpha", "backbone": "tiny-dense", "max_instances": 2}, adapter)
        expected = admin.invoke("alpha", body())["text"]
        [instance] = admin.describe("alpha")["instances"]
        auth = {"Authorization": f"Bearer {platform.admin_key}"}

        async def scenario() -> tuple[list[str], httpx.Response]:
            async with httpx.AsyncClient(base_url=platform.url, headers=auth, timeout=60) as http:
                lines: list[str] = []
                async with http.stream(
                    "POST", "/v1/functions/alpha/invoke", json=body(200, "a long story", stream=True)
                ) as stream:
                    reading = stream.aiter_lines()
                    while not (line := await anext(reading)).startswith("data:"):
                        pass
                    lines.append(line)  # the first token is out: the stream is running on `instance`
                    os.kill(instance["pid"], signal.SIGSTOP)  # frozen: what it is sent next does not start
                    queued = asyncio.create_task(http.post("/v1/functions/alpha/invoke", json=body()))
                    await asyncio.sleep(1.0)  # the second request is dispatched to the same (least-loaded) instance
                    os.kill(instance["pid"], signal.SIGKILL)
                    lines += [line async for line in reading]
                return lines, await queued

        lines, retried = asyncio.run(asyncio.wait_for(scenario(), 120))
        events = [line for line in lines if line.startswith(("event:", "data:"))]
        assert events[-2] == "event: error", events[-3:]
        assert json.loads(events[-1].removeprefix("data:"))["error"]["code"] == "instance_unavailable"
        assert retried.status_code == 200, retried.text
        assert retried.json()["text"] == expected, "the request that had not started ran again, elsewhere"
        described = admin.describe("alpha")
        assert instance["pid"] not in [i["pid"] for i in described["instances"]]
        assert [(f["pid"], f["reason"]) for f in described["failures"]] == [(instance["pid"], "exited unexpectedly")]
        assert admin.invoke("alpha", body())["text"] == expected


def mapped_segments(pid: int, prefix: str) -> dict[int, int]:
    """inode -> Pss_Shmem bytes of each backbone memfd (label starting with `prefix`) that `pid` maps."""
    found: dict[int, int] = {}
    inode = None
    for line in Path(f"/proc/{pid}/smaps").read_text().splitlines():
        fields = line.split()
        if len(fields) >= 6 and "-" in fields[0] and fields[5].startswith(f"/memfd:{prefix}"):
            inode = int(fields[4])
            found.setdefault(inode, 0)
        elif len(fields) >= 6 and "-" in fields[0]:
            inode = None
        elif inode is not None and fields[0] == "Pss_Shmem:":
            found[inode] += int(fields[1]) * 1024
    return found


def test_a_killed_backbone_daemon_is_restarted_and_re_adopts_its_segment_and_the_attached_instances(
    home, adapter
) -> None:
    config = DaemonConfig(home=home, backbone="tiny-dense", device="cpu")
    prefix = config.paths.segment_prefix
    with PlatformProcess(home) as platform, platform.client() as admin:
        admin.deploy({"name": "alpha", "backbone": "tiny-dense", "max_instances": 2}, adapter)
        expected = admin.invoke("alpha", body())["text"]
        [instance] = admin.describe("alpha")["instances"]
        first = daemon_status(config)
        assert [(lease.function, lease.pid) for lease in first.leases] == [("alpha", instance["pid"])]
        [inode] = mapped_segments(instance["pid"], prefix)  # the sealed memfd the instance maps
        os.kill(first.daemon_pid, signal.SIGKILL)
        killed_s = time.monotonic()
        second = wait_for(
            lambda: (status := daemon_status(config)) and status.daemon_pid != first.daemon_pid and status,
            60,
            "the platform restarting the killed daemon",
        )
        print(f"backbone daemon back {time.monotonic() - killed_s:.2f} s after SIGKILL (pid {second.daemon_pid})")
        # It adopted the segment (the same memfd, handed over by the platform: no second copy) and the lease.
        assert second.adopted_from_pid == first.daemon_pid
        assert second.segment == first.segment and list_segments(prefix) == []  # nothing in /dev/shm
        assert [(x.lease_id, x.function, x.pid) for x in second.leases] == [
            (x.lease_id, x.function, x.pid) for x in first.leases
        ]
        for _ in range(3):  # the attached instance serves on, from its mapping
            assert admin.invoke("alpha", body())["text"] == expected
        # A new version with another adapter and two instances (a roll: the attached instance drains and stops): new
        # cold starts bind to the restarted daemon, and the lease of the stopped one goes.
        other = save_tiny_adapter(home / "other-adapter", home / "models" / "tiny-dense", seed=7,
                                  base_model_name="tiny-dense")
        admin.update("alpha", {"min_instances": 2}, other)

        def new_instances_leased():
            ready = sorted(i["pid"] for i in admin.describe("alpha")["instances"] if i["state"] == "ready")
            status = daemon_status(config)
            leased = sorted(x.pid for x in status.leases) if status else None
            return len(ready) == 2 and instance["pid"] not in ready and leased == ready and status

        third = wait_for(new_instances_leased, 120, "two new instances leased from the restarted daemon")
        assert (third.daemon_pid, third.segment) == (second.daemon_pid, second.segment)
        answers = {admin.invoke("alpha", body())["text"] for _ in range(4)}
        assert len(answers) == 1 and answers != {expected}, "both new instances, on the one segment, answer alike"
        # One copy: both new instances map the very memfd the first one mapped, and their shares of it (PSS, as the
        # sharing benchmark measures) add up to at most that one segment.
        shares = [mapped_segments(x.pid, prefix) for x in third.leases]
        assert all(set(share) == {inode} for share in shares), shares
        assert sum(share[inode] for share in shares) <= third.segment_bytes + 64 * 1024
    assert not config.paths.record.exists(), "a clean stop leaves no record"


def daemon_status(config: DaemonConfig):
    """The daemon's status, None while no daemon answers."""
    try:
        with DaemonClient.connect(config.paths.socket, timeout_s=5) as daemon:
            return daemon.status()
    except DaemonUnavailable:
        return None


def test_async_invocations_accepted_before_the_gateway_is_killed_complete_after_restart(home, adapter) -> None:
    config = DaemonConfig(home=home, backbone="tiny-dense", device="cpu")
    platform = PlatformProcess(home).start()
    try:
        with platform.client() as admin:
            admin.deploy({"name": "alpha", "backbone": "tiny-dense"}, adapter)
            expected = {n: admin.invoke("alpha", body(32, f"question {n}"))["text"] for n in range(6)}
            accepted = {admin.invoke_async("alpha", body(32, f"question {n}"))["invocation_id"]: n for n in range(6)}
        daemon_pid = daemon_status(config).daemon_pid
        old_run = set(processes_naming(home)) - {platform.process.pid}  # the zygote, its workers, the daemon
        assert daemon_pid in old_run and len(old_run) >= 3, old_run
        platform.stop(signal.SIGKILL)  # no shutdown: whatever was queued or running is cut off
        assert set(processes_naming(home)) == old_run, "they run in their own sessions: nothing stopped them"
        platform.start()
        # The new platform stopped the dead one's zygote and instances, and adopted its daemon (the same backbone).
        assert set(processes_naming(home)) & old_run == {daemon_pid}
        with platform.client() as admin:

            def all_finished():
                records = [admin.invocation(i) for i in accepted]
                return records if all(r["status"] in ("succeeded", "failed") for r in records) else None

            records = wait_for(all_finished, 120, "every accepted invocation finishing after the restart")
        assert [r["status"] for r in records] == ["succeeded"] * len(accepted), records
        for record in records:
            assert record["result_text"] == expected[accepted[record["invocation_id"]]]
        assert daemon_status(config).daemon_pid == daemon_pid, "the restarted platform re-used the daemon"
    finally:
        platform.stop()
    assert processes_naming(home) == {}, "a clean stop leaves no process of either run"
    assert list_segments(config.paths.segment_prefix) == [], "nor a segment"


def test_redis_restarted_under_load_the_gateway_reconnects_and_no_function_is_lost(home, adapter, redis_server) -> None:
    with PlatformProcess(home, extra_args=("--state", redis_server.url())) as platform, platform.client() as admin:
        for name in ("alpha", "beta"):
            admin.deploy({"name": name, "backbone": "tiny-dense"}, adapter)
        specs = admin.list()
        auth = {"Authorization": f"Bearer {platform.admin_key}"}

        async def load() -> list[httpx.Response]:
            async with httpx.AsyncClient(base_url=platform.url, headers=auth, timeout=60) as http:

                async def client(name: str) -> list[httpx.Response]:
                    replies = []
                    for _ in range(12):
                        replies.append(await http.post(f"/v1/functions/{name}/invoke", json=body(4)))
                        await asyncio.sleep(0.1)
                    return replies

                tasks = [asyncio.create_task(client(name)) for name in ("alpha", "beta") for _ in range(2)]
                await asyncio.sleep(0.5)
                await asyncio.to_thread(redis_server.restart)  # SIGTERM, then the same port and data
                return [reply for replies in await asyncio.gather(*tasks) for reply in replies]

        replies = asyncio.run(asyncio.wait_for(load(), 120))
        statuses = sorted({r.status_code for r in replies})
        assert set(statuses) <= {200, 503}, [r.text for r in replies if r.status_code not in (200, 503)][:3]
        for reply in replies:
            if reply.status_code == 503:  # while Redis was away: a clear JSON error, never a hang or a 500
                assert reply.json()["error"]["code"] == "store_unavailable", reply.text
        assert replies[-1].status_code == 200, "the gateway reconnected by itself"
        assert admin.list() == specs, "no function spec was lost"
        assert admin.invoke("beta", body(4))["usage"]["completion_tokens"] == 4


@contextlib.contextmanager
def small_filesystem(path: Path, size: str):
    """A tmpfs of `size` mounted at `path` (root only): a real 'No space left on device'."""
    path.mkdir(parents=True, exist_ok=True)
    mounted = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", f"size={size},mode=0700", "tmpfs", str(path)], capture_output=True, text=True
    )
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount a small tmpfs here ({mounted.stderr.strip()}); needs root")
    try:
        yield path
    finally:
        subprocess.run(["umount", "-l", str(path)], check=False)


def test_a_full_disk_during_a_deploy_is_a_clear_error_and_leaves_no_half_written_adapter(
    home, tmp_path_factory, tiny_dense_dir
) -> None:
    big = save_tiny_adapter(
        tmp_path_factory.mktemp("big-adapter"),
        tiny_dense_dir,
        rank=16,  # within the adapter limits (rank per layer, half the backbone), still larger than the disk
        base_model_name="tiny-dense",
        target_modules=("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"),
    )
    small = save_tiny_adapter(tmp_path_factory.mktemp("small-adapter"), tiny_dense_dir, base_model_name="tiny-dense")
    weights_bytes = (big / "adapter_model.safetensors").stat().st_size
    with (
        small_filesystem(home / "adapters", f"{weights_bytes // 2}"),
        PlatformProcess(home) as platform,
        platform.client() as admin,
    ):
        admin.deploy({"name": "small", "backbone": "tiny-dense"}, small)
        before = sorted(p.name for p in (home / "adapters").iterdir())
        reply = httpx.post(
            f"{platform.url}/v1/functions",
            timeout=60,
            headers={"Authorization": f"Bearer {platform.admin_key}"},
            data={"spec": json.dumps({"name": "big", "backbone": "tiny-dense"})},
            files={"adapter": ("a.tar.gz", pack_adapter(big), "application/gzip")},
        )
        assert reply.status_code == 507, reply.text
        error = reply.json()["error"]
        assert error["code"] == "storage_full" and "No space left on device" in error["message"], error
        assert sorted(p.name for p in (home / "adapters").iterdir()) == before, "nothing half-written is left"
        assert [f.name for f in admin.list()] == ["small"]
        assert admin.invoke("small", body(3))["usage"]["completion_tokens"] == 3
