"""A TCP proxy between a client and a server on loopback (TLS passes through untouched), for the tests that show no
slow or broken call blocks the gateway's event loop:

- `delay_s`: each chunk a client sends is held that long (a slow Kubernetes API server or a slow Redis);
- `stall()`: the connections open now pass no more bytes either way and stay open, as a connection does when its
  peer or a middlebox is gone without a FIN or a RST (half-open); connections made afterwards pass as usual.
"""

from __future__ import annotations

import contextlib
import socket
import threading
import time


class Connection:
    def __init__(self, client: socket.socket, upstream: socket.socket) -> None:
        self.client, self.upstream = client, upstream
        self.stalled = threading.Event()
        self.closed_by_client = threading.Event()  # the client closed its end (e.g. after its read timeout)


class SlowProxy:
    def __init__(self, upstream_port: int, delay_s: float = 0.0) -> None:
        self.upstream_port = upstream_port
        self.delay_s = delay_s  # may be changed while it runs (0: pass at once)
        self.server = socket.create_server(("127.0.0.1", 0))
        self.port = self.server.getsockname()[1]
        self.held_at: list[float] = []  # when each held chunk arrived (monotonic)
        self.connections: list[Connection] = []
        self._lock = threading.Lock()
        self._closed = False
        threading.Thread(target=self._accept, daemon=True).start()

    def stall(self) -> list[Connection]:
        """Stall every connection open now; returns them."""
        with self._lock:
            open_now = [c for c in self.connections if not c.closed_by_client.is_set()]
        for connection in open_now:
            connection.stalled.set()
        return open_now

    def _accept(self) -> None:
        while not self._closed:
            try:
                client, _ = self.server.accept()
            except OSError:
                return
            connection = Connection(client, socket.create_connection(("127.0.0.1", self.upstream_port)))
            with self._lock:
                self.connections.append(connection)
            threading.Thread(target=self._pump, args=(connection, True), daemon=True).start()
            threading.Thread(target=self._pump, args=(connection, False), daemon=True).start()

    def _pump(self, connection: Connection, from_client: bool) -> None:
        source, sink = ((connection.client, connection.upstream) if from_client
                        else (connection.upstream, connection.client))
        try:
            while data := source.recv(65536):
                if from_client and self.delay_s > 0:
                    self.held_at.append(time.monotonic())
                    time.sleep(self.delay_s)
                if not connection.stalled.is_set():
                    sink.sendall(data)
        except OSError:
            pass
        finally:
            if from_client:
                connection.closed_by_client.set()
            if not connection.stalled.is_set() or from_client:  # a stalled upstream's close never reaches the client
                for sock in (source, sink):
                    with contextlib.suppress(OSError):
                        sock.shutdown(socket.SHUT_RDWR)

    def close(self) -> None:
        self._closed = True
        self.server.close()
        with self._lock:
            for connection in self.connections:
                for sock in (connection.client, connection.upstream):
                    with contextlib.suppress(OSError):
                        sock.close()
