"""Schemathesis against the gateway's own `/openapi.json`, with an admin key: requests that fit the schema and
requests that break it, for every operation. None may get a 5xx, and every error is the JSON error body
`{"error": {"code", "message", "type"}}`. Bounded: a few examples per operation, derandomized (same run every time).
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import httpx
import jsonschema
import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings
from hypothesis.errors import Unsatisfiable
from schemathesis import GenerationMode

from lorafaas.formats.model_store import ModelStore
from lorafaas.testing.platform_process import PlatformProcess
from lorafaas.testing.tiny_models import save_tiny_adapter

EXAMPLES_PER_OPERATION = 6
FUNCTION = "alpha"


@pytest.fixture(scope="module")
def platform(tmp_path_factory, tiny_dense_dir):
    home = tmp_path_factory.mktemp("fuzz-home")
    ModelStore(home / "models").import_dir("tiny-dense", tiny_dense_dir)
    adapter = save_tiny_adapter(home / "adapter-src", tiny_dense_dir, base_model_name="tiny-dense")
    with PlatformProcess(home) as running:
        with running.client() as admin:
            admin.deploy({"name": FUNCTION, "backbone": "tiny-dense", "max_tokens_limit": 16}, adapter)
        yield running


def check_reply(case, response) -> None:
    where = f"{case.method} {case.formatted_path} -> {response.status_code}: {response.text[:300]}"
    assert response.status_code < 500, where
    if response.status_code >= 400:
        content_type = response.headers.get("content-type") or [""]  # schemathesis: each header a list
        assert content_type[0].startswith("application/json"), where
        error = response.json()["error"]
        assert error["code"] and error["message"] and error["type"] == "invalid_request_error", where


def test_no_operation_answers_5xx_or_a_non_json_error(platform) -> None:
    auth = {"Authorization": f"Bearer {platform.admin_key}"}
    schema = schemathesis.openapi.from_url(f"{platform.url}/openapi.json")
    operations = [result.ok() for result in schema.get_all_operations()]
    assert len(operations) >= 15, [op.label for op in operations]  # every route is in the schema
    statuses: dict[int, int] = {}
    for operation in operations:
        # Also aim at the deployed function, so invoke and describe get past "not found"; never delete or patch it.
        fixed = [{}] if operation.method.upper() in ("DELETE", "PATCH") else [{}, {"name": FUNCTION}]
        for mode in (GenerationMode.POSITIVE, GenerationMode.NEGATIVE):
            for path_parameters in fixed:
                if path_parameters and "{name}" not in operation.path:
                    continue
                strategy = operation.as_strategy(mode, headers=auth, path_parameters=path_parameters or None)

                @given(case=strategy)
                @settings(
                    max_examples=EXAMPLES_PER_OPERATION,
                    deadline=None,
                    derandomize=True,
                    database=None,
                    suppress_health_check=list(HealthCheck),
                )
                def call(case) -> None:
                    response = case.call(base_url=platform.url, headers=auth, timeout=60)
                    statuses[response.status_code] = statuses.get(response.status_code, 0) + 1
                    check_reply(case, response)

                try:
                    call()
                except Unsatisfiable:  # nothing in this operation can be made invalid (e.g. GET /healthz)
                    assert mode is GenerationMode.NEGATIVE, operation.label
    print(f"{len(operations)} operations, {sum(statuses.values())} requests, statuses {sorted(statuses.items())}")
    assert sum(statuses.values()) >= len(operations) * 2
    with platform.client() as admin:  # and the platform still serves its function
        assert admin.invoke(FUNCTION, {"prompt": "still here", "max_tokens": 2})["usage"]["completion_tokens"] == 2


@pytest.mark.parametrize("caller", ["admin", "tenant"])
def test_schemathesis_with_every_check_finds_nothing(platform, caller) -> None:
    """`st run --checks all` (status codes, content types, response schemas and headers, positive and negative data,
    auth, methods) as the admin and as a tenant: zero failures, which includes zero 5xx. The one per-operation
    setting (multipart deploys) is explained in schemathesis.toml."""
    if caller == "admin":
        key = platform.admin_key
    else:
        with platform.client() as admin:
            key = admin.create_key("fuzz-tenant")["key"]
    st = Path(sys.executable).with_name("st")
    run = subprocess.run(
        [str(st), "--config-file", str(Path(__file__).with_name("schemathesis.toml")), "run",
         f"{platform.url}/openapi.json", "--checks", "all", "-H", f"Authorization: Bearer {key}",
         "--max-examples", "5", "--seed", "1", "--request-timeout", "60", "--no-color"],
        capture_output=True, text=True, timeout=900,
    )
    assert run.returncode == 0, run.stdout[-6000:] + run.stderr[-2000:]
    assert " passed" in run.stdout and "failures" not in run.stdout.lower().split("summary")[-1], run.stdout[-3000:]


def test_the_schema_states_the_rules_between_fields(platform) -> None:
    """What schemathesis `--checks all` found refused though the schema allowed it (issue 36, 12): each rule is in
    /openapi.json now, and each request that breaks it is still a 4xx naming the field."""
    document = httpx.get(f"{platform.url}/openapi.json").json()
    schemas = document["components"]["schemas"]

    def allowed(name: str, body: dict) -> bool:
        schema = {**schemas[name], "components": document["components"]}  # its $refs resolve from its root
        return jsonschema.Draft202012Validator(schema).is_valid(body)

    refused = {
        "ChatBody": {"model": "alpha", "messages": [{"role": "user", "content": "hi"}],
                     "stream_options": {"include_usage": False}},
        "CompletionBody": {"model": "alpha", "prompt": "hi", "echo": True, "logprobs": 0},
        "InvokeBody": {"prompt": "hi", "logit_bias": {"x": 1.0}},
    }
    paths = {"ChatBody": "/v1/chat/completions", "CompletionBody": "/v1/completions",
             "InvokeBody": f"/v1/functions/{FUNCTION}/invoke"}
    auth = {"Authorization": f"Bearer {platform.admin_key}"}
    for name, body in refused.items():
        assert not allowed(name, body), f"{name} allows {body}"
        reply = httpx.post(f"{platform.url}{paths[name]}", json=body, headers=auth, timeout=60)
        assert reply.status_code in (400, 422), (name, reply.text)
    assert allowed("ChatBody", {**refused["ChatBody"], "stream": True})
    assert allowed("CompletionBody", {**refused["CompletionBody"], "logprobs": None})
    assert allowed("InvokeBody", {"prompt": "hi", "logit_bias": {"7": 1.0}})
    for key in ("+7", " 7", "07", "7_0"):  # what pydantic alone would read as 7; the schema's pattern refuses
        assert not allowed("InvokeBody", {"prompt": "hi", "logit_bias": {key: 1.0}}), key
        reply = httpx.post(f"{platform.url}{paths['InvokeBody']}", json={"prompt": "hi", "logit_bias": {key: 1.0}},
                           headers=auth, timeout=60)
        assert reply.status_code == 422 and "logit_bias" in reply.json()["error"]["message"], (key, reply.text)

    # The multipart forms: a deploy's spec is a non-empty JSON text; PATCH's adapter is optional, never null.
    deploy = document["paths"]["/v1/functions"]["post"]["requestBody"]["content"]["multipart/form-data"]["schema"]
    spec = schemas[deploy["$ref"].rsplit("/", 1)[-1]]["properties"]["spec"]
    assert spec["minLength"] == 1 and spec["contentMediaType"] == "application/json", spec
    patch = document["paths"]["/v1/functions/{name}"]["patch"]["requestBody"]["content"]["multipart/form-data"]
    adapter = schemas[patch["schema"]["$ref"].rsplit("/", 1)[-1]]["properties"]["adapter"]
    assert "null" not in str(adapter), adapter
