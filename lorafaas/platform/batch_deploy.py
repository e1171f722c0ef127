"""Deploy many functions in one request (`POST /v1/functions:batch`, `lorafaas deploy -f FLEET`).

Each entry is deployed on its own, exactly as `POST /v1/functions` deploys one (service.deploy): stored whole or not
at all. An entry that cannot be deployed (a field out of bounds, a taken name, a bad adapter) is refused with its
index, name, the field at fault and the error, and the entries after it still go; a name already deployed is
refused, never replaced, so nothing stored before the batch is lost. The tenant's adapter bytes (its quota) are
read once per batch, not once per entry, so a batch costs the same per function however many functions exist.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import BinaryIO

from lorafaas.errors import (
    AdapterInvalid,
    AlreadyExists,
    BackboneNotFound,
    Forbidden,
    InvalidInput,
    LorafaasError,
    PayloadTooLarge,
    PickledWeightsRefused,
)
from lorafaas.platform.batches import BatchDeployed, RefusedEntry
from lorafaas.platform.service import FunctionService, TenantAdapters
from lorafaas.platform.state.records import ApiKeyRecord, FunctionSpec

DEPLOY_FIELDS = ("name", "backbone", "tenant", "slo_ttft_ms", "keep_alive_s", "min_instances", "max_instances",
                 "max_tokens_limit", "max_request_s", "lora_mode", "shared_base")
_LEADING_FIELD = re.compile(r"^(\w+) ")
_NAME_KINDS = {"function": "name", "tenant": "tenant", "backbone": "backbone"}


@dataclass(frozen=True)
class BatchEntry:
    """One entry as the route parsed it: its fields, or the error its spec already failed with."""

    name: str
    fields: dict | None = None
    error: LorafaasError | None = None


def field_of(exc: LorafaasError) -> str | None:
    """The deploy field an error is about, where one is: named by the error, by its kind, or leading its message."""
    if isinstance(exc, InvalidInput) and exc.param is not None:
        return exc.param
    if isinstance(exc, AlreadyExists):
        return "name"
    if isinstance(exc, BackboneNotFound):
        return "backbone"
    if isinstance(exc, Forbidden):
        return "tenant"
    if isinstance(exc, AdapterInvalid | PickledWeightsRefused | PayloadTooLarge):
        return "adapter"
    leading = _LEADING_FIELD.match(exc.message)
    if leading is None:
        return None
    word = leading.group(1)
    if word in _NAME_KINDS and exc.message.startswith(f"{word} name "):
        return _NAME_KINDS[word]
    return word if word in DEPLOY_FIELDS else None


async def deploy_batch(service: FunctionService, caller: ApiKeyRecord, entries: Sequence[BatchEntry],
                       archives: Sequence[BinaryIO]) -> BatchDeployed:
    """Deploy each entry with its archive (same order), one after the other; see the module's docstring."""
    deployed: list[FunctionSpec] = []
    refused: list[RefusedEntry] = []
    held: dict[str, TenantAdapters] = {}  # per tenant: the adapters its functions hold, read once
    for index, (entry, archive) in enumerate(zip(entries, archives, strict=True)):
        try:
            if entry.error is not None:
                raise entry.error
            assert entry.fields is not None
            # the tenant whose quota it counts against (another tenant's, named without the admin key, is refused)
            named = entry.fields.get("tenant")
            tenant = named if caller.is_admin and isinstance(named, str) and named else caller.tenant
            if tenant not in held:
                held[tenant] = await service.store_threads.run(service.tenant_adapters, tenant)
            deployed.append(await service.deploy(caller, entry.fields, archive, held=held[tenant]))
        except LorafaasError as exc:  # a server error (a full disk) too: the reply still says what landed
            refused.append(RefusedEntry(index=index, name=entry.name, field=field_of(exc), code=exc.code,
                                        message=service.public_message(exc.message)))
    return BatchDeployed(deployed=deployed, refused=refused)
