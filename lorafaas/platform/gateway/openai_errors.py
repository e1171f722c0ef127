"""Errors on the OpenAI-compatible routes, in OpenAI's (and vLLM's) shape.

    {"error": {"message": ..., "type": "invalid_request_error", "param": "max_tokens", "code": "invalid_input"}}

A request the caller can fix is a 400 there (OpenAI and vLLM answer 400, and the `openai` SDK raises
BadRequestError); lorafaas' own API keeps 422 for the same mistakes.
"""

from __future__ import annotations

from lorafaas.errors import InvalidInput

OPENAI_PATH_PREFIXES = ("/v1/chat/completions", "/v1/completions", "/v1/models", "/v1/responses")


class InvalidParameter(InvalidInput):
    """A request field out of bounds or not supported: `param` names it (as `messages[0].content`)."""

    def __init__(self, param: str, message: str) -> None:
        super().__init__(message, param=param)


def is_openai_path(path: str) -> bool:
    return any(path == prefix or path.startswith(prefix + "/") for prefix in OPENAI_PATH_PREFIXES)


def openai_status(status: int) -> int:
    """Validation failures (422 on the native API) are 400 on the OpenAI routes."""
    return 400 if status == 422 else status


def param_of(location: tuple | list) -> str | None:
    """A pydantic error location as OpenAI names parameters: ("body", "messages", 0, "content") ->
    "messages[0].content"."""
    param = ""
    for part in location:
        if part == "body" and not param:
            continue
        if isinstance(part, int):
            param += f"[{part}]"
        elif not _is_union_tag(part):
            param += f".{part}" if param else str(part)
    return param or None


def _is_union_tag(part: str) -> bool:
    """Pydantic names the union member it tried (`str`, `list[int]`, `function-after[...]`): not a field."""
    return any(mark in part for mark in ("[", "(")) or part in ("str", "int", "float", "bool", "list", "dict")
