"""What a batch deploy (`POST /v1/functions:batch`) answers, and its bound: light, for the CLI to import."""

from __future__ import annotations

import msgspec

from lorafaas.platform.state.records import FunctionSpec

MAX_BATCH_FUNCTIONS = 500  # per request; Starlette parses at most 1,000 parts of a form
DEFAULT_BATCH_SIZE = 100  # `lorafaas deploy -f FLEET --batch-size`


class RefusedEntry(msgspec.Struct, kw_only=True):
    """One entry of a batch that was not deployed; `field` is the spec field (or `adapter`) at fault, if one is."""

    index: int  # its place in the request's list, from 0
    name: str
    field: str | None
    code: str
    message: str


class BatchDeployed(msgspec.Struct, kw_only=True):
    """`POST /v1/functions:batch`: the entries deployed (their specs, in request order) and those refused."""

    deployed: list[FunctionSpec]
    refused: list[RefusedEntry]
