"""The platform as a user meets it: `lorafaas up` as a real process, driven over HTTP and the CLI (tiny backbone)."""

import asyncio
import json
import shutil
import signal
import time
from pathlib import Path

import httpx
import pytest

from lorafaas.formats.model_store import ModelStore
from lorafaas.platform.adapter_upload import pack_adapter
from lorafaas.platform.api_client import ApiClient
from lorafaas.testing.platform_process import PlatformProcess
from lorafaas.testing.tiny_models import TinySpec, save_tiny_adapter, save_tiny_backbone

PROMPT = "Tell me about the ocean."


@pytest.fixture(scope="module")
def adapters(tmp_path_factory, tiny_dense_dir) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("platform-adapters")
    made = {name: save_tiny_adapter(root / name, tiny_dense_dir, seed=seed, base_model_name="tiny-dense")
            for seed, name in enumerate(["alpha", "beta", "gamma"], start=1)}
    made["foreign"] = save_tiny_adapter(root / "foreign", tiny_dense_dir, base_model_name="meta-llama/Llama-2-7b-hf")
    narrow = save_tiny_backbone(root / "narrow-backbone", spec=TinySpec(hidden_size=32, intermediate_size=64))
    made["misshapen"] = save_tiny_adapter(root / "misshapen", narrow, base_model_name="tiny-dense")
    return made


@pytest.fixture(scope="module")
def platform(tmp_path_factory, tiny_dense_dir):
    home = tmp_path_factory.mktemp("platform-home")
    ModelStore(home / "models").import_dir("tiny-dense", tiny_dense_dir)
    with PlatformProcess(home) as running:
        yield running


@pytest.fixture
def admin(platform) -> ApiClient:
    with platform.client() as client:
        yield client


def deploy(client: ApiClient, name: str, adapter: Path, **fields) -> dict:
    return client.deploy({"name": name, "backbone": "tiny-dense", **fields}, adapter)


def chat(prompt: str = PROMPT, max_tokens: int = 8, **extra) -> dict:
    return {"messages": [{"role": "user", "content": prompt}], "max_tokens": max_tokens, **extra}


def cleanup(client: ApiClient) -> None:
    for function in client.list():
        client.delete(function.name)


def assert_start_breakdown(cold_start: dict[str, float]) -> None:
    """A start's stages: a process given by the standby pool attached the backbone before (standby_warm, off the
    start's path); one forked from the zygote found the libraries there and attached the backbone itself."""
    assert {"prepare", "spawn", "adapter", "total"} <= set(cold_start), cold_start
    if "standby_warm" in cold_start:
        assert not {"libraries", "backbone"} & set(cold_start), cold_start
    else:
        assert cold_start["libraries"] < 0.05 and "backbone" in cold_start, "libraries come pre-loaded from the zygote"


def test_deploy_list_describe_invoke_stream_async_delete(admin, adapters) -> None:
    spec = deploy(admin, "alpha", adapters["alpha"])
    try:
        assert spec["version"] == 1 and len(spec["adapter_digest"]) == 64
        assert [f.name for f in admin.list()] == ["alpha"]
        answer = admin.invoke("alpha", chat())
        assert answer["usage"]["completion_tokens"] >= 1 and answer["finish_reason"] in ("stop", "length")
        events = list(admin.invoke_stream("alpha", chat()))
        assert [e["type"] for e in events][-1] == "done" and len(events) >= 2
        assert "".join(e["text"] for e in events if e["type"] == "token") == events[-1]["text"] == answer["text"]
        accepted = admin.invoke_async("alpha", chat())
        deadline = time.monotonic() + 60
        while (record := admin.invocation(accepted["invocation_id"]))["status"] in ("queued", "running"):
            assert time.monotonic() < deadline
            time.sleep(0.1)
        assert record["status"] == "succeeded" and record["result_text"] == answer["text"]
        [instance] = admin.describe("alpha")["instances"]
        assert instance["state"] == "ready" and instance["device"] == "cpu" and instance["pid"] > 0
        assert_start_breakdown(instance["cold_start"])
    finally:
        cleanup(admin)
    assert admin.list() == []


def test_async_invocation_returns_202_and_location(platform, admin, adapters) -> None:
    deploy(admin, "alpha", adapters["alpha"])
    try:
        reply = httpx.post(f"{platform.url}/v1/functions/alpha/invoke?mode=async", json=chat(),
                           headers={"Authorization": f"Bearer {platform.admin_key}"})
        assert reply.status_code == 202
        assert reply.headers["location"] == f"/v1/invocations/{reply.json()['invocation_id']}"
    finally:
        cleanup(admin)


def test_bad_input_gets_a_4xx_json_error_and_changes_nothing(platform, admin, adapters) -> None:
    deploy(admin, "alpha", adapters["alpha"])
    headers = {"Authorization": f"Bearer {platform.admin_key}"}
    digests_before = sorted(p.name for p in (platform.home / "adapters").iterdir() if not p.name.startswith("."))
    listed_before = admin.list()

    def deploy_raw(spec: dict, adapter: Path) -> httpx.Response:
        return httpx.post(f"{platform.url}/v1/functions", headers=headers, data={"spec": json.dumps(spec)},
                          files={"adapter": ("a.tar.gz", pack_adapter(adapter), "application/gzip")}, timeout=60)

    def invoke_raw(name: str, body: bytes | dict) -> httpx.Response:
        content = body if isinstance(body, bytes) else json.dumps(body).encode()
        return httpx.post(f"{platform.url}/v1/functions/{name}/invoke", content=content, timeout=60,
                          headers={**headers, "Content-Type": "application/json"})

    cases = {
        "bad name": (deploy_raw({"name": "Bad_Name!", "backbone": "tiny-dense"}, adapters["beta"]), 422,
                     "invalid_name"),
        "unknown backbone": (deploy_raw({"name": "beta", "backbone": "gpt-17"}, adapters["beta"]), 404,
                             "backbone_not_found"),
        "foreign adapter": (deploy_raw({"name": "beta", "backbone": "tiny-dense"}, adapters["foreign"]), 422,
                            "adapter_incompatible"),
        "misshapen adapter": (deploy_raw({"name": "beta", "backbone": "tiny-dense"}, adapters["misshapen"]), 422,
                              "adapter_incompatible"),
        "duplicate deploy": (deploy_raw({"name": "alpha", "backbone": "tiny-dense"}, adapters["beta"]), 409,
                             "already_exists"),
        "prompt too long": (invoke_raw("alpha", chat("fox " * 400)), 422, "prompt_too_long"),
        "max_tokens past the room": (invoke_raw("alpha", chat("fox " * 100, max_tokens=250)), 422, "prompt_too_long"),
        "max_tokens 0": (invoke_raw("alpha", chat(max_tokens=0)), 422, "invalid_input"),
        "max_tokens huge": (invoke_raw("alpha", chat(max_tokens=10**9)), 422, "invalid_input"),
        "malformed json": (invoke_raw("alpha", b'{"messages": [}'), 400, "malformed_json"),
        "unknown function": (invoke_raw("nope", chat()), 404, "function_not_found"),
        "prompt and messages": (invoke_raw("alpha", {**chat(), "prompt": "x"}), 422, "invalid_input"),
    }
    try:
        for case, (reply, status, code) in cases.items():
            assert reply.status_code == status, (case, reply.text)
            error = reply.json()["error"]
            assert error["code"] == code, (case, error)
            assert error["message"], case
        assert admin.list() == listed_before
        digests_after = sorted(p.name for p in (platform.home / "adapters").iterdir() if not p.name.startswith("."))
        assert digests_after == digests_before, "a refused deploy must not leave an adapter behind"
        assert admin.invoke("alpha", chat())["text"] is not None, "the function still serves"
    finally:
        cleanup(admin)


def test_keys_and_tenant_isolation(platform, admin, adapters) -> None:
    assert httpx.get(f"{platform.url}/v1/functions").status_code == 401
    assert httpx.get(f"{platform.url}/v1/functions").json()["error"]["code"] == "unauthorized"
    bad = httpx.get(f"{platform.url}/v1/functions", headers={"Authorization": "Bearer lf_nope_nope"})
    assert bad.status_code == 401
    key_a = admin.create_key("team-a")["key"]
    key_b = admin.create_key("team-b")["key"]
    with ApiClient(platform.url, key_a) as a, ApiClient(platform.url, key_b) as b:
        deploy(a, "alpha", adapters["alpha"])
        try:
            assert [f.name for f in a.list()] == ["alpha"] and a.list()[0].tenant == "team-a"
            assert b.list() == []
            headers_b = {"Authorization": f"Bearer {key_b}"}
            for method, path, body in [("GET", "/v1/functions/alpha", None),
                                       ("POST", "/v1/functions/alpha/invoke", chat()),
                                       ("GET", "/v1/functions/alpha/logs", None),
                                       ("PATCH", "/v1/functions/alpha", None),
                                       ("DELETE", "/v1/functions/alpha", None)]:
                kwargs = {"json": body} if body else {"data": {"spec": "{}"}} if method == "PATCH" else {}
                reply = httpx.request(method, f"{platform.url}{path}", headers=headers_b, timeout=60, **kwargs)
                assert reply.status_code == 404, (method, path, reply.text)
            assert httpx.get(f"{platform.url}/v1/keys", headers=headers_b).status_code == 403
            openai_models = httpx.get(f"{platform.url}/v1/models", headers=headers_b).json()["data"]
            assert openai_models == []
            assert a.invoke("alpha", chat())["usage"]["completion_tokens"] >= 1
        finally:
            cleanup(admin)
    stored = (platform.home / "state.db").read_bytes() + b"".join(
        p.read_bytes() for p in platform.home.glob("state.db-*"))
    for key in (key_a, key_b, platform.admin_key):
        assert key.encode() not in stored, "keys must be stored hashed, never in plaintext"


def test_keep_alive_scales_to_zero_then_cold_starts_with_a_breakdown(admin, adapters) -> None:
    deploy(admin, "beta", adapters["beta"], keep_alive_s=1)
    try:
        admin.invoke("beta", chat())
        [instance] = admin.describe("beta")["instances"]
        deadline = time.monotonic() + 30
        # The record leaves the listing just after the process is reaped (it shows as "stopping" in between).
        while Path(f"/proc/{instance['pid']}").exists() or admin.describe("beta")["instances"]:
            assert time.monotonic() < deadline, "the idle instance outlived its keep-alive"
            time.sleep(0.2)
        admin.invoke("beta", chat())
        info = admin.describe("beta")
        [again] = info["instances"]
        assert again["pid"] != instance["pid"]
        assert info["last_cold_start"] == again["cold_start"]
        assert_start_breakdown(info["last_cold_start"])
    finally:
        cleanup(admin)


def test_redeploy_switches_atomically_to_the_new_adapter(admin, adapters) -> None:
    deploy(admin, "alpha", adapters["alpha"])
    try:
        before = admin.invoke("alpha", chat())["text"]
        updated = admin.update("alpha", {}, adapters["beta"])
        assert updated["version"] == 2
        after = admin.invoke("alpha", chat())["text"]
        assert after == reference_text(admin, adapters["beta"]), "version 2 serves the new adapter"
        assert after != before
        assert {i["version"] for i in admin.describe("alpha")["instances"]} == {2}, "version 1 was drained"
    finally:
        cleanup(admin)


def reference_text(admin: ApiClient, adapter: Path) -> str:
    """The answer of a fresh function holding `adapter`."""
    deploy(admin, "reference", adapter)
    try:
        return admin.invoke("reference", chat())["text"]
    finally:
        admin.delete("reference")


def test_sixty_concurrent_invocations_none_lost_or_duplicated(platform, admin, adapters) -> None:
    names = ["alpha", "beta", "gamma"]
    for name in names:
        deploy(admin, name, adapters[name], max_instances=2)
    prompts = [f"Question number {i}: tell me about the sea." for i in range(20)]
    try:
        expected = {(n, p): admin.invoke(n, chat(p, 6))["text"] for n in names for p in prompts[:2]}

        async def burst() -> list[tuple[str, str, dict]]:
            async with httpx.AsyncClient(base_url=platform.url, timeout=120,
                                         headers={"Authorization": f"Bearer {platform.admin_key}"}) as http:
                async def one(name: str, prompt: str):
                    reply = await http.post(f"/v1/functions/{name}/invoke", json=chat(prompt, 6))
                    return name, prompt, reply

                jobs = [one(n, p) for p in prompts for n in names]
                return await asyncio.wait_for(asyncio.gather(*jobs), timeout=300)

        results = asyncio.run(burst())
        assert len(results) == 60
        assert all(reply.status_code == 200 for _, _, reply in results), [r.text for *_, r in results][:3]
        bodies = {(n, p): reply.json() for n, p, reply in results}
        assert len(bodies) == 60, "every (function, prompt) answered exactly once"
        assert all(body["function"] == n for (n, _), body in bodies.items())
        for key, text in expected.items():
            assert bodies[key]["text"] == text, "a response went to the wrong request"
    finally:
        cleanup(admin)


def test_functions_survive_a_restart(tmp_path, tiny_dense_dir, adapters) -> None:
    ModelStore(tmp_path / "models").import_dir("tiny-dense", tiny_dense_dir)
    running = PlatformProcess(tmp_path).start()
    try:
        with running.client() as client:
            answers = {}
            for name in ("alpha", "beta", "gamma"):
                deploy(client, name, adapters[name])
                answers[name] = client.invoke(name, chat())["text"]
            pids = [i["pid"] for n in answers for i in client.describe(n)["instances"]]
        # uvicorn shuts down gracefully, then re-raises the signal so the exit status tells how it ended
        assert running.stop(signal.SIGTERM) in (0, -signal.SIGTERM)
        assert running.log().count(" stopped") >= 3, "every instance was stopped in the graceful shutdown"
        assert not any(Path(f"/proc/{pid}").exists() for pid in pids), "stopping the platform stops its instances"
        running.start()
        with running.client() as client:
            assert sorted(f.name for f in client.list()) == ["alpha", "beta", "gamma"]
            for name, text in answers.items():
                assert client.invoke(name, chat())["text"] == text
    finally:
        running.stop()
        shutil.rmtree(tmp_path / "adapters", ignore_errors=True)


def test_a_platform_on_redis_keeps_its_functions_across_restarts(tmp_path, tiny_dense_dir, adapters,
                                                                   redis_url) -> None:
    ModelStore(tmp_path / "models").import_dir("tiny-dense", tiny_dense_dir)
    running = PlatformProcess(tmp_path, extra_args=("--state", redis_url)).start()
    try:
        with running.client() as client:
            deploy(client, "alpha", adapters["alpha"])
            answer = client.invoke("alpha", chat())["text"]
        running.stop()
        assert not (tmp_path / "state.db").exists(), "the state lives in Redis, not in SQLite"
        running.start()
        with running.client() as client:
            assert [f.name for f in client.list()] == ["alpha"]
            assert client.invoke("alpha", chat())["text"] == answer
    finally:
        running.stop()


def test_the_cli_deploys_with_every_limit_flag(platform, admin, adapters, cli) -> None:
    result = cli("--home", str(platform.home), "deploy", "alpha", "--adapter", str(adapters["alpha"]),
                 "--backbone", "tiny-dense", "--slo-ttft-ms", "700", "--keep-alive", "30", "--max", "2",
                 "--max-tokens-limit", "32", "--max-request-s", "9.5", "--json", "--url", platform.url)
    try:
        assert result.returncode == 0, result.stderr
        spec = admin.describe("alpha")["function"]
        assert (spec["slo_ttft_ms"], spec["keep_alive_s"], spec["max_instances"], spec["max_tokens_limit"],
                spec["max_request_s"]) == (700, 30.0, 2, 32, 9.5)
        too_many = cli("--home", str(platform.home), "invoke", "alpha", "hi", "--max-tokens", "33", "--url",
                       platform.url)
        assert too_many.returncode == 2 and "32" in too_many.stderr, too_many.stderr
    finally:
        cleanup(admin)
