"""Thread pools whose threads are all running before anything is submitted.

`ThreadPoolExecutor` starts its threads lazily, in `submit`, and `Thread.start` blocks its caller until the new thread
runs, which needs the GIL: on a loaded machine, with another thread in a long garbage collection, that took over a
second. A coroutine submitting work must never wait for that, so the pools it submits to are started up front.
"""

from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor


def started_pool(num_threads: int, name: str) -> ThreadPoolExecutor:
    """A pool of `num_threads` threads named `name-N`, every one started (call it off the event loop)."""
    pool = ThreadPoolExecutor(num_threads, thread_name_prefix=name)
    all_started = threading.Barrier(num_threads + 1)
    for _ in range(num_threads):  # each waits at the barrier, so the next submit finds no idle thread and starts one
        pool.submit(all_started.wait)
    all_started.wait()
    return pool
