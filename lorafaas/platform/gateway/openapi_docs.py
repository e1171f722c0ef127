"""What /openapi.json says beyond the routes' own signatures: the error body every failure has, which statuses each
route answers, the bearer-key scheme, the async (202) and streaming (SSE) answers of invoke, /metrics as text (the
2xx JSON bodies are the structs of `responses`).

The gateway's tests run schemathesis with every check against this document, so it must describe the API as served.
"""

from __future__ import annotations

from fastapi.security import HTTPBearer
from pydantic import BaseModel, Field

from lorafaas.platform.gateway.responses import Accepted, InvokeResult, reply

# `auto_error=False`: the scheme is documented; a missing or bad key is still answered by auth.authenticate (401
# with the usual error body), not by FastAPI's own 403.
bearer = HTTPBearer(auto_error=False, scheme_name="apiKey",
                    description="An API key `lf_<key_id>_<secret>` (`lorafaas keys create TENANT`) or the admin key")


class ErrorDetail(BaseModel):
    code: str = Field(description="stable machine-readable code, e.g. function_not_found")
    message: str = Field(description="what was wrong, naming the field or value and the limit")
    type: str = Field(description="invalid_request_error (4xx) or server_error (5xx)")


class ErrorBody(BaseModel):
    error: ErrorDetail


STATUS_MEANINGS = {
    400: "Malformed request (the body is not JSON or not UTF-8)",
    401: "Missing, malformed or unknown API key",
    403: "The key may not do this (admin-only, another tenant, a reserved name)",
    404: "No such function, invocation, key or backbone (another tenant's function is not found either)",
    409: "The name is taken (function names are one namespace across tenants)",
    413: "The body is over its limit, or the tenant's adapters would pass its storage quota",
    422: "A field is out of bounds or of the wrong type, or the adapter is invalid or unsupported",
    429: "Too many adapter uploads at once; retry after the Retry-After header's seconds",
    431: "Request headers over 32 KiB",
    503: "The state store, the backbone daemon or a function instance is unavailable",
    504: "The invocation ran past its function's max_request_s",
    507: "The platform's disk is full",
}
COMMON = (400, 401, 413, 422, 431, 503)  # any authenticated route can answer these


def errors(*statuses: int) -> dict[int | str, dict]:
    """OpenAPI `responses` for these error statuses (plus COMMON), each with the error body."""
    return {status: {"model": ErrorBody, "description": STATUS_MEANINGS[status]}
            for status in sorted({*COMMON, *statuses})}


# A deploy's or PATCH's `spec` form field: a JSON document (its fields are the DeploySpec's; a field out of bounds, or a
# text that is not JSON, is a 422 naming it). Empty is no document: the schema says minLength 1.
SPEC_AS_JSON = {"contentMediaType": "application/json"}

# A stream's schema is one event's (as OpenAPI 3.2's itemSchema, and as schemathesis checks each event): its `data` a
# JSON document (or `[DONE]`, an OpenAI stream's end), `event` its kind where it is named.
SSE = {"text/event-stream": {"schema": {
    "type": "object", "description": "a server-sent event: `data: {json}`, after `event: KIND` where named",
    "properties": {"data": {"type": "string"}, "event": {"type": "string"}, "id": {"type": "string"},
                   "retry": {"type": "integer"}},
    "required": ["data"]}}}

INVOKE_RESPONSES: dict[int | str, dict] = {
    200: reply(InvokeResult, "The result as JSON, or with `stream: true` a stream of server-sent events: `token` "
               "events then `done` (an error after the headers: `error`)", **SSE),
    202: {**reply(Accepted, "Accepted (`Prefer: respond-async` or `?mode=async`): poll Location"),
          "headers": {"Location": {"schema": {"type": "string"}, "description": "/v1/invocations/{id}"}}},
    **errors(404, 504),
}

METRICS_RESPONSES: dict[int | str, dict] = {
    200: {"description": "Prometheus text exposition format",
          "content": {"text/plain": {"schema": {"type": "string"}}}},
    **errors(403),
}

TEXT_RESPONSES: dict[int | str, dict] = {
    200: {"description": "Plain text", "content": {"text/plain": {"schema": {"type": "string"}}}},
}
