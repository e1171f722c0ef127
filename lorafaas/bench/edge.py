"""`lorafaas bench edge`: how fast the gateway answers /healthz while one tenant attacks it (issue 18, items 1-3).

The attacks, all at once, each from its own thread: invocations of unknown functions with 1 MB names (metric
labels), /metrics scrapes, and adapter uploads: 300 MB of random bytes, a tar of 200,000 folders, a rank-4096 adapter
of zeros, a truncated archive (and any extra uploads given, e.g. a target_modules regex that backtracks). Meanwhile a
probe in a process of its own (so the attackers' threads cannot delay it: they share this process's GIL) asks
/healthz every 20 ms. Reported: /healthz latency idle and under attack (p50, p99, max) and whether every
attack got a 4xx. The platform runs on a tiny backbone: the gateway's answers, not the model, are measured.
"""

from __future__ import annotations

import math
import multiprocessing
import os
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import msgspec

from lorafaas.platform.adapter_upload import pack_adapter
from lorafaas.progress import ProgressSink, SilentProgress
from lorafaas.stats import percentile
from lorafaas.testing.hostile import BOUNDARY, multipart_head, redos_adapter, tar_of_folders, truncated, zero_adapter

PROBE_INTERVAL_S = 0.02
IDLE_PROBES = 50
UNKNOWN_NAME_BYTES = 1024 * 1024
NUM_UNKNOWN_INVOCATIONS = 40
NUM_SCRAPES = 20
RANDOM_UPLOAD_BYTES = 300 * 1024**2


class EdgeResult(msgspec.Struct, frozen=True, kw_only=True):
    attacks: dict[str, list[int]]  # attack -> the HTTP statuses it got
    attacks_refused: bool  # every attack answered with a 4xx (none 5xx, none accepted)
    healthz_idle_p50_ms: float
    healthz_idle_max_ms: float
    healthz_p50_ms: float
    healthz_p99_ms: float
    healthz_max_ms: float
    healthz_probes: int
    attack_s: float


def attack_and_probe(url: str, key: str, scratch: Path, backbone_dir: Path, backbone: str,
                     extra_uploads: dict[str, bytes] | None = None) -> dict:
    """Run every attack at once against the platform at `url` while probing /healthz; returns EdgeResult as a dict."""
    headers = {"Authorization": f"Bearer {key}"}
    uploads = {
        "200,000 folders": tar_of_folders(200_000),
        "rank-4096 zeros": pack_adapter(zero_adapter(scratch / "zeros", backbone_dir, rank=4096,
                                                     base_model_name=backbone)),
        "truncated tar": truncated(zero_adapter(scratch / "small", backbone_dir, rank=4, base_model_name=backbone)),
        **(extra_uploads or {}),
    }
    idle = _probe_n(url, IDLE_PROBES)
    statuses: dict[str, list[int]] = {}
    lock = threading.Lock()

    def record(attack: str, status: int) -> None:
        with lock:
            statuses.setdefault(attack, []).append(status)

    def unknown_names() -> None:
        with httpx.Client(base_url=url, headers=headers, timeout=120) as http:
            for i in range(NUM_UNKNOWN_INVOCATIONS):
                name = f"{i}-" + "n" * UNKNOWN_NAME_BYTES
                reply = http.post("/v1/completions", json={"model": name, "prompt": "hi", "max_tokens": 1})
                record("unknown 1 MB names", reply.status_code)

    def scrapes() -> None:
        with httpx.Client(base_url=url, headers=headers, timeout=120) as http:
            for _ in range(NUM_SCRAPES):
                http.get("/metrics").raise_for_status()

    def hostile_uploads() -> None:  # one after another: the gateway takes a few uploads at once (429 beyond)
        for name, archive in uploads.items():
            reply = httpx.post(f"{url}/v1/functions", headers=headers, timeout=300,
                               data={"spec": msgspec.json.encode({"name": "attack", "backbone": backbone}).decode()},
                               files={"adapter": ("a.tar.gz", archive, "application/gzip")})
            record(name, reply.status_code)

    def random_upload() -> None:
        head, tail = multipart_head("random", backbone), f"\r\n--{BOUNDARY}--\r\n".encode()

        def body() -> Iterator[bytes]:
            yield head
            chunk = os.urandom(1024**2)
            for _ in range(RANDOM_UPLOAD_BYTES // len(chunk)):
                yield chunk
            yield tail

        reply = httpx.post(f"{url}/v1/functions", content=body(), timeout=300, headers={
            **headers, "Content-Type": f"multipart/form-data; boundary={BOUNDARY}",
            "Content-Length": str(len(head) + RANDOM_UPLOAD_BYTES + len(tail))})
        record("300 MB random upload", reply.status_code)

    attacks = [unknown_names, scrapes, random_upload, hostile_uploads]
    threads = [threading.Thread(target=attack, daemon=True) for attack in attacks]
    context = multiprocessing.get_context("spawn")
    ready, stop = context.Event(), context.Event()
    receiver, sender = context.Pipe(duplex=False)
    prober = context.Process(target=_probe_until, args=(url, ready, stop, sender), daemon=True)
    prober.start()
    if not ready.wait(60):
        prober.kill()
        raise RuntimeError("the /healthz probe process did not start within 60 s")
    started = time.perf_counter()
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    attack_s = time.perf_counter() - started
    stop.set()
    latencies: list[float] = receiver.recv()
    prober.join(30)
    refused = all(400 <= s < 500 for got in statuses.values() for s in got) and \
        len(statuses) == 2 + len(uploads)  # every attack but the scrapes recorded its answers
    return msgspec.to_builtins(EdgeResult(
        attacks=statuses, attacks_refused=refused,
        healthz_idle_p50_ms=round(percentile(idle, 50, math.nan) * 1e3, 2),
        healthz_idle_max_ms=round(max(idle) * 1e3, 2),
        healthz_p50_ms=round(percentile(latencies, 50, math.nan) * 1e3, 2),
        healthz_p99_ms=round(percentile(latencies, 99, math.nan) * 1e3, 2),
        healthz_max_ms=round(max(latencies) * 1e3, 2), healthz_probes=len(latencies), attack_s=round(attack_s, 2),
    ))


def _probe_once(http: httpx.Client) -> float:
    started = time.perf_counter()
    http.get("/healthz").raise_for_status()
    return time.perf_counter() - started


def _probe_until(url: str, ready, stop, sender) -> None:
    """In the probe process: /healthz every PROBE_INTERVAL_S from `ready` until `stop`; the latencies go to `sender`."""
    latencies = []
    with httpx.Client(base_url=url, timeout=60) as http:
        _probe_once(http)  # connected before the attacks begin
        ready.set()
        while not stop.is_set():
            latencies.append(_probe_once(http))
            time.sleep(PROBE_INTERVAL_S)
    sender.send(latencies)


def _probe_n(url: str, n: int) -> list[float]:
    with httpx.Client(base_url=url, timeout=60) as http:
        samples = []
        for _ in range(n):
            samples.append(_probe_once(http))
            time.sleep(PROBE_INTERVAL_S)
        return samples


def run_edge_bench(redos: bool = True, progress: ProgressSink | None = None) -> dict:
    """A scratch platform on a tiny backbone, attacked as `attack_and_probe` does (with the ReDoS upload)."""
    from lorafaas.formats.model_store import ModelStore
    from lorafaas.testing.platform_process import PlatformProcess
    from lorafaas.testing.tiny_models import save_tiny_backbone

    progress = progress or SilentProgress()
    with tempfile.TemporaryDirectory(prefix="lorafaas-bench-edge-") as scratch:
        root = Path(scratch)
        backbone_dir = save_tiny_backbone(root / "tiny")
        ModelStore(root / "home" / "models").import_dir("tiny-dense", backbone_dir)
        extra = {"ReDoS target_modules": pack_adapter(redos_adapter(root / "redos", backbone_dir, "tiny-dense"))} \
            if redos else {}
        with PlatformProcess(root / "home") as platform:
            progress.stage("attacking the gateway while probing /healthz")
            return attack_and_probe(platform.url, platform.admin_key, root, backbone_dir, "tiny-dense", extra)
