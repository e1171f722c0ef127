"""The platform's operations, independent of HTTP: deploy, update, delete, list, invoke (sync, streaming, async).

Every operation takes the caller's key record: a tenant sees and touches only its own functions (another tenant's
function is reported as not found); the admin key sees all. Function names are one namespace across tenants, so a
deploy under a name another tenant holds is refused with 409 (which tells that the name is taken, nothing else).
Desired state is written to the store before the node agent acts on it, so a restarted platform rebuilds everything
from the store. Adapters no function references are removed from the adapter store after a delete, an update that
replaced one and a failed deploy.
"""

from __future__ import annotations

import asyncio
import builtins
import contextlib
import logging
import secrets
import time
from collections.abc import AsyncGenerator
from dataclasses import dataclass, field
from pathlib import Path
from typing import BinaryIO

import msgspec

from lorafaas.errors import (
    AlreadyExists,
    Forbidden,
    FunctionNotFound,
    InvalidInput,
    InvocationCancelled,
    InvocationFinished,
    InvocationNotFound,
    InvocationTimedOut,
    LorafaasError,
    ServerError,
)
from lorafaas.formats.model_store import ModelStore, read_model_config
from lorafaas.function_runtime import messages as m
from lorafaas.platform import log_lines
from lorafaas.platform.adapter_limits import AdapterLimits, check_adapter_size, check_tenant_quota
from lorafaas.platform.adapter_store import AdapterStore
from lorafaas.platform.adapter_upload import unpack_adapter
from lorafaas.platform.agent import NodeAgent
from lorafaas.platform.auth import revoke_key
from lorafaas.platform.backends.local import deployment_log_dir, remove_deployment_logs
from lorafaas.platform.descriptions import FunctionDescription
from lorafaas.platform.in_flight import InFlight, Ticket
from lorafaas.platform.metering import UsageMeter
from lorafaas.platform.state.interface import StateStore
from lorafaas.platform.state.records import (
    ApiKeyRecord,
    FunctionSpec,
    InvocationRecord,
    InvocationRequest,
    InvocationStatus,
)
from lorafaas.platform.store_threads import StoreThreads
from lorafaas.platform.usage import TimeBound, UsageRecorder, parse_time, summarize

log = logging.getLogger(__name__)

INVOCATION_RETENTION_S = 3600.0
SPEC_FIELDS = ("slo_ttft_ms", "keep_alive_s", "min_instances", "max_instances", "max_tokens_limit", "max_request_s",
               "lora_mode", "shared_base")
MOE_CONFIG_KEYS = ("num_local_experts", "num_experts", "n_routed_experts")  # Mixtral, Qwen-MoE, DeepSeek


class UsageGroup(msgspec.Struct, kw_only=True, omit_defaults=True):
    """One group's (or the total's) usage sums: `tenant` absent in the total, `function` with group_by=function."""

    tenant: str | None = None
    function: str | None = None
    invocations: int
    cold_starts: int
    prompt_tokens: int
    completion_tokens: int
    device_s: float
    memory_active_gb_s: float
    memory_idle_gb_s: float
    memory_gb_s: float
    keep_alive_s: float
    queue_s: float
    e2e_s: float


class UsageReport(msgspec.Struct, kw_only=True):
    since: float | None
    until: float | None
    group_by: str
    groups: list[UsageGroup]
    total: UsageGroup


@dataclass
class TenantAdapters:
    """The adapters one tenant's functions hold, and their bytes (an adapter shared by several counts once)."""

    digests: set[str] = field(default_factory=set)
    num_bytes: int = 0

    def add(self, digest: str, size_bytes: int) -> None:
        if digest not in self.digests:
            self.digests.add(digest)
            self.num_bytes += size_bytes


class FunctionService:
    def __init__(self, store: StateStore, models: ModelStore, adapters: AdapterStore, agent: NodeAgent,
                 limits: AdapterLimits | None = None) -> None:
        self.store = store
        self.models = models
        self.adapters = adapters
        self.agent = agent
        self.limits = limits or AdapterLimits()
        # Where this server keeps its files: named in logs, never in an answer to a client (`public_message`).
        self._private_roots = sorted({str(p) for root in (models.models_dir.parent, adapters.root)
                                      for p in (Path(root), Path(root).resolve())}, key=len, reverse=True)
        self._background: dict[str, asyncio.Task] = {}  # async invocations running here, by id
        self.in_flight = InFlight()  # every invocation running here, so a revoke or a cancel reaches it
        self.store_threads = StoreThreads()  # every store call from a coroutine runs here
        self.usage = UsageRecorder(store, agent.launcher.log_dir)
        agent.instances.on_keep_alive = self.usage.record_keep_alive

    # -- start-up --------------------------------------------------------------------------------------------------

    async def restore(self) -> int:
        """Hand every stored function to the agent and resume accepted async invocations; returns #functions."""
        specs = self.store.list_functions()
        for spec in specs:
            self.agent.apply(spec)
        await self._collect_adapters()  # left by a platform stopped between storing an adapter and using it
        live_key_ids = {key.key_id for key in self.store.list_keys()}
        for record in self.store.list_invocations():
            if record.status in ("queued", "running"):
                if record.key_id and record.key_id not in live_key_ids:  # revoked while the platform was down
                    self.in_flight.revoked_key_ids.add(record.key_id)
                self._run_in_background(record)
        return len(specs)

    def public_message(self, message: str) -> str:
        """`message` with this server's own paths (the home, the adapter store, sockets under run/) replaced."""
        for root in self._private_roots:
            message = message.replace(root, "$LORAFAAS_HOME")
        return message

    # -- functions -------------------------------------------------------------------------------------------------

    async def deploy(self, caller: ApiKeyRecord, fields: dict, adapter_archive: bytes | BinaryIO,
                     held: TenantAdapters | None = None) -> FunctionSpec:
        """`held`: the adapters the tenant's functions hold (`tenant_adapters()`), kept by a caller that deploys many
        (batch_deploy.py) so the quota costs no store read per function; the new adapter is added to it."""
        name = fields.get("name", "")
        tenant = _tenant_of(caller, fields.get("tenant"))
        now, started = time.time(), time.perf_counter()
        spec = FunctionSpec(name=name, tenant=tenant, backbone=fields.get("backbone", ""), adapter_digest="0" * 64,
                            uid=secrets.token_hex(8), created_at=now, updated_at=now, **_spec_values(fields)).check()
        self.models.get(spec.backbone)  # BackboneNotFound before any work
        self._check_lora_mode(spec)
        if await self.store_threads.run(self._exists, spec.name):
            raise AlreadyExists(f"function {spec.name!r} already exists; update it with PATCH (`lorafaas deploy "
                                "--replace`) or delete it first")
        checked = time.perf_counter()
        digest = await self._store_adapter(adapter_archive, spec.backbone, spec.tenant, held=held)
        spec = msgspec.structs.replace(spec, adapter_digest=digest)
        stored = time.perf_counter()
        try:
            await self.store_threads.run(self.store.put_function, spec, create=True)
        except BaseException:
            await self._release_adapter(digest)  # a failed deploy leaves no adapter behind
            raise
        recorded = time.perf_counter()
        # Stored: the function references the adapter now, so there is nothing to collect (a collect lists every
        # function and adapter: a deploy would cost more with each function deployed).
        self.adapters.unpin(digest)
        if held is not None:
            held.add(digest, self.adapters.size_bytes(digest))
        self.agent.apply(spec)
        # the registration's stages (the upload itself was read before this call): checks, the adapter (unpacked,
        # digested, checked against the backbone, stored), the function's record, handed to the node agent
        self.agent.record_registration(spec, {"check": checked - started, "adapter": stored - checked,
                                              "state": recorded - stored, "apply": time.perf_counter() - recorded})
        log.info("deployed %s (tenant %s, backbone %s, adapter %s)", spec.name, spec.tenant, spec.backbone,
                 digest[:12])
        return spec

    async def update(self, caller: ApiKeyRecord, name: str, fields: dict, adapter_archive: bytes | BinaryIO | None
                     ) -> FunctionSpec:
        """Change a function's settings and/or adapter; a new adapter rolls out atomically."""
        current = await self.aget(caller, name)
        changes = _spec_values(fields)
        if adapter_archive is not None:
            changes["adapter_digest"] = await self._store_adapter(adapter_archive, current.backbone, current.tenant,
                                                                  replacing=current.name)
        try:
            spec = msgspec.structs.replace(current, **changes, version=current.version + 1,
                                           updated_at=max(time.time(), current.created_at)).check()
            if "lora_mode" in changes:
                self._check_lora_mode(spec)
            await self.store_threads.run(self.store.put_function, spec, create=False)
        finally:
            if "adapter_digest" in changes:  # the replaced adapter, or the refused new one, may be unused now
                await self._release_adapter(changes["adapter_digest"])
        self.agent.apply(spec)
        return spec

    # The state store may be remote (Redis): every call to it from a coroutine goes through a store thread, so a
    # slow or unreachable store never stalls the event loop (/healthz, streams in flight), and nothing else that
    # holds threads makes a store call wait (store_threads.py).

    async def aget(self, caller: ApiKeyRecord, name: str) -> FunctionSpec:
        return await self.store_threads.run(self.get, caller, name)

    def get(self, caller: ApiKeyRecord, name: str) -> FunctionSpec:
        try:
            spec = self.store.get_function(name)
        except FunctionNotFound:
            spec = None
        if spec is None or not (caller.is_admin or spec.tenant == caller.tenant):
            raise FunctionNotFound(f"function {name!r} does not exist")
        return spec

    async def list(self, caller: ApiKeyRecord) -> list[FunctionSpec]:
        return await self.store_threads.run(self.store.list_functions, None if caller.is_admin else caller.tenant)

    async def delete(self, caller: ApiKeyRecord, name: str) -> None:
        spec = await self.aget(caller, name)
        await self.store_threads.run(self.store.delete_function, spec.name)
        await self.agent.remove(spec.name)
        await asyncio.to_thread(remove_deployment_logs, self.agent.launcher.log_dir, spec.uid)
        await self._collect_adapters()

    async def describe(self, caller: ApiKeyRecord, name: str) -> FunctionDescription:
        spec = await self.aget(caller, name)
        return self.agent.describe(spec)

    async def logs(self, caller: ApiKeyRecord, name: str, tail: int | None = None, since: float | None = None,
                   tail_bytes: int = 64 * 1024) -> str:
        return await asyncio.to_thread(self._logs, caller, name, tail, since, tail_bytes)

    def _logs(self, caller: ApiKeyRecord, name: str, tail: int | None, since: float | None, tail_bytes: int) -> str:
        """The last `tail_bytes` of each instance log of this deployment of the function (never a predecessor's or a
        namesake's: the files live in the deployment's own directory), cut to the lines logged at `since` or later
        (unix time) and to the last `tail` lines of each."""
        spec = self.get(caller, name)
        directory = deployment_log_dir(self.agent.launcher.log_dir, spec.uid)
        paths = sorted(directory.glob("*.log"), key=lambda p: p.stat().st_mtime) if directory.is_dir() else []
        sections = []
        for path in paths:
            with path.open("rb") as f:
                start = max(0, path.stat().st_size - tail_bytes)
                f.seek(start)
                text = f.read().decode(errors="replace")
            if start:  # the window began inside a line: drop that part-line
                text = text.partition("\n")[2]
            sections.append(log_lines.cut(log_lines.stamped(path.stem, text), tail, since))
        return log_lines.render(sections)

    def _check_lora_mode(self, spec: FunctionSpec) -> None:
        """A LoRA mode is a choice for MoE backbones only: refuse one given for a dense backbone."""
        if spec.lora_mode is None:
            return
        config = read_model_config(self.models.path(spec.backbone))
        if not any(isinstance(n := config.get(key), int) and n > 1 for key in MOE_CONFIG_KEYS):
            raise InvalidInput(
                f"lora_mode {spec.lora_mode!r} is for mixture-of-experts backbones (expert adapters), but backbone "
                f"{spec.backbone!r} ({config.get('model_type', 'unknown type')}) is dense; deploy without "
                "--lora-mode (lora_mode)"
            )

    def _exists(self, name: str) -> bool:
        try:
            self.store.get_function(name)
        except FunctionNotFound:
            return False
        return True

    async def _store_adapter(self, archive: bytes | BinaryIO, backbone: str, tenant: str,
                             replacing: str | None = None, held: TenantAdapters | None = None) -> str:
        """Unpack, check against the limits and the tenant's quota, validate and store; returns the digest, pinned
        until `_release_adapter`. `held`: the tenant's adapters, if the caller has them (see deploy)."""
        def unpack_and_store() -> str:
            # unpacked straight into the store's staging: validated there, hashed and renamed into place, not copied
            with self.adapters.staging() as staged:
                scratch = str(staged)
                try:
                    adapter_dir = unpack_adapter(archive, staged)
                    manifest = self.models.get(backbone)
                    new_bytes = check_adapter_size(adapter_dir, backbone, manifest.num_parameters, self.limits)
                    used = held if held is not None else self.tenant_adapters(tenant, replacing)
                    check_tenant_quota(tenant, used.num_bytes, new_bytes, self.limits)
                    return self.adapters.put_staged(adapter_dir, self.models, backbone)
                except LorafaasError as exc:  # name files as they are in the archive, not where this server put them
                    exc.message = exc.message.replace(f"{scratch}/", "").replace(scratch, "the archive")
                    exc.args = (exc.message,)
                    raise

        return await asyncio.to_thread(unpack_and_store)

    def tenant_adapters(self, tenant: str, replacing: str | None = None) -> TenantAdapters:
        """What the tenant's functions (but `replacing`, whose adapter an update swaps) hold in the adapter store."""
        held = TenantAdapters()
        for digest in {s.adapter_digest for s in self.store.list_functions(tenant) if s.name != replacing}:
            held.add(digest, self.adapters.size_bytes(digest))
        return held

    async def _release_adapter(self, digest: str) -> None:
        self.adapters.unpin(digest)
        await self._collect_adapters()

    async def _collect_adapters(self) -> None:
        """Remove the adapters no stored function references (and no deploy in progress holds)."""
        referenced = {spec.adapter_digest for spec in await self.store_threads.run(self.store.list_functions)}
        await asyncio.to_thread(self.adapters.collect, referenced)

    # -- invocations -----------------------------------------------------------------------------------------------

    async def invoke(self, caller: ApiKeyRecord, name: str, request: InvocationRequest, charge_prompt: bool = True
                     ) -> AsyncGenerator[m.Token | m.Finished, None]:
        """`charge_prompt` False: the request's prompt is charged to another invocation (choice 0 of OpenAI's `n`)."""
        spec = await self.aget(caller, name)
        request.check(spec.max_tokens_limit)
        generate = to_generate(request, secrets.token_hex(8))
        ticket = self.in_flight.open(generate.request_id, caller.key_id)
        try:
            async with contextlib.aclosing(self._metered(spec, generate, ticket, charge_prompt)) as events:
                async for event in events:  # a client that leaves closes the metering at once
                    yield event
        finally:
            self.in_flight.close(ticket)

    async def _metered(self, spec: FunctionSpec, request: m.Generate, ticket: Ticket, charge_prompt: bool = True
                       ) -> AsyncGenerator[m.Token | m.Finished, None]:
        """The invocation's events, until it ends or its ticket is cancelled (its key revoked, its tenant cancelled
        it). Its usage is recorded (in the background) however it ends: when `Finished` comes, or what it produced
        until then when its client leaves, its wall time runs out or it is cancelled. An invocation the platform
        failed (its instance crashed or hung) or that never reached an instance is not charged."""
        meter = UsageMeter()
        events = within_wall_time(self.agent.invoke(spec, request, meter), spec)
        recorded = platform_failed = False
        try:
            while True:
                try:
                    event = await ticket.wait(events.__anext__)
                except StopAsyncIteration:
                    break
                if isinstance(event, m.Finished):  # charged now: the caller may never pull past it
                    recorded = True
                    self.usage.record(spec, request.request_id, meter, charge_prompt)
                yield event
        except ServerError as exc:
            platform_failed = not isinstance(exc, InvocationTimedOut)
            raise
        finally:
            if not recorded:
                try:
                    await events.aclose()  # the agent's part ends first: the meter holds the device time then
                finally:
                    if meter.instance_id and not platform_failed:
                        self.usage.record(spec, request.request_id, meter, charge_prompt)

    async def usage_summary(self, caller: ApiKeyRecord, since: TimeBound, until: TimeBound, group_by: str
                            ) -> UsageReport:
        """Usage per function or tenant in [since, until): a tenant's own, or every tenant's (admin)."""
        start, end = parse_time("since", since), parse_time("until", until)
        summarize((), group_by)  # a bad group_by is refused before the store is read
        tenant = None if caller.is_admin else caller.tenant
        records = await self.store_threads.run(self.store.list_usage, start, end, tenant)
        return msgspec.convert({"since": start, "until": end, **summarize(records, group_by)}, UsageReport,
                               strict=False)

    async def submit(self, caller: ApiKeyRecord, name: str, request: InvocationRequest) -> InvocationRecord:
        """Accept an asynchronous invocation: stored first (it survives a restart), then run in the background."""
        spec = await self.aget(caller, name)
        request.check(spec.max_tokens_limit)
        now = time.time()
        record = InvocationRecord(
            invocation_id=secrets.token_hex(12), function=spec.name, tenant=spec.tenant, deployment=spec.uid,
            key_id=caller.key_id, status="queued",
            request=request, created_at=now, updated_at=now, expires_at=now + INVOCATION_RETENTION_S,
        )
        await self.store_threads.run(self.store.put_invocation, record)
        self._run_in_background(record)
        return record

    async def get_invocation(self, caller: ApiKeyRecord, invocation_id: str) -> InvocationRecord:
        record = await self.store_threads.run(self.store.get_invocation, invocation_id)
        if not (caller.is_admin or record.tenant == caller.tenant):
            raise InvocationNotFound(f"invocation {invocation_id!r} does not exist")
        return record

    async def list_invocations(self, caller: ApiKeyRecord, function: str | None, status: str | None, limit: int
                               ) -> builtins.list[InvocationRecord]:
        """The caller's invocations still retained (a tenant's own; every tenant's for the admin), newest first."""
        records = await self.store_threads.run(self.store.list_invocations, status)
        mine = [r for r in reversed(records) if (caller.is_admin or r.tenant == caller.tenant)
                and function in (None, r.function)]
        return mine[:limit]

    async def cancel_invocation(self, caller: ApiKeyRecord, invocation_id: str) -> InvocationRecord:
        """Cancel one of the caller's queued or running async invocations; its record ends `cancelled`."""
        record = await self.get_invocation(caller, invocation_id)  # another tenant's: not found
        if record.is_finished:
            raise InvocationFinished(f"invocation {invocation_id!r} already ended ({record.status}); only a queued or "
                                     "running one can be cancelled")
        reason = InvocationCancelled(f"invocation {invocation_id} was cancelled by its tenant")
        task = self._background.get(invocation_id)
        if task is None:  # accepted, but not running in this gateway (one gateway per state store): ended here
            await self.store_threads.run(self.store.put_invocation, _ended(record, "cancelled", reason))
        else:
            self.in_flight.cancel(invocation_id, reason)
            await asyncio.wait({task})
        record = await self.store_threads.run(self.store.get_invocation, invocation_id)
        if record.status == "succeeded":
            raise InvocationFinished(f"invocation {invocation_id!r} succeeded before it could be cancelled")
        return record

    async def revoke_key(self, key_id: str) -> ApiKeyRecord:
        """Delete a tenant's key and cancel its invocations in flight (streams, sync and async alike)."""
        record = await self.store_threads.run(revoke_key, self.store, key_id)
        cancelled = self.in_flight.revoke(key_id)
        if cancelled:
            log.info("revoked API key %s: cancelled %d invocation(s) in flight", key_id, cancelled)
        return record

    def _run_in_background(self, record: InvocationRecord) -> None:
        task = asyncio.create_task(self._run(record))
        self._background[record.invocation_id] = task
        task.add_done_callback(lambda _: self._background.pop(record.invocation_id, None))

    async def _run(self, record: InvocationRecord) -> None:
        ticket = self.in_flight.open(record.invocation_id, record.key_id)
        try:
            await self._run_ticket(record, ticket)
        finally:
            self.in_flight.close(ticket)

    async def _run_ticket(self, record: InvocationRecord, ticket: Ticket) -> None:
        running = msgspec.structs.replace(record, status="running", updated_at=time.time())
        await self.store_threads.run(self.store.put_invocation, running)
        try:
            spec = await self.store_threads.run(self.store.get_function, record.function)
            if (record.deployment and spec.uid != record.deployment) or spec.tenant != record.tenant:
                raise FunctionNotFound(f"function {record.function!r} was deleted before this invocation ran")
            finished = None
            async for event in self._metered(spec, to_generate(record.request, record.invocation_id), ticket):
                if isinstance(event, m.Finished):
                    finished = event
            if finished is None:
                raise ServerError("the instance ended the request without a result")
            done = msgspec.structs.replace(
                record, status="succeeded", result_text=finished.text, finish_reason=finished.finish_reason,
                prompt_tokens=finished.prompt_tokens, completion_tokens=finished.completion_tokens,
                updated_at=time.time(),
            )
        except LorafaasError as exc:
            cancelled = ticket.reason is not None and type(exc) is type(ticket.reason)
            done = _ended(record, "cancelled" if cancelled else "failed", exc, self.public_message(exc.message))
        except asyncio.CancelledError:  # the platform is stopping: the record stays running and resumes at restart
            raise
        except Exception as exc:  # an accepted invocation always ends: a bug fails it, with its reason
            log.exception("invocation %s of %s failed", record.invocation_id, record.function)
            done = msgspec.structs.replace(record, status="failed", error_code=ServerError.code,
                                           error_message=f"the invocation failed inside lorafaas "
                                                         f"({type(exc).__name__})", updated_at=time.time())
        await self.store_threads.run(self.store.put_invocation, done)

    def expire_invocations(self) -> int:
        return self.store.delete_expired_invocations(time.time())


async def within_wall_time(events: AsyncGenerator, spec: FunctionSpec) -> AsyncGenerator:
    """The events of one invocation until its function's `max_request_s` runs out, then InvocationTimedOut; the
    generation behind it is cancelled (the instance drops the request) either way."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + spec.max_request_s
    started = False
    try:
        while True:
            try:
                event = await asyncio.wait_for(anext(events), max(0.0, deadline - loop.time()))
            except StopAsyncIteration:
                return
            except TimeoutError:
                if started:
                    advice = "ask for fewer tokens or raise the limit"
                else:  # no token came: the request waited for an instance, or its prefill did not end in time
                    advice = "no token was generated in that time (the function was busy or its instance stalled)"
                raise InvocationTimedOut(
                    f"function {spec.name}: the request ran past its wall-time limit of {spec.max_request_s:g} s "
                    f"(max_request_s); {advice}"
                ) from None
            started = True
            yield event
    finally:
        await events.aclose()


def to_generate(request: InvocationRequest, request_id: str) -> m.Generate:
    params = m.SamplingParams(max_tokens=request.max_tokens, temperature=request.temperature, top_p=request.top_p,
                              stop=tuple(request.stop), seed=request.seed, top_k=request.top_k, min_p=request.min_p,
                              presence_penalty=request.presence_penalty, frequency_penalty=request.frequency_penalty,
                              repetition_penalty=request.repetition_penalty, logit_bias=dict(request.logit_bias),
                              logprobs=request.logprobs, ignore_eos=request.ignore_eos,
                              max_tokens_exact=request.max_tokens_exact,
                              json_schema=request.response_format.json_schema if request.response_format else None)
    if request.messages is not None:
        messages = tuple(m.ChatMessage(msg.role, msg.content, msg.tool_call_id,
                                       tuple(msg.tool_calls) if msg.tool_calls is not None else None, msg.name)
                         for msg in request.messages)
        return m.Generate(request_id=request_id, messages=messages, params=params, tools=request.tools)
    if request.prompt_token_ids is not None:
        return m.Generate(request_id=request_id, prompt_token_ids=tuple(request.prompt_token_ids), params=params)
    return m.Generate(request_id=request_id, prompt=request.prompt, params=params)


def _ended(record: InvocationRecord, status: InvocationStatus, exc: LorafaasError, message: str | None = None
           ) -> InvocationRecord:
    return msgspec.structs.replace(record, status=status, error_code=exc.code, error_message=message or exc.message,
                                   updated_at=time.time())


def _tenant_of(caller: ApiKeyRecord, requested: str | None) -> str:
    """The tenant a deploy is for: the caller's own; another one only with the admin key."""
    if requested is None or requested == caller.tenant:
        return caller.tenant
    if not caller.is_admin:
        raise Forbidden(f"the spec names tenant {requested!r}, but this key belongs to another tenant; a tenant's key "
                        "deploys for its own tenant only (leave 'tenant' out)")
    return requested


def _spec_values(fields: dict) -> dict:
    return {key: fields[key] for key in SPEC_FIELDS if fields.get(key) is not None}
