"""Size limits on what a client may send the gateway, applied before any route sees the request.

Headers over `max_header_bytes` are refused with 431; a body over its route's limit with 413, at once when its
Content-Length says so, otherwise as soon as the bytes received pass the limit (a chunked body), so a client can
neither make the gateway buffer an unbounded body nor hold a route waiting for gigabytes it will never send. Adapter
uploads (multipart) get a large limit, everything else (JSON) a small one. Both answers are the usual JSON error body.
An upload is spooled to disk as it arrives (Starlette keeps at most 1 MiB of a file part in memory), and at most
`max_concurrent_uploads` are received at once: one more is refused with 429 before its body is read.

A pure ASGI middleware: Starlette's BaseHTTPMiddleware would buffer streamed responses (SSE).
"""

from __future__ import annotations

import json
from dataclasses import dataclass

from lorafaas.errors import ClientError, HeadersTooLarge, PayloadTooLarge, TooManyRequests

MAX_HEADER_BYTES = 32 * 1024
MAX_JSON_BODY_BYTES = 4 * 1024**2  # a prompt at the end of a long context window is well under 1 MiB
MAX_UPLOAD_BODY_BYTES = 2 * 1024**3 + 1024**2  # the adapter archive's own limit plus the multipart envelope
UPLOAD_PATHS = ("/v1/functions",)  # POST deploys and PATCH /v1/functions/{name} replaces an adapter
MAX_CONCURRENT_UPLOADS = 4
UPLOAD_RETRY_AFTER_S = 5


@dataclass(frozen=True)
class RequestLimits:
    max_header_bytes: int = MAX_HEADER_BYTES
    max_json_body_bytes: int = MAX_JSON_BODY_BYTES
    max_upload_body_bytes: int = MAX_UPLOAD_BODY_BYTES
    max_concurrent_uploads: int = MAX_CONCURRENT_UPLOADS

    def max_body_bytes(self, method: str, path: str) -> int:
        return self.max_upload_body_bytes if is_upload(method, path) else self.max_json_body_bytes


def is_upload(method: str, path: str) -> bool:
    return method in ("POST", "PATCH") and (
        path in UPLOAD_PATHS or (path.startswith("/v1/functions/") and path.count("/") == 3)
    )


class RequestLimitsMiddleware:
    def __init__(self, app, limits: RequestLimits | None = None) -> None:
        self.app = app
        self.limits = limits or RequestLimits()
        self.num_uploads = 0  # uploads being received or unpacked now (one event loop: no lock needed)

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        header_bytes = sum(len(name) + len(value) + 4 for name, value in scope["headers"])
        if header_bytes > self.limits.max_header_bytes:
            await _send_error(
                send,
                HeadersTooLarge(
                    f"the request headers are {header_bytes} bytes; the limit is {self.limits.max_header_bytes}"
                ),
            )
            return
        limit = self.limits.max_body_bytes(scope["method"], scope["path"])
        declared = _content_length(scope["headers"])
        if declared is not None and declared > limit:
            await _send_error(
                send,
                PayloadTooLarge(
                    f"the request body is {declared} bytes (Content-Length); the limit for "
                    f"{scope['method']} {scope['path']} is {limit} bytes"
                ),
            )
            return
        if not is_upload(scope["method"], scope["path"]):
            await _LimitedRequest(self.app, limit, scope, receive, send).run()
            return
        if self.num_uploads >= self.limits.max_concurrent_uploads:
            await _send_error(
                send,
                TooManyRequests(
                    f"{self.num_uploads} adapter uploads are in progress, the most the gateway takes at once; "
                    f"retry in a few seconds"
                ),
                [(b"retry-after", str(UPLOAD_RETRY_AFTER_S).encode())],
            )
            return
        self.num_uploads += 1
        try:
            await _LimitedRequest(self.app, limit, scope, receive, send).run()
        finally:
            self.num_uploads -= 1


class _LimitedRequest:
    """One request whose body is counted as it arrives; past the limit the route's own answer is replaced."""

    def __init__(self, app, limit: int, scope, receive, send) -> None:
        self.app, self.limit, self.scope, self._receive, self._send = app, limit, scope, receive, send
        self.received = 0
        self.too_large = False
        self.started = False

    async def run(self) -> None:
        try:
            await self.app(self.scope, self.receive, self.send)
        except Exception:
            if not self.too_large:
                raise  # the route's own failure, for the outer handlers
        if self.too_large and not self.started:  # the route gave up reading without answering
            await self.send({"type": "http.response.start", "status": 413, "headers": []})

    async def receive(self):
        message = await self._receive()
        if message["type"] == "http.request":
            self.received += len(message.get("body", b""))
            if self.received > self.limit:
                self.too_large = True
                return {"type": "http.disconnect"}  # the route stops reading; its answer is replaced below
        return message

    async def send(self, message) -> None:
        if self.too_large and not self.started:
            self.started = True
            await _send_error(
                self._send,
                PayloadTooLarge(
                    f"the request body passed {self.limit} bytes, the limit for {self.scope['method']} "
                    f"{self.scope['path']}"
                ),
            )
            return
        if self.too_large:
            return  # the rest of the route's own answer
        self.started = self.started or message["type"] == "http.response.start"
        await self._send(message)


def _content_length(headers) -> int | None:
    for name, value in headers:
        if name == b"content-length":
            try:
                return int(value)
            except ValueError:
                return None
    return None


async def _send_error(send, exc: ClientError, extra_headers: list[tuple[bytes, bytes]] = ()) -> None:
    body = json.dumps({"error": {"code": exc.code, "message": exc.message, "type": "invalid_request_error"}})
    await send(
        {
            "type": "http.response.start",
            "status": exc.http_status,
            "headers": [
                (b"content-type", b"application/json"),
                (b"content-length", str(len(body)).encode()),
                (b"connection", b"close"),
                *extra_headers,
            ],
        }
    )
    await send({"type": "http.response.body", "body": body.encode()})
