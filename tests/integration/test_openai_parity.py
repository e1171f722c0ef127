"""The OpenAI-compatible API as vLLM's users know it (issue 21, items 1 and 3-6): the official `openai` client, and
httpx where the SDK cannot express a request, against `lorafaas up` serving tiny backbones."""

import json
import shutil
from pathlib import Path

import httpx
import openai
import pytest
from transformers import AutoTokenizer

from lorafaas.formats.model_store import ModelStore
from lorafaas.models.reference import chat_template_ids
from lorafaas.testing.platform_process import PlatformProcess
from lorafaas.testing.tiny_models import save_tiny_adapter

PROMPT = "Tell me about the ocean."
CONTEXT = 256  # the tiny backbones' max_position_embeddings
USER = [{"role": "user", "content": PROMPT}]


# ChatML that renders an assistant's tool calls (their arguments as JSON) and a tool turn's call id, as tool-aware
# templates (Qwen's, Llama 3's) do.
TOOL_TEMPLATE = (
    "{% if messages[0]['role'] == 'assistant' %}{{ raise_exception('a conversation starts with a user turn') }}"
    "{% endif %}{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\n' + message['content'] }}"
    "{% for call in message.get('tool_calls') or [] %}{{ call['function']['name'] + '(' "
    "+ call['function']['arguments'] | tojson + ')' }}{% endfor %}"
    "{% if message.get('tool_call_id') %}{{ ' [' + message['tool_call_id'] + ']' }}{% endif %}"
    "{{ '<|im_end|>\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


def bos_backbone(out_dir: Path, tiny_dense_dir: Path) -> Path:
    """tiny-dense whose tokenizer adds a BOS token to every text it encodes (as Llama's does), and whose chat
    template renders tool turns."""
    shutil.copytree(tiny_dense_dir, out_dir)
    (out_dir / "chat_template.jinja").write_text(TOOL_TEMPLATE)
    tokenizer_file = out_dir / "tokenizer.json"
    tokenizer = json.loads(tokenizer_file.read_text())
    bos = next(t for t in tokenizer["added_tokens"] if t["content"] == "<|im_start|>")
    tokenizer["post_processor"] = {
        "type": "TemplateProcessing",
        "single": [{"SpecialToken": {"id": "<|im_start|>", "type_id": 0}}, {"Sequence": {"id": "A", "type_id": 0}}],
        "pair": [{"Sequence": {"id": "A", "type_id": 0}}, {"Sequence": {"id": "B", "type_id": 1}}],
        "special_tokens": {"<|im_start|>": {"id": "<|im_start|>", "ids": [bos["id"]], "tokens": ["<|im_start|>"]}},
    }
    tokenizer_file.write_text(json.dumps(tokenizer))
    return out_dir


@pytest.fixture(scope="module")
def platform(tmp_path_factory, tiny_dense_dir):
    root = tmp_path_factory.mktemp("openai-parity")
    home = root / "home"
    models = ModelStore(home / "models")
    models.import_dir("tiny-dense", tiny_dense_dir)
    models.import_dir("tiny-bos", bos_backbone(root / "tiny-bos", tiny_dense_dir))
    with PlatformProcess(home) as running, running.client() as admin:
        adapter = save_tiny_adapter(root / "alpha", tiny_dense_dir, seed=1, base_model_name="tiny-dense")
        admin.deploy({"name": "alpha", "backbone": "tiny-dense"}, adapter)
        admin.deploy({"name": "small", "backbone": "tiny-dense", "max_tokens_limit": 8}, adapter)
        bos_adapter = save_tiny_adapter(root / "bos", models.path("tiny-bos"), seed=2, base_model_name="tiny-bos")
        admin.deploy({"name": "bos", "backbone": "tiny-bos"}, bos_adapter)
        yield running


@pytest.fixture(scope="module")
def client(platform) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{platform.url}/v1", api_key=platform.admin_key, max_retries=0)


@pytest.fixture(scope="module")
def tokenizer(tiny_dense_dir):
    return AutoTokenizer.from_pretrained(tiny_dense_dir)


def post(platform, path: str, body: dict) -> httpx.Response:
    return httpx.post(f"{platform.url}{path}", json=body, timeout=120,
                      headers={"Authorization": f"Bearer {platform.admin_key}"})


def bad_request(call) -> dict:
    """The error of a call the openai SDK must raise BadRequestError for, checked to be in OpenAI's shape."""
    with pytest.raises(openai.BadRequestError) as raised:
        call()
    error = raised.value.response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["type"] == "invalid_request_error"
    return error


# -- item 1: the default max_tokens fits the function and the context ------------------------------------------------

def test_an_omitted_max_tokens_is_bounded_by_the_function_limit_and_the_context(platform, client) -> None:
    limited = client.chat.completions.create(model="small", messages=USER, extra_body={"ignore_eos": True})
    assert limited.usage.completion_tokens == 8 and limited.choices[0].finish_reason == "length"
    completion = client.completions.create(model="small", prompt=PROMPT, extra_body={"ignore_eos": True})
    assert completion.usage.completion_tokens == 8
    # The chat default (512) passes the 256-token context: what is left after the prompt is generated.
    whole = client.chat.completions.create(model="alpha", messages=USER, extra_body={"ignore_eos": True})
    assert whole.usage.completion_tokens == CONTEXT - whole.usage.prompt_tokens
    assert whole.choices[0].finish_reason == "length"
    native = post(platform, "/v1/functions/small/invoke", {"prompt": PROMPT, "temperature": 0})
    assert native.status_code == 200, native.text
    assert native.json()["usage"]["completion_tokens"] <= 8
    # An explicit value past the limit is the caller's mistake, named.
    error = bad_request(lambda: client.chat.completions.create(model="small", messages=USER, max_tokens=9))
    assert error["param"] == "max_tokens" and "max_tokens_limit" in error["message"]


def test_an_explicit_max_tokens_past_the_room_the_prompt_leaves_is_a_bad_request_not_cut_short(client) -> None:
    """As vLLM and OpenAI answer: the prompt plus what was asked for must fit the context. Omitted, it is cut short
    (above)."""
    whole = client.chat.completions.create(model="alpha", messages=USER, extra_body={"ignore_eos": True})
    room = CONTEXT - whole.usage.prompt_tokens
    fits = client.chat.completions.create(model="alpha", messages=USER, max_tokens=room,
                                          extra_body={"ignore_eos": True})
    assert fits.usage.completion_tokens == room
    error = bad_request(lambda: client.chat.completions.create(model="alpha", messages=USER, max_tokens=room + 1))
    assert error["code"] == "prompt_too_long" and f"ask for at most {room}" in error["message"]
    error = bad_request(lambda: client.completions.create(model="alpha", prompt=PROMPT, max_tokens=CONTEXT - 1))
    assert error["code"] == "prompt_too_long" and "omit max_tokens" in error["message"]


# -- item 3: zero tokens is a 400 ------------------------------------------------------------------------------------

@pytest.mark.parametrize("field", ["max_tokens", "max_completion_tokens"])
def test_zero_max_tokens_is_a_bad_request(client, field) -> None:
    error = bad_request(lambda: client.chat.completions.create(model="alpha", messages=USER, **{field: 0}))
    assert error["param"] == field
    if field == "max_tokens":
        error = bad_request(lambda: client.completions.create(model="alpha", prompt=PROMPT, max_tokens=0))
        assert error["param"] == "max_tokens"


# -- item 4 and the rule "nothing is ignored": 400 in OpenAI's shape, with param ------------------------------------

def test_validation_errors_are_400s_naming_the_parameter(platform, client) -> None:
    assert bad_request(lambda: client.chat.completions.create(
        model="alpha", messages=USER, temperature=5))["param"] == "temperature"
    assert bad_request(lambda: client.chat.completions.create(
        model="alpha", messages=[{"role": "robot", "content": "hi"}]))["param"] == "messages[0].role"
    assert bad_request(lambda: client.completions.create(model="alpha", prompt=PROMPT, top_p=0))["param"] == "top_p"
    assert bad_request(lambda: client.completions.create(  # choice i samples with seed + i: past the seed bound
        model="alpha", prompt=PROMPT, n=2, seed=2**53 - 1))["param"] == "seed"
    malformed = httpx.post(f"{platform.url}/v1/chat/completions", content=b"{not json", timeout=30,
                           headers={"Authorization": f"Bearer {platform.admin_key}",
                                    "Content-Type": "application/json"})
    assert malformed.status_code == 400 and set(malformed.json()["error"]) == {"message", "type", "param", "code"}
    with pytest.raises(openai.NotFoundError) as missing:
        client.chat.completions.create(model="no-such-function", messages=USER)
    assert missing.value.response.json()["error"]["param"] is None
    # lorafaas' own API keeps 422 for the same mistake.
    native = post(platform, "/v1/functions/alpha/invoke", {"prompt": PROMPT, "temperature": 5})
    assert native.status_code == 422 and "param" not in native.json()["error"]


@pytest.mark.parametrize(("param", "value"), [
    ("best_of", 2), ("min_tokens", 3), ("stop_token_ids", [5]), ("length_penalty", 0.5),
    ("tool_choice", "auto"),
    ("tools", [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]),
    ("use_beam_search", True), ("metadata", {"a": "b"}), ("no_such_parameter", 1),
])
def test_parameters_lorafaas_does_not_implement_are_refused_by_name(client, param, value) -> None:
    error = bad_request(lambda: client.chat.completions.create(model="alpha", messages=USER, max_tokens=2,
                                                               extra_body={param: value}))
    assert error["param"] == param


@pytest.mark.parametrize(("tool", "param"), [
    ({"type": "function", "function": {"parameters": {"type": "object"}}}, "tools[0].function.name"),
    ({"type": "retrieval", "function": {"name": "f"}}, "tools[0].type"),
    ({"type": "function", "function": {"name": "f", "parameters": "{}"}}, "tools[0].function.parameters"),
    ({"type": "function", "function": {"name": "f", "arguments": "{}"}}, "tools[0].function.arguments"),
    ({"type": "function"}, "tools[0].function"),
])
def test_a_malformed_tool_is_a_400_naming_its_field(client, tool, param) -> None:
    """Issue 37: chat's tools are OpenAI's function tools, typed (the parameters a free-form JSON Schema)."""
    error = bad_request(lambda: client.chat.completions.create(model="alpha", messages=USER, max_tokens=2,
                                                               tools=[tool], tool_choice="none"))
    assert error["param"] == param, error


def test_unsupported_parameters_at_their_off_value_and_echo_are_handled(client) -> None:
    off = {"presence_penalty": 0, "frequency_penalty": 0.0, "logprobs": False, "top_k": -1, "logit_bias": {},
           "response_format": {"type": "text"}, "tool_choice": "none", "repetition_penalty": 1}
    reply = client.chat.completions.create(model="alpha", messages=USER, max_tokens=2, extra_body=off)
    assert reply.usage.completion_tokens >= 1
    assert bad_request(lambda: client.completions.create(
        model="alpha", prompt=PROMPT, echo=True, logprobs=1))["param"] == "echo"  # the prompt's logprobs
    assert bad_request(lambda: client.chat.completions.create(
        model="alpha", messages=USER, top_logprobs=2))["param"] == "top_logprobs"  # without logprobs: true
    assert bad_request(lambda: client.chat.completions.create(
        model="alpha", messages=USER, stream_options={"include_usage": True}))["param"] == "stream_options"


# -- issue 36 finding 12: strict booleans, every 400 names its param, chat echo, native message fields --------------

@pytest.mark.parametrize(("path", "field", "value"), [
    ("/v1/chat/completions", "stream", "yes"), ("/v1/chat/completions", "logprobs", "true"),
    ("/v1/chat/completions", "ignore_eos", 1), ("/v1/completions", "echo", "yes"),
    ("/v1/completions", "stream", 0),
])
def test_a_non_boolean_flag_is_a_400_naming_it(platform, path, field, value) -> None:
    """`"stream": "yes"` was read as true."""
    body = {"model": "alpha", "max_tokens": 2, field: value}
    body |= {"messages": USER} if "chat" in path else {"prompt": PROMPT}
    reply = post(platform, path, body)
    assert reply.status_code == 400, reply.text
    assert reply.json()["error"]["param"] == field and "boolean" in reply.json()["error"]["message"]
    native = post(platform, "/v1/functions/alpha/invoke", {"prompt": PROMPT, "max_tokens": 2, "stream": "yes"})
    assert native.status_code == 422 and native.json()["error"]["message"].startswith("stream: "), native.text


def test_refusals_from_the_function_name_their_param(client) -> None:
    """These four 400s came back from the worker with param null."""
    assert bad_request(lambda: client.chat.completions.create(
        model="alpha", messages=USER, max_tokens=2, logit_bias={"99999": 5}))["param"] == "logit_bias"
    nine = bad_request(lambda: client.completions.create(model="alpha", prompt=PROMPT, max_tokens=2,
                                                          stop=[f"s{i}" for i in range(9)]))
    assert nine["param"] == "stop" and "stop has 9 strings" in nine["message"]
    assert bad_request(lambda: client.completions.create(model="alpha", prompt=PROMPT, max_tokens=2,
                                                         stop=[""]))["param"] == "stop"
    assert bad_request(lambda: client.completions.create(model="alpha", prompt=[1, 99999],
                                                         max_tokens=2))["param"] == "prompt"


def test_chat_echo_is_refused_as_not_supported_and_its_off_value_served(client) -> None:
    """vLLM defines `echo` for chat; lorafaas said it was "not a parameter of this endpoint"."""
    error = bad_request(lambda: client.chat.completions.create(model="alpha", messages=USER, max_tokens=2,
                                                               extra_body={"echo": True}))
    assert error["param"] == "echo" and error["message"] == "echo is not supported by lorafaas; leave it out (or " \
        "send null)"
    reply = client.chat.completions.create(model="alpha", messages=USER, max_tokens=2, extra_body={"echo": False})
    assert reply.usage.completion_tokens >= 1


def test_the_native_api_refuses_unknown_message_fields_naming_them(platform) -> None:
    """They were dropped silently (extra="ignore")."""
    reply = post(platform, "/v1/functions/alpha/invoke", {
        "messages": [{"role": "user", "content": PROMPT, "tool_calls": []}], "max_tokens": 2})
    assert reply.status_code == 422, reply.text
    assert reply.json()["error"]["message"].startswith("messages.0.tool_calls: Extra inputs are not permitted")


# -- item 5: null means the default; text parts; developer; tool turns ----------------------------------------------

def test_null_fields_mean_their_defaults(platform) -> None:
    nulls = {"temperature": None, "top_p": None, "n": None, "max_tokens": None, "max_completion_tokens": None,
             "stop": None, "stream": None, "stream_options": None, "presence_penalty": None, "logprobs": None,
             "user": None, "ignore_eos": None}
    with_nulls = post(platform, "/v1/chat/completions", {"model": "small", "messages": USER, "seed": 7, **nulls})
    assert with_nulls.status_code == 200, with_nulls.text
    defaults = post(platform, "/v1/chat/completions", {"model": "small", "messages": USER, "seed": 7,
                                                        "temperature": 1.0, "top_p": 1.0, "n": 1, "max_tokens": 8})
    assert with_nulls.json()["choices"] == defaults.json()["choices"]
    del nulls["max_completion_tokens"]  # a chat parameter only, in OpenAI's API and vLLM's
    completion = post(platform, "/v1/completions", {"model": "small", "prompt": PROMPT, "echo": None, **nulls})
    assert completion.status_code == 200, completion.text


def test_text_parts_developer_role_and_tool_turns_render_through_the_chat_template(platform, client) -> None:
    def greedy(messages: list[dict], model: str = "alpha"):
        return client.chat.completions.create(model=model, messages=messages, max_tokens=6, temperature=0)

    parts = greedy([{"role": "user", "content": [{"type": "text", "text": "Tell me"},
                                                 {"type": "text", "text": "about the ocean."}]}])
    joined = greedy([{"role": "user", "content": "Tell me\nabout the ocean."}])
    assert parts.choices[0].message.content == joined.choices[0].message.content
    assert parts.usage.prompt_tokens == joined.usage.prompt_tokens

    developer = greedy([{"role": "developer", "content": "Be brief."}, *USER])
    system = greedy([{"role": "system", "content": "Be brief."}, *USER])
    assert developer.choices[0].message.content == system.choices[0].message.content
    assert developer.usage.prompt_tokens == system.usage.prompt_tokens

    call = {"id": "call_1", "type": "function", "function": {"name": "depth", "arguments": '{"sea": "north"}'}}
    tool_turns = greedy([*USER, {"role": "assistant", "content": None, "tool_calls": [call]},
                         {"role": "tool", "tool_call_id": "call_1", "content": "3000 m"}], model="bos")
    # As vLLM hands them to the template: null content as "", tool-call arguments parsed from their JSON.
    parsed_call = {**call, "function": {"name": "depth", "arguments": {"sea": "north"}}}
    rendered = [*USER, {"role": "assistant", "content": "", "tool_calls": [parsed_call]},
                {"role": "tool", "content": "3000 m", "tool_call_id": "call_1"}]
    tool_tokenizer = AutoTokenizer.from_pretrained(platform.home / "models" / "tiny-bos")
    expected = chat_template_ids(tool_tokenizer, rendered)
    assert tool_turns.usage.prompt_tokens == len(expected)
    as_text = [*USER, {"role": "assistant", "content": "", "tool_calls": [call]}, rendered[-1]]  # arguments unparsed
    assert len(chat_template_ids(tool_tokenizer, as_text)) != len(expected), "the template sees the parsed arguments"
    refused = bad_request(lambda: greedy([{"role": "assistant", "content": "Ahoy"}], model="bos"))
    assert "starts with a user turn" in refused["message"]
    image = [{"type": "image_url", "image_url": {"url": "http://example.invalid/a.png"}}]
    assert bad_request(lambda: greedy([{"role": "user", "content": image}]))["param"] == "messages[0].content"
    # Null content is empty text for any role, as vLLM reads it.
    assert greedy([{"role": "user", "content": None}]).usage.prompt_tokens == greedy(
        [{"role": "user", "content": ""}]).usage.prompt_tokens


# -- item 6: n, lists of prompts, token ids, GET /v1/models/{id}, EOS counted, special tokens ---------------------

def test_n_samples_are_indexed_seeded_as_vllm_and_their_usage_summed(client) -> None:
    many = client.chat.completions.create(model="alpha", messages=USER, n=3, seed=5, max_tokens=6)
    assert [c.index for c in many.choices] == [0, 1, 2]
    alone = [client.chat.completions.create(model="alpha", messages=USER, seed=5 + i, max_tokens=6) for i in range(3)]
    assert [c.message.content for c in many.choices] == [a.choices[0].message.content for a in alone]
    assert many.usage.prompt_tokens == alone[0].usage.prompt_tokens
    assert many.usage.completion_tokens == sum(a.usage.completion_tokens for a in alone)

    stream = client.chat.completions.create(model="alpha", messages=USER, n=3, seed=5, max_tokens=6, stream=True,
                                            stream_options={"include_usage": True})
    texts, finished = ["", "", ""], set()
    chunks = list(stream)
    for chunk in chunks:
        for choice in chunk.choices:
            texts[choice.index] += choice.delta.content or ""
            if choice.finish_reason:
                finished.add(choice.index)
    assert texts == [c.message.content for c in many.choices] and finished == {0, 1, 2}
    assert chunks[-1].usage.completion_tokens == many.usage.completion_tokens


def test_lists_of_prompts_and_token_id_prompts(client, tokenizer) -> None:
    prompts = [PROMPT, "Arr, matey!"]
    both = client.completions.create(model="alpha", prompt=prompts, n=2, seed=3, max_tokens=5)
    assert [c.index for c in both.choices] == [0, 1, 2, 3]
    alone = [client.completions.create(model="alpha", prompt=p, seed=3 + i, max_tokens=5)
             for p in prompts for i in range(2)]
    assert [c.text for c in both.choices] == [a.choices[0].text for a in alone]
    assert both.usage.prompt_tokens == alone[0].usage.prompt_tokens + alone[2].usage.prompt_tokens
    assert both.usage.completion_tokens == sum(a.usage.completion_tokens for a in alone)

    ids = [tokenizer(p)["input_ids"] for p in prompts]
    as_text = client.completions.create(model="alpha", prompt=PROMPT, temperature=0, max_tokens=5)
    as_ids = client.completions.create(model="alpha", prompt=ids[0], temperature=0, max_tokens=5)
    assert as_ids.choices[0].text == as_text.choices[0].text
    assert as_ids.usage.prompt_tokens == as_text.usage.prompt_tokens == len(ids[0])
    lists = client.completions.create(model="alpha", prompt=ids, temperature=0, max_tokens=5)
    assert [c.index for c in lists.choices] == [0, 1] and lists.choices[0].text == as_text.choices[0].text
    assert bad_request(lambda: client.completions.create(model="alpha", prompt=[10**6], max_tokens=2))
    assert bad_request(lambda: client.completions.create(model="alpha", prompt=[], max_tokens=2))["param"] == "prompt"


def test_a_model_is_retrieved_by_id_within_its_tenant(platform, client) -> None:
    model = client.models.retrieve("alpha")
    assert (model.id, model.object) == ("alpha", "model")
    with pytest.raises(openai.NotFoundError) as missing:
        client.models.retrieve("no-such-function")
    assert missing.value.response.json()["error"]["code"] == "function_not_found"
    with platform.client() as admin:
        key = admin.create_key("other")["key"]
    other = openai.OpenAI(base_url=f"{platform.url}/v1", api_key=key, max_retries=0)
    with pytest.raises(openai.NotFoundError):
        other.models.retrieve("alpha")


def test_completion_tokens_count_the_sampled_eos_as_vllm(platform, client) -> None:
    """A sampled end-of-sequence token is a completion token (vLLM counts it): it is one of the streamed tokens."""
    body = {"prompt": PROMPT, "max_tokens": CONTEXT // 2, "temperature": 2.0}
    for seed in range(64):
        with httpx.stream("POST", f"{platform.url}/v1/functions/alpha/invoke", timeout=120,
                          json={**body, "seed": seed, "stream": True},
                          headers={"Authorization": f"Bearer {platform.admin_key}"}) as reply:
            events = [json.loads(line[5:]) for line in reply.iter_lines() if line.startswith("data:")]
        if events[-1]["finish_reason"] == "stop":
            break
    else:
        pytest.fail("no sample ended with EOS")
    num_tokens = sum(1 for e in events if e["type"] == "token")
    openai_reply = client.completions.create(model="alpha", prompt=PROMPT, max_tokens=CONTEXT // 2, temperature=2.0,
                                             seed=seed)
    assert openai_reply.choices[0].finish_reason == "stop"
    assert openai_reply.usage.completion_tokens == num_tokens == events[-1]["usage"]["completion_tokens"]


def test_a_raw_prompt_gets_the_tokenizers_special_tokens_as_in_vllm(platform, client) -> None:
    bos_tokenizer = AutoTokenizer.from_pretrained(platform.home / "models" / "tiny-bos")
    with_bos = bos_tokenizer(PROMPT)["input_ids"]  # vLLM: add_special_tokens=True for a completion prompt
    assert len(with_bos) == len(bos_tokenizer(PROMPT, add_special_tokens=False)["input_ids"]) + 1
    reply = client.completions.create(model="bos", prompt=PROMPT, max_tokens=1)
    assert reply.usage.prompt_tokens == len(with_bos)
    # Chat prompts come from the template alone (vLLM: add_special_tokens=False after the template).
    chat = client.chat.completions.create(model="bos", messages=USER, max_tokens=1)
    assert chat.usage.prompt_tokens == len(chat_template_ids(bos_tokenizer, USER))
