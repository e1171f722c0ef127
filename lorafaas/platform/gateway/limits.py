"""Size limits on what a client may send the gateway, applied before any route sees the request.

Headers over `max_header_bytes` are refused with 431; a body over its route's limit with 413, at once when its
Content-Length says so, otherwise as soon as the bytes received pass the limit (a chunked body), so a client can
neither make the gateway buffer an unbounded body nor hold a route waiting for gigabytes it will never send. Adapter
uploads (multipart) get a large limit, everything else (JSON) a small one. Both answers are the usual JSON error body.
An upload is spooled to disk as it arrives (Starlette keeps at most 1 MiB of a file part in memory).

Upload slots are scarce and shared: at most `max_concurrent_uploads` are received at once, at most
`max_uploads_per_tenant` of them by one tenant (its key is checked before the body is read, so a request without a
valid key holds none), and one more is refused with 429 before its body is read. A slot is held from the first byte
to the answer, so an upload's body must keep coming: no bytes for `upload_timeout_s`, or fewer than
`upload_min_rate_bytes_s` a second on average once `upload_timeout_s` have passed (the deadline moves on by one
second per `upload_min_rate_bytes_s` received, as Apache's mod_reqtimeout `MinRate`), and it is answered 408 and its
slot is freed.

A pure ASGI middleware: Starlette's BaseHTTPMiddleware would buffer streamed responses (SSE).
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field

from lorafaas.errors import (
    ClientError,
    HeadersTooLarge,
    InvalidInput,
    LorafaasError,
    PayloadTooLarge,
    RequestTimeout,
    TooManyRequests,
)

MAX_HEADER_BYTES = 32 * 1024
MAX_JSON_BODY_BYTES = 4 * 1024**2  # a prompt at the end of a long context window is well under 1 MiB
MAX_UPLOAD_BODY_BYTES = 2 * 1024**3 + 1024**2  # the adapter archive's own limit plus the multipart envelope
UPLOAD_PATHS = ("/v1/functions", "/v1/functions:batch")  # deploys; PATCH /v1/functions/{name} replaces one
MAX_CONCURRENT_UPLOADS = 4
MAX_UPLOADS_PER_TENANT = 2  # one tenant never holds every slot
UPLOAD_TIMEOUT_S = 20.0  # `lorafaas up --upload-timeout`
UPLOAD_MIN_RATE_BYTES_S = 32 * 1024  # `lorafaas up --upload-min-rate`: a 100 MB adapter in under an hour
UPLOAD_RETRY_AFTER_S = 5


@dataclass(frozen=True)
class RequestLimits:
    max_header_bytes: int = MAX_HEADER_BYTES
    max_json_body_bytes: int = MAX_JSON_BODY_BYTES
    max_upload_body_bytes: int = MAX_UPLOAD_BODY_BYTES
    max_concurrent_uploads: int = MAX_CONCURRENT_UPLOADS
    max_uploads_per_tenant: int = MAX_UPLOADS_PER_TENANT
    upload_timeout_s: float = UPLOAD_TIMEOUT_S
    upload_min_rate_bytes_s: float = UPLOAD_MIN_RATE_BYTES_S

    def __post_init__(self) -> None:
        if not 1 <= self.max_uploads_per_tenant <= self.max_concurrent_uploads:
            raise InvalidInput(f"max_uploads_per_tenant is {self.max_uploads_per_tenant}; it must be 1 to "
                               f"max_concurrent_uploads ({self.max_concurrent_uploads})")
        if not 0 < self.upload_timeout_s <= 3600:
            raise InvalidInput(f"the upload timeout is {self.upload_timeout_s:g} s; it must be over 0 and at most "
                               "3600 s")
        if not self.upload_min_rate_bytes_s > 0:
            raise InvalidInput(f"the minimum upload rate is {self.upload_min_rate_bytes_s:g} bytes/s; it must be "
                               "over 0")

    def max_body_bytes(self, method: str, path: str) -> int:
        return self.max_upload_body_bytes if is_upload(method, path) else self.max_json_body_bytes


def is_upload(method: str, path: str) -> bool:
    return method in ("POST", "PATCH") and (
        path in UPLOAD_PATHS or (path.startswith("/v1/functions/") and path.count("/") == 3)
    )


@dataclass
class UploadSlots:
    """The uploads in progress, per tenant; `try_take` answers None (taken) or why not. One event loop owns it."""

    max_total: int
    max_per_tenant: int
    held: dict[str, int] = field(default_factory=dict)

    @property
    def num_held(self) -> int:
        return sum(self.held.values())

    def try_take(self, tenant: str) -> str | None:
        if self.held.get(tenant, 0) >= self.max_per_tenant:
            return (f"this tenant has {self.held[tenant]} adapter uploads in progress, the most one tenant may have "
                    "at once; retry when one has finished")
        if self.num_held >= self.max_total:
            return (f"{self.num_held} adapter uploads are in progress, the most the gateway takes at once; retry in "
                    "a few seconds")
        self.held[tenant] = self.held.get(tenant, 0) + 1
        return None

    def give_back(self, tenant: str) -> None:
        self.held[tenant] -= 1
        if not self.held[tenant]:
            del self.held[tenant]


# The tenant of a request's `Authorization` header value (raising Unauthorized), for the upload slots.
Identify = Callable[[str | None], Awaitable[str]]


class RequestLimitsMiddleware:
    def __init__(self, app, identify: Identify, limits: RequestLimits | None = None) -> None:
        self.app = app
        self.identify = identify
        self.limits = limits or RequestLimits()
        self.uploads = UploadSlots(self.limits.max_concurrent_uploads, self.limits.max_uploads_per_tenant)

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
        try:
            tenant = await self.identify(_header(scope["headers"], b"authorization"))
        except LorafaasError as exc:  # no valid key: refused before a slot is taken or the body read
            await _send_error(send, exc)
            return
        refusal = self.uploads.try_take(tenant)
        if refusal is not None:
            await _send_error(send, TooManyRequests(refusal), [(b"retry-after", str(UPLOAD_RETRY_AFTER_S).encode())])
            return
        try:
            await _LimitedRequest(self.app, limit, scope, receive, send, self.limits).run()
        finally:
            self.uploads.give_back(tenant)


class _LimitedRequest:
    """One request whose body is counted as it arrives; past the limit, or (an upload, `timing` given) when its body
    stops coming or comes too slowly, the route stops reading and its own answer is replaced by the refusal."""

    def __init__(self, app, limit: int, scope, receive, send, timing: RequestLimits | None = None) -> None:
        self.app, self.limit, self.scope, self._receive, self._send = app, limit, scope, receive, send
        self.timing = timing
        self.received = 0
        self.body_done = False
        self.refusal: ClientError | None = None
        self.started = False
        self.began_s = self.last_s = asyncio.get_running_loop().time()  # last_s: when the last bytes came

    async def run(self) -> None:
        try:
            await self.app(self.scope, self.receive, self.send)
        except Exception:
            if self.refusal is None:
                raise  # the route's own failure, for the outer handlers
        if self.refusal is not None and not self.started:  # the route gave up reading without answering
            self.started = True
            await _send_error(self._send, self.refusal)

    async def receive(self):
        if self.refusal is not None:
            return {"type": "http.disconnect"}
        if self.timing is None or self.body_done:
            message = await self._receive()
        else:
            message = await self._receive_in_time(self.timing)
            if message is None:
                return {"type": "http.disconnect"}  # the route stops reading; its answer is replaced
        if message["type"] == "http.request":
            self.received += len(message.get("body", b""))
            self.body_done = not message.get("more_body", False)
            if self.received > self.limit:
                self.refusal = PayloadTooLarge(f"the request body passed {self.limit} bytes, the limit for "
                                               f"{self.scope['method']} {self.scope['path']}")
                return {"type": "http.disconnect"}
        return message

    async def _receive_in_time(self, timing: RequestLimits):
        """The next part of the body, or None (and the refusal set) when it does not come in time."""
        loop = asyncio.get_running_loop()
        now = loop.time()
        rate_deadline = self.began_s + timing.upload_timeout_s + self.received / timing.upload_min_rate_bytes_s
        idle_deadline = self.last_s + timing.upload_timeout_s
        try:
            async with asyncio.timeout(max(0.0, min(idle_deadline, rate_deadline) - now)):
                message = await self._receive()
        except TimeoutError:
            message = None
        if message is not None:
            self.last_s = loop.time()
            return message
        now = loop.time()
        self.refusal = RequestTimeout(
            f"the upload sent {self.received} bytes of its body in {now - self.began_s:.1f} s, nothing in the last "
            f"{now - self.last_s:.1f} s; an upload may pause at most {timing.upload_timeout_s:g} s and must average "
            f"at least {timing.upload_min_rate_bytes_s:.0f} bytes/s after its first {timing.upload_timeout_s:g} s. "
            "It was cut to free its slot: send the whole body without pauses")
        return None

    async def send(self, message) -> None:
        if self.refusal is not None and not self.started:
            self.started = True
            await _send_error(self._send, self.refusal)
            return
        if self.refusal is not None:
            return  # the rest of the route's own answer
        self.started = self.started or message["type"] == "http.response.start"
        await self._send(message)


def _header(headers, wanted: bytes) -> str | None:
    for name, value in headers:
        if name == wanted:
            return value.decode("latin-1")
    return None


def _content_length(headers) -> int | None:
    value = _header(headers, b"content-length")
    try:
        return None if value is None else int(value)
    except ValueError:
        return None


async def _send_error(send, exc: LorafaasError, extra_headers: Sequence[tuple[bytes, bytes]] = ()) -> None:
    kind = "invalid_request_error" if isinstance(exc, ClientError) else "server_error"
    body = json.dumps({"error": {"code": exc.code, "message": exc.message, "type": kind}})
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
