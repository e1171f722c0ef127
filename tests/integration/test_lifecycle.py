"""Instance lifecycle regressions, each reproducing a finding of the lifecycle issue on a real platform process (tiny
backbone): a request is only ever answered by an instance of its own function's current deployment, updates never
hang or leak instances, a hung instance is replaced, one request's sampling parameters cannot fail another's, and
an accepted invocation always ends."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import re
import signal
import time
from pathlib import Path

import httpx
import psutil
import pytest

from lorafaas.formats.model_store import ModelStore
from lorafaas.platform.api_client import ApiClient
from lorafaas.platform.state.records import MAX_SEED
from lorafaas.testing.platform_process import PlatformProcess, stream_invocation, wait_for
from lorafaas.testing.tiny_models import save_tiny_adapter

PROMPT = "Tell me about the ocean."


def body(max_tokens: int = 8, prompt: str = PROMPT, **extra) -> dict:
    return {"messages": [{"role": "user", "content": prompt}], "max_tokens": max_tokens, **extra}


@pytest.fixture(scope="module")
def adapters(tmp_path_factory, tiny_dense_dir) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("lifecycle-adapters")
    return {name: save_tiny_adapter(root / name, tiny_dense_dir, seed=seed, base_model_name="tiny-dense")
            for seed, name in enumerate(["alpha", "beta", "gamma"], start=1)}


@pytest.fixture
def home(tmp_path, tiny_dense_dir) -> Path:
    ModelStore(tmp_path / "models").import_dir("tiny-dense", tiny_dense_dir)
    return tmp_path


def deploy(client: ApiClient, name: str, adapter: Path, **fields) -> dict:
    return client.deploy({"name": name, "backbone": "tiny-dense", **fields}, adapter)


def reference(admin: ApiClient, adapter: Path, request: dict) -> str:
    """The answer of a fresh function holding `adapter` alone."""
    deploy(admin, "reference", adapter)
    try:
        return admin.invoke("reference", request)["text"]
    finally:
        admin.delete("reference")


def instances_in_metrics(platform: PlatformProcess, function: str) -> int:
    text = httpx.get(f"{platform.url}/metrics", headers={"Authorization": f"Bearer {platform.admin_key}"}).text
    pattern = re.compile(rf'^lorafaas_instances\{{function="{re.escape(function)}",state="[a-z]+"\}} (\S+)$', re.M)
    return int(sum(float(v) for v in pattern.findall(text)))


# These tests count a platform's worker processes: without the pool, whose not-yet-assigned processes would count
# (a pool process serves one function for life: tests/integration/test_standby_pool.py)
NO_POOL = ("--standby-workers", "0")


def worker_pids(platform: PlatformProcess) -> set[int]:
    """Function worker processes of this platform: forked from its library pool (the zygote's children, which carry
    its command line) or started fresh."""
    pids = set()
    for child in psutil.Process(platform.process.pid).children(recursive=True):
        with contextlib.suppress(psutil.Error):
            if child.status() == psutil.STATUS_ZOMBIE:
                continue
            cmdline = " ".join(child.cmdline())
            forked = "function_runtime.zygote" in cmdline and "function_runtime.zygote" in " ".join(
                child.parent().cmdline())
            if forked or "lorafaas.function_runtime.worker" in cmdline:
                pids.add(child.pid)
    return pids


stream = stream_invocation


def http_client(platform: PlatformProcess, key: str) -> httpx.AsyncClient:
    return httpx.AsyncClient(base_url=platform.url, timeout=90, headers={"Authorization": f"Bearer {key}"})


# -- finding 1 ---------------------------------------------------------------------------------------------------


def test_a_deleted_function_never_answers_again_not_even_for_whoever_deploys_its_name_next(home, adapters) -> None:
    long = body(max_tokens=48)
    # A long hang timeout: the worker is paused below while the delete lands, which is not a hang.
    # a worker capacity of 8, so that of 24 requests 16 are queued when the delete lands
    with PlatformProcess(home, extra_args=("--hang-timeout", "120", "--max-batch", "8", *NO_POOL)) as platform, \
            platform.client() as admin:
        key_a, key_b = admin.create_key("team-a")["key"], admin.create_key("team-b")["key"]
        expected = {name: reference(admin, adapters[name], long) for name in ("alpha", "beta", "gamma")}
        assert len(set(expected.values())) == 3, "the adapters answer differently"
        with ApiClient(platform.url, key_a) as a, ApiClient(platform.url, key_b) as b:
            deploy(a, "x", adapters["alpha"], max_instances=1)
            assert a.invoke("x", long)["text"] == expected["alpha"]
            [worker] = a.describe("x")["instances"]

            async def delete_under_load() -> list[dict]:
                async with http_client(platform, key_a) as http:
                    # The worker is paused while the 24 arrive and the delete lands (on a loaded machine the batch
                    # could otherwise end before the delete, leaving nothing queued to fail).
                    os.kill(worker["pid"], signal.SIGSTOP)
                    try:
                        streams = [asyncio.create_task(stream(http, "x", long)) for _ in range(24)]
                        for _ in range(400):  # the worker's batch (8) is full: the other 16 are queued
                            described = (await http.get("/v1/functions/x")).json()
                            held = sum(i["in_flight"] for i in described["instances"])
                            if held == 8 and described["admission"]["queued"] == 16:
                                break
                            await asyncio.sleep(0.05)
                        else:
                            raise AssertionError(f"24 requests not held and queued: {described}")
                        deleted = await http.delete("/v1/functions/x")
                        assert deleted.status_code == 200, deleted.text
                    finally:
                        os.kill(worker["pid"], signal.SIGCONT)
                    return await asyncio.gather(*streams)

            results = asyncio.run(delete_under_load())
            deploy(b, "x", adapters["beta"])  # another tenant, another adapter, the same name (and version 1)
            assert b.invoke("x", long)["text"] == expected["beta"], "answered by the deleted function's adapter"
            for result in results:  # in flight: answered by its own adapter; still queued: failed, saying why
                if result["error"] is None and result["status"] == 200:
                    assert result["text"] == expected["alpha"]
                else:
                    error = result["error"]
                    assert error["code"] == "function_not_found" and "deleted" in error["message"], result
            assert any(r["error"] is not None or r["status"] != 200 for r in results), "some were still queued"
            pids = {i["pid"] for i in b.describe("x")["instances"]}
            wait_for(lambda: worker_pids(platform) == pids, 30, "the deleted deployment's instances stop")
            b.delete("x")
            wait_for(lambda: instances_in_metrics(platform, "x") == 0, 30, "the deleted function's instances stop")
            deploy(b, "x", adapters["gamma"])  # one tenant redeploying a fixed adapter under the same name
            assert b.invoke("x", long)["text"] == expected["gamma"]
            pids = {i["pid"] for i in b.describe("x")["instances"]}
            assert worker_pids(platform) == pids, "the redeployed function runs only its own instances"


# -- findings 2 and 3 ------------------------------------------------------------------------------------------------


def test_a_settings_only_update_during_a_cold_start_neither_hangs_nor_restarts(home, adapters) -> None:
    with PlatformProcess(home, extra_args=NO_POOL) as platform, platform.client() as admin:
        deploy(admin, "cold", adapters["alpha"], max_instances=1)
        expected = reference(admin, adapters["alpha"], body())

        async def update_during_cold_start() -> list[dict]:
            async with http_client(platform, platform.admin_key) as http:
                calls = [asyncio.create_task(http.post("/v1/functions/cold/invoke", json=body()))
                         for _ in range(10)]
                await _starting_instance(http, "cold")  # the first request is cold-starting the instance
                reply = await http.patch("/v1/functions/cold", data={"spec": json.dumps({"keep_alive_s": 30})})
                assert reply.status_code == 200, reply.text
                replies = await asyncio.wait_for(asyncio.gather(*calls), 90)
                return [(r.status_code, r.json()) for r in replies]

        replies = asyncio.run(update_during_cold_start())
        assert [status for status, _ in replies] == [200] * 10, replies
        assert all(reply["text"] == expected for _, reply in replies)
        instances = admin.describe("cold")["instances"]
        assert [(i["version"], i["state"]) for i in instances] == [(2, "ready")], "the instance serves version 2"
        assert admin.describe("cold")["function"]["keep_alive_s"] == 30


async def _starting_instance(http: httpx.AsyncClient, name: str) -> None:
    """Return once an instance of `name` has a process but is still staging (or after 30 s)."""
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        instances = (await http.get(f"/v1/functions/{name}")).json()["instances"]
        if any(i["state"] == "starting" and i["pid"] for i in instances):
            return
        await asyncio.sleep(0.01)


def test_an_adapter_update_under_load_answers_what_was_accepted_and_leaks_no_old_instance(home, adapters) -> None:
    # A long hang timeout: the version-1 worker is paused below while the update lands, which is not a hang.
    with PlatformProcess(home, extra_args=("--hang-timeout", "120", *NO_POOL)) as platform, platform.client() as admin:
        deploy(admin, "busy", adapters["alpha"], max_instances=1)
        before = reference(admin, adapters["alpha"], body(32))
        after = reference(admin, adapters["beta"], body(32))
        admin.invoke("busy", body())
        [old] = admin.describe("busy")["instances"]

        async def update_under_load() -> list[dict]:
            async with http_client(platform, platform.admin_key) as http:
                # Version 1 is paused while the requests arrive and the update lands: a tiny backbone otherwise
                # answers all 40 before the upload is validated (even within 0.2 s), and nothing is left to drain.
                os.kill(old["pid"], signal.SIGSTOP)
                try:
                    accepted = [asyncio.create_task(stream(http, "busy", body(32))) for _ in range(40)]
                    for _ in range(400):  # all 40 accepted: dispatched to version 1 or queued for it
                        described = (await http.get("/v1/functions/busy")).json()
                        held = sum(i["in_flight"] for i in described["instances"])
                        if held + described["admission"]["queued"] == 40:
                            break
                        await asyncio.sleep(0.05)
                    else:
                        raise AssertionError(f"40 requests not all accepted: {described}")
                    files = {"adapter": ("adapter.tar.gz", _archive(adapters["beta"]), "application/gzip")}
                    reply = await http.patch("/v1/functions/busy", data={"spec": "{}"}, files=files)
                    assert reply.status_code == 200, reply.text
                    for _ in range(100):  # version 1 drains what it accepted: describe and /metrics show it
                        instances = (await http.get("/v1/functions/busy")).json()["instances"]
                        if any(i["state"] == "draining" and i["version"] == 1 for i in instances):
                            metrics = (await http.get("/metrics")).text
                            assert 'lorafaas_instances{function="busy",state="draining"} 1.0' in metrics
                            break
                        await asyncio.sleep(0.02)
                    else:
                        raise AssertionError(f"no draining version-1 instance seen: {instances}")
                finally:
                    os.kill(old["pid"], signal.SIGCONT)
                return await asyncio.wait_for(asyncio.gather(*accepted), 90)

        results = asyncio.run(update_under_load())
        failed = [r for r in results if r["status"] != 200 or r["error"] is not None]
        assert not failed, f"{len(failed)} of {len(results)} failed: {failed}"
        assert {r["text"] for r in results} == {before}, "accepted before the update: answered by version 1"
        assert admin.invoke("busy", body(32))["text"] == after
        wait_for(lambda: {i["version"] for i in admin.describe("busy")["instances"]} == {2}, 30,
                 "version 1 drains and stops")
        time.sleep(1.0)  # an old-version instance started late would show now
        assert [i["version"] for i in admin.describe("busy")["instances"]] == [2]
        assert len(worker_pids(platform)) == 1, "no old-version instance beyond max_instances"


def _archive(adapter: Path) -> bytes:
    from lorafaas.platform.adapter_upload import pack_adapter

    return pack_adapter(adapter)


# -- finding 4 ---------------------------------------------------------------------------------------------------


def test_a_hung_instance_is_declared_hung_killed_and_replaced(home, adapters) -> None:
    with PlatformProcess(home, extra_args=("--hang-timeout", "2", *NO_POOL)) as platform, platform.client() as admin:
        deploy(admin, "stuck", adapters["alpha"], max_request_s=120)
        expected = admin.invoke("stuck", body())["text"]
        [instance] = admin.describe("stuck")["instances"]
        os.kill(instance["pid"], signal.SIGSTOP)
        try:
            started = time.monotonic()
            answer = admin.invoke("stuck", body())
            waited = time.monotonic() - started
        finally:
            with contextlib.suppress(ProcessLookupError):
                os.kill(instance["pid"], signal.SIGCONT)
        assert answer["text"] == expected, "retried on a new instance before its first token"
        assert waited < 60, f"answered after {waited:.0f} s: the hang was not detected well before max_request_s"
        described = admin.describe("stuck")
        assert any(f["pid"] == instance["pid"] and f["reason"].startswith("hung") for f in described["failures"])
        metrics = httpx.get(f"{platform.url}/metrics", headers={"Authorization": f"Bearer {platform.admin_key}"}).text
        assert 'lorafaas_instance_failures_total{function="stuck",reason="hung"} 1.0' in metrics
        assert instance["pid"] not in {i["pid"] for i in described["instances"]}
        wait_for(lambda: not psutil.pid_exists(instance["pid"])
                 or psutil.Process(instance["pid"]).status() == psutil.STATUS_ZOMBIE, 10, "the hung process dies")


# -- finding 5 ---------------------------------------------------------------------------------------------------


def test_sampling_parameters_that_cannot_form_a_distribution_fail_no_batch_mate(home, adapters) -> None:
    with PlatformProcess(home, extra_args=NO_POOL) as platform, platform.client() as admin:
        deploy(admin, "mates", adapters["alpha"], max_instances=1)
        greedy = admin.invoke("mates", body(16))["text"]

        async def batch() -> list:
            async with http_client(platform, platform.admin_key) as http:
                odd = [body(16, temperature=1.0, top_p=1e-300), body(16, temperature=1e-300)]
                requests = [body(16)] * 4 + odd
                return await asyncio.gather(*(http.post("/v1/functions/mates/invoke", json=r) for r in requests))

        replies = asyncio.run(batch())
        assert [r.status_code for r in replies] == [200] * 6, [r.text for r in replies]
        texts = [r.json()["text"] for r in replies]
        assert texts[:4] == [greedy] * 4, "the greedy batch-mates answer as they do alone"
        assert texts[4] == greedy, "top_p that small keeps only the most likely token: greedy"
        assert texts[5] == greedy, "a temperature below 1e-5 samples greedily"


# -- finding 6 ---------------------------------------------------------------------------------------------------


def test_out_of_range_seeds_are_refused_and_every_accepted_async_invocation_ends(home, adapters) -> None:
    with PlatformProcess(home, extra_args=NO_POOL) as platform, platform.client() as admin:
        deploy(admin, "seeded", adapters["alpha"])
        headers = {"Authorization": f"Bearer {platform.admin_key}"}
        url = f"{platform.url}/v1/functions/seeded/invoke"
        for seed in (2**64, 2**63, -(2**63) - 1, MAX_SEED + 1):
            for extra in ({}, {"Prefer": "respond-async"}):
                reply = httpx.post(url, json=body(temperature=1.0, seed=seed), headers={**headers, **extra},
                                   timeout=60)
                assert reply.status_code == 422, (seed, extra, reply.text)
                assert "seed" in reply.json()["error"]["message"]
        accepted = admin.invoke_async("seeded", body(temperature=1.0, seed=MAX_SEED))
        done = wait_for(lambda: (r := admin.invocation(accepted["invocation_id"]))["status"] in
                        ("succeeded", "failed") and r, 60, "the async invocation ends")
        assert done["status"] == "succeeded"
        assert admin.invoke("seeded", body(temperature=1.0, seed=MAX_SEED))["text"] == done["result_text"]
