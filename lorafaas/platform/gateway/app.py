"""The gateway's FastAPI application: function CRUD, invoke (JSON, SSE, async), invocations, health, metrics.

Every failure is a JSON body `{"error": {"code", "message", "type"}}` with a 4xx/5xx status, produced in one place
(`_error_response`) from LorafaasError's `code` and `http_status`. On the OpenAI routes the body also carries `param`
and a validation failure is a 400, not a 422 (`openai_errors`).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from datetime import datetime
from typing import Annotated, Literal

from fastapi import Depends, FastAPI, File, Form, Query, Request, UploadFile
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from fastapi.routing import APIRoute
from fastapi.security import HTTPAuthorizationCredentials
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from pydantic import Field, ValidationError
from starlette.exceptions import HTTPException
from starlette.routing import Match

from lorafaas import __version__
from lorafaas.errors import Forbidden, InvalidInput, LorafaasError, ServerError
from lorafaas.function_runtime import messages as m
from lorafaas.platform.auth import KeyInfo, authenticate, create_key, key_id_of
from lorafaas.platform.gateway.batch_route import install_batch_route
from lorafaas.platform.gateway.limits import RequestLimits, RequestLimitsMiddleware
from lorafaas.platform.gateway.max_tokens import max_tokens_for
from lorafaas.platform.gateway.metrics import GatewayMetrics
from lorafaas.platform.gateway.openai_errors import is_openai_path, openai_status, param_of
from lorafaas.platform.gateway.openapi_docs import (
    INVOKE_RESPONSES,
    METRICS_RESPONSES,
    SPEC_AS_JSON,
    TEXT_RESPONSES,
    bearer,
    errors,
)
from lorafaas.platform.gateway.responses import (
    Accepted,
    Deleted,
    FunctionDescription,
    FunctionList,
    InvocationList,
    InvocationRecord,
    InvokeResult,
    KeyCreated,
    KeyList,
    KeyRevoked,
    Status,
    Timings,
    Usage,
    UsageReport,
    encoded,
    install,
    reply,
)
from lorafaas.platform.gateway.schemas import INVOKE_DEFAULT_MAX_TOKENS, DeploySpec, InvokeBody, KeyBody
from lorafaas.platform.gateway.streaming import (
    InvocationEvents,
    counted_refusals,
    error_body,
    sse,
    start_invocation,
    usage,
)
from lorafaas.platform.gateway.uploads import first_problem, spooled
from lorafaas.platform.service import FunctionService
from lorafaas.platform.state.records import ApiKeyRecord, FunctionSpec, InvocationStatus

log = logging.getLogger(__name__)
MAX_LISTED_INVOCATIONS = 1000
MAX_LOG_TAIL_LINES = 100_000
MAX_UNIX_TIME = 2**33  # the year 2242: a bound the OpenAPI document states
UnixSeconds = Annotated[float, Field(allow_inf_nan=False)]


def create_app(service: FunctionService, metrics: GatewayMetrics, lifespan=None,
               is_ready: Callable[[], bool] = lambda: True, limits: RequestLimits | None = None) -> FastAPI:
    app = FastAPI(title="lorafaas", version=__version__, lifespan=lifespan,
                  description="Each LoRA adapter deployed as an isolated serverless function.")
    app.state.service = service
    app.state.metrics = metrics
    _install_error_handlers(app, service)
    install(app)

    async def uploader(authorization: str | None) -> str:
        """The tenant an upload's slot is counted against (its key checked before the body is read)."""
        return (await service.store_threads.run(authenticate, service.store, authorization)).tenant

    app.add_middleware(RequestLimitsMiddleware, identify=uploader, limits=limits)

    def caller(request: Request, _: HTTPAuthorizationCredentials | None = Depends(bearer)) -> ApiKeyRecord:
        return authenticate(service.store, request.headers.get("authorization"))

    @app.get("/healthz", tags=["health"], response_model=None, responses={200: reply(Status, "Alive")})
    async def healthz() -> Response:
        return encoded(Status(status="ok"))

    @app.get("/readyz", tags=["health"], response_model=None, responses={
        200: reply(Status, "Serving"),
        503: {"description": "Starting (a Status), or the state store is unreachable (an ErrorBody)",
              "content": {"application/json": {"schema": {"anyOf": [
                  {"$ref": "#/components/schemas/Status"}, {"$ref": "#/components/schemas/ErrorBody"}]}}}}})
    async def readyz() -> Response:
        await service.store_threads.run(service.store.ping)  # a remote store: never waited for on the event loop
        if not is_ready():
            return encoded(Status(status="starting"), status_code=503)
        return encoded(Status(status="ready"))

    @app.get("/metrics", tags=["health"], response_model=None, responses=METRICS_RESPONSES)
    async def prometheus(who: ApiKeyRecord = Depends(caller)) -> Response:
        # Its labels name every tenant's functions: the admin key only (Prometheus sends it as a bearer token).
        if not who.is_admin:
            raise Forbidden("only the admin key can read /metrics, which covers every tenant's functions")
        # Off the event loop: a scrape renders every series and reads each instance's memory from /proc.
        body = await asyncio.to_thread(generate_latest, metrics.registry)
        return Response(body, media_type=CONTENT_TYPE_LATEST)

    @app.post("/v1/functions", status_code=201, tags=["functions"], response_model=None,
              responses={201: reply(FunctionSpec, "Deployed: the function's spec"), **errors(403, 404, 409, 429, 507)})
    async def deploy(spec: str = Form(..., min_length=1, description="DeploySpec as JSON",
                                      json_schema_extra=SPEC_AS_JSON),
                     adapter: UploadFile = File(..., description="tar(.gz) of the adapter's two files"),
                     who: ApiKeyRecord = Depends(caller)) -> Response:
        fields = _parse_spec(spec)
        return encoded(await service.deploy(who, fields, spooled(adapter)), status_code=201)

    @app.get("/v1/functions", tags=["functions"], response_model=None,
             responses={200: reply(FunctionList, "The caller's functions (every tenant's for the admin)"), **errors()})
    async def list_functions(who: ApiKeyRecord = Depends(caller)) -> Response:
        return encoded(FunctionList(functions=await service.list(who)))

    @app.get("/v1/functions/{name}", tags=["functions"], response_model=None,
             responses={200: reply(FunctionDescription, "The spec and its instances, starts and decisions"),
                        **errors(404)})
    async def describe(name: str, who: ApiKeyRecord = Depends(caller)) -> Response:
        return encoded(await service.describe(who, name))

    @app.patch("/v1/functions/{name}", tags=["functions"], response_model=None,
               responses={200: reply(FunctionSpec, "Updated: the new spec"), **errors(404, 429, 507)})
    # `adapter` is optional, not nullable: a multipart form has no null, and a text part is no file.
    async def update(name: str, spec: str = Form("{}", min_length=1, description="the fields to change, as JSON",
                                                 json_schema_extra=SPEC_AS_JSON),
                     adapter: UploadFile = File(None, description="a new adapter: tar(.gz) of its two files"),
                     who: ApiKeyRecord = Depends(caller)) -> Response:
        fields = _parse_spec(spec)
        if fields.get("name") not in (None, name) or fields.get("backbone") or fields.get("tenant"):
            raise InvalidInput("PATCH cannot change a function's name, backbone or tenant; deploy a new function")
        archive = spooled(adapter) if adapter is not None else None
        return encoded(await service.update(who, name, fields, archive))

    @app.delete("/v1/functions/{name}", tags=["functions"], response_model=None,
                responses={200: reply(Deleted, "Deleted"), **errors(404)})
    async def delete(name: str, who: ApiKeyRecord = Depends(caller)) -> Response:
        await service.delete(who, name)
        metrics.forget(name)
        return encoded(Deleted(deleted=name))

    @app.get("/v1/functions/{name}/logs", tags=["functions"], response_model=None,
             responses={**TEXT_RESPONSES, **errors(404)})
    async def logs(
        name: str,
        tail: int | None = Query(None, ge=0, le=MAX_LOG_TAIL_LINES, description="the last N lines of each instance"),
        since: float | None = Query(None, ge=0, le=MAX_UNIX_TIME,
                                    description="only lines logged at this unix time or later"),
        who: ApiKeyRecord = Depends(caller),
    ) -> PlainTextResponse:
        return PlainTextResponse(await service.logs(who, name, tail, since))

    @app.post("/v1/functions/{name}/invoke", tags=["invoke"], responses=INVOKE_RESPONSES)
    async def invoke(name: str, body: InvokeBody, request: Request, mode: str | None = None,
                     who: ApiKeyRecord = Depends(caller)) -> Response:
        with counted_refusals(metrics, name):
            spec = await service.aget(who, name)
            max_tokens = await max_tokens_for(service, spec, body.max_tokens, INVOKE_DEFAULT_MAX_TOKENS)
            invocation = body.to_request(max_tokens)
        if mode == "async" or "respond-async" in request.headers.get("prefer", ""):
            record = await service.submit(who, name, invocation)
            location = f"/v1/invocations/{record.invocation_id}"
            return encoded(Accepted(invocation_id=record.invocation_id, status=record.status, location=location),
                           status_code=202, headers={"Location": location})
        events = await start_invocation(service, metrics, who, name, invocation)
        if body.stream:
            return StreamingResponse(_native_sse(events, service), media_type="text/event-stream")
        return encoded(await _collect(events, name))

    @app.get("/v1/invocations", tags=["invoke"], response_model=None,
             responses={200: reply(InvocationList, "The caller's invocations, newest first"), **errors()})
    async def list_invocations(
        function: str | None = Query(None, max_length=256, description="only this function's invocations"),
        status: InvocationStatus | None = Query(None, description="only invocations in this status"),
        limit: int = Query(100, ge=1, le=MAX_LISTED_INVOCATIONS, description="at most this many, newest first"),
        who: ApiKeyRecord = Depends(caller),
    ) -> Response:
        return encoded(InvocationList(invocations=await service.list_invocations(who, function, status, limit)))

    @app.get("/v1/invocations/{invocation_id}", tags=["invoke"], response_model=None,
             responses={200: reply(InvocationRecord, "The invocation: status, result or error"), **errors(404)})
    async def invocation(invocation_id: str, who: ApiKeyRecord = Depends(caller)) -> Response:
        return encoded(await service.get_invocation(who, invocation_id))

    @app.delete("/v1/invocations/{invocation_id}", tags=["invoke"], response_model=None,
                responses={200: reply(InvocationRecord, "Cancelled: the invocation's record"), **errors(404, 409)})
    async def cancel_invocation(invocation_id: str, who: ApiKeyRecord = Depends(caller)) -> Response:
        """Cancel one of the caller's queued or running asynchronous invocations: its generation stops, and its record
        ends `cancelled` (`error_code` `invocation_cancelled`; what it produced until then is charged). Another
        tenant's invocation is not found (404); one that already ended is a 409 `invocation_finished`."""
        return encoded(await service.cancel_invocation(who, invocation_id))

    @app.get("/v1/usage", tags=["usage"], response_model=None,
             responses={200: reply(UsageReport, "Usage sums per group and in total"), **errors()})
    async def usage_summary(
        since: UnixSeconds | datetime | None = Query(
            None, description="From this time on: unix seconds or ISO 8601 (UTC if no zone)"),
        until: UnixSeconds | datetime | None = Query(
            None, description="Before this time (exclusive): unix seconds or ISO 8601 (UTC if no zone)"),
        group_by: Literal["function", "tenant"] = Query("function", description="Sum per function or per tenant"),
        who: ApiKeyRecord = Depends(caller),
    ) -> Response:
        """Invocations, tokens, device-seconds and memory GB-seconds charged (docs/platform.md, "Usage"): the
        caller's tenant only, every tenant's with the admin key."""
        return encoded(await service.usage_summary(who, since, until, group_by))

    @app.post("/v1/keys", status_code=201, tags=["keys"], response_model=None,
              responses={201: reply(KeyCreated, "The new key (shown only now)"), **errors(403)})
    async def create_tenant_key(body: KeyBody, who: ApiKeyRecord = Depends(caller)) -> Response:
        _require_admin(who)
        key = await service.store_threads.run(create_key, service.store, body.tenant)
        key_id = key_id_of(key)
        if key_id is None:  # create_key makes lf_<key_id>_<secret> keys
            raise ServerError("the new key has no id")
        return encoded(KeyCreated(tenant=body.tenant, key_id=key_id, key=key), status_code=201)

    @app.get("/v1/keys", tags=["keys"], response_model=None,
             responses={200: reply(KeyList, "Every key (never the key itself)"), **errors(403)})
    async def list_keys(who: ApiKeyRecord = Depends(caller)) -> Response:
        _require_admin(who)
        keys = await service.store_threads.run(service.store.list_keys)
        return encoded(KeyList(keys=[KeyInfo.of(k) for k in keys]))

    @app.delete("/v1/keys/{key_id}", tags=["keys"], response_model=None,
                responses={200: reply(KeyRevoked, "Revoked"), **errors(403, 404)})
    async def revoke_tenant_key(key_id: str, who: ApiKeyRecord = Depends(caller)) -> Response:
        """Revoke a tenant's key: its next request is a 401, and its invocations in flight (streams, synchronous and
        queued or running asynchronous ones) are cancelled with `key_revoked`."""
        _require_admin(who)
        record = await service.revoke_key(key_id)
        return encoded(KeyRevoked(revoked=record.key_id, tenant=record.tenant))

    install_batch_route(app, service, caller)
    from lorafaas.platform.gateway.openai_api import openai_router
    from lorafaas.platform.gateway.responses_api import responses_router

    app.include_router(openai_router(service, metrics, caller))
    app.include_router(responses_router(service, metrics, caller))
    return app


async def _collect(events: InvocationEvents, name: str) -> InvokeResult:
    async for event in events:
        if isinstance(event, m.Finished):
            return InvokeResult(function=name, invocation_id=event.request_id, text=event.text,
                                finish_reason=event.finish_reason, usage=Usage(**usage(event)),
                                timings=Timings(ttft_s=round(events.ttft_s, 4), e2e_s=round(event.e2e_s, 4)))
    raise LorafaasError("the instance ended the request without a result")


async def _native_sse(events: InvocationEvents, service: FunctionService) -> AsyncIterator[bytes]:
    try:
        async for event in events:
            if isinstance(event, m.Token):
                yield sse({"type": "token", "text": event.text, "token_id": event.token_id})
            else:
                yield sse({"type": "done", "invocation_id": event.request_id, "text": event.text,
                           "finish_reason": event.finish_reason,
                           "usage": usage(event), "timings": {"ttft_s": round(events.ttft_s, 4)}})
    except LorafaasError as exc:  # headers are sent: the error travels as an SSE event
        yield sse(error_body(exc, service), event="error")


def _require_admin(who: ApiKeyRecord) -> None:
    if not who.is_admin:
        raise Forbidden("only the admin key can manage API keys")


def _parse_spec(raw: str) -> dict:
    try:
        return DeploySpec.model_validate_json(raw).model_dump(exclude_none=True)
    except ValidationError as exc:
        raise InvalidInput(f"invalid spec: {first_problem(exc.errors())}") from exc


def _error_response(status: int, code: str, message: str, openai_param: str | bool | None = False) -> JSONResponse:
    """The error body; on the OpenAI routes (`openai_param` not False) a 422 is a 400 and `param` names the field."""
    kind = "invalid_request_error" if status < 500 else "server_error"
    error: dict[str, str | bool | None] = {"code": code, "message": message, "type": kind}
    if openai_param is not False:
        status, error["param"] = openai_status(status), openai_param
    return JSONResponse({"error": error}, status_code=status)


def _install_error_handlers(app: FastAPI, service: FunctionService) -> None:
    def openai_param(request: Request, param: str | None) -> str | bool | None:
        return param if is_openai_path(request.url.path) else False

    async def lorafaas_error(request: Request, exc: LorafaasError) -> JSONResponse:
        if exc.http_status >= 500:
            log.warning("%s: %s", exc.code, exc.message)
        return _error_response(exc.http_status, exc.code, service.public_message(exc.message),
                               openai_param(request, getattr(exc, "param", None)))

    async def validation_error(request: Request, exc: RequestValidationError) -> JSONResponse:
        errors = exc.errors()
        if any(e.get("type") == "json_invalid" for e in errors):
            return _error_response(400, "malformed_json", "the request body is not valid JSON",
                                   openai_param(request, None))
        param = param_of(errors[0].get("loc", ())) if errors else None
        return _error_response(422, "invalid_input", first_problem(errors), openai_param(request, param))

    async def http_error(request: Request, exc: HTTPException) -> JSONResponse:
        if isinstance(exc.__cause__, UnicodeDecodeError):  # FastAPI's "error parsing the body", made specific
            bad = exc.__cause__
            return _error_response(400, "malformed_json", f"the request body is not valid UTF-8 (byte "
                                   f"0x{bad.object[bad.start]:02x} at offset {bad.start})",
                                   openai_param(request, None))
        reply = _error_response(exc.status_code, f"http_{exc.status_code}", str(exc.detail),
                                openai_param(request, None))
        reply.headers.update(exc.headers or {})
        if exc.status_code == 405:  # every method of the path, not only those of the one route Starlette tried
            methods = {method for route in app.routes if isinstance(route, APIRoute)
                       and route.matches(request.scope)[0] is not Match.NONE for method in route.methods or ()}
            reply.headers["Allow"] = ", ".join(sorted(methods))
        return reply

    async def unexpected_error(request: Request, exc: Exception) -> JSONResponse:
        # A bug, not a user's mistake: logged with its traceback once, and still answered as JSON.
        log.error("%s %s failed unexpectedly", request.method, request.url.path, exc_info=exc)
        return _error_response(500, "internal", f"internal error ({type(exc).__name__}); see the platform's log",
                               openai_param(request, None))

    handlers: dict[type, Callable[..., Awaitable[JSONResponse]]] = {
        LorafaasError: lorafaas_error, RequestValidationError: validation_error, HTTPException: http_error,
        Exception: unexpected_error,
    }
    for exc_class, handler in handlers.items():
        app.add_exception_handler(exc_class, handler)
