"""`lorafaas bench control-plane`: the control plane's per-function costs at N functions (default 1,000).

On a scratch platform (`lorafaas up`, a tiny seeded backbone, N distinct seeded adapters of mixed ranks and target
modules) it measures, in one run:

    deploy_s                    N functions by `POST /v1/functions:batch` (`--batch-size` a request)
    one_by_one_s_per_function   the baseline: `--sample` more functions deployed one request each, per function
    list_api_ms                 GET /v1/functions with N functions (median of `--repeats`)
    list_cli_s, help_cli_s      `lorafaas list` as a process, and `lorafaas --help` (the CLI's start alone)
    describe_api_ms             GET /v1/functions/{name}
    metrics_bytes, scrape_ms    /metrics with N functions deployed, `--invoked` of them invoked once
    metrics_bytes_per_invoked   what one invoked function adds to /metrics (its series), measured
    metrics_bytes_all_invoked   metrics_bytes + N x that: the scrape once every function has been invoked

Nothing is asserted: tests/integration/test_batch_deploy.py checks that all N are listed and /metrics is served.
"""

from __future__ import annotations

import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import httpx
import msgspec

from lorafaas.formats.model_store import ModelStore
from lorafaas.platform.api_client import ApiClient
from lorafaas.platform.batch_client import deploy_in_batches
from lorafaas.progress import ProgressSink, SilentProgress
from lorafaas.testing.platform_process import PlatformProcess
from lorafaas.testing.synthetic_adapters import write_random_adapter
from lorafaas.testing.tiny_models import save_tiny_backbone

BACKBONE = "tiny-dense"
RANKS = (4, 8, 16, 32)
TARGETS = (("q_proj", "v_proj"), ("q_proj", "k_proj", "v_proj", "o_proj"), ("v_proj",))


class ControlPlaneResult(msgspec.Struct, frozen=True, kw_only=True):
    functions: int
    batch_size: int
    deploy_s: float
    deploy_s_per_function: float
    one_by_one_s_per_function: float
    list_api_ms: float
    list_cli_s: float
    help_cli_s: float
    describe_api_ms: float
    metrics_bytes: int
    scrape_ms: float
    invoked: int
    metrics_bytes_per_invoked: float
    metrics_bytes_all_invoked: int
    failed: int  # entries refused or requests failed: 0 in a sound run


def run_control_plane_bench(functions: int = 1000, batch_size: int = 100, sample: int = 20, invoked: int = 3,
                            repeats: int = 5, progress: ProgressSink | None = None) -> ControlPlaneResult:
    progress = progress or SilentProgress()
    with tempfile.TemporaryDirectory(prefix="lorafaas-bench-control-") as scratch:
        root = Path(scratch)
        store = ModelStore(root / "home" / "models")
        store.import_dir(BACKBONE, save_tiny_backbone(root / "backbone", "dense"))
        progress.stage(f"writing {functions + sample} adapters", total=functions + sample)
        adapters = []
        for index in range(functions + sample):
            adapters.append(write_random_adapter(root / "adapters" / f"fn-{index:05d}", store, BACKBONE,
                                                 rank=RANKS[index % len(RANKS)],
                                                 target_modules=TARGETS[index % len(TARGETS)], seed=index))
            progress.advance()
        with PlatformProcess(root / "home") as platform, platform.client() as client:
            refusals, deploy_s = deploy_batches(client, adapters[:functions], {"backbone": BACKBONE, "keep_alive_s": 5},
                                              batch_size, progress)
            failed = len(refusals)
            one_by_one_s = _deploy_one_by_one(client, adapters[functions:], progress)
            progress.stage("timing list, describe and /metrics")
            headers = {"Authorization": f"Bearer {platform.admin_key}"}
            with httpx.Client(base_url=platform.url, headers=headers, timeout=120) as http:
                list_ms = median_s(lambda: http.get("/v1/functions").raise_for_status(), repeats) * 1e3
                describe_ms = median_s(lambda: http.get("/v1/functions/fn-00000").raise_for_status(), repeats) * 1e3
                before = len(http.get("/metrics").content)
                for name in [a.name for a in adapters[:invoked]]:
                    reply = http.post(f"/v1/functions/{name}/invoke", json={"prompt": "hi", "max_tokens": 2})
                    failed += reply.status_code != 200
                metrics_bytes = len(http.get("/metrics").content)
                scrape_ms = median_s(lambda: http.get("/metrics").raise_for_status(), repeats) * 1e3
            env = {**os.environ, "LORAFAAS_URL": platform.url}
            cli = [sys.executable, "-m", "lorafaas", "--home", str(platform.home)]
            list_cli_s = median_s(lambda: subprocess.run([*cli, "list"], env=env, capture_output=True, check=True),
                                   repeats)
            help_cli_s = median_s(lambda: subprocess.run([*cli, "--help"], env=env, capture_output=True, check=True),
                                   repeats)
    per_invoked = (metrics_bytes - before) / invoked if invoked else 0.0
    return ControlPlaneResult(
        functions=functions, batch_size=batch_size, deploy_s=deploy_s, deploy_s_per_function=deploy_s / functions,
        one_by_one_s_per_function=one_by_one_s, list_api_ms=list_ms, list_cli_s=list_cli_s, help_cli_s=help_cli_s,
        describe_api_ms=describe_ms, metrics_bytes=metrics_bytes, scrape_ms=scrape_ms, invoked=invoked,
        metrics_bytes_per_invoked=per_invoked,
        metrics_bytes_all_invoked=int(before + per_invoked * functions), failed=failed)


def deploy_batches(client: ApiClient, adapters: list[Path], fields: dict, batch_size: int, progress: ProgressSink
                   ) -> tuple[list[dict], float]:
    """(the entries refused, seconds) of deploying one function per adapter (named by its directory, with `fields`),
    `batch_size` a request, as `lorafaas deploy -f` does."""
    progress.stage(f"deploying {len(adapters)} functions, {batch_size} a request", total=len(adapters))
    started = time.perf_counter()
    outcome = deploy_in_batches(client, [{"name": a.name, "adapter": a, **fields} for a in adapters], batch_size,
                                progress)
    return outcome.refused, time.perf_counter() - started


def _deploy_one_by_one(client: ApiClient, adapters: list[Path], progress: ProgressSink) -> float:
    """Seconds per function of deploying each adapter with its own request (`POST /v1/functions`)."""
    progress.stage(f"deploying {len(adapters)} more, one a request", total=len(adapters))
    started = time.perf_counter()
    for adapter in adapters:
        client.deploy({"name": adapter.name, "backbone": BACKBONE, "keep_alive_s": 5}, adapter)
        progress.advance()
    return (time.perf_counter() - started) / max(1, len(adapters))


def median_s(call: Callable[[], object], repeats: int = 3) -> float:
    """The median wall time of `repeats` calls."""
    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        call()
        times.append(time.perf_counter() - started)
    return statistics.median(times)
