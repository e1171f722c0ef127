"""Two defects mypy found in the platform's wiring (issue 37), each a test of its own: a platform built with no
devices named (the default of `ServerConfig`, as tests and embedders build it) called `_default_budget()` without
the device it needs (a TypeError), and the service read `Backend.log_dir` through a protocol that lacked it."""

from __future__ import annotations

from pathlib import Path

from lorafaas.platform.backends.base import Backend
from lorafaas.platform.backends.local import LocalLauncher
from lorafaas.platform.server import Platform, ServerConfig


def test_a_platform_built_with_no_devices_gets_the_cpu_with_a_budget(tmp_path: Path) -> None:
    platform = Platform(ServerConfig(home=tmp_path))  # built, not started: no process runs
    [device] = platform.agent.config.devices
    assert device.name == "cpu" and device.budget_bytes > 0
    platform.store.close()


def test_the_backend_protocol_declares_the_log_dir_the_service_reads(tmp_path: Path) -> None:
    assert "log_dir" in Backend.__annotations__
    launcher = LocalLauncher(tmp_path)
    assert isinstance(launcher, Backend) and launcher.log_dir.is_relative_to(tmp_path)
