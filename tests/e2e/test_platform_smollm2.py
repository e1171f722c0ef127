"""The main job as a new user runs it: `lorafaas up --demo`, then the CLI, curl -N and the official openai client."""

import shutil
import subprocess

import openai
import pytest

from lorafaas.formats.model_store import ModelStore
from lorafaas.testing.platform_process import PlatformProcess

PIRATE_WORDS = ("arr", "matey", "ye", "aye", "ahoy", "treasure", "hearties", "yer")


@pytest.fixture(scope="module")
def demo_platform(tmp_path_factory, smollm2_store):
    home = tmp_path_factory.mktemp("demo-home")
    # The session already converted the GGUF once; `up --demo` finds the backbone and skips its import.
    ModelStore(home / "models").import_dir("smollm2-135m", smollm2_store.path("smollm2-135m"))
    with PlatformProcess(home, extra_args=("--demo",)) as running:
        yield running


def test_demo_functions_are_deployed_and_the_admin_key_printed_once(demo_platform) -> None:
    with demo_platform.client() as client:
        assert sorted(f.name for f in client.list()) == ["french", "haiku", "pirate"]
    log = demo_platform.log()
    assert log.count(demo_platform.admin_key) == 1
    assert (demo_platform.home / "admin.key").stat().st_mode & 0o777 == 0o600


def test_cli_invoke_answers_in_the_adapters_style(demo_platform, cli) -> None:
    result = cli("--home", str(demo_platform.home), "invoke", "pirate", "Tell me about the ocean.", "--max-tokens",
                 "40", env={"LORAFAAS_URL": demo_platform.url}, timeout=300)
    assert result.returncode == 0, result.stderr
    words = {w.strip(".,!?;:'\"").lower() for w in result.stdout.split()}
    assert len(words & set(PIRATE_WORDS)) >= 2, result.stdout


def test_curl_streams_server_sent_events(demo_platform) -> None:
    curl = shutil.which("curl")
    if curl is None:
        pytest.fail("curl is not installed (.ci/run installs it)")
    result = subprocess.run(
        [curl, "-sN", f"{demo_platform.url}/v1/functions/haiku/invoke",
         "-H", f"Authorization: Bearer {demo_platform.admin_key}", "-H", "Content-Type: application/json",
         "-d", '{"prompt": "Tell me about the ocean.", "stream": true, "max_tokens": 16}'],
        capture_output=True, text=True, timeout=300,
    )
    events = [line for line in result.stdout.splitlines() if line.startswith("data: ")]
    assert len(events) >= 3, result.stdout
    assert all('"type": "token"' in e for e in events[:-1]) and '"type": "done"' in events[-1]


def test_openai_client_streams_chat_completions(demo_platform) -> None:
    client = openai.OpenAI(base_url=f"{demo_platform.url}/v1", api_key=demo_platform.admin_key)
    assert {m.id for m in client.models.list()} == {"french", "haiku", "pirate"}
    stream = client.chat.completions.create(
        model="french", messages=[{"role": "user", "content": "Tell me about the ocean."}], stream=True,
        max_tokens=24, temperature=0, stream_options={"include_usage": True},
    )
    chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert sum(1 for c in chunks if c.choices and c.choices[0].delta.content) >= 3, "tokens arrive as they are made"
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens >= 3
    whole = client.chat.completions.create(
        model="french", messages=[{"role": "user", "content": "Tell me about the ocean."}], max_tokens=24,
        temperature=0,
    )
    assert whole.choices[0].message.content == text
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="no-such-function", messages=[{"role": "user", "content": "hi"}])
