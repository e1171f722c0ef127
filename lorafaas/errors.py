"""Every error lorafaas raises on purpose.

    LorafaasError                     base; `code` is a stable machine-readable string
    ├── ClientError                   the caller can fix it -> CLI exit 2, HTTP 4xx
    │   ├── NotFound                  404
    │   │   ├── BackboneNotFound
    │   │   ├── FunctionNotFound
    │   │   ├── InvocationNotFound    an invocation id never issued, or its record expired
    │   │   ├── AdapterNotFound       no adapter with this digest in the adapter store
    │   │   ├── ApiKeyNotFound
    │   │   └── LeaseNotFound         a backbone lease that was released or reaped
    │   ├── Forbidden                 403: the key may not do this (admin-only operations)
    │   ├── AlreadyExists             409
    │   │   └── DaemonAlreadyRunning  one backbone daemon per (device, backbone)
    │   ├── LeasesHeld                409: a backbone daemon asked to stop while functions are attached
    │   ├── InvalidInput              400/422
    │   │   ├── InvalidName
    │   │   ├── PromptTooLong
    │   │   ├── PickledWeightsRefused
    │   │   ├── MalformedModel
    │   │   ├── TraceMalformed        a trace file's header or row is not in its format (file and line named)
    │   │   ├── ClusterInvalid        a simulator cluster description lacks a field or is out of bounds
    │   │   └── AdapterInvalid        the adapter's own files are broken
    │   │       ├── AdapterIncompatible   well-formed, but not for this backbone
    │   │       └── AdapterUnsupported    a PEFT feature lorafaas refuses rather than run differently (field named)
    │   ├── Unauthorized              401: a missing, malformed or unknown API key
    │   │   └── KeyRevoked            the key of an invocation in flight was revoked: it was cancelled
    │   ├── InvocationCancelled       409: an asynchronous invocation cancelled by its tenant (DELETE)
    │   ├── InvocationFinished        409: cancelling an invocation that already ended
    │   ├── PayloadTooLarge           413: a request body over the gateway's limit
    │   │   └── QuotaExceeded         a tenant's stored adapters would pass its quota
    │   ├── TooManyRequests           429: too many uploads at once
    │   ├── RequestTimeout            408: a request body that stopped arriving, or arrived too slowly
    │   ├── HeadersTooLarge           431: request headers over the gateway's limit
    │   ├── SourceUnavailable         a model source (package, directory) is missing
    │   └── TransportUnavailable      a device whose transport cannot run here (cuda:N without CUDA)
    └── ServerError                   lorafaas failed -> CLI exit 1, HTTP 5xx
        ├── DaemonUnavailable         503: no backbone daemon answers at the socket, or it died mid-request
        ├── LeaseRefused              503: the daemon is stopping and grants no new lease
        ├── InstanceUnavailable       503: a function worker does not answer, or went away mid-request
        │   └── InstanceHung          503: a worker held requests without progress or heartbeat; it was replaced
        ├── PlatformUnavailable       503: the CLI cannot reach the gateway
        ├── StoreUnavailable          503: the state store (SQLite file, Redis server) cannot be reached or refused
        ├── StorageFull               507: a write failed for lack of space (disk full, quota, file size limit)
        │   └── InsufficientMemory    507: a backbone segment cannot be reserved (needed and free bytes named)
        ├── InvocationTimedOut        504: a request ran past its function's wall-time limit
        ├── ProtocolError             a peer spoke another protocol version or sent a malformed message
        ├── SegmentError              a shared segment is missing, truncated or does not match its manifest
        └── BindingFailed             a bound model has a parameter outside the shared segment or on meta

Foreign exceptions are translated once, where they are raised (`raise X(...) from exc`); messages name the value
and what was expected.
"""

from __future__ import annotations


class LorafaasError(Exception):
    code = "internal"
    http_status = 500

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.message = message


class ClientError(LorafaasError):
    code = "bad_request"
    http_status = 400


class NotFound(ClientError):
    code = "not_found"
    http_status = 404


class BackboneNotFound(NotFound):
    code = "backbone_not_found"


class FunctionNotFound(NotFound):
    code = "function_not_found"


class AlreadyExists(ClientError):
    code = "already_exists"
    http_status = 409


class InvalidInput(ClientError):
    """`param`: the request field at fault, where one is (the OpenAI routes name it)."""

    code = "invalid_input"
    http_status = 422
    param: str | None = None  # a subclass may name its field once for all its errors

    def __init__(self, message: str, *, param: str | None = None) -> None:
        super().__init__(message)
        if param is not None:
            self.param = param


class InvalidName(InvalidInput):
    code = "invalid_name"


class PromptTooLong(InvalidInput):
    code = "prompt_too_long"


class PickledWeightsRefused(InvalidInput):
    code = "pickled_weights"


class MalformedModel(InvalidInput):
    code = "malformed_model"


class AdapterInvalid(InvalidInput):
    code = "adapter_invalid"


class AdapterIncompatible(AdapterInvalid):
    code = "adapter_incompatible"


class AdapterUnsupported(AdapterInvalid):
    code = "adapter_unsupported"


class SourceUnavailable(ClientError):
    code = "source_unavailable"


class ServerError(LorafaasError):
    code = "internal"
    http_status = 500


class LeaseNotFound(NotFound):
    code = "lease_not_found"


class DaemonAlreadyRunning(AlreadyExists):
    code = "daemon_running"


class LeasesHeld(ClientError):
    code = "leases_held"
    http_status = 409


class TransportUnavailable(ClientError):
    code = "transport_unavailable"


class DaemonUnavailable(ServerError):
    code = "daemon_unavailable"
    http_status = 503


class LeaseRefused(ServerError):
    code = "lease_refused"
    http_status = 503


class InstanceUnavailable(ServerError):
    code = "instance_unavailable"
    http_status = 503


class InstanceHung(InstanceUnavailable):
    code = "instance_hung"
    http_status = 503


class PlatformUnavailable(ServerError):
    code = "platform_unavailable"
    http_status = 503


class ProtocolError(ServerError):
    code = "protocol_error"


class SegmentError(ServerError):
    code = "segment_error"


class BindingFailed(ServerError):
    code = "binding_failed"


class InvocationNotFound(NotFound):
    code = "invocation_not_found"


class AdapterNotFound(NotFound):
    code = "adapter_not_found"


class ApiKeyNotFound(NotFound):
    code = "api_key_not_found"


class Unauthorized(ClientError):
    code = "unauthorized"
    http_status = 401


class KeyRevoked(Unauthorized):
    code = "key_revoked"


class InvocationCancelled(ClientError):
    code = "invocation_cancelled"
    http_status = 409


class InvocationFinished(ClientError):
    code = "invocation_finished"
    http_status = 409


class Forbidden(ClientError):
    code = "forbidden"
    http_status = 403


class StoreUnavailable(ServerError):
    code = "store_unavailable"
    http_status = 503


class TraceMalformed(InvalidInput):
    code = "trace_malformed"


class ClusterInvalid(InvalidInput):
    code = "cluster_invalid"


class PayloadTooLarge(ClientError):
    code = "payload_too_large"
    http_status = 413


class HeadersTooLarge(ClientError):
    code = "headers_too_large"
    http_status = 431


class StorageFull(ServerError):
    code = "storage_full"
    http_status = 507


class InsufficientMemory(StorageFull):
    code = "insufficient_memory"


class InvocationTimedOut(ServerError):
    code = "invocation_timeout"
    http_status = 504


class QuotaExceeded(PayloadTooLarge):
    code = "quota_exceeded"


class TooManyRequests(ClientError):
    code = "too_many_requests"
    http_status = 429


class RequestTimeout(ClientError):
    code = "request_timeout"
    http_status = 408
