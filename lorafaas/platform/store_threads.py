"""The threads the state store's calls run on, apart from the default executor.

The store may be remote (Redis), so a coroutine never calls it on the event loop. Its calls get threads of their own:
nothing else that holds a thread for long (an adapter being unpacked, a backend call, a worker being stopped) can
make /readyz, a list or a deploy wait for one.
"""

from __future__ import annotations

import asyncio
import contextvars
import functools
from collections.abc import Callable
from typing import Any, TypeVar

from lorafaas.platform.thread_pools import started_pool

T = TypeVar("T")

STORE_THREADS = 4  # each call is one round trip (Redis, SQLite): a few threads keep up with any request rate


class StoreThreads:
    def __init__(self, max_threads: int = STORE_THREADS) -> None:  # off the event loop: it starts the threads
        self._executor = started_pool(max_threads, "state-store")

    async def run(self, call: Callable[..., T], *args: Any, **kwargs: Any) -> T:
        """`call(*args, **kwargs)` on a store thread (in the caller's context, as `asyncio.to_thread` does)."""
        context = contextvars.copy_context()
        return await asyncio.get_running_loop().run_in_executor(
            self._executor, functools.partial(context.run, call, *args, **kwargs))

    def close(self) -> None:
        self._executor.shutdown(wait=False, cancel_futures=True)
