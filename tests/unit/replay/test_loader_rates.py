"""Loader rates from the profile: every loader's rate is its fraction of the cluster's hardware limits (one set of
limits for all), and the simulator's load times follow them; a node's host tier serves a backbone loaded there."""

from __future__ import annotations

import copy
from dataclasses import replace
from pathlib import Path

import pytest
import yaml

from lorafaas.errors import ClusterInvalid
from lorafaas.replay.sim.cluster import GB, parse_cluster
from lorafaas.replay.sim.costmodel import CostModel
from lorafaas.replay.sim.policies import POLICIES
from lorafaas.replay.sim.runner import simulate
from lorafaas.replay.workload import Request, Workload

PAPER_YAML = yaml.safe_load((Path(__file__).resolve().parents[3] / "lorafaas/replay/clusters/paper.yaml").read_text())
SIZE = int(13.5 * GB)


def _cluster(disk: float, host: float, nvme_gbps: float = 7.0, h2d_gbps: float = 24.0):
    data = copy.deepcopy(PAPER_YAML)
    data["loading"]["hardware"] = {"nvme_gbps": nvme_gbps, "host_to_device_gbps": h2d_gbps}
    data["loading"]["loaders"]["standard"] = {"disk": disk, "host": host}
    return parse_cluster(data, "x.yaml")


def test_lorafaas_load_time_is_its_fraction_of_the_hardware() -> None:
    costs = CostModel(_cluster(disk=0.5, host=0.25))
    assert costs.backbone_load_s(SIZE, on_device=False, on_host=False, shared=False) == pytest.approx(
        SIZE / (0.5 * 7.0 * GB))
    assert costs.backbone_load_s(SIZE, on_device=False, on_host=True, shared=False) == pytest.approx(
        SIZE / (0.25 * 24.0 * GB))
    faster = CostModel(_cluster(disk=1.0, host=0.5))  # the fraction doubled: the load takes half as long
    assert faster.backbone_load_s(SIZE, False, False, False) == pytest.approx(
        costs.backbone_load_s(SIZE, False, False, False) / 2)
    assert faster.backbone_load_s(SIZE, False, True, False) == pytest.approx(
        costs.backbone_load_s(SIZE, False, True, False) / 2)


def test_every_loader_reads_the_same_disk() -> None:
    """A faster NVMe speeds up both loaders by the same factor: no policy gets a disk of its own."""
    slow, fast = CostModel(_cluster(0.9, 0.5, nvme_gbps=3.5)), CostModel(_cluster(0.9, 0.5, nvme_gbps=7.0))
    for kind in ("standard", "fast"):
        load = (lambda c: c.backbone_load_s(SIZE, False, False, False)) if kind == "standard" else \
            (lambda c: c.fast_backbone_load_s(SIZE, cached_in_host=False))
        assert load(slow) == pytest.approx(2 * load(fast))
    shipped = parse_cluster(PAPER_YAML, "paper.yaml").loading
    assert shipped.fast_ssd_bytes_per_s == pytest.approx(PAPER_YAML["loading"]["loaders"]["fast"]["disk"] * 7.0 * GB)
    assert shipped.disk_bytes_per_s == pytest.approx(PAPER_YAML["loading"]["loaders"]["standard"]["disk"] * 7.0 * GB)


@pytest.mark.parametrize(("where", "value", "message"), [
    (("loaders", "standard", "disk"), 1.2, r"x.yaml.loading.loaders.standard.disk is 1.2; it must be in"),
    (("hardware", "nvme_gbps"), 0, r"x.yaml.loading.hardware.nvme_gbps is 0; it must be in"),
    (("loaders", "fast", "dsik"), 0.5, r"x.yaml.loading.loaders.fast: unknown key\(s\) dsik"),
])
def test_a_fraction_above_the_limit_or_a_missing_limit_is_refused(where: tuple, value: float, message: str) -> None:
    data = copy.deepcopy(PAPER_YAML)
    node = data["loading"]
    for key in where[:-1]:
        node = node[key]
    node[where[-1]] = value
    with pytest.raises(ClusterInvalid, match=message):
        parse_cluster(data, "x.yaml")


def test_a_backbone_the_node_loaded_before_comes_from_its_host_tier() -> None:
    """The second cold start of a function (its instance gone after the keep-alive) on the one-node cluster reads the
    backbone from the node's host memory at the host rate, not from NVMe."""
    data = copy.deepcopy(PAPER_YAML)
    data["nodes"], data["devices_per_node"] = 1, 1
    cluster = parse_cluster(data, "x.yaml")
    name = "llama2-7b-a"
    work = Workload((Request(0.0, "t", name, 100, 4), Request(5000.0, "t", name, 100, 4)), 5001.0)
    policy = replace(POLICIES["no-preload"], keep_alive="fixed")  # nothing kept ahead; gone after keep_alive_s
    out, _row = simulate(work, cluster, policy, seed=1)
    first, second = out.results
    assert first.cold and second.cold
    size = cluster.backbones["llama2-7b"].size_bytes
    disk_s, host_s = size / cluster.loading.disk_bytes_per_s, size / cluster.loading.host_to_device_bytes_per_s
    assert first.cold_start_s - second.cold_start_s == pytest.approx(disk_s - host_s, rel=1e-6)
