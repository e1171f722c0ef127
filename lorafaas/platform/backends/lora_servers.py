"""The node's LoRA servers: one per MoE backbone, started when the first remote-mode instance of that backbone needs
it, stopped when no function of the backbone remains or the node agent stops (InfiniLoRA's shared LoRA server).

    servers = LoraServers(run_dir, log_dir)
    spec = with_lora_mode(spec, "tiny-moe", None, servers)   # expert adapter, remote: lora_server = the socket
    servers.stop("tiny-moe"); servers.close()

A server found answering at a backbone's socket (left by a platform killed with SIGKILL) is adopted rather than
replaced, so it is not left running beside a new one; this node stops it like its own.
"""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import msgspec

from lorafaas.errors import LorafaasError
from lorafaas.function_runtime.messages import WorkerSpec
from lorafaas.platform.backends.local import process_alive

log = logging.getLogger(__name__)
STOP_TIMEOUT_S = 10.0
PROBE_BUFFER_BYTES = 4096  # the adoption probe sends no rows: the smallest buffer will do


@dataclass
class LoraServerProcess:
    backbone: str
    pid: int
    address: str  # the Unix socket instances connect to (shared-memory transport)
    process: subprocess.Popen | None  # None when adopted: not our child

    def alive(self) -> bool:
        return process_alive(self.process, self.pid)

    def stop(self, timeout_s: float = STOP_TIMEOUT_S) -> None:
        """SIGTERM (the server closes its sockets and exits), SIGKILL if it does not go within `timeout_s`."""
        if self.process is not None:
            if self.process.poll() is None:
                self.process.terminate()
                try:
                    self.process.wait(timeout_s)
                except subprocess.TimeoutExpired:
                    log.warning("LoRA server %d of %s did not stop; killing it", self.pid, self.backbone)
                    self.process.kill()
                    self.process.wait()
            if self.process.stdout is not None:  # the pipe its ready line came through
                self.process.stdout.close()
            return
        if not self.alive():
            return
        os.kill(self.pid, signal.SIGTERM)
        deadline = time.monotonic() + timeout_s
        while self.alive() and time.monotonic() < deadline:
            time.sleep(0.02)
        if self.alive():
            os.kill(self.pid, signal.SIGKILL)


class LoraServers:
    """The LoRA server processes of one node, by backbone. Thread-safe: instances start from worker threads."""

    def __init__(
        self, run_dir: Path, log_dir: Path, *, device: str = "cpu", capacity: int = 8, num_threads: int | None = 1
    ) -> None:
        self.run_dir = Path(run_dir)
        self.log_dir = Path(log_dir)
        self.device = device
        self.capacity = capacity  # adapters resident per server (M)
        self.num_threads = num_threads
        self._servers: dict[str, LoraServerProcess] = {}
        self._lock = threading.Lock()

    def socket_path(self, backbone: str) -> Path:
        return self.run_dir / f"lora-{backbone}.sock"

    def address(self, backbone: str, model_dir: Path) -> str:
        """The socket of the backbone's LoRA server, started (or adopted) if none runs."""
        with self._lock:
            server = self._servers.get(backbone)
            if server is not None and server.alive():
                return server.address
            if server is not None:
                log.warning("LoRA server %d of %s exited; starting another", server.pid, backbone)
            server = self._adopt(backbone) or self._start(backbone, Path(model_dir))
            self._servers[backbone] = server
            return server.address

    def running(self) -> dict[str, int]:
        """backbone -> pid of its LoRA server, for those alive."""
        with self._lock:
            return {b: s.pid for b, s in self._servers.items() if s.alive()}

    def stop(self, backbone: str) -> bool:
        """Stop the backbone's server; False if none ran."""
        with self._lock:
            server = self._servers.pop(backbone, None)
        if server is None:
            return False
        server.stop()
        log.info("LoRA server %d of %s stopped", server.pid, backbone)
        return True

    def close(self) -> None:
        for backbone in list(self._servers):
            self.stop(backbone)

    def _start(self, backbone: str, model_dir: Path) -> LoraServerProcess:
        from lorafaas.lora_server.server import LoraServerConfig, spawn_lora_server  # imports torch
        from lorafaas.platform.backends.local import private_dir

        private_dir(self.run_dir)
        private_dir(self.log_dir)
        config = LoraServerConfig(
            model_dir=model_dir,
            socket_path=self.socket_path(backbone),
            capacity=self.capacity,
            device=self.device,
            num_threads=self.num_threads,
        )
        started = time.perf_counter()
        with open(self.log_dir / f"lora-server-{backbone}.log", "ab") as log_file:
            process, addresses = spawn_lora_server(config, stderr=log_file)
        log.info(
            "LoRA server %d of %s serving at %s (started in %.0f ms)",
            process.pid,
            backbone,
            addresses["socket"],
            (time.perf_counter() - started) * 1e3,
        )
        return LoraServerProcess(backbone, process.pid, addresses["socket"], process)

    def _adopt(self, backbone: str) -> LoraServerProcess | None:
        """A server already answering at the backbone's socket (a predecessor's), or None."""
        from lorafaas.protocols.lora_transport import LoraServerClient

        path = self.socket_path(backbone)
        if not path.exists():
            return None
        try:
            with LoraServerClient.connect(
                str(path), client="node-agent", timeout_s=2.0, buffer_bytes=PROBE_BUFFER_BYTES
            ) as client:
                pid = client.welcome.server_pid
        except LorafaasError:
            return None  # a stale socket file: the new server replaces it
        log.info("adopted the LoRA server %d of %s found at %s", pid, backbone, path)
        return LoraServerProcess(backbone, pid, str(path), None)


def with_lora_mode(spec: WorkerSpec, backbone: str, lora_mode: str | None, servers: LoraServers | None) -> WorkerSpec:
    """The worker spec of an instance, with its LoRA mode if its adapter is an expert adapter, and in remote mode
    (the default) the address of the node's LoRA server for the backbone, started here if none runs. Dense adapters
    are returned unchanged (the mode means nothing for them). Without `servers` (a backend that runs none, such as
    Kubernetes pods) a remote-mode instance fails at its adapter step with a message naming --lora-mode local."""
    from lorafaas.formats.expert_adapters import is_expert_adapter

    if spec.adapter_dir is None or not is_expert_adapter(Path(spec.adapter_dir)):
        return spec
    mode = lora_mode or "remote"
    if mode == "local" or servers is None:
        return msgspec.structs.replace(spec, lora_mode=mode)
    return msgspec.structs.replace(spec, lora_mode=mode, lora_server=servers.address(backbone, Path(spec.model_dir)))
