"""`lorafaas up` as a real process for tests: start, wait until ready, stop with SIGTERM (or SIGKILL), restart."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import psutil

from lorafaas.platform.api_client import ApiClient
from lorafaas.sse import aevents


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class PlatformProcess:
    def __init__(self, home: Path, port: int | None = None, extra_args: tuple[str, ...] = (),
                 env: dict[str, str] | None = None) -> None:
        self.home = Path(home)
        self.port = port or free_port()
        self.extra_args = extra_args
        self.env = env or {}
        self.process: subprocess.Popen | None = None
        self.log_path = self.home / "up.log"

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def admin_key(self) -> str:
        return (self.home / "admin.key").read_text().strip()

    @property
    def pid(self) -> int:
        """The `lorafaas up` process's (once started)."""
        if self.process is None:
            raise RuntimeError("the platform process is not started")
        return self.process.pid

    def client(self, key: str | None = None) -> ApiClient:
        return ApiClient(self.url, key or self.admin_key)

    def start(self, timeout_s: float = 180.0) -> PlatformProcess:
        self.home.mkdir(parents=True, exist_ok=True)
        with open(self.log_path, "ab") as log:
            self.process = subprocess.Popen(
                [sys.executable, "-m", "lorafaas", "--home", str(self.home), "up", "--port", str(self.port),
                 *self.extra_args],
                stdin=subprocess.DEVNULL, stdout=log, stderr=log, env={**os.environ, **self.env},
            )
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"lorafaas up exited with {self.process.returncode}:\n{self.log()[-3000:]}")
            try:
                if httpx.get(f"{self.url}/readyz", timeout=2).status_code == 200:
                    return self
            except httpx.TransportError:
                pass
            time.sleep(0.2)
        raise TimeoutError(f"lorafaas up was not ready within {timeout_s} s:\n{self.log()[-3000:]}")

    def stop(self, sig: int = signal.SIGTERM, timeout_s: float = 60.0) -> int:
        if self.process is None or self.process.poll() is not None:
            return self.process.returncode if self.process else 0
        self.process.send_signal(sig)
        try:
            return self.process.wait(timeout_s)
        except subprocess.TimeoutExpired:
            self.process.kill()
            return self.process.wait()

    def log(self) -> str:
        return self.log_path.read_text(errors="replace") if self.log_path.exists() else ""

    def __enter__(self) -> PlatformProcess:
        return self.start()

    def __exit__(self, *exc_info: object) -> None:
        self.stop()


def processes_naming(home: Path) -> dict[int, str]:
    """Live processes whose command line names `home`: every process a platform on `home` starts does."""
    found = {}
    for process in psutil.process_iter(["pid", "cmdline", "status"]):
        cmdline = " ".join(process.info["cmdline"] or ())
        if process.info["status"] != psutil.STATUS_ZOMBIE and str(home) in cmdline:
            found[process.info["pid"]] = cmdline[:160]
    return found


def wait_for(predicate, timeout_s: float, what: str):
    """Poll `predicate` until it returns something true (returned), failing the test after `timeout_s`."""
    deadline = time.monotonic() + timeout_s
    while not (value := predicate()):
        assert time.monotonic() < deadline, f"{what} did not happen within {timeout_s} s"
        time.sleep(0.05)
    return value


async def stream_invocation(http: httpx.AsyncClient, name: str, request: dict, headers: dict | None = None) -> dict:
    """One streaming invocation as a client sees it: `status`, the streamed `text`, and `error` (the JSON error of a
    refused request, or of an `error` event after the headers)."""
    text, error = "", None
    async with http.stream("POST", f"/v1/functions/{name}/invoke", json={**request, "stream": True},
                           headers=headers) as reply:
        if reply.status_code != 200:
            await reply.aread()
            return {"status": reply.status_code, "text": "", "error": reply.json()["error"]}
        async for event in aevents(reply):
            if event.error is not None:
                error = event.error
            elif event.data and event.data.get("type") == "token":
                text += event.data["text"]
    return {"status": 200, "text": text, "error": error}
