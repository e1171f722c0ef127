"""Usage a tenant can bill: one `UsageRecord` per invocation that ran (finished, abandoned by its client or past its
wall time), with what it produced, written to the state store and as a one-line
`REPORT` in the function's log (as AWS Lambda prints), and summed per function or tenant for `GET /v1/usage`.

Recording never fails or slows an invocation: it happens in a worker thread after the last event, and a failure is
logged and counted (`lorafaas_usage_record_failures` in /metrics), never raised.
"""

from __future__ import annotations

import asyncio
import logging
import math
import threading
import time
from collections.abc import Iterable
from datetime import UTC, datetime
from pathlib import Path

from lorafaas.errors import InvalidInput
from lorafaas.platform.backends.local import deployment_log_dir
from lorafaas.platform.instance_table import Instance
from lorafaas.platform.metering import GB, UsageMeter
from lorafaas.platform.state.interface import StateStore
from lorafaas.platform.state.records import FunctionSpec, UsageRecord

log = logging.getLogger(__name__)
GROUP_BYS = ("function", "tenant")
TimeBound = str | float | datetime | None  # as the gateway parsed it, or as typed
SUMMED = ("prompt_tokens", "completion_tokens", "device_s", "memory_active_gb_s", "memory_idle_gb_s",
          "keep_alive_s", "queue_s", "e2e_s")


class UsageRecorder:
    def __init__(self, store: StateStore, log_dir: Path | None) -> None:
        self.store = store
        self.log_dir = log_dir  # where instances log (local backend); None: no REPORT lines
        self.num_failures = 0  # records that could not be stored (read by /metrics from another thread)
        self._failures_lock = threading.Lock()
        self._tasks: set[asyncio.Task] = set()

    def record(self, spec: FunctionSpec, invocation_id: str, meter: UsageMeter, charge_prompt: bool = True) -> None:
        """Store the invocation's usage in the background; returns at once."""
        self._spawn(usage_record(spec, invocation_id, meter, time.time(), charge_prompt), report=True)

    def record_keep_alive(self, instance: Instance, idle_s: float, idle_bytes: float) -> None:
        """An idle instance stops: its last keep-alive is charged to its function (NodeAgent.on_keep_alive)."""
        identity = instance.identity
        if not idle_s or not identity.uid:
            return
        record = UsageRecord(invocation_id=f"keep-alive-{instance.instance_id}", kind="keep_alive",
                             tenant=identity.tenant, function=identity.function, deployment=identity.uid,
                             instance_id=instance.instance_id, finished_at=time.time(),
                             memory_idle_gb_s=idle_bytes * idle_s / GB, keep_alive_s=idle_s)
        self._spawn(record, report=False)

    def _spawn(self, record: UsageRecord, report: bool) -> None:
        task = asyncio.create_task(asyncio.to_thread(self._write, record, report))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def flush(self) -> None:
        """Wait for the records being written (at shutdown)."""
        if self._tasks:
            await asyncio.gather(*list(self._tasks), return_exceptions=True)

    def _write(self, record: UsageRecord, report: bool) -> None:
        try:
            self.store.put_usage(record)
        except Exception as exc:  # whatever the store raised: billing data lost is reported, the invocation stands
            with self._failures_lock:
                self.num_failures += 1
            log.warning("%s: the usage of invocation %s was not recorded: %s", record.function, record.invocation_id,
                        getattr(exc, "message", repr(exc)))
        if report and self.log_dir is not None and record.instance_id:
            try:
                directory = deployment_log_dir(self.log_dir, record.deployment)
                if directory.is_dir():  # never re-create the logs of a deleted function
                    with (directory / f"{record.instance_id}.log").open("a", encoding="utf-8") as f:
                        f.write(report_line(record) + "\n")
            except (OSError, ValueError) as exc:
                log.warning("%s: no REPORT line for invocation %s: %s", record.function, record.invocation_id, exc)


def usage_record(spec: FunctionSpec, invocation_id: str, meter: UsageMeter, now: float,
                 charge_prompt: bool = True) -> UsageRecord:
    """`charge_prompt` False: another invocation of the same request (sample 0 of `n`) is charged the prompt."""
    return UsageRecord(
        invocation_id=invocation_id, tenant=spec.tenant, function=spec.name, deployment=spec.uid,
        instance_id=meter.instance_id, finished_at=now, prompt_tokens=meter.prompt_tokens if charge_prompt else 0,
        completion_tokens=meter.completion_tokens, queue_s=meter.queue_s, ttft_s=meter.ttft_s, e2e_s=meter.e2e_s,
        cold_start=meter.cold_start, cold_start_s=dict(meter.cold_start_s), device_s=meter.device_s,
        memory_active_gb_s=meter.memory_active_gb_s, memory_idle_gb_s=meter.memory_idle_gb_s,
        keep_alive_s=meter.keep_alive_s,
    )


def report_line(r: UsageRecord) -> str:
    """`REPORT RequestId: ... Duration: ... ms ...`, two spaces between fields (tabs in AWS Lambda)."""
    cold = r.cold_start
    if r.cold_start_s:
        stages = ", ".join(f"{stage} {seconds * 1e3:.0f} ms" for stage, seconds in r.cold_start_s.items())
        cold = f"{cold} ({stages})"
    return (f"REPORT RequestId: {r.invocation_id}  Duration: {r.e2e_s * 1e3:.2f} ms  "
            f"Queue: {r.queue_s * 1e3:.2f} ms  TTFT: {r.ttft_s * 1e3:.2f} ms  Prompt tokens: {r.prompt_tokens}  "
            f"Completion tokens: {r.completion_tokens}  Cold start: {cold}  Device-seconds: {r.device_s:.6f}  "
            f"Memory: {r.memory_gb_s:.6f} GB-s")


def parse_time(field: str, value: TimeBound) -> float | None:
    """A bound given as unix seconds or ISO 8601 (a time without a zone is UTC); InvalidInput naming the field."""
    if value is None or value == "":
        return None
    if isinstance(value, datetime):
        return (value if value.tzinfo else value.replace(tzinfo=UTC)).timestamp()
    try:
        seconds = float(value)
    except ValueError:
        try:
            moment = datetime.fromisoformat(str(value))  # (a str: float() takes any number)
        except ValueError:
            raise InvalidInput(f"{field} is {value!r}; give unix seconds (1732435200) or ISO 8601 "
                               "(2026-11-24T07:00:00Z)") from None
        if moment.tzinfo is None:
            moment = moment.replace(tzinfo=UTC)
        return moment.timestamp()
    if not math.isfinite(seconds):
        raise InvalidInput(f"{field} is {value!r}; unix seconds must be a finite number")
    return seconds


def summarize(records: Iterable[UsageRecord], group_by: str) -> dict:
    """Totals per function (with its tenant) or per tenant, and over all."""
    if group_by not in GROUP_BYS:
        raise InvalidInput(f"group_by is {group_by!r}; expected one of {', '.join(GROUP_BYS)}")
    groups: dict[tuple[str, ...], dict] = {}
    total = _empty()
    for r in records:
        key = (r.tenant, r.function) if group_by == "function" else (r.tenant,)
        group = groups.get(key)
        if group is None:
            group = groups[key] = {"tenant": r.tenant, **({"function": r.function} if group_by == "function" else {}),
                                   **_empty()}
        for target in (group, total):
            _add(target, r)
    return {"group_by": group_by, "groups": [_rounded(groups[k]) for k in sorted(groups)], "total": _rounded(total)}


def _empty() -> dict:
    return {"invocations": 0, "cold_starts": 0, **dict.fromkeys(SUMMED, 0), "memory_gb_s": 0.0}


def _add(target: dict, r: UsageRecord) -> None:
    if r.kind == "invocation":
        target["invocations"] += 1
        target["cold_starts"] += r.cold_start != "warm"
    for name in SUMMED:
        target[name] += getattr(r, name)
    target["memory_gb_s"] += r.memory_gb_s


def _rounded(totals: dict) -> dict:
    return {k: round(v, 9) if isinstance(v, float) else v for k, v in totals.items()}
