"""Isolation on a real platform process: between tenants over HTTP (every route the app serves, found in its own
OpenAPI document, so a new endpoint is covered without editing this test), between processes on the machine (file
modes of sockets and directories, checked by a process of another user), the read-only backbone, and the limits of
one request (tokens, wall time)."""

from __future__ import annotations

import json
import os
import signal
import socket
import stat
import time

import httpx
import pytest

from lorafaas.formats.model_store import ModelStore
from lorafaas.platform.adapter_upload import pack_adapter
from lorafaas.platform.api_client import ApiClient
from lorafaas.platform.auth import key_id_of
from lorafaas.protocols.daemon_config import DaemonConfig
from lorafaas.testing.attach_probe import ProbeProcess
from lorafaas.testing.platform_process import PlatformProcess
from lorafaas.testing.tiny_models import save_tiny_adapter

SECRET_FUNCTION = "secret-fn"
SECRET_PROMPT = "the launch code of team a"
NOBODY_UID = 65534


@pytest.fixture(scope="module")
def world(tmp_path_factory, tiny_dense_dir):
    """A platform with tenants team-a (one function, one finished async invocation) and team-b (nothing)."""
    home = tmp_path_factory.mktemp("isolation-home")
    ModelStore(home / "models").import_dir("tiny-dense", tiny_dense_dir)
    adapters = {
        name: save_tiny_adapter(home / f"src-{name}", tiny_dense_dir, seed=seed, base_model_name="tiny-dense")
        for seed, name in enumerate(("a", "b"), start=1)
    }
    with PlatformProcess(home) as platform, platform.client() as admin:
        keys = {tenant: admin.create_key(f"team-{tenant}")["key"] for tenant in ("a", "b")}
        with ApiClient(platform.url, keys["a"]) as a:
            spec = a.deploy({"name": SECRET_FUNCTION, "backbone": "tiny-dense", "max_tokens_limit": 64}, adapters["a"])
            accepted = a.invoke_async(SECRET_FUNCTION, {"prompt": SECRET_PROMPT, "max_tokens": 4})
            deadline = time.monotonic() + 60
            while (record := a.invocation(accepted["invocation_id"]))["status"] in ("queued", "running"):
                assert time.monotonic() < deadline
                time.sleep(0.1)
        assert record["status"] == "succeeded"
        yield {
            "platform": platform,
            "admin": admin,
            "keys": keys,
            "adapters": adapters,
            "spec": spec,
            "invocation": record,
        }


def request_body(method: str, operation: dict, components: dict, world) -> dict:
    """Keyword arguments for httpx that make a request B could plausibly send to reach A's function."""
    content = operation.get("requestBody", {}).get("content", {})
    if "multipart/form-data" in content:  # deploy, deploy many or replace: A's name, B's adapter
        archive = pack_adapter(world["adapters"]["b"])
        if "specs" in _form_fields(content["multipart/form-data"], components):  # POST /v1/functions:batch
            return {"data": {"specs": json.dumps([{"name": SECRET_FUNCTION, "backbone": "tiny-dense"}])},
                    "files": [("adapters", ("a.tar.gz", archive, "application/gzip"))]}
        spec = {"name": SECRET_FUNCTION, "backbone": "tiny-dense"} if method == "post" else {"max_instances": 1}
        return {"data": {"spec": json.dumps(spec)}, "files": {"adapter": ("a.tar.gz", archive, "application/gzip")}}
    if "application/json" in content:
        schema = content["application/json"]["schema"]
        if "$ref" in schema:
            schema = components[schema["$ref"].rsplit("/", 1)[1]]
        values = {
            "prompt": "tell me your secrets",
            "max_tokens": 2,
            "model": SECRET_FUNCTION,
            "tenant": "team-a",
            "messages": [{"role": "user", "content": "tell me your secrets"}],
            "input": "tell me your secrets",  # POST /v1/responses
            "max_output_tokens": 2,
        }
        body = {key: value for key, value in values.items() if key in schema.get("properties", {})}
        if "prompt" in body and "messages" in body:
            del body["messages"]
        return {"json": body}
    return {}


def _form_fields(media: dict, components: dict) -> set[str]:
    schema = media.get("schema", {})
    if "$ref" in schema:
        schema = components[schema["$ref"].rsplit("/", 1)[1]]
    return set(schema.get("properties", {}))


def path_for(path: str, world) -> str:
    values = {"name": SECRET_FUNCTION, "invocation_id": world["invocation"]["invocation_id"],
              "key_id": key_id_of(world["keys"]["a"])}
    for param in [part[1:-1] for part in path.split("/") if part.startswith("{")]:
        assert param in values, f"route {path} has a path parameter {param!r} this test cannot fill: add it"
        path = path.replace(f"{{{param}}}", values[param])
    return path


def a_state(world) -> tuple:
    admin = world["admin"]
    spec = admin.describe(SECRET_FUNCTION)["function"]
    return (
        spec,
        admin.invocation(world["invocation"]["invocation_id"]),
        sorted(p.name for p in (world["platform"].home / "adapters").iterdir()),
    )


def test_no_route_lets_tenant_b_reach_tenant_a(world) -> None:
    platform, spec, invocation = world["platform"], world["spec"], world["invocation"]
    document = httpx.get(f"{platform.url}/openapi.json").json()
    components = document.get("components", {}).get("schemas", {})
    secrets_of_a = [spec["adapter_digest"], SECRET_PROMPT, invocation["result_text"], "team-a"]
    before = a_state(world)
    headers_b = {"Authorization": f"Bearer {world['keys']['b']}"}
    seen = []
    for path, methods in document["paths"].items():
        for method, operation in methods.items():
            reply = httpx.request(
                method.upper(),
                f"{platform.url}{path_for(path, world)}",
                headers=headers_b,
                timeout=60,
                **request_body(method, operation, components, world),
            )
            where = f"{method.upper()} {path} as team-b -> {reply.status_code}: {reply.text[:300]}"
            seen.append((method.upper(), path, reply.status_code))
            for secret in secrets_of_a:
                assert secret not in reply.text, f"{where} reveals {secret!r}"
            if path.endswith(":batch"):
                # many deploys in one request: each entry answers on its own, and A's name is refused as taken
                assert reply.status_code == 200, where
                [refused] = reply.json()["refused"]
                assert (refused["name"], refused["code"], reply.json()["deployed"]) == (
                    SECRET_FUNCTION, "already_exists", []), where
            elif "{" in path or method != "get":
                # Anything aimed at A's function or invocation is refused as if it did not exist (404); deploying
                # under A's name is refused as taken (409: names are one namespace); admin routes are 403.
                assert reply.status_code in (403, 404, 409), where
            else:
                assert reply.status_code < 400 or reply.status_code == 403, where
                assert SECRET_FUNCTION not in reply.text, f"{where} lists A's function"
            assert a_state(world) == before, f"{where} changed A's function, invocation or adapters"
    routes = {(m, p) for m, p, _ in seen}
    for route in [
        ("GET", "/v1/functions"),
        ("GET", "/v1/models"),
        ("POST", "/v1/functions/{name}/invoke"),
        ("PATCH", "/v1/functions/{name}"),
        ("DELETE", "/v1/functions/{name}"),
        ("GET", "/v1/invocations/{invocation_id}"),
        ("POST", "/v1/chat/completions"),
        ("POST", "/v1/responses"),
    ]:
        assert route in routes, f"{route} was not exercised"
    with ApiClient(platform.url, world["keys"]["a"]) as a:  # and A is served as before
        assert a.invoke(SECRET_FUNCTION, {"prompt": "hi", "max_tokens": 2})["usage"]["completion_tokens"] == 2


def as_user(uid: int, action) -> str:
    """Run `action()` in a child process with another uid; return what it reports (an exception's class name)."""
    read_end, write_end = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: drop to `uid`, try, report, exit without running any test machinery
        os.close(read_end)
        try:
            os.setgid(uid)
            os.setuid(uid)
            outcome = action()
        except Exception as exc:
            outcome = type(exc).__name__
        os.write(write_end, str(outcome).encode())
        os._exit(0)
    os.close(write_end)
    with os.fdopen(read_end) as reader:
        outcome = reader.read()
    os.waitpid(pid, 0)
    return outcome


def test_sockets_and_run_directories_are_private_to_the_platform_user(world) -> None:
    platform = world["platform"]
    world["admin"].invoke(SECRET_FUNCTION, {"prompt": "wake up", "max_tokens": 2})  # an instance is running
    [instance] = world["admin"].describe(SECRET_FUNCTION)["instances"]
    run_dir = platform.home / "run"
    sockets = [p for p in run_dir.iterdir() if stat.S_ISSOCK(p.stat().st_mode)]
    assert any(p.name.startswith(instance["instance_id"]) for p in sockets), sockets
    assert len(sockets) >= 3, sockets  # an instance, the library pool, the backbone daemon
    for directory in (run_dir, platform.home / "logs"):
        assert stat.S_IMODE(directory.stat().st_mode) == 0o700, directory
    for path in sockets:
        assert stat.S_IMODE(path.stat().st_mode) & 0o077 == 0, f"{path} is {oct(path.stat().st_mode)}"
    assert stat.S_IMODE((platform.home / "admin.key").stat().st_mode) == 0o600
    if os.geteuid() != 0:
        pytest.skip("checking access as another user needs root (to switch users)")
    instance_socket = next(p for p in sockets if p.name.startswith(instance["instance_id"]))

    def connect() -> str:
        with socket.socket(socket.AF_UNIX) as sock:
            sock.connect(str(instance_socket))
        return "connected"

    assert as_user(NOBODY_UID, connect) == "PermissionError"
    assert as_user(NOBODY_UID, lambda: (platform.home / "admin.key").read_text() and "read") == "PermissionError"


def test_a_process_writing_the_backbone_faults_and_the_platform_serves_on(world) -> None:
    platform, admin = world["platform"], world["admin"]
    before = admin.invoke(SECRET_FUNCTION, {"prompt": "same answer", "max_tokens": 6})["text"]
    daemon_socket = DaemonConfig(home=platform.home, backbone="tiny-dense", device="cpu").paths.socket
    with ProbeProcess(["daemon", str(daemon_socket), "fn-rogue"]) as rogue:
        assert rogue.wait_report().params_in_segment  # it holds the platform's own shared backbone
        rogue.send("write")
        assert rogue.wait_exit() == -signal.SIGSEGV, rogue.stderr()[-500:]  # SIGSEGV: the mapping is read-only
    assert admin.invoke(SECRET_FUNCTION, {"prompt": "same answer", "max_tokens": 6})["text"] == before


def test_per_request_limits_max_tokens_and_wall_time(world) -> None:
    platform, admin = world["platform"], world["admin"]
    too_many = httpx.post(
        f"{platform.url}/v1/functions/{SECRET_FUNCTION}/invoke",
        timeout=60,
        headers={"Authorization": f"Bearer {world['keys']['a']}"},
        json={"prompt": "x", "max_tokens": 65},
    )
    assert too_many.status_code == 422 and "max_tokens" in too_many.json()["error"]["message"]
    admin.update(SECRET_FUNCTION, {"max_request_s": 0.5})
    admin.invoke(SECRET_FUNCTION, {"prompt": "x", "max_tokens": 2})
    pids = [i["pid"] for i in admin.describe(SECRET_FUNCTION)["instances"]]  # the new version's, maybe an old one
    for pid in pids:
        os.kill(pid, signal.SIGSTOP)  # a request that never ends, whatever the machine's speed
    try:
        for stream in (False, True):
            started = time.monotonic()
            reply = httpx.post(
                f"{platform.url}/v1/functions/{SECRET_FUNCTION}/invoke",
                timeout=60,
                headers={"Authorization": f"Bearer {platform.admin_key}"},
                json={"prompt": "a long story", "max_tokens": 8, "stream": stream},
            )
            assert reply.status_code == 504, reply.text
            error = reply.json()["error"]
            assert error["code"] == "invocation_timeout" and "0.5 s" in error["message"], error
            assert time.monotonic() - started < 10
    finally:
        for pid in pids:
            os.kill(pid, signal.SIGCONT)
        admin.update(SECRET_FUNCTION, {"max_request_s": 300})
    assert admin.invoke(SECRET_FUNCTION, {"prompt": "x", "max_tokens": 2})["usage"]["completion_tokens"] == 2
