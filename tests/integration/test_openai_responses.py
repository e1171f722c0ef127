"""POST /v1/responses (issue 21, item 7) with the official `openai` client against a real platform: the same text as
the chat completion of the same messages, whole and streamed in OpenAI's event order, usage counted, and what
lorafaas does not implement refused by name."""

from __future__ import annotations

import openai
import pytest

from lorafaas.formats.model_store import ModelStore
from lorafaas.testing.platform_process import PlatformProcess
from lorafaas.testing.tiny_models import save_tiny_adapter

STREAM_ORDER = ["response.created", "response.in_progress", "response.output_item.added",
                "response.content_part.added"]
STREAM_END = ["response.output_text.done", "response.content_part.done", "response.output_item.done",
              "response.completed"]


@pytest.fixture(scope="module")
def client(tmp_path_factory, tiny_dense_dir):
    root = tmp_path_factory.mktemp("responses")
    home = root / "home"
    ModelStore(home / "models").import_dir("tiny-dense", tiny_dense_dir)
    with PlatformProcess(home) as platform, platform.client() as admin:
        adapter = save_tiny_adapter(root / "alpha", tiny_dense_dir, seed=1, base_model_name="tiny-dense")
        admin.deploy({"name": "alpha", "backbone": "tiny-dense"}, adapter)
        admin.deploy({"name": "small", "backbone": "tiny-dense", "max_tokens_limit": 8}, adapter)
        yield openai.OpenAI(base_url=f"{platform.url}/v1", api_key=platform.admin_key, max_retries=0)


def chat_text(client: openai.OpenAI, messages: list[dict], max_tokens: int) -> tuple[str, object]:
    reply = client.chat.completions.create(model="alpha", messages=messages, max_tokens=max_tokens, temperature=0)
    return reply.choices[0].message.content, reply.usage


def test_a_response_answers_as_the_chat_completion_of_the_same_messages(client) -> None:
    response = client.responses.create(model="alpha", input="Tell me about the ocean.", instructions="Be brief.",
                                       max_output_tokens=12, temperature=0)
    text, usage = chat_text(client, [{"role": "system", "content": "Be brief."},
                                     {"role": "user", "content": "Tell me about the ocean."}], 12)
    assert response.object == "response" and response.id.startswith("resp_")
    assert response.output_text == text
    [item] = response.output
    assert item.type == "message" and item.role == "assistant" and item.content[0].type == "output_text"
    assert response.usage.input_tokens == usage.prompt_tokens
    assert response.usage.output_tokens == usage.completion_tokens
    assert response.usage.total_tokens == usage.prompt_tokens + usage.completion_tokens
    assert response.status == ("incomplete" if usage.completion_tokens == 12 else "completed")


def test_a_list_of_messages_with_text_parts_and_the_developer_role(client) -> None:
    response = client.responses.create(model="alpha", temperature=0, max_output_tokens=8, input=[
        {"role": "developer", "content": "Be brief."},
        {"role": "user", "content": [{"type": "input_text", "text": "Tell me"},
                                     {"type": "input_text", "text": "about the ocean."}]},
    ])
    text, _ = chat_text(client, [{"role": "system", "content": "Be brief."},
                                 {"role": "user", "content": "Tell me\nabout the ocean."}], 8)
    assert response.output_text == text


def test_a_streamed_response_sends_openais_events_and_the_same_text(client) -> None:
    whole = client.responses.create(model="alpha", input="The ocean is", max_output_tokens=16, temperature=0)
    events = list(client.responses.create(model="alpha", input="The ocean is", max_output_tokens=16, temperature=0,
                                          stream=True))
    kinds = [event.type for event in events]
    assert kinds[:4] == STREAM_ORDER and kinds[-4:] == STREAM_END
    assert set(kinds[4:-4]) <= {"response.output_text.delta"}
    assert [event.sequence_number for event in events] == list(range(len(events)))
    deltas = "".join(event.delta for event in events if event.type == "response.output_text.delta")
    assert deltas == whole.output_text == events[-1].response.output_text
    assert events[-1].response.usage.output_tokens == whole.usage.output_tokens


def test_a_response_cut_by_max_output_tokens_is_incomplete(client) -> None:
    response = client.responses.create(model="small", input="The ocean is", temperature=0)
    assert response.usage.output_tokens <= 8  # the function's max_tokens_limit bounds the default
    cut = client.responses.create(model="alpha", input="The ocean is", max_output_tokens=1, temperature=0)
    assert cut.status == "incomplete" and cut.incomplete_details.reason == "max_output_tokens"


@pytest.mark.parametrize(("param", "value"), [
    ("store", True), ("previous_response_id", "resp_123"), ("reasoning", {"effort": "low"}),
    ("tools", [{"type": "function", "name": "f", "parameters": {"type": "object"}}]),
    ("text", {"format": {"type": "json_object"}}), ("no_such_parameter", 1),
])
def test_what_lorafaas_does_not_implement_is_refused_by_name(client, param, value) -> None:
    with pytest.raises(openai.BadRequestError) as raised:
        client.responses.create(model="alpha", input="hi", max_output_tokens=2, extra_body={param: value})
    assert raised.value.response.json()["error"]["param"] == param


def test_bad_values_and_unknown_functions_are_refused_in_openais_shape(client) -> None:
    with pytest.raises(openai.BadRequestError) as raised:
        client.responses.create(model="small", input="hi", max_output_tokens=9)
    assert raised.value.response.json()["error"]["param"] == "max_output_tokens"
    with pytest.raises(openai.BadRequestError):
        client.responses.create(model="alpha", input=[], max_output_tokens=2)
    with pytest.raises(openai.NotFoundError):
        client.responses.create(model="nobody", input="hi")
    # Accepted at their off values, as the SDK and other clients send them.
    off = {"store": False, "tools": [], "tool_choice": "none", "metadata": {}, "text": {"format": {"type": "text"}}}
    assert client.responses.create(model="alpha", input="hi", max_output_tokens=2, extra_body=off).output_text \
        is not None
