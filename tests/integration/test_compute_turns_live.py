"""Strict compute on a live platform (`up --strict-compute`): three functions with requests at once on two
compute slots never have more than two busy instances; the third waits its turn and is served (the scheduling
issue's live check, and the performance issue's "never more busy instances than the device has compute for")."""

import asyncio

import httpx
from prometheus_client.parser import text_string_to_metric_families

from lorafaas.formats.model_store import ModelStore
from lorafaas.testing.platform_process import PlatformProcess
from lorafaas.testing.tiny_models import save_tiny_adapter

FUNCTIONS = ("red", "green", "blue")
PER_FUNCTION = 4


def chat(prompt: str, max_tokens: int) -> dict:
    return {"messages": [{"role": "user", "content": prompt}], "max_tokens": max_tokens}


def metric(text: str, name: str) -> float:
    return max(s.value for f in text_string_to_metric_families(text) if f.name == name for s in f.samples)


def test_three_hot_functions_on_two_slots_take_turns_and_never_exceed_the_slots(tmp_path, tiny_dense_dir) -> None:
    ModelStore(tmp_path / "models").import_dir("tiny-dense", tiny_dense_dir)
    args = ("--compute-slots", "2", "--strict-compute")
    with PlatformProcess(tmp_path, extra_args=args) as platform, platform.client() as admin:
        for seed, name in enumerate(FUNCTIONS):
            adapter = save_tiny_adapter(tmp_path / f"a-{name}", tiny_dense_dir, seed=seed, base_model_name="tiny-dense")
            admin.deploy({"name": name, "backbone": "tiny-dense", "max_instances": 2, "keep_alive_s": 600}, adapter)
            admin.invoke(name, chat("warm up", 2))  # one warm instance each, started one after another

        async def everyone_at_once():
            async with httpx.AsyncClient(base_url=platform.url, timeout=120,
                                         headers={"Authorization": f"Bearer {platform.admin_key}"}) as http:
                return await asyncio.gather(*(
                    http.post(f"/v1/functions/{name}/invoke", json=chat(f"{name} request {i}", 120))
                    for i in range(PER_FUNCTION) for name in FUNCTIONS))

        for _ in range(2):
            replies = asyncio.run(everyone_at_once())
            assert [r.status_code for r in replies] == [200] * len(replies), [r.text for r in replies]
            assert all(r.json()["usage"]["completion_tokens"] > 0 for r in replies)
        metrics = httpx.get(f"{platform.url}/metrics", headers={"Authorization": f"Bearer {platform.admin_key}"}).text
        assert metric(metrics, "lorafaas_compute_slots") == 2
        assert metric(metrics, "lorafaas_busy_instances_peak") == 2  # all three hot, two at a time
        waited = [admin.describe(name)["admission"]["waits"] for name in FUNCTIONS]
        assert any(w.get("no_compute", 0) + w.get("yield", 0) > 0 for w in waited), waited
