"""`python -m lorafaas.bench.healthz_probe URL INTERVAL_S`: GET URL/healthz every INTERVAL_S on one kept-alive
connection until SIGTERM, then print one JSON object: {"latencies_s": [...], "failed": n}.

A process of its own, so that what it measures is the gateway's answer, not the wait for the load generator's
event loop (bench fleet streams hundreds of replies in its own loop meanwhile).
"""

from __future__ import annotations

import http.client
import json
import signal
import sys
import time
from urllib.parse import urlsplit


def main(url: str, interval_s: float) -> None:
    stopping = False

    def stop(*_) -> None:
        nonlocal stopping
        stopping = True

    signal.signal(signal.SIGTERM, stop)
    parts = urlsplit(url)
    latencies_s: list[float] = []
    failed = 0
    connection = http.client.HTTPConnection(parts.hostname or "127.0.0.1", parts.port or 80, timeout=10.0)
    while not stopping:
        started = time.perf_counter()
        try:
            connection.request("GET", "/healthz")
            reply = connection.getresponse()
            reply.read()
            failed += reply.status != 200
        except (OSError, http.client.HTTPException):
            failed += 1
            connection.close()  # reconnects on the next request
        latencies_s.append(time.perf_counter() - started)
        time.sleep(max(0.0, interval_s - (time.perf_counter() - started)))
    json.dump({"latencies_s": latencies_s, "failed": failed}, sys.stdout)


if __name__ == "__main__":
    main(sys.argv[1], float(sys.argv[2]))
