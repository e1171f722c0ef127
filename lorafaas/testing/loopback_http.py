"""A Starlette app served by uvicorn in a thread on a free loopback port: the real HTTP server that client tests
(the serving benchmarks) talk to."""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Iterator, Sequence

import uvicorn
from starlette.applications import Starlette
from starlette.routing import Route

from lorafaas.testing.platform_process import free_port


@contextlib.contextmanager
def serve_routes(routes: Sequence[Route], start_timeout_s: float = 10.0) -> Iterator[str]:
    """Serve `routes` until the block ends; yields the base URL (http://127.0.0.1:PORT)."""
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(Starlette(routes=list(routes)), host="127.0.0.1", port=port,
                                           log_level="warning"))
    thread = threading.Thread(target=server.run, name=f"loopback-http-{port}", daemon=True)
    thread.start()
    deadline = time.monotonic() + start_timeout_s
    while not server.started:
        if time.monotonic() > deadline or not thread.is_alive():
            raise RuntimeError(f"the loopback HTTP server on port {port} did not start")
        time.sleep(0.01)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(start_timeout_s)
