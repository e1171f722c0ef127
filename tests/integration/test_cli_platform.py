"""The CLI against a real platform (`lorafaas up` on a free, non-default port, tiny backbone), run as a user runs it:
a real process, its stdout piped, its exit code."""

import contextlib
import json
import os
import queue
import re
import shlex
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest

from lorafaas.formats.model_store import ModelStore
from lorafaas.platform import log_lines
from lorafaas.platform.api_client import ApiClient
from lorafaas.testing.platform_process import PlatformProcess
from lorafaas.testing.tiny_models import save_tiny_adapter

PROMPT = "Tell me about the ocean."
NO_URL = {"LORAFAAS_URL": ""}  # an empty variable counts as unset: the CLI finds the platform by itself


@pytest.fixture(scope="module")
def adapters(tmp_path_factory, tiny_dense_dir) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("cli-adapters")
    return {name: save_tiny_adapter(root / name, tiny_dense_dir, seed=seed, base_model_name="tiny-dense")
            for seed, name in enumerate(["alpha", "beta"], start=1)}


@pytest.fixture(scope="module")
def platform(tmp_path_factory, tiny_dense_dir):
    home = tmp_path_factory.mktemp("cli-home")
    ModelStore(home / "models").import_dir("tiny-dense", tiny_dense_dir)
    # A worker stopped with SIGSTOP holds its requests: a long hang timeout keeps it from being replaced meanwhile.
    with PlatformProcess(home, extra_args=("--hang-timeout", "600")) as running:
        yield running


@pytest.fixture
def admin(platform) -> ApiClient:
    with platform.client() as client:
        yield client
        for function in client.list():
            client.delete(function.name)


@pytest.fixture
def lorafaas(platform, cli):
    """`lorafaas("list", "--json")`: the real CLI on the platform's home and URL ($LORAFAAS_URL; the tests of the
    recorded URL give `env=NO_URL`)."""
    def run(*args: str, env: dict[str, str] | None = None, timeout: float = 120) -> subprocess.CompletedProcess:
        return cli("--home", str(platform.home), *args, env={"LORAFAAS_URL": platform.url, **(env or {})},
                   timeout=timeout)
    return run


def deploy(client: ApiClient, name: str, adapter: Path, **fields) -> dict:
    return client.deploy({"name": name, "backbone": "tiny-dense", **fields}, adapter)


def chat(prompt: str = PROMPT, max_tokens: int = 8, **extra) -> dict:
    return {"messages": [{"role": "user", "content": prompt}], "max_tokens": max_tokens, **extra}


def write_yaml(path: Path, text: str) -> Path:
    path.write_text(text)
    return path


# -- item 8: model text and logs verbatim ----------------------------------------------------------------------------


def test_model_text_and_log_lines_are_printed_verbatim_when_piped(admin, adapters, lorafaas) -> None:
    deploy(admin, "verbatim", adapters["alpha"])
    expected = admin.invoke("verbatim", chat(max_tokens=64))["text"]
    assert len(expected) > 40  # longer than the narrow terminal below: rich would have wrapped it
    narrow = {"COLUMNS": "40"}
    printed = lorafaas("invoke", "verbatim", PROMPT, "--max-tokens", "64", env=narrow)
    assert printed.returncode == 0, printed.stderr
    assert printed.stdout == expected + "\n"
    streamed = lorafaas("invoke", "verbatim", PROMPT, "--max-tokens", "64", "--stream", env=narrow)
    assert streamed.stdout == expected + "\n"
    logged = lorafaas("logs", "verbatim", env=narrow)
    assert logged.returncode == 0, logged.stderr
    assert any(len(line) > 40 for line in logged.stdout.splitlines())
    assert logged.stdout.rstrip("\n") in admin.logs("verbatim")  # every line whole: none split by a wrap


# -- item 9: asynchronous invocations ---------------------------------------------------------------------------------


def test_invoke_async_returns_the_id_at_once_and_invocations_get_list_wait(admin, adapters, lorafaas) -> None:
    deploy(admin, "waiter", adapters["alpha"])
    admin.invoke("waiter", chat())  # an instance is ready
    [instance] = admin.describe("waiter")["instances"]
    os.kill(instance["pid"], signal.SIGSTOP)  # it holds the next request until it is continued
    try:
        accepted = lorafaas("invoke", "waiter", PROMPT, "--async", "--max-tokens", "8", timeout=60)
        assert accepted.returncode == 0, accepted.stderr
        invocation_id = accepted.stdout.strip()
        assert re.fullmatch(r"[0-9a-f]{24}", invocation_id), accepted.stdout
        assert admin.invocation(invocation_id)["status"] in ("queued", "running")  # the CLI did not wait for it
        pending = lorafaas("invocations", "wait", invocation_id, "--timeout", "0.5")
        assert pending.returncode == 124, pending.stderr
        assert invocation_id in pending.stderr and "--timeout" in pending.stderr
        shown = json.loads(lorafaas("invocations", "get", invocation_id, "--json").stdout)
        assert shown["status"] in ("queued", "running") and shown["function"] == "waiter"
    finally:
        os.kill(instance["pid"], signal.SIGCONT)
    [wait_hint] = re.findall(r"`lorafaas ([^`]*)`", accepted.stderr)  # the command it printed, run as printed
    waited = lorafaas(*shlex.split(wait_hint), "--timeout", "120")
    assert waited.returncode == 0, waited.stderr
    record = admin.invocation(invocation_id)
    assert record["status"] == "succeeded"
    assert waited.stdout == record["result_text"] + "\n"
    assert record["result_text"] == admin.invoke("waiter", chat())["text"]  # greedy: the same answer
    got = lorafaas("invocations", "get", invocation_id)
    assert got.returncode == 0 and got.stdout == record["result_text"] + "\n" and "succeeded" in got.stderr

    too_long = " ".join(["ocean"] * 600)  # past tiny-dense's 256-token context: accepted, then failed by the worker
    failing = lorafaas("invoke", "waiter", too_long, "--raw", "--async", "--json")
    failed_id = json.loads(failing.stdout)["invocation_id"]
    failed = lorafaas("invocations", "wait", failed_id, "--timeout", "120")
    assert failed.returncode == 1 and "prompt_too_long" in failed.stderr, failed.stderr

    listed = json.loads(lorafaas("invocations", "list", "--function", "waiter", "--json").stdout)
    assert [r["invocation_id"] for r in listed] == [failed_id, invocation_id]  # newest first
    only_failed = json.loads(lorafaas("invocations", "list", "--status", "failed", "--json").stdout)
    assert [r["invocation_id"] for r in only_failed] == [failed_id]
    table = lorafaas("invocations", "list")
    assert invocation_id in table.stdout and "succeeded" in table.stdout
    bad_status = lorafaas("invocations", "list", "--status", "finished")
    assert bad_status.returncode == 2 and "status" in bad_status.stderr


def test_a_tenant_lists_and_gets_only_its_own_invocations(platform, admin, adapters, lorafaas) -> None:
    created = admin.create_key("acme")
    tenant_key = created["key"]
    deploy(admin, "admins-fn", adapters["alpha"])
    mine = admin.invoke_async("admins-fn", chat())["invocation_id"]
    with ApiClient(platform.url, tenant_key) as acme:
        acme.deploy({"name": "acme-fn", "backbone": "tiny-dense"}, adapters["beta"])
        theirs = acme.invoke_async("acme-fn", chat())["invocation_id"]
        assert [r["invocation_id"] for r in acme.invocations()] == [theirs]
        assert acme.invocations(function="admins-fn") == []
    as_tenant = {"LORAFAAS_API_KEY": tenant_key}
    listed = json.loads(lorafaas("invocations", "list", "--json", env=as_tenant).stdout)
    assert [r["invocation_id"] for r in listed] == [theirs]
    hidden = lorafaas("invocations", "get", mine, env=as_tenant)
    assert hidden.returncode == 2 and "does not exist" in hidden.stderr
    assert {r["invocation_id"] for r in admin.invocations()} >= {mine, theirs}  # the admin sees every tenant's
    revoked = lorafaas("keys", "revoke", created["key_id"], "--json")
    assert json.loads(revoked.stdout) == {"revoked": created["key_id"], "tenant": "acme"}


# -- issue 36 finding 11: revocation and cancellation reach work in flight ---------------------------------------------


@contextlib.contextmanager
def stopped(admin: ApiClient, function: str):
    """The function's one ready instance stopped (SIGSTOP): it holds the requests sent to it until the block ends."""
    [instance] = admin.describe(function)["instances"]
    os.kill(instance["pid"], signal.SIGSTOP)
    try:
        yield
    finally:
        os.kill(instance["pid"], signal.SIGCONT)


def raw_stream(platform, key: str, function: str) -> socket.socket:
    """A streaming invocation sent by hand; the caller reads what comes back."""
    body = json.dumps({**chat(max_tokens=200), "stream": True}).encode()
    conn = socket.create_connection(("127.0.0.1", platform.port))
    conn.sendall(f"POST /v1/functions/{function}/invoke HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {key}\r\n"
                 f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n".encode() + body)
    conn.settimeout(60)
    return conn


def read_until(conn: socket.socket, marker: bytes, received: bytes = b"") -> bytes:
    while marker not in received:
        chunk = conn.recv(65536)
        assert chunk, f"the connection closed before {marker!r}: {received!r}"
        received += chunk
    return received


def settled(client: ApiClient, invocation_id: str, timeout_s: float = 30) -> dict:
    deadline = time.monotonic() + timeout_s
    while (record := client.invocation(invocation_id))["status"] in ("queued", "running"):
        assert time.monotonic() < deadline, record
        time.sleep(0.1)
    return record


def test_revoking_a_key_cancels_its_open_streams_and_async_invocations(platform, admin, adapters, lorafaas) -> None:
    created = admin.create_key("rev-a")
    with ApiClient(platform.url, created["key"]) as tenant:
        tenant.deploy({"name": "rev-fn", "backbone": "tiny-dense"}, adapters["alpha"])
        tenant.invoke("rev-fn", chat(max_tokens=2))  # an instance is ready
        with stopped(admin, "rev-fn"):
            waiting = raw_stream(platform, created["key"], "rev-fn")  # no token yet: no answer yet
            accepted = tenant.invoke_async("rev-fn", chat())["invocation_id"]
            time.sleep(0.5)  # both reach the stopped instance
            revoked = lorafaas("keys", "revoke", created["key_id"], "--json")
            assert revoked.returncode == 0, revoked.stderr
            # The stream waiting for its first token is answered at once: 401, the key revoked.
            answer = read_until(waiting, b"}}")
            assert answer.startswith(b"HTTP/1.1 401"), answer
            assert b'"code":"key_revoked"' in answer.replace(b" ", b""), answer
            # The async invocation accepted before the revoke ends cancelled, not succeeded.
            record = settled(admin, accepted)
            assert record["status"] == "cancelled" and record["error_code"] == "key_revoked", record
    waiting.close()
    assert admin.invoke("rev-fn", chat(max_tokens=2))["text"] is not None  # the instance serves on

    # A stream already sending tokens when the key is revoked ends with an error event, before its 200 tokens.
    created = admin.create_key("rev-b")
    with ApiClient(platform.url, created["key"]) as tenant:
        tenant.deploy({"name": "rev-fn-b", "backbone": "tiny-dense"}, adapters["beta"])
        tenant.invoke("rev-fn-b", chat(max_tokens=2))
        [instance] = admin.describe("rev-fn-b")["instances"]
        streaming = raw_stream(platform, created["key"], "rev-fn-b")
        received = read_until(streaming, b'"type": "token"')
        os.kill(instance["pid"], signal.SIGSTOP)  # mid-stream
        try:
            assert lorafaas("keys", "revoke", created["key_id"]).returncode == 0
            received = read_until(streaming, b"event: error", received)
        finally:
            os.kill(instance["pid"], signal.SIGCONT)
        received = read_until(streaming, b"\r\n0\r\n\r\n", received)  # the end of the chunked body
        assert b"key_revoked" in received.partition(b"event: error")[2], received
        assert b'"type": "done"' not in received
        streaming.close()


def test_a_tenant_cancels_its_own_async_invocation_and_no_one_elses(platform, admin, adapters, lorafaas) -> None:
    owner, other = admin.create_key("can-a")["key"], admin.create_key("can-b")["key"]
    with ApiClient(platform.url, owner) as tenant, ApiClient(platform.url, other) as stranger:
        tenant.deploy({"name": "can-fn", "backbone": "tiny-dense"}, adapters["alpha"])
        tenant.invoke("can-fn", chat(max_tokens=2))
        with stopped(admin, "can-fn"):
            first = tenant.invoke_async("can-fn", chat())["invocation_id"]
            second = tenant.invoke_async("can-fn", chat())["invocation_id"]
            refused = httpx.delete(f"{platform.url}/v1/invocations/{first}", timeout=30,
                                   headers={"Authorization": f"Bearer {other}"})
            assert refused.status_code == 404 and refused.json()["error"]["code"] == "invocation_not_found"
            assert stranger.invocations() == []
            reply = httpx.delete(f"{platform.url}/v1/invocations/{first}", timeout=30,
                                 headers={"Authorization": f"Bearer {owner}"})
            assert reply.status_code == 200, reply.text
            cancelled = reply.json()
            assert cancelled["status"] == "cancelled" and cancelled["error_code"] == "invocation_cancelled", cancelled
            by_cli = lorafaas("invocations", "cancel", second, "--json", env={"LORAFAAS_API_KEY": owner})
            assert by_cli.returncode == 0, by_cli.stderr
            assert json.loads(by_cli.stdout)["status"] == "cancelled"
        assert settled(tenant, first)["status"] == "cancelled" and settled(tenant, second)["status"] == "cancelled"
        again = httpx.delete(f"{platform.url}/v1/invocations/{first}", timeout=30,
                             headers={"Authorization": f"Bearer {owner}"})
        assert again.status_code == 409 and again.json()["error"]["code"] == "invocation_finished", again.text
        unknown = lorafaas("invocations", "cancel", "0" * 24, env={"LORAFAAS_API_KEY": owner})
        assert unknown.returncode == 2 and "does not exist" in unknown.stderr
        later = tenant.invoke_async("can-fn", chat(max_tokens=2))["invocation_id"]
        assert settled(tenant, later, 120)["status"] == "succeeded"  # the instance serves on


# -- item 10: the CLI finds the local platform ------------------------------------------------------------------------


def test_the_cli_finds_a_local_platform_on_a_non_default_port(platform, admin, adapters, lorafaas) -> None:
    assert not platform.url.endswith(":8080")
    assert (platform.home / "gateway.url").read_text().strip() == platform.url
    listed = lorafaas("list", "--json", env=NO_URL)
    assert listed.returncode == 0, listed.stderr
    dead = "http://127.0.0.1:9"
    for name, flags, shell in [("hinted", (), NO_URL), ("hinted-url", ("--url", platform.url), {"LORAFAAS_URL": dead})]:
        deployed = lorafaas("deploy", name, "--adapter", str(adapters["alpha"]), "--backbone", "tiny-dense", *flags,
                            env=NO_URL)
        assert deployed.returncode == 0, deployed.stderr
        [hint] = re.findall(r"`(lorafaas [^`]*)`", deployed.stderr)
        argv = shlex.split(hint)
        assert argv[1:3] == ["--home", str(platform.home)] and ("--url" in argv) == bool(flags)
        # Run as printed, in a shell where the hint needs what it names (a --url given must survive a stale variable)
        hinted = subprocess.run([sys.executable, "-m", *argv], capture_output=True, text=True, timeout=120,
                                env={**os.environ, **shell}, stdin=subprocess.DEVNULL)
        assert hinted.returncode == 0, (hint, hinted.stderr)
        assert hinted.stdout.strip()
    # --url > $LORAFAAS_URL > the recorded URL
    unreachable = lorafaas("list", env={"LORAFAAS_URL": dead})
    assert unreachable.returncode == 1 and dead in unreachable.stderr
    flagged = lorafaas("list", "--json", "--url", platform.url, env={"LORAFAAS_URL": dead})
    assert flagged.returncode == 0 and [f["name"] for f in json.loads(flagged.stdout)] == ["hinted", "hinted-url"]


def test_up_records_its_url_while_it_serves(tmp_path) -> None:
    with PlatformProcess(tmp_path / "home") as running:
        assert (running.home / "gateway.url").read_text() == running.url + "\n"
    assert running.process.returncode == -signal.SIGTERM  # stopped by SIGTERM, and still ends by it
    assert not (running.home / "gateway.url").exists()  # a stopped platform leaves no URL to find


# -- items 11 and 12: function.yaml ------------------------------------------------------------------------------------


def test_replace_refuses_a_changed_backbone_and_changes_nothing(tmp_path, admin, adapters, lorafaas) -> None:
    first = write_yaml(tmp_path / "function.yaml", f"name: yamlfn\nadapter: {adapters['alpha']}\n"
                                                   "backbone: tiny-dense\nkeep_alive_s: 30\n")
    assert lorafaas("deploy", "-f", str(first)).returncode == 0
    before = admin.describe("yamlfn")["function"]
    moved = write_yaml(tmp_path / "moved.yaml", f"name: yamlfn\nadapter: {adapters['beta']}\n"
                                                "backbone: smollm2-135m\nkeep_alive_s: 90\n")
    refused = lorafaas("deploy", "-f", str(moved), "--replace")
    assert refused.returncode == 2
    message = " ".join(refused.stderr.split())
    assert "'tiny-dense'" in message and "'smollm2-135m'" in message and "cannot change" in message, message
    assert admin.describe("yamlfn")["function"] == before  # neither the adapter nor the keep-alive changed
    # The same backbone and tenant, spelled out in the file, are no change: --replace goes through.
    same = write_yaml(tmp_path / "same.yaml", f"name: yamlfn\nadapter: {adapters['beta']}\n"
                                              "backbone: tiny-dense\ntenant: admin\nkeep-alive: 90\n")
    replaced = lorafaas("deploy", "-f", str(same), "--replace", "--json")
    assert replaced.returncode == 0, replaced.stderr
    after = admin.describe("yamlfn")["function"]
    assert (after["version"], after["keep_alive_s"]) == (2, 90.0)
    assert after["adapter_digest"] != before["adapter_digest"]


def test_function_yaml_takes_the_flag_spellings_and_names_unknown_keys(tmp_path, admin, adapters, lorafaas) -> None:
    flags = write_yaml(tmp_path / "flags.yaml", "name: spelled\nadapter: alpha\nbackbone: tiny-dense\n"
                                                "slo-ttft-ms: 700\nkeep-alive: 30\nmin: 0\nmax: 2\n"
                                                "max_tokens_limit: 32\nmax-request-s: 9.5\nshared-base: false\n")
    (tmp_path / "alpha").symlink_to(adapters["alpha"])  # `adapter:` is relative to the file
    deployed = lorafaas("deploy", "-f", str(flags), "--json")
    assert deployed.returncode == 0, deployed.stderr
    spec = admin.describe("spelled")["function"]
    assert (spec["slo_ttft_ms"], spec["keep_alive_s"], spec["min_instances"], spec["max_instances"],
            spec["max_tokens_limit"], spec["max_request_s"], spec["shared_base"]) == (700, 30.0, 0, 2, 32, 9.5, False)
    # the flag wins over the file, and says the opposite here
    assert lorafaas("deploy", "-f", str(flags), "--replace", "--shared-base").returncode == 0
    assert admin.describe("spelled")["function"]["shared_base"] is True
    unknown = write_yaml(tmp_path / "unknown.yaml", "name: other\nkeep-alive-s: 3\nreplicas: 2\n")
    refused = lorafaas("deploy", "-f", str(unknown))
    assert refused.returncode == 2
    message = " ".join(refused.stderr.split())
    assert "unknown key(s) keep-alive-s, replicas" in message and "keep-alive" in message, message
    twice = write_yaml(tmp_path / "twice.yaml", "name: other\nkeep-alive: 3\nkeep_alive_s: 4\n")
    doubled = lorafaas("deploy", "-f", str(twice))
    assert doubled.returncode == 2 and "keep-alive and keep_alive_s" in " ".join(doubled.stderr.split())
    assert [f.name for f in admin.list()] == ["spelled"]


# -- item 13: --json everywhere, sampling flags, stdin, aliases --------------------------------------------------------


def test_json_on_scale_delete_logs_and_stream_json_lines(admin, adapters, lorafaas) -> None:
    deploy(admin, "jsonfn", adapters["alpha"])
    lines = lorafaas("invoke", "jsonfn", PROMPT, "--max-tokens", "12", "--stream", "--json").stdout.splitlines()
    events = [json.loads(line) for line in lines]
    assert [e["type"] for e in events] == ["token"] * (len(events) - 1) + ["done"]
    assert "".join(e["text"] for e in events[:-1]) == events[-1]["text"] == admin.invoke("jsonfn", chat(
        max_tokens=12))["text"]
    scaled = json.loads(lorafaas("scale", "jsonfn", "--min", "1", "--max", "3", "--json").stdout)
    assert (scaled["min_instances"], scaled["max_instances"]) == (1, 3)
    logged = json.loads(lorafaas("logs", "jsonfn", "--json").stdout)
    assert logged["function"] == "jsonfn" and "==>" in logged["text"]
    assert json.loads(lorafaas("delete", "jsonfn", "--json").stdout) == {"deleted": "jsonfn"}
    assert admin.list() == []


def test_invoke_sampling_flags_system_message_and_prompt_from_stdin(platform, admin, adapters, lorafaas) -> None:
    deploy(admin, "sampler", adapters["alpha"])

    def text_of(*args: str, stdin: str | None = None) -> str:
        argv = [sys.executable, "-m", "lorafaas", "--home", str(platform.home), "invoke", "sampler", *args]
        done = subprocess.run(argv, input=stdin, capture_output=True, text=True, timeout=120,
                              env={**os.environ, "LORAFAAS_URL": platform.url},
                              stdin=None if stdin is not None else subprocess.DEVNULL)
        assert done.returncode == 0, done.stderr
        return done.stdout.removesuffix("\n")

    sampled = {"temperature": 1.0, "top_p": 0.9, "seed": 7}
    assert text_of(PROMPT, "--max-tokens", "16", "--temperature", "1", "--top-p", "0.9", "--seed", "7") == \
        admin.invoke("sampler", chat(max_tokens=16, **sampled))["text"]
    system = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": PROMPT}]
    assert text_of(PROMPT, "--max-tokens", "16", "--system", "You are terse.") == \
        admin.invoke("sampler", {"messages": system, "max_tokens": 16})["text"]
    unstopped = admin.invoke("sampler", chat(max_tokens=16))["text"]
    stop = unstopped.strip()[4:6]
    assert stop
    assert text_of(PROMPT, "--max-tokens", "16", f"--stop={stop}") == \
        admin.invoke("sampler", chat(max_tokens=16, stop=[stop]))["text"]
    assert text_of("--max-tokens", "16", stdin=PROMPT) == unstopped
    assert text_of("-", "--max-tokens", "16", stdin=PROMPT) == unstopped
    empty = lorafaas("invoke", "sampler")  # stdin is /dev/null: an empty prompt
    assert empty.returncode == 2 and "empty" in empty.stderr


def test_ls_and_rm_are_aliases(admin, adapters, lorafaas) -> None:
    deploy(admin, "aliased", adapters["alpha"])
    assert [f["name"] for f in json.loads(lorafaas("ls", "--json").stdout)] == ["aliased"]
    removed = lorafaas("rm", "aliased")
    assert removed.returncode == 0 and "deleted aliased" in removed.stderr
    assert admin.list() == []


def test_a_settings_only_change_keeps_the_warm_instances(admin, adapters, lorafaas) -> None:
    deploy(admin, "settled", adapters["alpha"], keep_alive_s=300)
    answer = admin.invoke("settled", chat())["text"]
    [before] = admin.describe("settled")["instances"]
    changed = lorafaas("deploy", "settled", "--replace", "--keep-alive", "120", "--slo-ttft-ms", "900", "--max", "3",
                       "--max-tokens-limit", "64")
    assert changed.returncode == 0, changed.stderr
    scaled = lorafaas("scale", "settled", "--max", "2")
    assert scaled.returncode == 0, scaled.stderr
    described = admin.describe("settled")
    spec = described["function"]
    assert (spec["version"], spec["keep_alive_s"], spec["slo_ttft_ms"], spec["max_instances"],
            spec["max_tokens_limit"]) == (3, 120.0, 900, 2, 64)
    assert [(i["instance_id"], i["pid"]) for i in described["instances"]] == [(before["instance_id"], before["pid"])]
    assert admin.invoke("settled", chat())["text"] == answer
    assert [(i["pid"], i["state"]) for i in admin.describe("settled")["instances"]] == [(before["pid"], "ready")]


def test_logs_tail_since_and_follow(platform, admin, adapters, lorafaas) -> None:
    deploy(admin, "logged", adapters["alpha"])
    # two requests, two REPORT lines: an instance given a standby pool process logs no libraries or backbone line
    admin.invoke("logged", chat())
    admin.invoke("logged", chat())
    [first] = admin.describe("logged")["instances"]
    # The instance may go on logging (warm-up, preloads) at any time: stopped, its log holds still while it is read.
    os.kill(first["pid"], signal.SIGSTOP)
    follower = None
    try:
        lines = [line for line in admin.logs("logged").splitlines() if line and not line.startswith("==> ")]
        assert len(lines) >= 4
        header = f"==> {first['instance_id']} <=="
        tailed = lorafaas("logs", "logged", "--tail", "2")
        assert tailed.returncode == 0, tailed.stderr
        assert tailed.stdout.splitlines() == [header, *lines[-2:]]
        # REPORT lines carry no stamp: they belong to the stamped line before them (as a traceback does)
        stamped = [i for i, line in enumerate(lines) if log_lines.STAMP.match(line)]
        assert len(stamped) >= 1 and stamped[0] == 0
        stamp = lines[stamped[-1]][:19]  # `2026-11-24 06:52:47`, the log's own (local) clock
        first_since = next(i for i in stamped if lines[i][:19] >= stamp)
        since = lorafaas("logs", "logged", "--since", stamp.replace(" ", "T"))
        assert since.stdout.splitlines() == [header, *lines[first_since:]]
        assert lorafaas("logs", "logged", "--since", "1d").stdout.splitlines() == [header, *lines]
        assert lorafaas("logs", "logged", "--tail", "0").stdout == ""
        bad = lorafaas("logs", "logged", "--since", "yesterday")
        assert bad.returncode == 2 and "--since" in bad.stderr

        follower = subprocess.Popen(
            [sys.executable, "-m", "lorafaas", "--home", str(platform.home), "logs", "logged", "--follow"],
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
            env={**os.environ, "LORAFAAS_URL": platform.url},
        )
        followed: queue.Queue[str] = queue.Queue()
        threading.Thread(target=lambda: [followed.put(line.rstrip("\n")) for line in follower.stdout],
                         daemon=True).start()

        def read_until(predicate) -> list[str]:
            seen = []
            while not seen or not predicate(seen[-1]):
                try:
                    seen.append(followed.get(timeout=120))
                except queue.Empty:
                    exited = f" and exited: {follower.stderr.read()}" if follower.poll() is not None else ""
                    raise AssertionError(f"the follower printed {seen}{exited}; the log is {admin.logs('logged')}"
                                         ) from None
            return seen

        assert read_until(lambda line: line == lines[-1]) == [header, *lines]
        os.kill(first["pid"], signal.SIGCONT)
        admin.update("logged", {}, adapters["beta"])  # a new version: its instance starts and logs
        more = read_until(lambda line: line.startswith("==> ") and line != header)  # another instance's lines
        more += read_until(lambda line: "listening on" in line)
        assert not set(more) & set(lines)  # nothing printed twice
    finally:
        with contextlib.suppress(ProcessLookupError):  # replaced by the new version, it may be gone already
            os.kill(first["pid"], signal.SIGCONT)
        if follower is not None:
            follower.terminate()
            follower.wait(30)


# -- issue 37: the client decodes typed structs; the CLI prints what the gateway sent ---------------------------------


def test_list_keys_list_and_describe_print_the_json_the_gateway_sent(platform, admin, adapters, lorafaas) -> None:
    deploy(admin, "typed", adapters["alpha"])
    admin.create_key("typed-team")
    headers = {"Authorization": f"Bearer {platform.admin_key}"}
    for argv, path, field in [(("list",), "/v1/functions", "functions"), (("keys", "list"), "/v1/keys", "keys")]:
        printed = lorafaas(*argv, "--json")
        assert printed.returncode == 0, printed.stderr
        sent = httpx.get(platform.url + path, headers=headers, timeout=30).raise_for_status().json()[field]
        assert json.loads(printed.stdout) == sent and [list(item) for item in json.loads(printed.stdout)] == \
            [list(item) for item in sent], "the same fields, in the same order"
        table = lorafaas(*argv)
        assert table.returncode == 0 and "typed" in table.stdout, table.stderr
    admin.invoke("typed", {"prompt": PROMPT, "max_tokens": 2})
    described = lorafaas("describe", "typed", "--json")
    body = httpx.get(f"{platform.url}/v1/functions/typed", headers=headers, timeout=30).raise_for_status().json()
    printed = json.loads(described.stdout)
    # (an instance's state and counters may move between the two reads: its fields are compared by name)
    assert [list(i) for i in printed.pop("instances")] == [list(i) for i in body.pop("instances")]
    assert printed == body
    [instance] = admin.describe("typed")["instances"]
    assert list(instance["adapter"]) == ["kind", "lora_mode", "held_bytes", "expert_bytes"]
    assert instance["adapter"]["kind"] == "dense" and instance["adapter"]["held_bytes"] > 0
