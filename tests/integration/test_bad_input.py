"""Hostile and broken input against a real platform process: every refusal is a 4xx with a JSON error naming the
problem, and nothing already stored (functions, adapters) changes. Tiny backbone; one platform for the module."""

from __future__ import annotations

import io
import json
import pickle
import socket
import struct
import tarfile
import time
from pathlib import Path

import httpx
import pytest
from safetensors.torch import load_file, save_file

from lorafaas.formats.model_store import ModelStore
from lorafaas.platform.gateway.limits import MAX_HEADER_BYTES, MAX_JSON_BODY_BYTES
from lorafaas.testing.platform_process import PlatformProcess
from lorafaas.testing.tiny_models import TinySpec, save_tiny_adapter, save_tiny_backbone

CONFIG, WEIGHTS = "adapter_config.json", "adapter_model.safetensors"


@pytest.fixture(scope="module")
def adapter(tmp_path_factory, tiny_dense_dir) -> Path:
    return save_tiny_adapter(tmp_path_factory.mktemp("bad-input-adapter"), tiny_dense_dir, base_model_name="tiny-dense")


@pytest.fixture(scope="module")
def platform(tmp_path_factory, tiny_dense_dir, adapter):
    home = tmp_path_factory.mktemp("bad-input-home")
    ModelStore(home / "models").import_dir("tiny-dense", tiny_dense_dir)
    with PlatformProcess(home) as running:
        with running.client() as admin:
            admin.deploy({"name": "alpha", "backbone": "tiny-dense"}, adapter)
        yield running


@pytest.fixture
def headers(platform) -> dict[str, str]:
    return {"Authorization": f"Bearer {platform.admin_key}"}


def stored_state(platform) -> tuple[list[dict], list[str]]:
    """What must not change when input is refused: the functions and every file under the adapter store."""
    functions = httpx.get(f"{platform.url}/v1/functions", headers={"Authorization": f"Bearer {platform.admin_key}"})
    files = sorted(str(p.relative_to(platform.home)) for p in (platform.home / "adapters").rglob("*"))
    return functions.json()["functions"], files


def assert_json_error(reply: httpx.Response, status: int, code: str, *words: str) -> dict:
    assert reply.status_code == status, reply.text
    assert reply.headers["content-type"].startswith("application/json"), reply.text
    error = reply.json()["error"]
    assert error["code"] == code, error
    for word in words:
        assert word in error["message"], (word, error["message"])
    return error


def tar_of(*members: tuple[tarfile.TarInfo, bytes | None]) -> bytes:
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w:gz") as tar:
        for info, data in members:
            tar.addfile(info, io.BytesIO(data) if data is not None else None)
    return buffer.getvalue()


def regular(name: str, data: bytes) -> tuple[tarfile.TarInfo, bytes]:
    info = tarfile.TarInfo(name)
    info.size = len(data)
    return info, data


def link(name: str, target: str, kind: bytes) -> tuple[tarfile.TarInfo, None]:
    info = tarfile.TarInfo(name)
    info.type, info.linkname = kind, target
    return info, None


def deploy_archive(platform, headers, archive: bytes, name: str = "beta") -> httpx.Response:
    return httpx.post(
        f"{platform.url}/v1/functions",
        headers=headers,
        timeout=60,
        data={"spec": json.dumps({"name": name, "backbone": "tiny-dense"})},
        files={"adapter": ("adapter.tar.gz", archive, "application/gzip")},
    )


def adapter_with(adapter: Path, out: Path, change) -> Path:
    """A copy of `adapter` whose tensors went through `change(dict) -> dict`."""
    out.mkdir(parents=True, exist_ok=True)
    (out / CONFIG).write_bytes((adapter / CONFIG).read_bytes())
    save_file(change(load_file(adapter / WEIGHTS)), out / WEIGHTS)
    return out


def with_nan(tensors: dict) -> dict:
    first = sorted(tensors)[0]
    poisoned = tensors[first].clone()
    poisoned.view(-1)[0] = float("nan")
    return {**tensors, first: poisoned}


def test_hostile_adapter_archives_are_refused_with_a_message_and_store_nothing(
    platform, headers, adapter, tmp_path, tiny_dense_dir
) -> None:
    config, weights = (adapter / CONFIG).read_bytes(), (adapter / WEIGHTS).read_bytes()
    narrow = save_tiny_backbone(tmp_path / "narrow", spec=TinySpec(hidden_size=32, intermediate_size=64))
    misshapen = save_tiny_adapter(tmp_path / "misshapen", narrow, base_model_name="tiny-dense")
    nan_adapter = adapter_with(adapter, tmp_path / "nan", with_nan)
    oversized = tarfile.TarInfo(WEIGHTS)
    oversized.size = 3 * 1024**3  # only the header is sent: the claim alone must be refused
    lying_header = json.dumps({"w": {"dtype": "F32", "shape": [10**6], "data_offsets": [0, 4 * 10**6]}}).encode()
    cases = {
        "path traversal": (
            tar_of(regular("../" + CONFIG, config), regular(WEIGHTS, weights)),
            "adapter_invalid",
            "points outside",
        ),
        "absolute path": (
            tar_of(regular("/tmp/" + CONFIG, config), regular(WEIGHTS, weights)),
            "adapter_invalid",
            "points outside",
        ),
        "symlink": (
            tar_of(regular(CONFIG, config), link(WEIGHTS, "/etc/passwd", tarfile.SYMTYPE)),
            "adapter_invalid",
            "is a link",
        ),
        "hard link": (
            tar_of(regular(CONFIG, config), link(WEIGHTS, "/etc/passwd", tarfile.LNKTYPE)),
            "adapter_invalid",
            "is a link",
        ),
        "oversized member": (
            regular(CONFIG, config)[0].tobuf() + config + b"\0" * (-len(config) % 512) + oversized.tobuf(),
            "adapter_invalid",
            "3221225472 bytes; the limit",
        ),
        "pickled tensors by name": (
            tar_of(regular(CONFIG, config), regular("adapter_model.bin", pickle.dumps({}))),
            "pickled_weights",
            "pickled",
        ),
        "pickle renamed safetensors": (
            tar_of(regular(CONFIG, config), regular(WEIGHTS, pickle.dumps({"w": [1]}))),
            "adapter_invalid",
            "not safetensors",
        ),
        "safetensors header lies": (
            tar_of(regular(CONFIG, config), regular(WEIGHTS, struct.pack("<Q", len(lying_header)) + lying_header)),
            "adapter_invalid",
            "truncated",
        ),
        "not an archive": (b"GIF89a" + b"\0" * 100, "adapter_invalid", "not a tar archive"),
        "config not json": (
            tar_of(regular(CONFIG, b"{nope"), regular(WEIGHTS, weights)),
            "adapter_invalid",
            "not valid JSON",
        ),
        "missing weights": (tar_of(regular(CONFIG, config)), "adapter_invalid", "lacks " + WEIGHTS),
        "mismatched shapes": (
            tar_of(
                regular(CONFIG, (misshapen / CONFIG).read_bytes()), regular(WEIGHTS, (misshapen / WEIGHTS).read_bytes())
            ),
            "adapter_incompatible",
            "shape",
        ),
        "NaN weights": (
            tar_of(regular(CONFIG, config), regular(WEIGHTS, (nan_adapter / WEIGHTS).read_bytes())),
            "adapter_invalid",
            "NaN",
        ),
    }
    before = stored_state(platform)
    for case, (archive, code, words) in cases.items():
        reply = deploy_archive(platform, headers, archive)
        try:
            assert_json_error(reply, 422, code, words)
        except AssertionError as exc:
            raise AssertionError(f"{case}: {exc}") from None
        assert "lorafaas-upload-" not in reply.text, f"{case}: the message names a path on the server: {reply.text}"
        # The same archive as a replacement adapter for a deployed function is refused the same way.
        patched = httpx.patch(
            f"{platform.url}/v1/functions/alpha",
            headers=headers,
            data={"spec": "{}"},
            files={"adapter": ("a.tar.gz", archive, "application/gzip")},
            timeout=60,
        )
        assert patched.status_code == 422, (case, patched.text)
    assert stored_state(platform) == before, "a refused adapter left something behind or changed a function"
    assert not (Path("/etc") / CONFIG).exists() and not (Path("/tmp") / CONFIG).exists()


def invoke_raw(platform, headers, body: bytes, path: str = "/v1/functions/alpha/invoke") -> httpx.Response:
    return httpx.post(
        f"{platform.url}{path}", content=body, timeout=60, headers={**headers, "Content-Type": "application/json"}
    )


def test_prompts_with_invalid_utf8_or_lone_surrogates_are_refused_and_control_characters_served(
    platform, headers
) -> None:
    before = stored_state(platform)
    assert_json_error(
        invoke_raw(platform, headers, b'{"prompt": "caf\xc3\x28 \xff", "max_tokens": 2}'), 400, "malformed_json"
    )
    surrogate_bodies = {
        "/v1/functions/alpha/invoke": b'{"prompt": "a\\ud800b", "max_tokens": 2}',
        "/v1/chat/completions": b'{"model": "alpha", "messages": [{"role": "user", "content": "x\\udfff"}]}',
        "/v1/completions": b'{"model": "alpha", "prompt": "x", "stop": ["\\ud83d"], "max_tokens": 2}',
    }
    for path, body in surrogate_bodies.items():
        status = 422 if path.startswith("/v1/functions") else 400  # the OpenAI routes answer as OpenAI does
        assert_json_error(invoke_raw(platform, headers, body, path), status, "invalid_input", "surrogate")
    async_reply = invoke_raw(
        platform, headers, b'{"prompt": "a\\ud800", "max_tokens": 2}', "/v1/functions/alpha/invoke?mode=async"
    )
    assert_json_error(async_reply, 422, "invalid_input", "surrogate")  # refused before it is stored
    # Control characters are text like any other: the tokenizer takes them and the function answers.
    control = json.dumps({"prompt": "a\u0000b\u0007c\u001b[31m\u202e\ufeffd", "max_tokens": 3}).encode()
    answer = invoke_raw(platform, headers, control)
    assert answer.status_code == 200, answer.text
    assert answer.json()["usage"]["completion_tokens"] == 3
    assert stored_state(platform) == before


def test_header_and_body_size_limits(platform, headers) -> None:
    big_header = httpx.get(f"{platform.url}/v1/functions", headers={**headers, "X-Pad": "a" * MAX_HEADER_BYTES})
    assert_json_error(big_header, 431, "headers_too_large", str(MAX_HEADER_BYTES))
    many_headers = {f"X-Pad-{i}": "a" * 64 for i in range(MAX_HEADER_BYTES // 64)}
    assert_json_error(
        httpx.get(f"{platform.url}/v1/functions", headers={**headers, **many_headers}), 431, "headers_too_large"
    )
    big_prompt = json.dumps({"prompt": "a" * (MAX_JSON_BODY_BYTES + 1), "max_tokens": 2}).encode()
    assert_json_error(invoke_raw(platform, headers, big_prompt), 413, "payload_too_large", str(MAX_JSON_BODY_BYTES))

    def chunks():  # no Content-Length: the limit must hold as the bytes arrive
        yield b'{"prompt": "'
        for _ in range(MAX_JSON_BODY_BYTES // 65536 + 2):
            yield b"a" * 65536
        yield b'", "max_tokens": 2}'

    chunked = httpx.post(
        f"{platform.url}/v1/functions/alpha/invoke",
        content=chunks(),
        timeout=60,
        headers={**headers, "Content-Type": "application/json"},
    )
    assert_json_error(chunked, 413, "payload_too_large")
    # A Content-Length of 5 GB is refused at once, without waiting for bytes that never come.
    port = int(platform.url.rsplit(":", 1)[1])
    with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
        sock.sendall(
            (
                f"POST /v1/functions HTTP/1.1\r\nHost: x\r\nAuthorization: {headers['Authorization']}\r\n"
                "Content-Type: multipart/form-data; boundary=x\r\nContent-Length: 5000000000\r\n\r\n"
            ).encode()
        )
        answer = b""
        while chunk := sock.recv(4096):  # the gateway closes the connection after its answer
            answer += chunk
    head, _, body = answer.decode(errors="replace").partition("\r\n\r\n")
    assert head.startswith("HTTP/1.1 413"), head
    assert json.loads(body)["error"]["code"] == "payload_too_large"
    ok = invoke_raw(platform, headers, json.dumps({"prompt": "still serving", "max_tokens": 2}).encode())
    assert ok.status_code == 200, "the platform serves on after refusing oversized requests"


def peft_adapter(out: Path, backbone_dir: Path, **lora: object) -> Path:
    """An adapter saved by PEFT itself, with its lora_B biases and saved modules moved off the backbone's values."""
    import torch
    from peft import LoraConfig, get_peft_model

    from lorafaas.formats.adapter_files import set_base_model
    from lorafaas.models.reference import load_backbone

    model, _ = load_backbone(backbone_dir)
    torch.manual_seed(3)
    peft_model = get_peft_model(model, LoraConfig(init_lora_weights=False, **lora))
    with torch.no_grad():
        for name, parameter in peft_model.named_parameters():
            if name.endswith("lora_B.default.bias") or "modules_to_save" in name:
                parameter.add_(torch.randn(parameter.shape) * 0.5)
    peft_model.save_pretrained(out)
    set_base_model(out, "tiny-dense")
    return out


def test_odd_adapters_get_their_own_422_and_peft_features_run_as_peft(
    platform, headers, adapter, tmp_path, tiny_dense_dir
) -> None:
    """Issue 18 items 1, 5, 6, 7 and 11 through the real gateway and worker."""
    from lorafaas.models.reference import greedy_generate, load_backbone, with_adapter

    config = json.loads((adapter / CONFIG).read_text())
    weights = (adapter / WEIGHTS).read_bytes()

    def with_config(**changes: object) -> bytes:
        return tar_of(regular(CONFIG, json.dumps({**config, **changes}).encode()), regular(WEIGHTS, weights))

    cases = {
        "invalid regex": (with_config(target_modules="(q_proj"), "adapter_unsupported", "target_modules"),
        "ReDoS regex": (with_config(target_modules="model\\.layers\\.1\\.(?:.|.|.|.)*!"), "adapter_incompatible",
                        "matches no layer"),
        "alpha a word": (with_config(lora_alpha="abc"), "adapter_invalid", "lora_alpha"),
        "alpha a list": (with_config(lora_alpha=[16]), "adapter_invalid", "lora_alpha"),
        "DoRA": (with_config(use_dora=True), "adapter_unsupported", "use_dora"),
        "trailing bytes": (tar_of(regular(CONFIG, json.dumps(config).encode()), regular(WEIGHTS, weights + b"\0" * 8)),
                           "adapter_invalid", "trailing bytes"),
    }
    before = stored_state(platform)
    for case, (archive, code, words) in cases.items():
        started = time.monotonic()
        reply = deploy_archive(platform, headers, archive, name="odd")
        elapsed_s = time.monotonic() - started
        try:
            assert_json_error(reply, 422, code, words)
        except AssertionError as exc:
            raise AssertionError(f"{case}: {exc}") from None
        for server_path in ("lorafaas-upload-", str(platform.home)):
            assert server_path not in reply.text, f"{case}: the message names a server path: {reply.text}"
        assert elapsed_s < 10, f"{case}: {elapsed_s:.1f} s"  # generous: the ReDoS took 12.7 s under Python's re
    assert stored_state(platform) == before

    # lora_bias, modules_to_save, layers_to_transform and an alpha_pattern regex key, deployed from a directory in
    # the Hugging Face cache layout (files are symlinks into blobs/): the output is PEFT's, token for token.
    made = peft_adapter(tmp_path / "made", tiny_dense_dir, r=4, lora_alpha=8, target_modules=["q_proj", "o_proj"],
                        lora_bias=True, modules_to_save=["norm"], layers_to_transform=[1],
                        alpha_pattern={r"layers\.1\.self_attn\.o_.*": 3})
    blobs, snapshot = tmp_path / "hub" / "blobs", tmp_path / "hub" / "snapshots" / "0123abc"
    blobs.mkdir(parents=True)
    snapshot.mkdir(parents=True)
    for name in (CONFIG, WEIGHTS):
        (made / name).rename(blobs / name)
        (snapshot / name).symlink_to(Path("../../blobs") / name)
    prompt = "Tell me about the ocean."
    with platform.client() as admin:
        admin.deploy({"name": "peft-features", "backbone": "tiny-dense"}, snapshot)
        try:
            answer = admin.invoke("peft-features", {"messages": [{"role": "user", "content": prompt}],
                                                    "max_tokens": 10})
        finally:
            admin.delete("peft-features")
    model, tokenizer = load_backbone(tiny_dense_dir)
    assert answer["text"] == greedy_generate(with_adapter(model, snapshot), tokenizer, prompt, 10).text


def test_the_gateway_process_never_maps_torch(platform, headers) -> None:
    """Last in the module, after its uploads were validated and its function served: the `lorafaas up` process
    (gateway and node agent) computes nothing, so it never loads torch's libraries (they and transformers were
    about 250 MB of its 330; a function's memory is in its worker)."""
    reply = httpx.post(f"{platform.url}/v1/functions/alpha/invoke", headers=headers, timeout=120,
                       json={"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2})
    assert reply.status_code == 200, reply.text
    maps = Path(f"/proc/{platform.pid}/maps").read_text()
    assert "libtorch" not in maps and "tokenizers" not in maps
