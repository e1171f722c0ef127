"""The host tier: a stopped CPU daemon's segment is kept by the launcher, within a budget, and the backbone's next
daemon adopts it instead of loading the store again (real daemons, real memfds)."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest

from lorafaas.formats.model_store import ModelStore
from lorafaas.platform.backends.host_tier import HostTier
from lorafaas.platform.backends.local import LocalLauncher
from lorafaas.protocols.daemon_client import DaemonClient
from lorafaas.protocols.daemon_config import DaemonConfig


def _inode_and_adopter(config: DaemonConfig) -> tuple[int, int | None]:
    with DaemonClient.connect(config.paths.socket) as client:
        _manifest, fd = client.hold_segment()
        status = client.status()
    try:
        return os.fstat(fd).st_ino, status.adopted_from_pid
    finally:
        os.close(fd)


@pytest.fixture
def home(tmp_path: Path, tiny_dense_dir: Path, tiny_moe_dir: Path) -> Path:
    store = ModelStore(tmp_path / "models")
    store.import_dir("tiny-dense", tiny_dense_dir)
    store.import_dir("tiny-moe", tiny_moe_dir)
    return tmp_path


def test_a_stopped_daemons_segment_is_adopted_by_the_backbones_next_daemon(home: Path) -> None:
    config = DaemonConfig(home=home, backbone="tiny-dense", device="cpu")
    with LocalLauncher(home, host_tier_bytes=1 << 30) as launcher:
        launcher.daemon_socket("tiny-dense")
        inode, _ = _inode_and_adopter(config)
        first_pid = launcher.daemons.processes[("tiny-dense", "cpu")].ref.pid
        assert launcher.stop_daemon("tiny-dense")
        assert launcher.host_tier.keys() == [("tiny-dense", "cpu")]
        launcher.daemon_socket("tiny-dense")
        assert _inode_and_adopter(config) == (inode, first_pid)  # the same memfd: nothing read from the store
        assert launcher.host_tier.keys() == []  # handed over, not kept twice


def test_without_a_budget_a_stopped_daemons_segment_goes_and_the_next_loads_anew(home: Path) -> None:
    config = DaemonConfig(home=home, backbone="tiny-dense", device="cpu")
    with LocalLauncher(home, host_tier_bytes=0) as launcher:
        launcher.daemon_socket("tiny-dense")
        inode, _ = _inode_and_adopter(config)
        launcher.stop_daemon("tiny-dense")
        assert launcher.host_tier.keys() == []
        launcher.daemon_socket("tiny-dense")
        new_inode, adopted_from = _inode_and_adopter(config)
        assert new_inode != inode and adopted_from is None


def test_the_budget_keeps_the_most_recently_stopped_backbones(home: Path) -> None:
    with LocalLauncher(home, host_tier_bytes=1 << 30) as launcher:
        sizes = {}
        for backbone in ("tiny-dense", "tiny-moe"):
            launcher.daemon_socket(backbone)
            with DaemonClient.connect(DaemonConfig(home=home, backbone=backbone, device="cpu").paths.socket) as c:
                manifest, fd = c.hold_segment()
            os.close(fd)
            sizes[backbone] = manifest.size
        launcher.host_tier = HostTier(max(sizes.values()))  # room for one of them
        launcher.stop_daemon("tiny-dense")
        launcher.stop_daemon("tiny-moe")
        assert launcher.host_tier.keys() == [("tiny-moe", "cpu")]  # the least recently kept went first
        assert launcher.host_tier.kept_bytes == sizes["tiny-moe"]


def test_a_kept_segment_of_weights_since_reimported_is_refused_and_the_store_loaded(home: Path,
                                                                                  tiny_moe_dir: Path) -> None:
    config = DaemonConfig(home=home, backbone="tiny-dense", device="cpu")
    with LocalLauncher(home, host_tier_bytes=1 << 30) as launcher:
        launcher.daemon_socket("tiny-dense")
        inode, _ = _inode_and_adopter(config)
        launcher.stop_daemon("tiny-dense")
        store = ModelStore(home / "models")
        shutil.rmtree(store.path("tiny-dense"))
        store.import_dir("tiny-dense", tiny_moe_dir)  # other weights under the same name: another digest
        launcher.daemon_socket("tiny-dense")
        new_inode, adopted_from = _inode_and_adopter(config)
        assert new_inode != inode and adopted_from is None
