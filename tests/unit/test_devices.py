"""`--devices`: several GPUs each with a budget, every device once, never the CPU beside GPUs; the launcher's daemons
keyed by (backbone, device)."""

from __future__ import annotations

import pytest

from lorafaas.errors import InvalidInput
from lorafaas.platform.agent import AgentConfig
from lorafaas.platform.backends.local import LocalLauncher
from lorafaas.platform.backends.local_daemons import daemon_log_name
from lorafaas.platform.backends.local_record import daemon_key, parse_daemon_key
from lorafaas.platform.devices import Device, backbone_device
from lorafaas.platform.server import parse_devices


def test_several_gpus_with_budgets_are_accepted_in_order() -> None:
    assert parse_devices("cuda:0=20G, cuda:1=512M,cuda:3=1.5G") == (
        Device("cuda:0", 20 * 1024**3), Device("cuda:1", 512 * 1024**2), Device("cuda:3", int(1.5 * 1024**3)))
    assert parse_devices("cpu=8G") == (Device("cpu", 8 * 1024**3),)


@pytest.mark.parametrize(("text", "message"), [
    ("cuda:0=20G,cuda:0=10G", r"device cuda:0 is named 2 times; name each once"),
    ("cuda:1,cuda:1", r"device cuda:1 is named 2 times"),  # refused before its free memory is read
    ("cpu,cpu", r"device cpu is named 2 times"),
    ("cpu=8G,cuda:0=20G", r"cpu cannot be mixed with GPUs \(cuda:0\)"),
    ("cuda:0=20G,cuda:1=20G,cpu", r"cpu cannot be mixed with GPUs \(cuda:0, cuda:1\)"),
    ("", r"no device given"),
    ("cuda:0=20G,gpu1", r"device 'gpu1' is not 'cpu' or 'cuda:N'"),
])
def test_bad_device_lists_are_refused_with_what_is_wrong(text: str, message: str) -> None:
    with pytest.raises(InvalidInput, match=message):
        parse_devices(text)


def test_the_agent_config_refuses_what_parse_devices_refuses() -> None:
    with pytest.raises(InvalidInput, match="named 2 times"):
        AgentConfig(devices=(Device("cuda:0", 1), Device("cuda:0", 1)))
    config = AgentConfig(devices=(Device("cuda:0", 1), Device("cuda:1", 2)))
    assert config.device_names == ("cuda:0", "cuda:1") and not config.cpu
    assert AgentConfig().cpu


def test_a_backbone_is_preloaded_where_it_runs_else_on_the_device_serving_fewest() -> None:
    served = {"cuda:0": ["a", "b"], "cuda:1": ["c"], "cuda:2": []}
    assert backbone_device(tuple(served), served.__getitem__, "c") == "cuda:1"
    assert backbone_device(tuple(served), served.__getitem__, "d") == "cuda:2"


def test_launcher_records_name_each_daemons_device_and_read_records_of_one_device() -> None:
    assert parse_daemon_key(daemon_key("tiny", "cuda:1"), "cuda:0") == ("tiny", "cuda:1")
    assert parse_daemon_key("tiny", "cuda:0") == ("tiny", "cuda:0")  # as a launcher of one device wrote it
    assert daemon_log_name("tiny", "cpu") == "daemon-tiny.log"
    assert daemon_log_name("tiny", "cuda:1") == "daemon-tiny@cuda-1.log"


def test_a_launcher_binds_only_the_devices_it_drives(tmp_path) -> None:
    launcher = LocalLauncher(tmp_path, devices=("cuda:0", "cuda:1"))
    assert launcher.device == "cuda:0" and launcher.running_backbones("cuda:1") == []
    with pytest.raises(InvalidInput, match="device cuda:2 is not driven by this launcher"):
        launcher.daemon_socket("tiny", "cuda:2")
    with pytest.raises(InvalidInput, match="cannot be mixed"):
        LocalLauncher(tmp_path, devices=("cpu", "cuda:0"))
