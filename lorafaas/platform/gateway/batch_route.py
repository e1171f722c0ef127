"""`POST /v1/functions:batch`: many functions in one request, each deployed on its own (platform/batch_deploy.py)."""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

from fastapi import Depends, FastAPI, File, Form, UploadFile
from fastapi.responses import Response
from pydantic import ValidationError

from lorafaas.errors import InvalidInput, LorafaasError
from lorafaas.platform.batch_deploy import BatchEntry, deploy_batch
from lorafaas.platform.batches import MAX_BATCH_FUNCTIONS
from lorafaas.platform.gateway.openapi_docs import SPEC_AS_JSON, errors
from lorafaas.platform.gateway.responses import BatchDeployed, encoded, reply
from lorafaas.platform.gateway.schemas import DeploySpec
from lorafaas.platform.gateway.uploads import problem, spooled
from lorafaas.platform.service import FunctionService
from lorafaas.platform.state.records import ApiKeyRecord


def install_batch_route(app: FastAPI, service: FunctionService, caller: Callable[..., ApiKeyRecord]) -> None:
    @app.post("/v1/functions:batch", tags=["functions"], response_model=None,
              responses={200: reply(BatchDeployed, "Each entry deployed or refused (with its field and error)"),
                         **errors(403, 429)})
    async def deploy_many(
        specs: str = Form(..., min_length=1, json_schema_extra=SPEC_AS_JSON,
                          description=f"a JSON list of 1 to {MAX_BATCH_FUNCTIONS} DeploySpecs, each with its name"),
        adapters: list[UploadFile] = File(..., description="one tar(.gz) of an adapter's two files per spec, in the "
                                                           "order of `specs`"),
        who: ApiKeyRecord = Depends(caller),
    ) -> Response:
        """Deploy many functions at once: each is deployed on its own, as `POST /v1/functions` deploys one, and an
        entry refused (a field out of bounds, a taken name, a bad adapter) does not stop the others."""
        entries = parse_entries(specs)
        if len(adapters) != len(entries):
            raise InvalidInput(f"specs lists {len(entries)} function(s) but {len(adapters)} adapter file(s) came; "
                               "send one `adapters` part per spec, in the same order", param="adapters")
        archives = []
        for index, upload in enumerate(adapters):
            try:
                archives.append(spooled(upload))
            except LorafaasError as exc:
                entries[index] = BatchEntry(name=entries[index].name, error=exc)
                archives.append(upload.file)
        return encoded(await deploy_batch(service, who, entries, archives))


def parse_entries(raw: str) -> list[BatchEntry]:
    """The `specs` field as entries: the list as a whole must be a JSON list of 1 to MAX_BATCH_FUNCTIONS objects
    (else 422); an entry whose fields are out of bounds carries its error, and is refused alone."""
    try:
        document: Any = json.loads(raw)
    except ValueError as exc:
        raise InvalidInput(f"specs is not JSON: {exc}", param="specs") from None
    if not isinstance(document, list) or not 1 <= len(document) <= MAX_BATCH_FUNCTIONS:
        raise InvalidInput(f"specs must be a JSON list of 1 to {MAX_BATCH_FUNCTIONS} function specs", param="specs")
    entries = []
    for item in document:
        name = item.get("name") if isinstance(item, dict) else None
        name = name if isinstance(name, str) else ""
        try:
            fields = DeploySpec.model_validate(item).model_dump(exclude_none=True)
        except ValidationError as exc:
            where, message = problem(exc.errors())
            entries.append(BatchEntry(name=name, error=InvalidInput(f"invalid spec: {message}", param=where)))
            continue
        if not name:
            entries.append(BatchEntry(name=name, error=InvalidInput("a function spec needs its name", param="name")))
            continue
        entries.append(BatchEntry(name=name, fields=fields))
    return entries
