"""Every error lorafaas raises on purpose.

    LorafaasError                     base; `code` is a stable machine-readable string
    ├── ClientError                   the caller can fix it -> CLI exit 2, HTTP 4xx
    │   ├── NotFound                  404
    │   │   ├── BackboneNotFound
    │   │   └── FunctionNotFound
    │   ├── AlreadyExists             409
    │   ├── InvalidInput              400/422
    │   │   ├── InvalidName
    │   │   ├── PickledWeightsRefused
    │   │   ├── MalformedModel
    │   │   └── AdapterInvalid        the adapter's own files are broken
    │   │       └── AdapterIncompatible   well-formed, but not for this backbone
    │   └── SourceUnavailable         a model source (package, directory) is missing
    └── ServerError                   lorafaas failed -> CLI exit 1, HTTP 5xx

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
    code = "invalid_input"
    http_status = 422


class InvalidName(InvalidInput):
    code = "invalid_name"


class PickledWeightsRefused(InvalidInput):
    code = "pickled_weights"


class MalformedModel(InvalidInput):
    code = "malformed_model"


class AdapterInvalid(InvalidInput):
    code = "adapter_invalid"


class AdapterIncompatible(AdapterInvalid):
    code = "adapter_incompatible"


class SourceUnavailable(ClientError):
    code = "source_unavailable"


class ServerError(LorafaasError):
    code = "internal"
    http_status = 500
