"""The scheduler acting on a live platform: a burst that does not fit the device budget offloads idle functions; a
burst joins a running batch rather than wait for a start slower than its SLO."""

import asyncio
import time

import httpx

from lorafaas.formats.model_store import ModelStore
from lorafaas.platform.agent.artifacts import INSTANCE_OVERHEAD_BYTES
from lorafaas.testing.platform_process import PlatformProcess, wait_for
from lorafaas.testing.tiny_models import save_tiny_adapter

# The budget's room beyond everything resident: more than a 4-token request's KV cache (~19 KB estimated), less than
# a 100-token one's (~69 KB).
SLACK_BYTES = 40_000


def chat(prompt: str, max_tokens: int) -> dict:
    return {"messages": [{"role": "user", "content": prompt}], "max_tokens": max_tokens}


def test_a_burst_offloads_idle_functions_artifacts_and_is_served(tmp_path, tiny_dense_dir, tiny_moe_dir) -> None:
    store = ModelStore(tmp_path / "models")
    dense, _ = store.import_dir("tiny-dense", tiny_dense_dir)
    moe, _ = store.import_dir("tiny-moe", tiny_moe_dir)
    adapters = {
        "burst": (save_tiny_adapter(tmp_path / "a-burst", tiny_dense_dir, base_model_name="tiny-dense"), "tiny-dense"),
        "idle-a": (save_tiny_adapter(tmp_path / "a-idle-a", tiny_moe_dir, seed=2, base_model_name="tiny-moe"),
                   "tiny-moe"),
        "idle-b": (save_tiny_adapter(tmp_path / "a-idle-b", tiny_moe_dir, seed=3, base_model_name="tiny-moe"),
                   "tiny-moe"),
    }
    # Room for both backbones, three instances and a little more; not for a burst's KV caches on top.
    adapter_bytes = sum((a / "adapter_model.safetensors").stat().st_size for a, _ in adapters.values())
    budget = dense.bytes + moe.bytes + adapter_bytes + 3 * INSTANCE_OVERHEAD_BYTES + SLACK_BYTES
    with PlatformProcess(tmp_path, extra_args=("--devices", f"cpu={budget}")) as platform, platform.client() as admin:
        for name, (adapter, backbone) in adapters.items():
            admin.deploy({"name": name, "backbone": backbone, "keep_alive_s": 600, "max_instances": 1}, adapter)
            admin.invoke(name, chat("warm up", 4))
        assert all(len(admin.describe(n)["instances"]) == 1 for n in adapters)
        assert admin.describe("idle-a")["offloaded"] == []

        async def burst():
            async with httpx.AsyncClient(base_url=platform.url, timeout=120,
                                         headers={"Authorization": f"Bearer {platform.admin_key}"}) as http:
                replies = await asyncio.gather(*(
                    http.post("/v1/functions/burst/invoke", json=chat(f"Burst request {i}", 100)) for i in range(4)
                ))
            return replies

        replies = asyncio.run(burst())
        assert [r.status_code for r in replies] == [200] * 4, [r.text for r in replies]
        assert all(r.json()["usage"]["completion_tokens"] >= 1 for r in replies)

        offloaded = {name: admin.describe(name)["offloaded"] for name in adapters}
        assert offloaded["burst"] == [], "the function being invoked is never offloaded"
        idle_kinds = {event["kind"] for name in ("idle-a", "idle-b") for event in offloaded[name]}
        assert idle_kinds, f"nothing of the idle functions was offloaded: {offloaded}"
        event = (offloaded["idle-a"] + offloaded["idle-b"])[0]
        assert event["from"] == "device" and "burst needed" in event["reason"]
        if "backbone" in idle_kinds:  # the tiny-moe backbone went: its idle instances went with it
            deadline = time.monotonic() + 10
            while any(admin.describe(n)["instances"] for n in ("idle-a", "idle-b")):
                assert time.monotonic() < deadline
                time.sleep(0.1)
        # an offloaded function still answers: it loads again on demand
        assert admin.invoke("idle-a", chat("back again", 4))["usage"]["completion_tokens"] >= 1


def test_a_start_slower_than_the_slo_gives_way_to_a_running_batch(tmp_path, tiny_dense_dir) -> None:
    """A TTFT SLO of 1 ms: B = 1 and every start outlasts the SLO. A burst's first scale-out is tried (nothing is
    known of its start yet); once it took longer than the SLO, requests join the running batches
    (`start_beats_joining`) instead of waiting for a start, and the function's third instance starts in the
    background for the requests that follow (`requests_per_background_start`), on a device with compute to spare."""
    store = ModelStore(tmp_path / "models")
    store.import_dir("tiny-dense", tiny_dense_dir)
    adapter = save_tiny_adapter(tmp_path / "a", tiny_dense_dir, base_model_name="tiny-dense")
    with PlatformProcess(tmp_path, extra_args=("--compute-slots", "4")) as platform, platform.client() as admin:
        admin.deploy({"name": "strict", "backbone": "tiny-dense", "slo_ttft_ms": 1, "max_instances": 3,
                      "keep_alive_s": 600}, adapter)  # fmt: skip
        admin.invoke("strict", chat("warm up", 4))

        async def burst():
            async with httpx.AsyncClient(base_url=platform.url, timeout=120,
                                         headers={"Authorization": f"Bearer {platform.admin_key}"}) as http:
                return await asyncio.gather(*(
                    http.post("/v1/functions/strict/invoke", json=chat(f"Burst request {i}", 100)) for i in range(6)
                ))

        for _ in range(2):
            replies = asyncio.run(burst())
            assert [r.status_code for r in replies] == [200] * 6, [r.text for r in replies]
            assert admin.describe("strict")["batching"]["max_batch_size"] == 1
        # The third instance starts in the background and nothing waits for it, so the bursts may end before it is
        # ready (and counted): the test waits for it, and for any other start under way, before counting starts.
        def settled() -> dict | None:
            described = admin.describe("strict")
            return None if any(i["state"] == "starting" for i in described["instances"]) else described

        described = wait_for(settled, 60, "every start of strict done")
        assert described["last_cold_start"]["total"] > 0.001
        assert described["cold_starts"].get("scale_out") == 1, described["cold_starts"]  # the background start
        assert sum(described["cold_starts"].values()) == 3 and len(described["instances"]) == 3  # max_instances
        assert described["batching"]["most_in_flight"] >= 2  # requests joined a running batch


def test_max_batch_caps_what_one_instance_holds(tmp_path, tiny_dense_dir) -> None:
    """`up --max-batch 2`: a burst of six to a function of one instance runs two at a time, and all are served."""
    store = ModelStore(tmp_path / "models")
    store.import_dir("tiny-dense", tiny_dense_dir)
    adapter = save_tiny_adapter(tmp_path / "a", tiny_dense_dir, base_model_name="tiny-dense")
    with PlatformProcess(tmp_path, extra_args=("--max-batch", "2")) as platform, platform.client() as admin:
        admin.deploy({"name": "capped", "backbone": "tiny-dense", "max_instances": 1}, adapter)

        async def burst():
            async with httpx.AsyncClient(base_url=platform.url, timeout=120,
                                         headers={"Authorization": f"Bearer {platform.admin_key}"}) as http:
                return await asyncio.gather(*(
                    http.post("/v1/functions/capped/invoke", json=chat(f"Burst request {i}", 40)) for i in range(6)
                ))

        replies = asyncio.run(burst())
        assert [r.status_code for r in replies] == [200] * 6, [r.text for r in replies]
        batching = admin.describe("capped")["batching"]
        assert batching["most_in_flight"] == 2, batching  # the burst filled the instance up to its capacity
        assert batching["max_batch_size"] <= 2, batching
