"""What the deploy routes share: an uploaded archive read from its spool file, and a validation error in a line."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, BinaryIO

from fastapi import UploadFile

from lorafaas.errors import PayloadTooLarge

MAX_ADAPTER_UPLOAD_BYTES = 2 * 1024**3


def spooled(upload: UploadFile) -> BinaryIO:
    """The uploaded archive as the file Starlette spooled it to (on disk past 1 MiB), read as a stream."""
    if upload.size is not None and upload.size > MAX_ADAPTER_UPLOAD_BYTES:
        raise PayloadTooLarge(f"the adapter upload is {upload.size} bytes; the limit is {MAX_ADAPTER_UPLOAD_BYTES}")
    upload.file.seek(0)
    return upload.file


def problem(errors: Sequence[Mapping[str, Any]]) -> tuple[str | None, str]:
    """The field (dotted) and the message of the first of pydantic's (or FastAPI's) errors."""
    if not errors:
        return None, "invalid request"
    first = errors[0]
    where = ".".join(str(p) for p in first.get("loc", ()) if p != "body")
    return where or None, str(first.get("msg"))


def first_problem(errors: Sequence[Mapping[str, Any]]) -> str:
    where, message = problem(errors)
    return f"{where}: {message}" if where else message
