"""response_format on the real smollm2-135m with the pirate demo adapter, through a real platform and the official
openai client: every output parses and validates against its schema, greedy and seeded, whole and streamed, with
free-text requests batched alongside unchanged."""

import json
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import jsonschema
import openai
import pytest

from lorafaas.formats.model_store import ModelStore
from lorafaas.testing.platform_process import PlatformProcess

ADAPTER = Path(__file__).resolve().parents[2] / "examples" / "adapters" / "pirate"
MESSAGES = [{"role": "user", "content": "Describe a pirate ship as JSON."}]
SHIP = {"type": "object", "additionalProperties": False, "required": ["name", "cannons", "flag", "crew"],
        "properties": {
            "name": {"type": "string", "maxLength": 24},
            "cannons": {"type": "integer", "minimum": 0, "maximum": 60},
            "flag": {"enum": ["black", "red", "white"]},
            "crew": {"type": "array", "maxItems": 3, "items": {
                "type": "object", "required": ["role"], "additionalProperties": False,
                "properties": {"role": {"enum": ["captain", "mate", "cook"]}}}}}}
FORMAT = {"type": "json_schema", "json_schema": {"name": "ship", "schema": SHIP, "strict": True}}


@pytest.fixture(scope="module")
def client(tmp_path_factory, smollm2_store):
    home = tmp_path_factory.mktemp("structured-home")
    ModelStore(home / "models").import_dir("smollm2-135m", smollm2_store.path("smollm2-135m"))
    with PlatformProcess(home) as running:
        with running.client() as admin:
            admin.deploy({"name": "pirate", "backbone": "smollm2-135m"}, ADAPTER)
        yield openai.OpenAI(base_url=f"{running.url}/v1", api_key=running.admin_key, max_retries=0, timeout=300)


def chat(client, **params):
    return client.chat.completions.create(model="pirate", messages=MESSAGES, **{"max_tokens": 150} | params)


def test_schema_and_json_object_outputs_validate_on_smollm2(client) -> None:
    free = [dict(temperature=0, max_tokens=20), dict(temperature=0.8, seed=2, max_tokens=20)]
    constrained = [dict(response_format=FORMAT, temperature=0), dict(response_format=FORMAT, temperature=0.9, seed=7),
                   dict(response_format={"type": "json_object"}, temperature=0.7, seed=1)]
    alone = [chat(client, **params).choices[0].message.content for params in free]
    with ThreadPoolExecutor(len(free) + len(constrained)) as pool:
        replies = list(pool.map(lambda params: chat(client, **params), free + constrained))
    assert [r.choices[0].message.content for r in replies[:2]] == alone
    for reply in replies[2:4]:
        assert reply.choices[0].finish_reason == "stop", reply.choices[0].message.content
        jsonschema.validate(json.loads(reply.choices[0].message.content), SHIP)
    assert replies[4].choices[0].finish_reason == "stop", replies[4].choices[0].message.content
    assert isinstance(json.loads(replies[4].choices[0].message.content), dict)
    streamed = chat(client, response_format=FORMAT, temperature=0.9, seed=7, stream=True)
    assert "".join(c.choices[0].delta.content or "" for c in streamed if c.choices) == \
        replies[3].choices[0].message.content


def test_tools_are_refused_because_smollm2s_template_does_not_render_them(client) -> None:
    tools = [{"type": "function", "function": {"name": "sail", "parameters": {"type": "object"}}}]
    with pytest.raises((openai.BadRequestError, openai.UnprocessableEntityError)) as refused:
        chat(client, tools=tools, tool_choice="none", max_tokens=4)
    assert "tools" in str(refused.value) and "does not render tools" in str(refused.value)
