"""The step gate on a live platform (the default on a CPU): local workers ask their device's gate before every
engine step, so three hot functions on two cores never compute more than two at once, and answer exactly as
ungated; a worker that dies holding its cores gives them back; no process but a worker of the agent is let in."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import socket
import time

import httpx
from prometheus_client.parser import text_string_to_metric_families

from lorafaas.formats.model_store import ModelStore
from lorafaas.function_runtime.step_gate import WANT
from lorafaas.testing.platform_process import PlatformProcess, wait_for
from lorafaas.testing.tiny_models import save_tiny_adapter

FUNCTIONS = ("red", "green", "blue")
PER_FUNCTION = 3


def chat(prompt: str, max_tokens: int) -> dict:
    return {"messages": [{"role": "user", "content": prompt}], "max_tokens": max_tokens, "temperature": 0}


def metrics(platform: PlatformProcess) -> dict[str, float]:
    text = httpx.get(f"{platform.url}/metrics", headers={"Authorization": f"Bearer {platform.admin_key}"}).text
    return {f"{s.name}{s.labels.get('kind', '')}": s.value for f in text_string_to_metric_families(text)
            for s in f.samples if s.name.startswith(("lorafaas_computing", "lorafaas_gated"))}


def deploy_all(platform: PlatformProcess, tmp_path, tiny_dense_dir) -> None:
    with platform.client() as admin:
        for seed, name in enumerate(FUNCTIONS):
            adapter = save_tiny_adapter(tmp_path / f"a-{name}", tiny_dense_dir, seed=seed, base_model_name="tiny-dense")
            admin.deploy({"name": name, "backbone": "tiny-dense", "keep_alive_s": 600}, adapter)


def everyone_at_once(platform: PlatformProcess) -> list[str]:
    async def run():
        async with httpx.AsyncClient(base_url=platform.url, timeout=120,
                                     headers={"Authorization": f"Bearer {platform.admin_key}"}) as http:
            return await asyncio.gather(*(http.post(f"/v1/functions/{name}/invoke", json=chat(f"{name} {i}", 60))
                                          for i in range(PER_FUNCTION) for name in FUNCTIONS))
    replies = asyncio.run(run())
    assert [r.status_code for r in replies] == [200] * len(replies), [r.text for r in replies]
    return [r.json()["text"] for r in replies]


def test_three_hot_functions_on_two_cores_compute_two_at_a_time_and_answer_as_ungated(tmp_path, tiny_dense_dir):
    ModelStore(tmp_path / "models").import_dir("tiny-dense", tiny_dense_dir)
    ungated_home = tmp_path / "ungated"
    ModelStore(ungated_home / "models").import_dir("tiny-dense", tiny_dense_dir)
    with PlatformProcess(ungated_home, extra_args=("--compute-slots", "2", "--no-step-gate")) as platform:
        deploy_all(platform, tmp_path, tiny_dense_dir)
        ungated = everyone_at_once(platform)
        assert not metrics(platform)  # no gate, no gate metrics
    with PlatformProcess(tmp_path, extra_args=("--compute-slots", "2")) as platform:
        deploy_all(platform, tmp_path, tiny_dense_dir)
        gated = [everyone_at_once(platform) for _ in range(2)]
        seen = metrics(platform)
    assert gated == [ungated, ungated]  # the gate decides when a step runs, never what it computes
    assert seen["lorafaas_computing_instances_peak"] == 2  # three hot functions, two cores
    assert seen["lorafaas_gated_steps_totalgranted"] >= 2 * PER_FUNCTION * len(FUNCTIONS)
    assert seen["lorafaas_gated_steps_totalwaited"] > 0  # a function waited for another's step
    assert seen["lorafaas_computing_instances"] == 0  # idle: every core given back


def test_a_worker_killed_holding_the_only_core_gives_it_back_and_strangers_are_refused(tmp_path, tiny_dense_dir):
    ModelStore(tmp_path / "models").import_dir("tiny-dense", tiny_dense_dir)
    with PlatformProcess(tmp_path, extra_args=("--compute-slots", "1")) as platform, platform.client() as admin:
        deploy_all(platform, tmp_path, tiny_dense_dir)
        for name in FUNCTIONS[:2]:
            admin.invoke(name, chat("warm up", 2))
        [red] = [i for i in admin.describe("red")["instances"] if i["state"] == "ready"]

        # a process that is no worker of the agent gets no core: the gate hangs up on it
        gate = socket.socket(socket.AF_UNIX)
        gate.connect(str(tmp_path / "run" / "step-gate-cpu.sock"))
        gate.settimeout(10)
        # the gate may hang up before the send, before reading it, or after: never with a grant
        with contextlib.suppress(BrokenPipeError, ConnectionResetError):
            gate.sendall(WANT)
            assert gate.recv(1) == b""  # hung up: no grant

        def computing() -> float | None:
            return metrics(platform).get("lorafaas_computing_instances")

        async def kill_red_holding_the_core() -> None:
            async with httpx.AsyncClient(base_url=platform.url, timeout=120,
                                         headers={"Authorization": f"Bearer {platform.admin_key}"}) as http:
                # Red stopped while it has generations in flight holds the one core (in its step, or granted the
                # next one it asked for) and, stopped, cannot give it back: that state is held by the test, however
                # fast red computes. Red is sent more long generations whenever it has finished those it had, and
                # stopped once seen computing; stopped between two requests instead (no core held), it goes on.
                tasks: list[asyncio.Task] = []
                for _ in range(100):
                    if all(t.done() for t in tasks):
                        tasks += [asyncio.create_task(http.post("/v1/functions/red/invoke",
                                                                json=chat(f"long {len(tasks) + i}", 200)))
                                  for i in range(8)]
                    while not all(t.done() for t in tasks) and computing() != 1:
                        await asyncio.sleep(0.005)  # until red computes them (or has finished them all)
                    os.kill(red["pid"], signal.SIGSTOP)
                    await asyncio.sleep(0.1)  # a NEXT red sent before it stopped is granted by now
                    if computing() == 1 and not all(t.done() for t in tasks):  # red's, frozen (green is idle)
                        break
                    os.kill(red["pid"], signal.SIGCONT)
                else:
                    raise AssertionError("red never seen stopped holding the core")
                os.kill(red["pid"], signal.SIGKILL)
                await asyncio.gather(*tasks)

        asyncio.run(kill_red_holding_the_core())
        started = time.monotonic()
        reply = admin.invoke("green", chat("still served", 20))  # with red's core lost, this would never run
        assert reply["usage"]["completion_tokens"] > 0, reply
        assert time.monotonic() - started < 60
        wait_for(lambda: metrics(platform)["lorafaas_computing_instances"] == 0, 30, "every core given back")
        assert metrics(platform)["lorafaas_computing_instances_peak"] == 1
