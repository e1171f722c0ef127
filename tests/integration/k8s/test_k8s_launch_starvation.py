"""Pods that cannot start do not starve the gateway: `lorafaas up --backend kubernetes` against the real API server
launches NUM_STUCK function pods that the scheduler can place nowhere (the template's nodeSelector matches no node),
each waiting out its start budget, and meanwhile /readyz (a store ping), listing and deploying each answer promptly.

The bound (1 s against the 120 s a launch waits) is a bound on starvation, not a benchmark: waiting launches used to
hold threads of the default executor, which the store calls behind /readyz, list and deploy share."""

from __future__ import annotations

import json
import time
from pathlib import Path

import httpx
import yaml
from k8s_env import NODES, RELEASE, TEMPLATE, Release, wait_until

from lorafaas.platform.adapter_upload import pack_adapter
from lorafaas.testing.platform_process import PlatformProcess

NUM_STUCK = 8  # more than the default executor's threads on a 2-core machine (6)
PROBE_S = 10.0
BOUND_S = 1.0


def nowhere(pod: dict) -> None:
    pod["spec"]["nodeSelector"] = {"lorafaas.io/test": "no-node-has-this"}


def test_readyz_list_and_deploy_answer_while_launches_wait_for_unschedulable_pods(
        release: Release, tmp_path: Path, tiny_dense_dir: Path, tiny_adapter_dir: Path, cli) -> None:
    for node in NODES[:2]:
        release.add_agent(node, backbones="tiny-dense")
    release.set_template(nowhere)
    home = tmp_path / "home"
    assert cli("--home", str(home), "backbone", "import", "tiny-dense", "--from", str(tiny_dense_dir)).returncode == 0
    kubeconfig = tmp_path / "kubeconfig"
    kubeconfig.write_text(yaml.safe_dump(yaml.safe_load(release.plane.kubeconfig.read_text())))
    env = {"KUBECONFIG": str(kubeconfig), "POD_NAMESPACE": release.namespace, "LORAFAAS_RELEASE": RELEASE,
           "LORAFAAS_POD_TEMPLATE": TEMPLATE}
    archive = pack_adapter(tiny_adapter_dir)
    platform = PlatformProcess(home, extra_args=("--backend", "kubernetes"), env=env).start()
    try:
        with httpx.Client(base_url=platform.url, headers={"Authorization": f"Bearer {platform.admin_key}"},
                          timeout=60) as http:
            def deploy(name: str, min_instances: int) -> httpx.Response:
                spec = {"name": name, "backbone": "tiny-dense", "min_instances": min_instances}
                return http.post("/v1/functions", data={"spec": json.dumps(spec)},
                                 files={"adapter": ("adapter.tar.gz", archive, "application/gzip")})

            for i in range(NUM_STUCK):
                assert deploy(f"stuck-{i}", 1).status_code == 201
            wait_until(lambda: len(pending_function_pods(release)) >= NUM_STUCK,
                       f"{NUM_STUCK} function pods pending", timeout_s=60)
            slowest_s = {"readyz": 0.0, "list": 0.0, "deploy": 0.0}
            started = time.monotonic()
            probe = 0
            while time.monotonic() - started < PROBE_S:
                for kind, ask, status in (("readyz", lambda: http.get("/readyz"), 200),
                                          ("list", lambda: http.get("/v1/functions"), 200),
                                          ("deploy", lambda name=f"probe-{probe}": deploy(name, 0), 201)):
                    asked = time.monotonic()
                    answer = ask()
                    slowest_s[kind] = max(slowest_s[kind], time.monotonic() - asked)
                    assert answer.status_code == status, f"{kind}: {answer.status_code} {answer.text}"
                probe += 1
            still_pending = len(pending_function_pods(release))
        print(f"slowest answers while {still_pending} pods were pending: "
              + ", ".join(f"{k} {v * 1e3:.0f} ms" for k, v in slowest_s.items()))
        assert still_pending >= NUM_STUCK, "the launches stopped waiting before the probes ended"
        assert all(s < BOUND_S for s in slowest_s.values()), f"starved: {slowest_s} (bound {BOUND_S} s)"
    finally:
        platform.stop()


def pending_function_pods(release: Release) -> list:
    return [p for p in release.function_pods() if p.status is not None and p.status.phase == "Pending"
            and p.metadata.deletion_timestamp is None]
