"""A real `redis-server` on a free port in a temp dir, for the Redis state store and anything built on it.

`redis_url` is a shared server (one per session), flushed before each test. `redis_server` is a server of the test's
own that it may stop and restart on the same port and directory (append-only file on, so data survives restarts).
Without the binary the tests skip, unless LORAFAAS_REQUIRE_REDIS=1 (CI), where they fail.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis

from lorafaas.testing.platform_process import free_port

START_TIMEOUT_S = 10.0
STOP_TIMEOUT_S = 10.0


def redis_server_binary() -> str:
    binary = shutil.which("redis-server")
    if binary is None:
        reason = "redis-server is not installed (apt-get install redis-server); the Redis tests need a real server"
        if os.environ.get("LORAFAAS_REQUIRE_REDIS") == "1":
            pytest.fail(f"{reason}, and LORAFAAS_REQUIRE_REDIS=1 forbids skipping them", pytrace=False)
        pytest.skip(reason)
    return binary



class RedisServer:
    """One redis-server process; `restart()` keeps its port and data directory."""

    def __init__(self, binary: str, directory: Path) -> None:
        self.binary = binary
        self.directory = directory
        self.port = 0
        self.process: subprocess.Popen | None = None

    def url(self, db: int = 0) -> str:
        return f"redis://127.0.0.1:{self.port}/{db}"

    def start(self) -> None:
        """Start on a free port the first time, on the same port after that."""
        first_start = not self.port
        for _ in range(3 if first_start else 1):  # another process may take the port before redis-server binds it
            if first_start:
                self.port = free_port()
            if self._try_start():
                return
        log = (self.directory / "redis.log").read_text(errors="replace")[-2000:]
        raise RuntimeError(f"redis-server did not start on port {self.port}:\n{log}")

    def _try_start(self) -> bool:
        with (self.directory / "redis.log").open("ab") as log:
            self.process = subprocess.Popen(
                [
                    self.binary, "--port", str(self.port), "--bind", "127.0.0.1", "--dir", str(self.directory),
                    "--appendonly", "yes", "--save", "", "--daemonize", "no",
                ],
                stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
            )
        deadline = time.monotonic() + START_TIMEOUT_S
        client = redis.Redis(port=self.port, socket_connect_timeout=0.5, socket_timeout=0.5)
        try:
            while time.monotonic() < deadline:
                if self.process.poll() is not None:
                    return False
                try:
                    if client.ping():
                        return True
                except redis.RedisError:  # not listening yet, or still loading its append-only file
                    time.sleep(0.02)
        finally:
            client.close()
        self.stop(signal.SIGKILL)
        return False

    def stop(self, sig: signal.Signals = signal.SIGTERM) -> None:
        if self.process is None or self.process.poll() is not None:
            return
        self.process.send_signal(sig)
        try:
            self.process.wait(STOP_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()

    def restart(self) -> None:
        self.stop()
        self.start()


@pytest.fixture
def redis_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RedisServer]:
    """A redis-server of this test's own, which it may stop and restart."""
    server = RedisServer(redis_server_binary(), tmp_path_factory.mktemp("redis"))
    server.start()
    try:
        yield server
    finally:
        server.stop(signal.SIGKILL)


@pytest.fixture(scope="session")
def redis_session_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RedisServer]:
    server = RedisServer(redis_server_binary(), tmp_path_factory.mktemp("redis-session"))
    server.start()
    try:
        yield server
    finally:
        server.stop(signal.SIGKILL)


@pytest.fixture
def redis_url(redis_session_server: RedisServer) -> str:
    """`redis://127.0.0.1:<port>/0` of the shared server, empty at the start of the test."""
    client = redis.Redis.from_url(redis_session_server.url())
    try:
        client.flushdb()
    finally:
        client.close()
    return redis_session_server.url()
