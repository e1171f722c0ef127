"""The node agent's instances: one table, explicit states, every transition in one place.

    starting ──> ready ──> draining ──> stopping ──> stopped
       │           │          │   ^         ^
       │           ├──> hung ─┼───┼─────────┤
       └───────────┴──────────┴───┴──> crashed

- starting: being spawned and staged; counted against `max_instances` at once.
- ready: serves requests of exactly its identity (tenant, function, deployment uid, version, adapter digest).
- draining: its function was deleted, redeployed or updated to another adapter: nothing new starts for it and only
  requests accepted for its own identity before the change may still go to it; it stops when it holds none.
- hung: it holds requests but made no progress (its worker answered no heartbeat) within the liveness bound: its
  requests fail or are retried elsewhere, and it is killed.
- stopping -> stopped: asked to exit (keep-alive, drain, shutdown); crashed: its process went away unasked.

An instance in stopped or crashed has left the table. The table is owned by the node agent's event loop: callers
mutate it only through `transition`, between awaits, so no locks are needed.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass, field
from typing import Literal

from lorafaas.function_runtime.client import WorkerClient
from lorafaas.function_runtime.messages import AdapterStats
from lorafaas.platform.backends.base import InstanceRef
from lorafaas.platform.descriptions import InstanceView
from lorafaas.platform.state.records import FunctionSpec

log = logging.getLogger(__name__)

InstanceState = Literal["starting", "ready", "draining", "hung", "stopping", "stopped", "crashed"]
INSTANCE_STATES: tuple[InstanceState, ...] = ("starting", "ready", "draining", "hung", "stopping", "stopped",
                                              "crashed")
TRANSITIONS: dict[str, frozenset[str]] = {
    "starting": frozenset({"ready", "draining", "stopping", "crashed"}),
    "ready": frozenset({"draining", "hung", "stopping", "crashed"}),
    "draining": frozenset({"hung", "stopping", "crashed"}),
    "hung": frozenset({"stopping", "crashed"}),
    "stopping": frozenset({"stopped", "crashed"}),
    "stopped": frozenset(),
    "crashed": frozenset(),
}
LIVE_STATES = frozenset({"starting", "ready", "draining", "hung", "stopping"})


class InvalidTransition(RuntimeError):
    """A bug: a transition the lifecycle does not have (e.g. stopping an instance twice)."""


@dataclass(frozen=True)
class Identity:
    """What an instance serves; a request goes only to an instance whose identity equals its own."""

    tenant: str
    function: str
    uid: str  # the deployment: a redeploy under the same name has another
    version: int
    adapter_digest: str

    @classmethod
    def of(cls, spec: FunctionSpec) -> Identity:
        return cls(spec.tenant, spec.name, spec.uid, spec.version, spec.adapter_digest)

    def describe(self) -> dict:
        return {"tenant": self.tenant, "deployment": self.uid, "version": self.version,
                "adapter_digest": self.adapter_digest}


@dataclass(eq=False)
class Instance:
    instance_id: str
    identity: Identity
    device: str
    backbone: str = ""
    state: InstanceState = "starting"
    handle: InstanceRef | None = None
    client: WorkerClient | None = None
    in_flight: int = 0
    started_at: float = field(default_factory=time.time)
    started_s: float = 0.0  # agent clock, for tie-breaks
    last_used_s: float = 0.0  # agent clock
    last_progress_s: float = 0.0  # agent clock: the last token, heartbeat or dispatch while it held requests
    num_steps: int = -1  # the worker's engine steps at the last heartbeat (-1: none yet)
    cold_start: dict[str, float] = field(default_factory=dict)  # seconds per step of the start that made it
    start_kind: str = ""  # why it was started (libraries_preloaded, scale_out, prewarm, redeploy) or adopted
    ready_s: float = 0.0  # agent clock: when its start finished (a request that arrived before waited for it)
    backbone_bytes: int = 0  # the backbone copy it is bound to (shared with the instances on that backbone)
    loaded: set[str] = field(default_factory=set)  # artifact kinds loaded in it
    adapter: AdapterStats | None = None  # the adapter it loaded at start (kind, LoRA mode, bytes held)
    reason: str = ""  # why it is in its state (draining, hung, crashed)
    staged: bool = False  # its start finished (until then only the start may stop it)
    hung: str = ""  # why it was declared hung (its requests' errors say so after it is gone)
    abort: str = ""  # why its start was stopped (its deployment went, or it ran past the start budget)
    aborted: asyncio.Event = field(default_factory=asyncio.Event)  # set with `abort`
    launching: asyncio.Event = field(default_factory=asyncio.Event)  # its process is being spawned
    ready_event: asyncio.Event = field(default_factory=asyncio.Event)

    @property
    def function(self) -> str:
        return self.identity.function

    @property
    def version(self) -> int:
        return self.identity.version

    @property
    def pid(self) -> int | None:
        return self.handle.pid if self.handle else None

    @property
    def serving(self) -> bool:
        """May take requests of its identity: ready, or draining what was accepted for it."""
        return self.state in ("ready", "draining") and self.client is not None and self.client.connected

    def describe(self) -> InstanceView:
        return InstanceView(instance_id=self.instance_id, pid=self.pid, device=self.device, state=self.state,
                            version=self.version, deployment=self.identity.uid, in_flight=self.in_flight,
                            started_at=self.started_at, loaded=sorted(self.loaded), cold_start=dict(self.cold_start),
                            adapter=self.adapter, shared_base=self.in_shared_base, reason=self.reason)

    @property
    def in_shared_base(self) -> bool:
        """Started as a member of its daemon's shared base pass (the step gate decides each step)."""
        return self.handle is not None and bool(self.handle.spec.base_pass)


class InstanceTable:
    def __init__(self) -> None:
        self._instances: list[Instance] = []
        # function -> its instances: a fleet's thousand functions are looked up each tick, never scanned
        self._by_function: dict[str, list[Instance]] = {}
        # device -> the most instances ever busy on it at once (running a request or starting): the scheduling
        # issue's check that a device never runs more busy instances than it has compute for
        self.busy_peak: dict[str, int] = {}

    def add(self, instance: Instance) -> Instance:
        if instance.state != "starting":
            raise InvalidTransition(f"an instance enters the table starting, not {instance.state}")
        self._instances.append(instance)
        self._by_function.setdefault(instance.function, []).append(instance)
        self.record_busy(instance.device)
        return instance

    def record_busy(self, device: str) -> None:
        busy = self.busy_on_device(device)
        if busy > self.busy_peak.get(device, 0):
            self.busy_peak[device] = busy

    def transition(self, instance: Instance, state: InstanceState, reason: str = "") -> bool:
        """Move `instance` to `state`; False (and nothing changes) when it is already there or past it in a way
        that makes the move moot (e.g. crashed while being stopped). Raises InvalidTransition for a move the
        lifecycle does not have."""
        if instance.state == state or instance.state in ("stopped", "crashed"):
            return False
        if state not in TRANSITIONS[instance.state]:
            raise InvalidTransition(f"instance {instance.instance_id} of {instance.function}: "
                                    f"{instance.state} -> {state}")
        log.info("%s: instance %s %s -> %s%s", instance.function, instance.instance_id, instance.state, state,
                 f" ({reason})" if reason else "")
        instance.state = state
        if reason:
            instance.reason = reason
        if state in ("stopped", "crashed"):
            self._instances.remove(instance)
            same_function = self._by_function[instance.function]
            same_function.remove(instance)
            if not same_function:
                del self._by_function[instance.function]
        if state != "starting":
            instance.ready_event.set()  # whoever awaits a start learns how it ended
        return True

    # -- queries ---------------------------------------------------------------------------------------------------

    def all(self) -> list[Instance]:
        return list(self._instances)

    def of_function(self, name: str) -> list[Instance]:
        return list(self._by_function.get(name, ()))

    def of_identity(self, identity: Identity, states: frozenset[str] | None = None) -> list[Instance]:
        return [i for i in self._by_function.get(identity.function, ())
                if i.identity == identity and (states is None or i.state in states)]

    def current(self, spec: FunctionSpec) -> list[Instance]:
        """Instances starting or ready for exactly this spec: those `max_instances` and keep-alive count."""
        return self.of_identity(Identity.of(spec), frozenset({"starting", "ready"}))

    def busy_on_device(self, device: str) -> int:
        """Instances on `device` running a request or starting (of every function)."""
        return sum(1 for i in self._instances if i.device == device
                   and (i.state == "starting" or (i.in_flight and i.state in ("ready", "draining"))))

    def count_by_state(self) -> dict[tuple[str, str], int]:
        counts: dict[tuple[str, str], int] = {}
        for instance in list(self._instances):  # a copy: /metrics reads it from another thread
            key = (instance.function, instance.state)
            counts[key] = counts.get(key, 0) + 1
        return counts

    def relabel(self, old: Identity, new: Identity) -> int:
        """A settings-only update (same deployment and adapter): the running instances serve the new version as
        they are. Returns how many were relabelled."""
        if (old.tenant, old.function, old.uid, old.adapter_digest) != (
                new.tenant, new.function, new.uid, new.adapter_digest):
            raise InvalidTransition(f"{old} -> {new} changes what an instance serves; it is a roll, not a relabel")
        moved = self.of_identity(old, frozenset({"starting", "ready"}))
        for instance in moved:
            instance.identity = new
        return len(moved)
