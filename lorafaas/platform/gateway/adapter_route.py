"""The internal route function pods fetch their adapter from (platform/adapter_access.py says who may)."""

from __future__ import annotations

from fastapi import FastAPI, Request
from fastapi.responses import FileResponse

from lorafaas.errors import AdapterNotFound
from lorafaas.function_runtime.adapter_fetch import ADAPTER_FILES, FUNCTION_HEADER
from lorafaas.platform.adapter_access import AdapterAccess
from lorafaas.platform.adapter_store import AdapterStore
from lorafaas.platform.state.records import check_digest


def install_adapter_route(app: FastAPI, adapters: AdapterStore, access: AdapterAccess) -> None:
    @app.get("/internal/adapters/{digest}/{file}", include_in_schema=False)
    async def adapter_file(digest: str, file: str, request: Request) -> FileResponse:
        check_digest(digest)
        access.check(request.headers.get(FUNCTION_HEADER), digest, request.headers.get("authorization"))
        if file not in ADAPTER_FILES:
            raise AdapterNotFound(f"an adapter has no file {file!r}; it has {', '.join(ADAPTER_FILES)}")
        return FileResponse(adapters.path(digest) / file, media_type="application/octet-stream")
