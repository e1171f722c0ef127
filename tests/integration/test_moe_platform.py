"""MoE functions through the whole platform (`lorafaas up` as a real process, the tiny Mixtral-style backbone):
expert adapters in remote mode (the node's one LoRA server runs their experts' LoRA) and in local mode, side by side.
"""

from __future__ import annotations

import json
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import psutil
import pytest
import torch

from lorafaas.formats.expert_adapters import read_expert_adapter_info, write_expert_adapter
from lorafaas.formats.model_store import ModelStore
from lorafaas.function_runtime.instance import FunctionInstance
from lorafaas.function_runtime.messages import SamplingParams, WorkerSpec
from lorafaas.models.moe_lora import ExpertLoraForward
from lorafaas.platform.adapter_upload import pack_adapter
from lorafaas.protocols.lora_transport import LoraServerClient
from lorafaas.testing.platform_process import PlatformProcess

PROMPT = "Tell me about the ocean."
MAX_TOKENS = 12
LORA_SERVER_MODULE = "lorafaas.lora_server.server"


@pytest.fixture(scope="module")
def expert_adapters(tmp_path_factory: pytest.TempPathFactory, tiny_moe_dir: Path) -> dict[str, Path]:
    """`experts`: expert factors only (whatever it changes, only the expert LoRA changed it); `mixed`: attention
    pairs too. Large enough factors that they change the greedy text."""
    root = tmp_path_factory.mktemp("moe-adapters")
    return {
        "experts": write_expert_adapter(
            root / "experts", tiny_moe_dir, seed=21, scale=0.3, attention_modules=(), base_model_name="tiny-moe"
        ),
        "mixed": write_expert_adapter(root / "mixed", tiny_moe_dir, seed=22, scale=0.3, base_model_name="tiny-moe"),
    }


@pytest.fixture(scope="module")
def platform(tmp_path_factory: pytest.TempPathFactory, tiny_moe_dir: Path, tiny_dense_dir: Path):
    home = tmp_path_factory.mktemp("moe-platform-home")
    models = ModelStore(home / "models")
    models.import_dir("tiny-moe", tiny_moe_dir)
    models.import_dir("tiny-dense", tiny_dense_dir)
    with PlatformProcess(home) as running:
        yield running


def lora_servers_of(platform: PlatformProcess) -> list[psutil.Process]:
    children = psutil.Process(platform.process.pid).children(recursive=True)
    return [p for p in children if LORA_SERVER_MODULE in " ".join(_cmdline(p))]


def _cmdline(process: psutil.Process) -> list[str]:
    try:
        return process.cmdline()
    except psutil.Error:  # exited meanwhile
        return []


def in_process_instance(model_dir: Path, adapter_dir: Path | None, lora_mode: str = "local", server: str | None = None):
    """A function instance in this process (no daemon, no worker process) running the same staged loading."""
    spec = WorkerSpec(
        function="ref",
        instance_id="ref-0",
        socket_path="unused",
        model_dir=str(model_dir),
        adapter_dir=str(adapter_dir) if adapter_dir else None,
        lora_mode=lora_mode,
        lora_server=server,
    )
    return FunctionInstance(spec)


def generate(instance: FunctionInstance) -> str:
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as the workers run: the same summation order
    try:
        instance.load_for_request()
        engine = instance.engine
        engine.add("r", engine.encode_text(PROMPT), SamplingParams(max_tokens=MAX_TOKENS))
        while engine.has_work():
            for out in engine.step():
                if out.finish_reason is not None:
                    return out.full_text
    finally:
        torch.set_num_threads(threads)
    raise AssertionError("the generation did not finish")


def _status(socket_path: str):
    with LoraServerClient.connect(socket_path, client="test") as client:
        return client.status()


def expert_hooks(model) -> int:
    return sum(isinstance(m.__dict__.get("forward"), ExpertLoraForward) for m in model.modules())


def test_remote_and_local_functions_of_one_adapter_give_the_same_text_through_one_lora_server(
    platform: PlatformProcess, cli, expert_adapters: dict[str, Path], tiny_moe_dir: Path, tmp_path: Path
) -> None:
    url, home = platform.url, str(platform.home)
    # Remote mode by flag (CLI), by default (HTTP, no lora_mode), and local mode from a function.yaml (CLI -f).
    deployed = cli(
        "--home",
        home,
        "deploy",
        "moe-a",
        "--adapter",
        str(expert_adapters["experts"]),
        "--backbone",
        "tiny-moe",
        "--lora-mode",
        "remote",
        "--url",
        url,
        "--json",
    )
    assert deployed.returncode == 0, deployed.stderr
    assert json.loads(deployed.stdout)["lora_mode"] == "remote"
    function_yaml = tmp_path / "function.yaml"
    function_yaml.write_text(
        f"name: moe-a-local\nadapter: {expert_adapters['experts']}\nbackbone: tiny-moe\nlora_mode: local\n"
    )
    deployed = cli("--home", home, "deploy", "-f", str(function_yaml), "--url", url, "--json")
    assert deployed.returncode == 0, deployed.stderr
    with platform.client() as admin:
        assert admin.deploy({"name": "moe-b", "backbone": "tiny-moe"}, expert_adapters["mixed"])["lora_mode"] is None
        try:
            names = ["moe-a", "moe-a-local", "moe-b"]

            def invoke(name: str) -> str:
                with platform.client() as client:
                    return client.invoke(name, {"prompt": PROMPT, "max_tokens": MAX_TOKENS, "temperature": 0})["text"]

            with ThreadPoolExecutor(len(names)) as pool:  # all three at once: the server serves two instances
                texts = dict(zip(names, pool.map(invoke, names), strict=True))
            assert texts["moe-a"] == texts["moe-a-local"], texts
            expected = generate(in_process_instance(tiny_moe_dir, expert_adapters["experts"]))
            assert texts["moe-a"] == expected
            assert generate(in_process_instance(tiny_moe_dir, None)) != expected, "the expert LoRA must change the text"
            assert texts["moe-b"] != texts["moe-a"]

            described = {name: admin.describe(name) for name in names}
            assert [described[n]["function"]["lora_mode"] for n in names] == ["remote", "local", None]
            adapters = {name: info["instances"][0]["adapter"] for name, info in described.items()}
            experts_info = read_expert_adapter_info(expert_adapters["experts"])
            mixed_info = read_expert_adapter_info(expert_adapters["mixed"])
            assert adapters["moe-a"] == {
                "kind": "experts",
                "lora_mode": "remote",
                "held_bytes": 0,
                "expert_bytes": experts_info.expert_bytes,
            }
            assert adapters["moe-a-local"] == {
                "kind": "experts",
                "lora_mode": "local",
                "held_bytes": experts_info.expert_bytes,
                "expert_bytes": experts_info.expert_bytes,
            }
            assert adapters["moe-b"] == {
                "kind": "experts",
                "lora_mode": "remote",
                "held_bytes": mixed_info.attention_bytes,
                "expert_bytes": mixed_info.expert_bytes,
            }
            shown = cli("--home", home, "describe", "moe-a", "--url", url)
            assert shown.returncode == 0, shown.stderr
            assert "LoRA mode remote" in shown.stdout and "experts, remote" in shown.stdout, shown.stdout

            # One LoRA server for the backbone, serving both remote functions' adapters (not the local one's).
            [server] = lora_servers_of(platform)
            assert str(platform.home / "models" / "tiny-moe") in server.cmdline()
            with LoraServerClient.connect(str(platform.home / "run" / "lora-tiny-moe.sock"), client="test") as client:
                status = client.status()
            assert status.server_pid == server.pid
            assert status.num_adapters == 2 and status.num_calls > 0
            assert len(status.cache.resident) == 2

            # Offloading a remote-mode adapter removes its hooks and releases its server connection; reloading
            # reconnects and gives the same text again.
            socket_path = str(platform.home / "run" / "lora-tiny-moe.sock")
            instance = in_process_instance(tiny_moe_dir, expert_adapters["experts"], "remote", socket_path)
            assert generate(instance) == expected and expert_hooks(instance.model) == 2
            connections = _status(socket_path).num_connections
            instance.unload("adapter_offload")
            assert expert_hooks(instance.model) == 0 and instance.adapter_stats() is None
            deadline = time.monotonic() + 10  # the server sees the close when its loop reads the end of the stream
            while _status(socket_path).num_connections != connections - 1:
                assert time.monotonic() < deadline, "offloading did not close the instance's server connection"
                time.sleep(0.05)
            assert generate(instance) == expected and expert_hooks(instance.model) == 2
            instance.unload("adapter_drop")

            memory = {}
            for name in names:
                info = psutil.Process(described[name]["instances"][0]["pid"]).memory_full_info()
                memory[name] = {"pss_bytes": info.pss, "uss_bytes": info.uss, **adapters[name]}
            print("\nMoE instance memory (tiny backbone):", json.dumps(memory, indent=1))
        finally:
            for name in ("moe-a", "moe-a-local", "moe-b"):
                admin.delete(name)
    # The backbone's last function went: its LoRA server goes too.
    deadline = time.monotonic() + 15
    while server.is_running() and server.status() != psutil.STATUS_ZOMBIE and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not lora_servers_of(platform)


def test_a_lora_mode_on_a_dense_backbone_is_refused_with_a_4xx_and_nothing_stored(
    platform: PlatformProcess, cli, tiny_adapter_dir: Path
) -> None:
    adapters_dir = platform.home / "adapters"
    stored_before = sorted(p.name for p in adapters_dir.iterdir()) if adapters_dir.is_dir() else []
    reply = httpx.post(
        f"{platform.url}/v1/functions",
        headers={"Authorization": f"Bearer {platform.admin_key}"},
        data={"spec": json.dumps({"name": "dense-remote", "backbone": "tiny-dense", "lora_mode": "remote"})},
        files={"adapter": ("a.tar.gz", pack_adapter(tiny_adapter_dir), "application/gzip")},
        timeout=60,
    )
    assert reply.status_code == 422, reply.text
    error = reply.json()["error"]
    assert error["code"] == "invalid_input" and "dense" in error["message"] and "tiny-dense" in error["message"]
    refused = cli(
        "--home",
        str(platform.home),
        "deploy",
        "dense-local",
        "--adapter",
        str(tiny_adapter_dir),
        "--backbone",
        "tiny-dense",
        "--lora-mode",
        "local",
        "--url",
        platform.url,
    )
    assert refused.returncode == 2 and "dense" in refused.stderr, refused.stderr
    unknown = cli(
        "--home",
        str(platform.home),
        "deploy",
        "moe-x",
        "--adapter",
        str(tiny_adapter_dir),
        "--backbone",
        "tiny-moe",
        "--lora-mode",
        "merged",
        "--url",
        platform.url,
    )
    assert unknown.returncode == 2 and "lora_mode is 'merged'" in unknown.stderr, unknown.stderr
    with platform.client() as admin:
        assert admin.list() == []
    assert (sorted(p.name for p in adapters_dir.iterdir()) if adapters_dir.is_dir() else []) == stored_before
