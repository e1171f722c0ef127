"""A hostile tenant with one key and ordinary HTTP (issue 18): every attempt is a clear 4xx, nothing leaks between
tenants or deployments, and the gateway keeps answering /healthz meanwhile. One tiny-backbone platform per module."""

from __future__ import annotations

import gzip
import io
import json
import os
import socket
import tarfile
import time
from pathlib import Path

import httpx
import psutil
import pytest

from lorafaas.formats.model_store import ModelStore
from lorafaas.platform.adapter_upload import pack_adapter
from lorafaas.platform.api_client import ApiClient
from lorafaas.platform.gateway.limits import MAX_CONCURRENT_UPLOADS, MAX_UPLOADS_PER_TENANT
from lorafaas.platform.state.records import MAX_SEED
from lorafaas.testing.hostile import (
    multipart_head,
    redos_adapter,
    tar_of_folders,
    zero_adapter,
)
from lorafaas.testing.platform_process import PlatformProcess
from lorafaas.testing.tiny_models import save_tiny_adapter

CONFIG, WEIGHTS = "adapter_config.json", "adapter_model.safetensors"
BACKBONE = "tiny-dense"


@pytest.fixture(scope="module")
def adapters(tmp_path_factory, tiny_dense_dir) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("hostile-adapters")
    return {f"a{seed}": save_tiny_adapter(root / f"a{seed}", tiny_dense_dir, seed=seed, base_model_name=BACKBONE)
            for seed in range(1, 5)}


@pytest.fixture(scope="module")
def platform(tmp_path_factory, tiny_dense_dir, adapters):
    home = tmp_path_factory.mktemp("hostile-home")
    ModelStore(home / "models").import_dir(BACKBONE, tiny_dense_dir)
    one = sum((adapters["a1"] / name).stat().st_size for name in (CONFIG, WEIGHTS))  # what the store keeps
    # Room for two distinct adapters per tenant, not three: the quota test needs a small, exact quota.
    with PlatformProcess(home, extra_args=("--tenant-adapter-quota", str(int(one * 2.5)))) as running:
        with running.client() as admin:
            admin.deploy({"name": "alpha", "backbone": BACKBONE}, adapters["a1"])
        yield running


@pytest.fixture
def admin_headers(platform) -> dict[str, str]:
    return {"Authorization": f"Bearer {platform.admin_key}"}


def new_tenant(platform, name: str) -> dict[str, str]:
    with platform.client() as admin:
        return {"Authorization": f"Bearer {admin.create_key(name)['key']}"}


def deploy(platform, headers, archive: bytes, name: str, **spec) -> httpx.Response:
    return httpx.post(f"{platform.url}/v1/functions", headers=headers, timeout=120,
                      data={"spec": json.dumps({"name": name, "backbone": BACKBONE, **spec})},
                      files={"adapter": ("adapter.tar.gz", archive, "application/gzip")})


def error_of(reply: httpx.Response, status: int, code: str) -> str:
    assert reply.status_code == status, reply.text
    error = reply.json()["error"]
    assert error["code"] == code, error
    return error["message"]


def assert_no_server_path(platform, text: str) -> None:
    for path in (str(platform.home), "/tmp/", "lorafaas-upload-", ".sock"):
        assert path not in text, f"{path!r} named in {text!r}"


def stored_adapters(platform) -> set[str]:
    root = platform.home / "adapters"
    return {p.name for p in root.iterdir() if not p.name.startswith(".")} if root.is_dir() else set()


# -- item 2: metric labels ------------------------------------------------------------------------------------------


def test_invocations_of_unknown_functions_add_no_metric_series(platform, admin_headers) -> None:
    names = [f"nobody-{i}-{'x' * 40}" for i in range(20)]
    for name in names:
        reply = httpx.post(f"{platform.url}/v1/functions/{name}/invoke", headers=admin_headers,
                           json={"prompt": "hi", "max_tokens": 1}, timeout=30)
        error_of(reply, 404, "function_not_found")
    huge = "m" * (1024 * 1024)  # a 1 MB model name fits the JSON body limit
    reply = httpx.post(f"{platform.url}/v1/completions", headers=admin_headers,
                       json={"model": huge, "prompt": "hi", "max_tokens": 1}, timeout=30)
    assert reply.status_code == 404, reply.text[:300]
    metrics = httpx.get(f"{platform.url}/metrics", headers=admin_headers, timeout=30).text
    assert not any(name in metrics for name in names) and huge[:100] not in metrics
    assert 'lorafaas_invocations_total{function="(unknown)",status="rejected"}' in metrics
    assert len(metrics) < 200_000, len(metrics)


# -- item 11: seeds, truncated tars, no server paths ---------------------------------------------------------------


@pytest.mark.parametrize("seed", [2**63, -(2**63) - 1, 10**30, 2**53])
def test_out_of_range_seeds_are_refused_on_every_route(platform, admin_headers, seed) -> None:
    routes = {
        "invoke": ("/v1/functions/alpha/invoke", {"prompt": "hi", "max_tokens": 1, "seed": seed}),
        "invoke async": ("/v1/functions/alpha/invoke?mode=async", {"prompt": "hi", "max_tokens": 1, "seed": seed}),
        "completions": ("/v1/completions", {"model": "alpha", "prompt": "hi", "max_tokens": 1, "seed": seed}),
        "chat": ("/v1/chat/completions", {"model": "alpha", "max_tokens": 1, "seed": seed,
                                          "messages": [{"role": "user", "content": "hi"}]}),
    }
    for route, (path, body) in routes.items():
        reply = httpx.post(f"{platform.url}{path}", headers=admin_headers, json=body, timeout=30)
        status = 422 if path.startswith("/v1/functions") else 400  # the OpenAI routes answer as OpenAI does
        assert "seed" in error_of(reply, status, "invalid_input"), (route, reply.text)
    edge = httpx.post(f"{platform.url}/v1/functions/alpha/invoke", headers=admin_headers, timeout=60,
                      json={"prompt": "hi", "max_tokens": 2, "temperature": 1.0, "seed": MAX_SEED})
    assert edge.status_code == 200, edge.text


def test_a_truncated_tar_is_a_422_naming_no_server_path(platform, admin_headers, adapters) -> None:
    archive = pack_adapter(adapters["a2"])
    # the CLI's tar is plain: cutting its trailing zero blocks loses nothing, so the last cut is 64 bytes into the
    # last file's data (a gzipped archive was cut 64 bytes from its end)
    with tarfile.open(fileobj=io.BytesIO(archive)) as tar:
        data_end = max(member.offset_data + member.size for member in tar.getmembers())
    for cut in (len(archive) // 2, data_end - 64):
        reply = deploy(platform, admin_headers, archive[:cut], "truncated")
        message = error_of(reply, 422, "adapter_invalid")
        assert "truncated" in message or "not a tar" in message, message
        assert_no_server_path(platform, reply.text)
    unknown = deploy(platform, admin_headers, archive, "nowhere", backbone="no-such-backbone")
    error_of(unknown, 404, "backbone_not_found")
    assert_no_server_path(platform, unknown.text)


# -- item 3: uploads -----------------------------------------------------------------------------------------------


def test_a_tar_of_200000_folders_is_refused(platform, admin_headers) -> None:
    reply = deploy(platform, admin_headers, tar_of_folders(200_000), "folders")
    assert "more than 16 entries" in error_of(reply, 422, "adapter_invalid")


def test_a_rank_beyond_its_layer_and_an_adapter_larger_than_its_backbone_are_refused(
    platform, admin_headers, tmp_path, tiny_dense_dir
) -> None:
    zeros = zero_adapter(tmp_path / "zeros", tiny_dense_dir, rank=4096, base_model_name=BACKBONE)
    archive = gzip.compress(pack_adapter(zeros))  # the CLI sends a plain tar; an attacker gzips (still accepted)
    assert len(archive) < (zeros / WEIGHTS).stat().st_size // 100  # tiny to send, large to store
    message = error_of(deploy(platform, admin_headers, archive, "zeros"), 422, "adapter_invalid")
    assert "rank 4096" in message and "lower r" in message, message
    # A rank each layer can use, on every linear layer: more parameters than half the backbone.
    wide = save_tiny_adapter(tmp_path / "wide", tiny_dense_dir, rank=32, base_model_name=BACKBONE,
                             target_modules=("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj",
                                             "down_proj"))
    message = error_of(deploy(platform, admin_headers, pack_adapter(wide), "wide"), 422, "adapter_invalid")
    assert "parameters" in message and "at most" in message, message
    assert not any((platform.home / "adapters" / d / WEIGHTS).stat().st_size > 10**6
                   for d in stored_adapters(platform))


def test_adapters_no_function_uses_are_removed(platform, adapters) -> None:
    headers = new_tenant(platform, "gc-tenant")
    with ApiClient(platform.url, headers["Authorization"].removeprefix("Bearer ")) as tenant:
        first = tenant.deploy({"name": "gc-fn", "backbone": BACKBONE}, adapters["a2"])["adapter_digest"]
        assert first in stored_adapters(platform)
        second = tenant.update("gc-fn", {}, adapters["a3"])["adapter_digest"]
        assert second != first and second in stored_adapters(platform)
        assert first not in stored_adapters(platform), "PATCH left the replaced adapter behind"
        tenant.delete("gc-fn")
        assert second not in stored_adapters(platform), "DELETE left the function's adapter behind"
    # A deploy refused after its adapter was stored (the name is taken) stores nothing either.
    taken = deploy(platform, headers, pack_adapter(adapters["a4"]), "alpha")
    error_of(taken, 409, "already_exists")
    digests_before = stored_adapters(platform)
    assert len(digests_before) == 1  # alpha's only


def test_a_tenants_adapters_are_bounded_by_its_quota(platform, adapters) -> None:
    headers = new_tenant(platform, "quota-tenant")
    assert deploy(platform, headers, pack_adapter(adapters["a1"]), "q1").status_code == 201
    assert deploy(platform, headers, pack_adapter(adapters["a1"]), "q1-again").status_code == 201  # shared: once
    assert deploy(platform, headers, pack_adapter(adapters["a2"]), "q2").status_code == 201
    reply = deploy(platform, headers, pack_adapter(adapters["a3"]), "q3")
    assert "quota" in error_of(reply, 413, "quota_exceeded")
    # Another tenant has its own quota; and freeing space lets the first tenant deploy again.
    assert deploy(platform, new_tenant(platform, "quota-other"), pack_adapter(adapters["a3"]), "q3").status_code == 201
    assert httpx.delete(f"{platform.url}/v1/functions/q2", headers=headers, timeout=60).status_code == 200
    assert deploy(platform, headers, pack_adapter(adapters["a3"]), "q4").status_code == 201


def test_an_upload_is_spooled_to_disk_not_held_in_memory(platform, admin_headers) -> None:
    gateway = psutil.Process(platform.process.pid)
    size = 400 * 1024**2
    head, tail = multipart_head("big", BACKBONE), b"\r\n--edge-boundary--\r\n"

    def body():
        yield head
        chunk = os.urandom(1024**2)
        for _ in range(size // len(chunk)):
            yield chunk
        yield tail

    before = gateway.memory_info().rss
    peak = before
    with httpx.Client(timeout=300) as client:
        reply = client.post(f"{platform.url}/v1/functions", content=body(), headers={
            **admin_headers, "Content-Type": "multipart/form-data; boundary=edge-boundary",
            "Content-Length": str(len(head) + size + len(tail))})
        peak = max(peak, gateway.memory_info().rss)
    error_of(reply, 422, "adapter_invalid")
    assert peak - before < 200 * 1024**2, f"the gateway grew by {(peak - before) / 1024**2:.0f} MB"


def stalled_upload(platform, headers) -> socket.socket:
    """A deploy whose body stops after its multipart head: the gateway holds it as an upload in progress."""
    conn = socket.create_connection(("127.0.0.1", platform.port))
    conn.sendall(
        f"POST /v1/functions HTTP/1.1\r\nHost: x\r\nAuthorization: {headers['Authorization']}\r\n"
        f"Content-Type: multipart/form-data; boundary=edge-boundary\r\nContent-Length: {10 * 1024**2}\r\n"
        "\r\n".encode() + multipart_head("stalled", BACKBONE))
    conn.settimeout(0.5)
    try:
        answer = conn.recv(100)  # a previous test's upload may still hold a slot for a moment: then 429
    except TimeoutError:
        return conn  # no answer: it is being received
    conn.close()
    assert answer.startswith(b"HTTP/1.1 429"), answer
    time.sleep(0.5)
    return stalled_upload(platform, headers)


def test_uploads_beyond_the_concurrency_cap_are_429(platform, admin_headers) -> None:
    stalled = []
    uploaders = [admin_headers] + [new_tenant(platform, f"cap-{i}")
                                   for i in range(MAX_CONCURRENT_UPLOADS // MAX_UPLOADS_PER_TENANT - 1)]
    try:
        for headers in uploaders:
            for _ in range(MAX_UPLOADS_PER_TENANT):
                stalled.append(stalled_upload(platform, headers))
        reply = deploy(platform, new_tenant(platform, "cap-late"), b"anything", "one-more")
        assert "adapter uploads are in progress" in error_of(reply, 429, "too_many_requests")
        assert reply.headers["retry-after"]
        reply = deploy(platform, admin_headers, b"anything", "one-more")
        assert "this tenant has" in error_of(reply, 429, "too_many_requests")
        # Without a valid key an upload takes no slot: it is refused before its body is read.
        reply = deploy(platform, {"Authorization": "Bearer lf_nobody_x"}, b"anything", "one-more")
        error_of(reply, 401, "unauthorized")
    finally:
        for conn in stalled:
            conn.close()
    deadline = time.monotonic() + 10
    while (reply := deploy(platform, admin_headers, b"not a tar", "after")).status_code == 429:
        assert time.monotonic() < deadline
        time.sleep(0.2)
    error_of(reply, 422, "adapter_invalid")


# -- issue 36 finding 7: slow uploads ------------------------------------------------------------------------------

UPLOAD_TIMEOUT_S = 4.0  # the short body timeout the slow-upload platform runs with


@pytest.fixture(scope="module")
def slow_upload_platform(tmp_path_factory, tiny_dense_dir):
    home = tmp_path_factory.mktemp("slow-upload-home")
    ModelStore(home / "models").import_dir(BACKBONE, tiny_dense_dir)
    with PlatformProcess(home, extra_args=("--upload-timeout", str(UPLOAD_TIMEOUT_S))) as running:
        yield running


def raw_upload(platform, headers, name: str) -> socket.socket:
    """A deploy sent by hand: headers and the multipart head, then nothing (the caller may drip more)."""
    conn = socket.create_connection(("127.0.0.1", platform.port))
    conn.sendall(
        f"POST /v1/functions HTTP/1.1\r\nHost: x\r\nAuthorization: {headers['Authorization']}\r\n"
        f"Content-Type: multipart/form-data; boundary=edge-boundary\r\nContent-Length: {10 * 1024**2}\r\n"
        "\r\n".encode() + multipart_head(name, BACKBONE))
    return conn


def answer_of(conn: socket.socket, timeout_s: float) -> tuple[int, dict] | None:
    """The status and JSON error of the gateway's answer on a raw connection, or None if none came in time."""
    conn.settimeout(timeout_s)
    data = b""
    try:
        while b"\r\n\r\n" not in data or not data.rstrip().endswith(b"}"):
            chunk = conn.recv(65536)
            if not chunk:
                break
            data += chunk
    except TimeoutError:
        if not data:
            return None
    head, _, body = data.partition(b"\r\n\r\n")
    return int(head.split()[1]), json.loads(body)


def test_a_tenants_slow_uploads_neither_refuse_another_tenants_deploy_nor_hold_their_slots(
        slow_upload_platform, adapters) -> None:
    platform = slow_upload_platform
    hostile, other = new_tenant(platform, "slow-a"), new_tenant(platform, "slow-b")
    idle = [raw_upload(platform, hostile, f"idle-{i}") for i in range(MAX_CONCURRENT_UPLOADS)]
    try:
        started = time.monotonic()
        answers = [answer_of(conn, 0.5) for conn in idle]
        held = [conn for conn, answer in zip(idle, answers, strict=True) if answer is None]
        refused = [answer for answer in answers if answer is not None]
        # One tenant holds at most its share of the gateway's uploads; the rest of its uploads are refused at once.
        assert 0 < len(held) < MAX_CONCURRENT_UPLOADS, answers
        assert all(status == 429 and "this tenant" in error["error"]["message"] for status, error in refused)
        # Another tenant deploys (and replaces) meanwhile.
        reply = deploy(platform, other, pack_adapter(adapters["a2"]), "slow-b-fn")
        assert reply.status_code == 201, reply.text
        assert all(answer_of(conn, 0.01) is None for conn in held), "the deploy waited for the slow uploads to be cut"
        # The idle uploads are cut after the timeout, with a clear 408, and their slots are free again.
        for conn in held:
            answer = answer_of(conn, UPLOAD_TIMEOUT_S + 10)
            assert answer is not None and answer[0] == 408, answer
            assert answer[1]["error"]["code"] == "request_timeout", answer
            assert "may pause at most" in answer[1]["error"]["message"], answer
        assert time.monotonic() - started < UPLOAD_TIMEOUT_S + 10
    finally:
        for conn in idle:
            conn.close()
    # An upload that trickles (a byte every 0.2 s: never idle, far below the minimum rate) is cut as well.
    drip = raw_upload(platform, hostile, "drip")
    try:
        started = time.monotonic()
        answer = None
        while answer is None and time.monotonic() - started < UPLOAD_TIMEOUT_S + 10:
            drip.sendall(b"x")
            answer = answer_of(drip, 0.2)
        assert answer is not None and answer[0] == 408, answer
        assert "bytes/s after its first" in answer[1]["error"]["message"], answer
    finally:
        drip.close()
    reply = deploy(platform, hostile, pack_adapter(adapters["a3"]), "slow-a-fn")
    assert reply.status_code == 201, reply.text


# -- item 8: logs belong to one deployment --------------------------------------------------------------------------


def test_logs_belong_to_one_deployment(platform, adapters) -> None:
    a = new_tenant(platform, "logs-a")
    b = new_tenant(platform, "logs-b")
    assert deploy(platform, a, pack_adapter(adapters["a1"]), "acme-secret").status_code == 201
    assert deploy(platform, b, pack_adapter(adapters["a1"]), "acme").status_code == 201
    for headers, name in ((a, "acme-secret"), (b, "acme")):
        reply = httpx.post(f"{platform.url}/v1/functions/{name}/invoke", headers=headers, timeout=120,
                           json={"prompt": "hello", "max_tokens": 2})
        assert reply.status_code == 200, reply.text
    logs_b = httpx.get(f"{platform.url}/v1/functions/acme/logs", headers=b, timeout=30).text
    logs_a = httpx.get(f"{platform.url}/v1/functions/acme-secret/logs", headers=a, timeout=30).text
    assert "==> acme-" in logs_b and "acme-secret" not in logs_b, logs_b[:500]
    assert "==> acme-secret-" in logs_a
    # Deleted and deployed again under the same name: the new deployment starts with no logs.
    assert httpx.delete(f"{platform.url}/v1/functions/acme", headers=b, timeout=60).status_code == 200
    assert not list((platform.home / "logs").rglob("acme-[0-9a-f]*.log"))
    assert deploy(platform, b, pack_adapter(adapters["a1"]), "acme").status_code == 201
    assert httpx.get(f"{platform.url}/v1/functions/acme/logs", headers=b, timeout=30).text == ""


# -- item 9: names --------------------------------------------------------------------------------------------------


def test_reserved_tenant_names_and_other_tenants_in_a_spec_are_refused(platform, admin_headers, adapters) -> None:
    for reserved in ("admin", "system"):
        reply = httpx.post(f"{platform.url}/v1/keys", headers=admin_headers, json={"tenant": reserved}, timeout=30)
        assert "reserved" in error_of(reply, 403, "forbidden")
    tenant = new_tenant(platform, "names-a")
    for other in ("admin", "names-b"):
        reply = deploy(platform, tenant, pack_adapter(adapters["a1"]), "impostor", tenant=other)
        assert "tenant" in error_of(reply, 403, "forbidden")
    own = deploy(platform, tenant, pack_adapter(adapters["a1"]), "own", tenant="names-a")
    assert own.status_code == 201 and own.json()["tenant"] == "names-a"
    on_behalf = deploy(platform, admin_headers, pack_adapter(adapters["a1"]), "for-b", tenant="names-b")
    assert on_behalf.status_code == 201 and on_behalf.json()["tenant"] == "names-b"


# -- item 10: keys --------------------------------------------------------------------------------------------------


def test_keys_are_listed_with_their_last_use_and_revoked(platform, admin_headers, cli) -> None:
    with platform.client() as admin:
        created = admin.create_key("keys-a")
        listed = {k.key_id: k for k in admin.list_keys()}
        assert listed[created["key_id"]].last_used_at is None
        before = time.time()
        assert httpx.get(f"{platform.url}/v1/functions", timeout=30,
                         headers={"Authorization": f"Bearer {created['key']}"}).status_code == 200
        used = {k.key_id: k for k in admin.list_keys()}[created["key_id"]].last_used_at
        assert used is not None and used >= before - 1
        admin_id = next(k.key_id for k in admin.list_keys() if k.is_admin)
    refused = httpx.delete(f"{platform.url}/v1/keys/{admin_id}", headers=admin_headers, timeout=30)
    assert "admin key" in error_of(refused, 403, "forbidden")
    env = {"LORAFAAS_API_KEY": platform.admin_key}
    listing = cli("--home", str(platform.home), "keys", "list", "--url", platform.url, env=env)
    assert listing.returncode == 0 and created["key_id"] in listing.stdout, listing.stderr
    revoked = cli("--home", str(platform.home), "keys", "revoke", created["key_id"], "--url", platform.url, env=env)
    assert revoked.returncode == 0, revoked.stderr
    reply = httpx.get(f"{platform.url}/v1/functions", headers={"Authorization": f"Bearer {created['key']}"},
                      timeout=30)
    error_of(reply, 401, "unauthorized")
    again = cli("--home", str(platform.home), "keys", "revoke", created["key_id"], "--url", platform.url, env=env)
    assert again.returncode == 2 and created["key_id"] in again.stderr


# -- acceptance 1: /healthz while a tenant attacks -----------------------------------------------------------------


@pytest.mark.parametrize("with_redos", [False, True])
def test_healthz_answers_within_a_second_while_a_tenant_attacks(platform, tmp_path, tiny_dense_dir,
                                                                with_redos) -> None:
    from lorafaas.bench.edge import attack_and_probe

    extra = {"redos": pack_adapter(redos_adapter(tmp_path / "redos", tiny_dense_dir, BACKBONE))} if with_redos else {}
    report = attack_and_probe(platform.url, platform.admin_key, tmp_path, tiny_dense_dir, BACKBONE,
                              extra_uploads=extra)
    assert report["attacks_refused"], report
    assert report["healthz_max_ms"] < 1000, report

