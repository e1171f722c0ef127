"""No Kubernetes call blocks the gateway's event loop: `lorafaas up --backend kubernetes` talks to the real API
server through a proxy that holds every request for seconds, and /healthz keeps answering at once meanwhile."""

from __future__ import annotations

import time
from pathlib import Path

import httpx
import yaml
from k8s_env import NODES, RELEASE, TEMPLATE, Release

from lorafaas.platform.api_client import ApiClient
from lorafaas.testing.platform_process import PlatformProcess
from lorafaas.testing.slow_proxy import SlowProxy

DELAY_S = 2.0


def test_healthz_answers_at_once_while_api_calls_are_slow(release: Release, tmp_path: Path, tiny_dense_dir: Path,
                                                           tiny_adapter_dir: Path, cli) -> None:
    for node in NODES[:2]:
        release.add_agent(node, backbones="tiny-dense")
    proxy = SlowProxy(release.plane.port, DELAY_S)
    kubeconfig = yaml.safe_load(release.plane.kubeconfig.read_text())
    kubeconfig["clusters"][0]["cluster"]["server"] = f"https://127.0.0.1:{proxy.port}"
    (tmp_path / "kubeconfig").write_text(yaml.safe_dump(kubeconfig))
    home = tmp_path / "home"
    assert cli("--home", str(home), "backbone", "import", "tiny-dense", "--from", str(tiny_dense_dir)).returncode == 0
    env = {"KUBECONFIG": str(tmp_path / "kubeconfig"), "POD_NAMESPACE": release.namespace,
           "LORAFAAS_RELEASE": RELEASE, "LORAFAAS_POD_TEMPLATE": TEMPLATE}
    platform = PlatformProcess(home, extra_args=("--backend", "kubernetes"), env=env).start()
    try:
        with ApiClient(platform.url, platform.admin_key) as client:
            client.deploy({"name": "steady", "backbone": "tiny-dense", "min_instances": 1}, tiny_adapter_dir)
            started = time.monotonic()
            slowest_s = 0.0
            while time.monotonic() - started < 4 * DELAY_S:
                asked = time.monotonic()
                assert httpx.get(f"{platform.url}/healthz", timeout=30).status_code == 200
                slowest_s = max(slowest_s, time.monotonic() - asked)
                time.sleep(0.05)
        held = [t for t in proxy.held_at if t >= started - DELAY_S]
        assert held, "no API call was in flight while /healthz was asked"
        print(f"slowest /healthz {slowest_s * 1e3:.0f} ms while {len(held)} API request chunks were held {DELAY_S} s")
        assert slowest_s < DELAY_S / 2, f"/healthz took {slowest_s:.2f} s while API calls took {DELAY_S} s"
    finally:
        platform.stop()
        proxy.close()
