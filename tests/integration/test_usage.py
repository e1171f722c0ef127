"""Usage a tenant can bill (issue 21 item 14): a real platform (tiny backbone), two tenants invoking through every
route, and the sums of GET /v1/usage, `lorafaas usage` and the REPORT lines checked against the replies; the totals
survive a restart of the gateway on either state store."""

import json
import os
import re
import socket
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import openai
import pytest
from transformers import AutoTokenizer

from lorafaas.formats.model_store import ModelStore
from lorafaas.testing.platform_process import PlatformProcess
from lorafaas.testing.tiny_models import save_tiny_adapter

MESSAGES = [{"role": "user", "content": "Tell me about the ocean."}]
REPORT = re.compile(r"^REPORT RequestId: (\w+)  Duration: [\d.]+ ms  Queue: [\d.]+ ms  TTFT: [\d.]+ ms  "
                    r"Prompt tokens: (\d+)  Completion tokens: (\d+)  Cold start: (.+?)  Device-seconds: ([\d.]+)  "
                    r"Memory: ([\d.]+) GB-s$", re.MULTILINE)


@pytest.fixture(params=["sqlite", "redis"])
def platform(request, tmp_path: Path, tiny_dense_dir: Path):
    home = tmp_path / "home"
    ModelStore(home / "models").import_dir("tiny-dense", tiny_dense_dir)
    extra = ("--state", request.getfixturevalue("redis_url")) if request.param == "redis" else ()
    running = PlatformProcess(home, extra_args=extra).start()
    yield running
    running.stop()


def invoke_every_route(url: str, key: str, function: str, native_ids: set[str]) -> dict[str, int]:
    """One sync, one streaming (native SSE), one OpenAI chat and one OpenAI streaming completion; returns the sums
    of the usage the replies reported, and adds the invocation ids the native replies named to `native_ids`."""
    headers = {"Authorization": f"Bearer {key}"}
    body = {"messages": MESSAGES, "max_tokens": 6}
    answer = httpx.post(f"{url}/v1/functions/{function}/invoke", json=body, headers=headers, timeout=120)
    replies = [answer.raise_for_status().json()["usage"]]
    with httpx.stream("POST", f"{url}/v1/functions/{function}/invoke", json={**body, "stream": True},
                      headers=headers, timeout=120) as reply:
        events = [json.loads(line[6:]) for line in reply.iter_lines() if line.startswith("data: ")]
    replies.append(events[-1]["usage"])
    native_ids.update({answer.json()["invocation_id"], events[-1]["invocation_id"]})
    client = openai.OpenAI(base_url=f"{url}/v1", api_key=key, max_retries=0)
    chat = client.chat.completions.create(model=function, messages=MESSAGES, max_tokens=5)
    replies.append(chat.usage.model_dump())
    stream = client.completions.create(model=function, prompt="Once upon a time", max_tokens=4, stream=True,
                                       stream_options={"include_usage": True})
    replies.append(next(c.usage for c in list(stream) if c.usage is not None).model_dump())
    return {"invocations": len(replies), "prompt_tokens": sum(r["prompt_tokens"] for r in replies),
            "completion_tokens": sum(r["completion_tokens"] for r in replies)}


def invoke_async(platform: PlatformProcess, key: str, function: str) -> dict[str, int]:
    client = platform.client(key)
    accepted = client.invoke_async(function, {"messages": MESSAGES, "max_tokens": 3})
    deadline = time.monotonic() + 120
    while (record := client.invocation(accepted["invocation_id"]))["status"] in ("queued", "running"):
        assert time.monotonic() < deadline
        time.sleep(0.1)
    assert record["status"] == "succeeded", record
    return {"invocations": 1, **{k: record[k] for k in ("prompt_tokens", "completion_tokens")}}


def invoke_at_once(url: str, key: str, function: str, num_requests: int = 4) -> dict[str, int]:
    """Requests sent together, so that they run on the device at the same time (batched, or side by side)."""
    def one(i: int) -> dict:
        return httpx.post(f"{url}/v1/functions/{function}/invoke", headers={"Authorization": f"Bearer {key}"},
                          json={"prompt": f"Count to {i}:", "max_tokens": 8}, timeout=120).raise_for_status().json()

    with ThreadPoolExecutor(num_requests) as pool:
        replies = [r["usage"] for r in pool.map(one, range(num_requests))]
    return {"invocations": num_requests, "prompt_tokens": sum(r["prompt_tokens"] for r in replies),
            "completion_tokens": sum(r["completion_tokens"] for r in replies)}


def invoked(group: dict) -> dict:
    """What a group's invocations were charged (not the keep-alive of instances, which grows as they retire)."""
    return {k: group[k] for k in ("tenant", "function", "invocations", "cold_starts", "prompt_tokens",
                                  "completion_tokens", "device_s", "memory_active_gb_s") if k in group}


def usage(url: str, key: str, **params) -> httpx.Response:
    return httpx.get(f"{url}/v1/usage", params=params, headers={"Authorization": f"Bearer {key}"}, timeout=30)


def settled_usage(url: str, key: str, invocations: int, **params) -> dict:
    """Usage is recorded in the background just after an invocation ends: wait until all of them are in."""
    deadline = time.monotonic() + 30
    while (summary := usage(url, key, **params).raise_for_status().json())["total"]["invocations"] < invocations:
        assert time.monotonic() < deadline, summary
        time.sleep(0.1)
    return summary


def test_usage_sums_isolation_reports_cli_and_restart(platform: PlatformProcess, tmp_path: Path,
                                                     tiny_dense_dir: Path) -> None:
    admin = platform.client()
    keys = {tenant: admin.create_key(tenant)["key"] for tenant in ("acme", "globex")}
    for seed, (tenant, function) in enumerate((("acme", "sea"), ("globex", "sky")), start=1):
        adapter = save_tiny_adapter(tmp_path / function, tiny_dense_dir, seed=seed, base_model_name="tiny-dense")
        platform.client(keys[tenant]).deploy({"name": function, "backbone": "tiny-dense"}, adapter)

    started = time.time()
    wall_started = time.monotonic()
    native_ids: dict[str, set[str]] = {"sea": set(), "sky": set()}
    expected = {"sea": invoke_every_route(platform.url, keys["acme"], "sea", native_ids["sea"])}
    between = time.time()
    expected["sky"] = invoke_every_route(platform.url, keys["globex"], "sky", native_ids["sky"])
    for extra in (invoke_async(platform, keys["globex"], "sky"), invoke_at_once(platform.url, keys["globex"], "sky")):
        expected["sky"] = {k: expected["sky"][k] + extra[k] for k in extra}
    second = invoke_every_route(platform.url, keys["acme"], "sea", native_ids["sea"])
    wall_s = time.monotonic() - wall_started
    expected["sea"] = {k: expected["sea"][k] + second[k] for k in second}

    everything = settled_usage(platform.url, platform.admin_key, 17)
    assert everything["group_by"] == "function"
    by_function = {g["function"]: g for g in everything["groups"]}
    assert set(by_function) == {"sea", "sky"}
    assert by_function["sea"]["tenant"] == "acme" and by_function["sky"]["tenant"] == "globex"
    for function, sums in expected.items():
        group = by_function[function]
        assert {k: group[k] for k in sums} == sums, function
        assert group["cold_starts"] >= 1, "each function's first request waited for its instance to start"
        assert group["device_s"] > 0 and group["memory_gb_s"] > 0 and group["memory_active_gb_s"] > 0
    assert by_function["sea"]["cold_starts"] == 1  # one request at a time: one instance, started once
    # One CPU device: the shares of all invocations (the ones sent together included) add up to its busy time,
    # never more than the wall time.
    assert 0 < everything["total"]["device_s"] <= wall_s

    # A tenant sees its own usage only, whatever it asks for.
    acme = settled_usage(platform.url, keys["acme"], 8)
    assert [g["function"] for g in acme["groups"]] == ["sea"] and acme["total"]["invocations"] == 8
    per_tenant = usage(platform.url, keys["globex"], group_by="tenant").json()
    assert per_tenant["groups"] == [{**per_tenant["total"], "tenant": "globex"}]
    per_tenant = usage(platform.url, platform.admin_key, group_by="tenant").json()
    assert {g["tenant"]: g["invocations"] for g in per_tenant["groups"]} == {"acme": 8, "globex": 9}

    # since / until, as unix seconds and as ISO 8601
    later = usage(platform.url, platform.admin_key, since=str(between)).json()
    assert later["total"]["invocations"] == 13  # globex's 9 and acme's second 4
    iso = time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(started - 1)) + "Z"
    assert usage(platform.url, platform.admin_key, since=iso, until=str(between)).json()["total"]["invocations"] == 4
    assert usage(platform.url, platform.admin_key, since=str(time.time() + 3600)).json()["total"]["invocations"] == 0
    assert usage(platform.url, platform.admin_key, since="200", until="100").json()["total"]["invocations"] == 0
    for params, field in (({"since": "yesterday"}, "since"), ({"until": "nan"}, "until"),
                          ({"group_by": "color"}, "group_by")):
        reply = usage(platform.url, keys["acme"], **params)
        assert reply.status_code in (400, 422) and field in reply.json()["error"]["message"], (params, reply.text)

    # One REPORT line per invocation in the function's logs, its tokens as billed.
    reports = REPORT.findall(admin.logs("sea"))
    assert len(reports) == 8 and len({r[0] for r in reports}) == 8
    assert len(native_ids["sea"]) == 4 and native_ids["sea"] <= {r[0] for r in reports}  # the ids the replies named
    assert sum(int(r[1]) for r in reports) == expected["sea"]["prompt_tokens"]
    assert sum(int(r[2]) for r in reports) == expected["sea"]["completion_tokens"]
    assert sum(r[3] != "warm" for r in reports) == 1 and reports[0][3].startswith("libraries_preloaded (prepare ")
    assert all(float(r[4]) > 0 for r in reports)
    assert len(REPORT.findall(platform.client(keys["globex"]).logs("sky"))) == 9

    # The CLI, as the tenant's key sees it
    env = {**os.environ, "LORAFAAS_API_KEY": keys["acme"]}
    cli = [sys.executable, "-m", "lorafaas", "--home", str(platform.home), "usage", "--url", platform.url]
    as_json = json.loads(subprocess.run([*cli, "--json"], env=env, capture_output=True, text=True, check=True).stdout)
    assert [invoked(g) for g in as_json["groups"]] == [invoked(g) for g in acme["groups"]]
    table = subprocess.run([*cli, "--group-by", "tenant"], env=env, capture_output=True, text=True, check=True).stdout
    assert table.splitlines()[0].split()[:3] == ["TENANT", "INVOCATIONS", "COLD"]
    assert table.splitlines()[1].split()[:2] == ["acme", "8"]
    bad = subprocess.run([*cli, "--since", "soon"], env=env, capture_output=True, text=True)
    assert bad.returncode == 2 and "since" in bad.stderr

    # The totals survive a restart of the gateway (same home, same state store); stopping it retired the idle
    # instances, whose last keep-alive is now charged to their functions.
    platform.stop()
    platform.start()
    restarted = usage(platform.url, platform.admin_key).json()
    assert [invoked(g) for g in restarted["groups"]] == [invoked(g) for g in everything["groups"]]
    for before, after in zip(everything["groups"], restarted["groups"], strict=True):
        assert after["memory_idle_gb_s"] > before["memory_idle_gb_s"] and after["keep_alive_s"] > 0


# -- issue 36 findings 8 and 9: billing that cannot be dodged -------------------------------------------------------


@pytest.fixture(scope="module")
def billing(tmp_path_factory, tiny_dense_dir: Path):
    """One platform (SQLite) and a tenant key, for the billing attacks."""
    home = tmp_path_factory.mktemp("billing-home")
    ModelStore(home / "models").import_dir("tiny-dense", tiny_dense_dir)
    with PlatformProcess(home) as running:
        key = running.client().create_key("mallory")["key"]
        yield running, key


def deploy_for(platform: PlatformProcess, key: str, function: str, tmp_path: Path, tiny_dense_dir: Path) -> None:
    adapter = save_tiny_adapter(tmp_path / function, tiny_dense_dir, seed=7, base_model_name="tiny-dense")
    platform.client(key).deploy({"name": function, "backbone": "tiny-dense"}, adapter)


def function_usage(platform: PlatformProcess, key: str, function: str) -> dict:
    groups = usage(platform.url, key).raise_for_status().json()["groups"]
    return next((g for g in groups if g["function"] == function), {"invocations": 0})


@pytest.mark.parametrize("route", ["openai", "native"])
def test_a_stream_hung_up_on_is_charged_what_it_produced(billing, tmp_path: Path, tiny_dense_dir: Path,
                                                         route: str) -> None:
    platform, key = billing
    function = f"hangup-{route}"
    deploy_for(platform, key, function, tmp_path, tiny_dense_dir)
    max_tokens = 200
    request = {"prompt": "Once upon a time", "max_tokens": max_tokens, "stream": True}
    if route == "openai":
        path, request = "/v1/completions", {**request, "model": function, "ignore_eos": True}
    else:  # the end-of-sequence token is never drawn, so the stream runs its max_tokens
        eos_id = AutoTokenizer.from_pretrained(tiny_dense_dir).eos_token_id
        path, request = f"/v1/functions/{function}/invoke", {**request, "logit_bias": {str(eos_id): -100}}
    body = json.dumps(request).encode()
    conn = socket.create_connection(("127.0.0.1", platform.port))
    conn.sendall(f"POST {path} HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {key}\r\n"
                 f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n".encode() + body)
    received = b""
    conn.settimeout(120)
    while received.count(b'"text": "') < 4:  # the first chunks of the stream, then the client hangs up
        chunk = conn.recv(4096)
        assert chunk, received
        received += chunk
    assert received.startswith(b"HTTP/1.1 200"), received
    conn.close()

    deadline = time.monotonic() + 30
    while (group := function_usage(platform, key, function))["invocations"] < 1:
        assert time.monotonic() < deadline, f"the abandoned stream was never charged: {group}"
        time.sleep(0.2)
    assert group["invocations"] == 1
    assert group["prompt_tokens"] > 0
    assert 3 <= group["completion_tokens"] < max_tokens, group  # what was produced before the hang-up, no more
    assert group["device_s"] > 0 and group["memory_active_gb_s"] > 0


def test_n_choices_are_charged_the_prompt_once_as_the_reply_says(billing, tmp_path: Path,
                                                                  tiny_dense_dir: Path) -> None:
    platform, key = billing
    deploy_for(platform, key, "choices", tmp_path, tiny_dense_dir)
    client = openai.OpenAI(base_url=f"{platform.url}/v1", api_key=key, max_retries=0)
    chat = client.chat.completions.create(model="choices", messages=MESSAGES, max_tokens=5, n=3)
    completion = client.completions.create(model="choices", prompt=["Once upon a time", "The sea"], max_tokens=4,
                                           n=2)
    replies = [chat.usage, completion.usage]
    assert chat.usage.prompt_tokens > 0
    deadline = time.monotonic() + 30
    while (group := function_usage(platform, key, "choices"))["invocations"] < 3 + 4:
        assert time.monotonic() < deadline, group
        time.sleep(0.2)
    assert group["invocations"] == 7  # one invocation per choice
    assert group["prompt_tokens"] == sum(r.prompt_tokens for r in replies), (group, replies)
    assert group["completion_tokens"] == sum(r.completion_tokens for r in replies), (group, replies)
