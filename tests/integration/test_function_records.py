"""What the platform keeps of a function lives and dies with its deployment (one record per function in the node
agent), and a cold start is bounded: on a real platform process (tiny backbone).

- Tenant A's `f` crashes and cold-starts, A deletes it, tenant B deploys `f`: B's describe, /metrics and usage show
  nothing of A's function (before, the agent kept A's crash records and cold-start counts under the name).
- A start stuck in a stage (its backbone daemon stopped) is killed when its deployment is deleted, at once, and
  when it runs past the agent's start budget (`up --start-timeout`), counted a failed start.
"""

from __future__ import annotations

import os
import signal
import threading
import time
from pathlib import Path

import httpx
import pytest

from lorafaas.errors import DaemonUnavailable
from lorafaas.formats.model_store import ModelStore
from lorafaas.protocols.daemon_client import DaemonClient
from lorafaas.protocols.daemon_config import DaemonConfig
from lorafaas.testing.platform_process import PlatformProcess, wait_for
from lorafaas.testing.tiny_models import save_tiny_adapter

BODY = {"prompt": "Tell me about the ocean.", "max_tokens": 4}


@pytest.fixture
def home(tmp_path, tiny_dense_dir) -> Path:
    ModelStore(tmp_path / "models").import_dir("tiny-dense", tiny_dense_dir)
    return tmp_path


@pytest.fixture(scope="module")
def adapters(tmp_path_factory, tiny_dense_dir) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("records-adapters")
    return {name: save_tiny_adapter(root / name, tiny_dense_dir, seed=seed, base_model_name="tiny-dense")
            for seed, name in enumerate(("a", "b", "c"), start=1)}


def metric_lines(platform: PlatformProcess, function: str) -> list[str]:
    text = httpx.get(f"{platform.url}/metrics", headers={"Authorization": f"Bearer {platform.admin_key}"},
                     timeout=30).raise_for_status().text
    return [line for line in text.splitlines() if not line.startswith("#") and f'function="{function}"' in line]


def test_a_function_deleted_and_deployed_again_by_another_tenant_shows_nothing_of_the_first(home, adapters) -> None:
    with PlatformProcess(home) as platform, platform.client() as admin:
        keys = {t: admin.create_key(f"team-{t}")["key"] for t in ("a", "b")}
        with platform.client(keys["a"]) as a:
            a.deploy({"name": "f", "backbone": "tiny-dense", "max_instances": 1}, adapters["a"])
            a.invoke("f", BODY)
            [instance] = a.describe("f")["instances"]
            os.kill(instance["pid"], signal.SIGKILL)
            wait_for(lambda: a.describe("f")["failures"], 30, "the crash recorded")
            a.invoke("f", BODY)  # a second cold start, after the crash
            described = a.describe("f")
            assert [f["reason"] for f in described["failures"]] == ["exited unexpectedly"]
            assert sum(described["cold_starts"].values()) == 2
            assert any("lorafaas_instance_failures" in line for line in metric_lines(platform, "f"))
            a.delete("f")
            wait_for(lambda: not [line for line in metric_lines(platform, "f")
                                  if line.startswith("lorafaas_instances{") and not line.endswith(" 0.0")],
                     30, "A's instances stopped")

        with platform.client(keys["b"]) as b:
            b.deploy({"name": "f", "backbone": "tiny-dense", "max_instances": 1}, adapters["b"])
            fresh = b.describe("f")
            assert fresh["failures"] == [] and fresh["cold_starts"] == {} and fresh["last_cold_start"] is None
            assert fresh["instances"] == [] and fresh["batching"]["most_in_flight"] == 0
            assert fresh["admission"]["waits"] == {} and fresh["admission"]["last_decision"] is None
            assert metric_lines(platform, "f") == [], "A's series of `f` outlived its deletion"
            b.invoke("f", BODY)
            mine = b.describe("f")
            assert mine["failures"] == [] and sum(mine["cold_starts"].values()) == 1
            lines = metric_lines(platform, "f")
            assert not any(line.startswith("lorafaas_instance_failures") for line in lines), lines
            assert [line for line in lines if line.startswith("lorafaas_cold_starts{")] == [
                f'lorafaas_cold_starts{{function="f",kind="{kind}"}} 1.0' for kind in mine["cold_starts"]]
            assert [line for line in lines if line.startswith("lorafaas_invocations_total")] == [
                'lorafaas_invocations_total{function="f",status="succeeded"} 1.0']
            usage = wait_for(lambda: (u := b.usage())["total"]["invocations"] >= 1 and u, 30, "B's usage recorded")
            assert usage["total"]["invocations"] == 1, usage  # A's two invocations of `f` are A's


def daemon_pid(home: Path) -> int:
    config = DaemonConfig(home=home, backbone="tiny-dense", device="cpu")
    try:
        with DaemonClient.connect(config.paths.socket, timeout_s=5) as daemon:
            return daemon.status().daemon_pid
    except DaemonUnavailable:
        return 0


def start_stuck_in_its_backbone_stage(platform: PlatformProcess, admin, adapter: Path, name: str,
                                      daemon: int) -> tuple[threading.Thread, dict, int]:
    """Deploy `name` and invoke it while the backbone daemon is stopped: its instance's start waits in the backbone
    stage. Returns the invoking thread, where its answer lands, and the stuck worker's pid."""
    admin.deploy({"name": name, "backbone": "tiny-dense", "max_instances": 1}, adapter)
    os.kill(daemon, signal.SIGSTOP)
    answer: dict = {}

    def invoke() -> None:
        with httpx.Client(base_url=platform.url, timeout=120,
                          headers={"Authorization": f"Bearer {platform.admin_key}"}) as http:
            answer["response"] = http.post(f"/v1/functions/{name}/invoke", json=BODY)

    thread = threading.Thread(target=invoke)
    thread.start()
    [starting] = wait_for(lambda: [i for i in admin.describe(name)["instances"] if i["pid"]], 30,
                          "the worker forked and waiting for its backbone")
    assert starting["state"] == "starting"
    return thread, answer, starting["pid"]


def pid_alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split()[2] != "Z"
    except FileNotFoundError:
        return False


def test_deleting_a_function_stops_its_start_at_once(home, adapters) -> None:
    with PlatformProcess(home) as platform, platform.client() as admin:
        admin.deploy({"name": "warm", "backbone": "tiny-dense"}, adapters["a"])
        admin.invoke("warm", BODY)  # the backbone daemon runs
        daemon = daemon_pid(home)
        try:
            thread, answer, worker = start_stuck_in_its_backbone_stage(platform, admin, adapters["b"], "slow", daemon)
            deleted_s = time.monotonic()
            admin.delete("slow")
            wait_for(lambda: not pid_alive(worker), 10, "the starting worker killed by the delete")
            thread.join(30)
            assert not thread.is_alive()
            print(f"start stopped {time.monotonic() - deleted_s:.2f} s after DELETE")
            assert answer["response"].status_code == 404, answer["response"].text  # the function is gone
        finally:
            os.kill(daemon, signal.SIGCONT)
        assert admin.invoke("warm", BODY)["text"]  # the others carry on
        assert admin.describe("warm")["failures"] == []


def test_a_start_past_the_start_budget_is_killed_and_counted_a_failed_start(home, adapters) -> None:
    # no pool: a start forks a worker that waits for its backbone (a pool process has attached it already)
    no_pool = ("--standby-workers", "0")
    with PlatformProcess(home, extra_args=("--start-timeout", "3", *no_pool)) as platform, platform.client() as admin:
        admin.deploy({"name": "warm", "backbone": "tiny-dense"}, adapters["a"])
        admin.invoke("warm", BODY)
        daemon = daemon_pid(home)
        try:
            thread, answer, worker = start_stuck_in_its_backbone_stage(platform, admin, adapters["c"], "slow", daemon)
            thread.join(60)
            assert not thread.is_alive()
            wait_for(lambda: not pid_alive(worker), 10, "the worker past its budget killed")
        finally:
            os.kill(daemon, signal.SIGCONT)
        response = answer["response"]
        assert response.status_code == 503, response.text
        assert "took over 3 s" in response.json()["error"]["message"]
        [failure] = admin.describe("slow")["failures"]
        assert failure["reason"].startswith("start failed: it took over 3 s"), failure
        assert any(line.startswith('lorafaas_instance_failures_total{function="slow",reason="start_failed"} 1')
                   for line in metric_lines(platform, "slow"))
        assert admin.invoke("slow", BODY)["text"]  # the daemon back: the next start succeeds
