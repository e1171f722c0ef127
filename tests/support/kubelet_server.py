"""The kubelet's port-forward endpoint for the process kubelet, so that `kubectl port-forward` works on a test cluster.

`kubectl port-forward` asks the API server (`pods/portforward`), which proxies the upgraded connection to the pod's
node: `https://<InternalIP>:<daemonEndpoints.kubeletEndpoint.Port>/portForward/<namespace>/<pod>`. This serves that
path, TLS with a certificate of the cluster's CA, speaking the protocol the kubelet speaks there: SPDY/3.1 with the
`portforward.k8s.io` subprotocol. Each forwarded connection is a pair of streams with the same `requestid` header, an
error stream and a data stream naming the pod's `port`; the data stream's bytes go to `<pod IP>:<port>` and back, a
failure to connect is written on the error stream, and each side's end is a FIN on the data stream.

kubectl 1.31+ first asks for SPDY tunnelled in a WebSocket (which an API server older than 1.30 passes on unchanged);
that is refused with 400 here, as a 1.20 kubelet refuses it, and kubectl falls back to SPDY. No flow control (SPDY
window updates are ignored; kubectl's side sends none that matter for small exchanges) and no exec, attach or logs.
"""

from __future__ import annotations

import contextlib
import logging
import re
import socket
import ssl
import struct
import threading
import zlib
from collections.abc import Callable
from pathlib import Path

log = logging.getLogger(__name__)

# SPDY/3's zlib dictionary for header blocks (the SPDY/3 draft, section 2.6.10.1), as Go's spdy package holds it
_WORD_LIST = (
    "options head post put delete trace accept accept-charset accept-encoding accept-language accept-ranges age "
    "allow authorization cache-control connection content-base content-encoding content-language content-length "
    "content-location content-md5 content-range content-type date etag expect expires from host if-match "
    "if-modified-since if-none-match if-range if-unmodified-since last-modified location max-forwards pragma "
    "proxy-authenticate proxy-authorization range referer retry-after server te trailer transfer-encoding upgrade "
    "user-agent vary via warning www-authenticate method get status")
_TAIL = ("100101201202205206300302303304305306307402405406407408409410411412413414415416417502504505203 "
         "Non-Authoritative Information204 No Content301 Moved Permanently400 Bad Request401 Unauthorized403 "
         "Forbidden404 Not Found500 Internal Server Error501 Not Implemented503 Service UnavailableJan Feb Mar Apr "
         "May Jun Jul Aug Sept Oct Nov Dec 00:00:00 Mon, Tue, Wed, Thu, Fri, Sat, Sun, GMTchunked,text/html,"
         "image/png,image/jpg,image/gif,application/xml,application/xhtml+xml,text/plain,text/javascript,"
         "publicprivatemax-age=gzip,deflate,sdchcharset=utf-8charset=iso-8859-1,utf-,*,enq=0.")
_ENTRIES = [*_WORD_LIST.split(), "200 OK", "version", "HTTP/1.1", "url", "public", "set-cookie", "keep-alive", "origin"]
HEADER_DICTIONARY = b"".join(struct.pack(">I", len(w)) + w.encode() for w in _ENTRIES) + _TAIL.encode()
assert zlib.adler32(HEADER_DICTIONARY) == 0xE3C6A7C2, "SPDY/3 header dictionary"

SYN_STREAM, SYN_REPLY, RST_STREAM, SETTINGS, PING, GOAWAY = 1, 2, 3, 4, 6, 7
FLAG_FIN = 0x01
PATH = re.compile(r"^/portForward/([^/]+)/([^/?]+)")


class KubeletServer:
    """Serves `/portForward/<namespace>/<pod>` for the pods `pod_ip(namespace, name)` knows (None: not here)."""

    def __init__(self, pod_ip: Callable[[str, str], str | None], cert: Path, key: Path) -> None:
        self.pod_ip = pod_ip
        self._tls = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        self._tls.load_cert_chain(str(cert), str(key))
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.port: int = self._listener.getsockname()[1]
        self._sessions: set[socket.socket] = set()
        self._lock = threading.Lock()
        self._stopped = False

    def start(self) -> None:
        threading.Thread(target=self._accept, name="kubelet-server", daemon=True).start()

    def stop(self) -> None:
        self._stopped = True
        with contextlib.suppress(OSError):
            self._listener.shutdown(socket.SHUT_RDWR)
        self._listener.close()
        with self._lock:
            sessions = list(self._sessions)
        for connection in sessions:
            with contextlib.suppress(OSError):
                connection.shutdown(socket.SHUT_RDWR)

    def _accept(self) -> None:
        while not self._stopped:
            try:
                connection, _ = self._listener.accept()
            except OSError:
                return
            threading.Thread(target=self._serve, args=(connection,), name="kubelet-connection", daemon=True).start()

    def _serve(self, raw: socket.socket) -> None:
        try:
            with self._tls.wrap_socket(raw, server_side=True) as connection:
                with self._lock:
                    self._sessions.add(connection)
                try:
                    self._handle(connection)
                finally:
                    with self._lock:
                        self._sessions.discard(connection)
        except (OSError, ValueError) as exc:
            log.debug("kubelet connection ended: %s", exc)

    def _handle(self, connection: socket.socket) -> None:
        head = b""
        while b"\r\n\r\n" not in head:
            chunk = connection.recv(4096)
            if not chunk or len(head) > 65536:
                return
            head += chunk
        head, rest = head.split(b"\r\n\r\n", 1)
        request_line, *lines = head.decode("latin-1").split("\r\n")
        headers = {k.strip().lower(): v.strip() for k, _, v in (line.partition(":") for line in lines)}
        path = request_line.split(" ")[1] if request_line.count(" ") >= 2 else ""
        match = PATH.match(path)
        if match is None or headers.get("upgrade", "").lower() != "spdy/3.1":
            why = b"only SPDY/3.1 port forwarding is served here\n"
            connection.sendall(b"HTTP/1.1 400 Bad Request\r\nContent-Type: text/plain\r\nContent-Length: "
                               + str(len(why)).encode() + b"\r\nConnection: close\r\n\r\n" + why)
            return
        connection.sendall(b"HTTP/1.1 101 Switching Protocols\r\nConnection: Upgrade\r\nUpgrade: SPDY/3.1\r\n"
                           b"X-Stream-Protocol-Version: portforward.k8s.io\r\n\r\n")
        PortForwardSession(connection, rest, lambda: self.pod_ip(match.group(1), match.group(2))).run()


class PortForwardSession:
    """One SPDY connection: pairs of streams by requestid, each pair one TCP connection to the pod."""

    def __init__(self, connection: socket.socket, buffered: bytes, pod_ip: Callable[[], str | None]) -> None:
        self.connection = connection
        self.buffer = buffered
        self.pod_ip = pod_ip
        self._inflate = zlib.decompressobj(zdict=HEADER_DICTIONARY)
        self._deflate = zlib.compressobj(9, zdict=HEADER_DICTIONARY)
        self._write = threading.Lock()
        self._requests: dict[str, dict[str, int]] = {}  # requestid -> streamtype -> stream id
        self._targets: dict[int, socket.socket] = {}  # data stream -> its connection to the pod

    def run(self) -> None:
        try:
            while True:
                header = self._read(8)
                length = int.from_bytes(header[5:8], "big")
                flags, body = header[4], self._read(length)
                if header[0] & 0x80:
                    self._control(int.from_bytes(header[2:4], "big"), flags, body)
                else:
                    self._data(int.from_bytes(header[0:4], "big") & 0x7FFFFFFF, flags, body)
        except (ConnectionError, OSError, EOFError):
            pass
        finally:
            for target in list(self._targets.values()):
                with contextlib.suppress(OSError):
                    target.close()

    def _read(self, size: int) -> bytes:
        while len(self.buffer) < size:
            chunk = self.connection.recv(65536)
            if not chunk:
                raise EOFError
            self.buffer += chunk
        data, self.buffer = self.buffer[:size], self.buffer[size:]
        return data

    def _control(self, kind: int, flags: int, body: bytes) -> None:
        if kind == SYN_STREAM:
            stream = int.from_bytes(body[0:4], "big") & 0x7FFFFFFF
            headers = self._headers(self._inflate.decompress(body[10:]))
            self._send_control(SYN_REPLY, 0, struct.pack(">I", stream) + self._header_block({}))
            streams = self._requests.setdefault(headers.get("requestid", ""), {})
            streams[headers.get("streamtype", "")] = stream
            if "error" in streams and "data" in streams:
                self._connect(streams["error"], streams["data"], headers.get("port", ""))
        elif kind == RST_STREAM:
            target = self._targets.pop(int.from_bytes(body[0:4], "big") & 0x7FFFFFFF, None)
            if target is not None:
                target.close()
        elif kind == PING:
            self._send_control(PING, 0, body)
        elif kind == GOAWAY:
            raise EOFError
        # SETTINGS, WINDOW_UPDATE, HEADERS: nothing to do

    def _data(self, stream: int, flags: int, body: bytes) -> None:
        target = self._targets.get(stream)
        if target is None:  # the error stream, or a stream already closed
            return
        try:
            if body:
                target.sendall(body)
            if flags & FLAG_FIN:
                target.shutdown(socket.SHUT_WR)
        except OSError:
            self._targets.pop(stream, None)

    def _connect(self, error_stream: int, data_stream: int, port: str) -> None:
        ip = self.pod_ip()
        try:
            if ip is None or not port.isdigit():
                raise OSError(f"no pod here, or no port {port!r}")
            target = socket.create_connection((ip, int(port)), timeout=10)
            target.settimeout(None)
        except OSError as exc:
            self._send_data(error_stream, f"error forwarding port {port} to pod: {exc}".encode(), FLAG_FIN)
            self._send_data(data_stream, b"", FLAG_FIN)
            return
        self._targets[data_stream] = target
        threading.Thread(target=self._copy_back, args=(target, error_stream, data_stream), daemon=True,
                         name=f"port-forward-{port}").start()

    def _copy_back(self, target: socket.socket, error_stream: int, data_stream: int) -> None:
        with contextlib.suppress(OSError):
            while chunk := target.recv(65536):
                self._send_data(data_stream, chunk, 0)
        with contextlib.suppress(OSError):
            self._send_data(data_stream, b"", FLAG_FIN)
            self._send_data(error_stream, b"", FLAG_FIN)
        if self._targets.pop(data_stream, None) is not None:
            target.close()

    # -- frames --------------------------------------------------------------------------------------------------------

    @staticmethod
    def _headers(block: bytes) -> dict[str, str]:
        count, offset, headers = int.from_bytes(block[0:4], "big"), 4, {}
        for _ in range(count):
            size = int.from_bytes(block[offset:offset + 4], "big")
            name = block[offset + 4:offset + 4 + size].decode()
            offset += 4 + size
            size = int.from_bytes(block[offset:offset + 4], "big")
            headers[name.lower()] = block[offset + 4:offset + 4 + size].decode().split("\0")[0]
            offset += 4 + size
        return headers

    def _header_block(self, headers: dict[str, str]) -> bytes:
        raw = struct.pack(">I", len(headers)) + b"".join(
            struct.pack(">I", len(k)) + k.encode() + struct.pack(">I", len(v)) + v.encode() for k, v in headers.items())
        return self._deflate.compress(raw) + self._deflate.flush(zlib.Z_SYNC_FLUSH)

    def _send_control(self, kind: int, flags: int, body: bytes) -> None:
        with self._write:
            self.connection.sendall(struct.pack(">HHI", 0x8003, kind, flags << 24 | len(body)) + body)

    def _send_data(self, stream: int, data: bytes, flags: int) -> None:
        with self._write:
            self.connection.sendall(struct.pack(">II", stream, flags << 24 | len(data)) + data)
