"""What one invocation costs its function, measured live as the simulator charges it (`replay/sim/state.py`).

The simulator bills device memory over time: the bytes of functions running a batch at the active rate, everything
else resident (kept-alive instances, pre-loaded artifacts) at the idle rate. Live, each invocation is charged:

    device_s            its share of its device while it ran: the device's busy time divided equally among the
                        requests running on it at each moment (processor sharing), from dispatch to its last event;
                        the sum over all invocations is the device's busy time, never more than its wall time
    memory_active_gb_s  (the backbone copy + its adapter) x device_s: the bytes it ran with, for its share
    memory_idle_gb_s    its pre-loaded artifacts while kept alive: the idle time of its instance before the
                        invocation (since the instance's last request ended or it became ready) x the adapter and
                        the instance's share of the backbone copy (divided among the instances bound to it)

The idle time after an instance's last invocation, until it stops (keep-alive expired, drained, shutdown), is charged
to its function when it stops, as a usage record of kind `keep_alive` (NodeAgent.on_keep_alive).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from lorafaas.platform.instance_table import Instance, InstanceTable

GB = 1e9


class DeviceShareClock:
    """The integral of 1 / (requests running on the device) over its busy time: a request's device share is the
    difference of the integral between its dispatch and its end."""

    def __init__(self, clock: Callable[[], float]) -> None:
        self.clock = clock
        self.num_running = 0
        self.share_s = 0.0
        self.at_s = clock()

    def _advance(self) -> float:
        now = self.clock()
        if self.num_running:
            self.share_s += (now - self.at_s) / self.num_running
        self.at_s = now
        return self.share_s

    def enter(self) -> float:
        """A request starts running; returns the mark its `leave` takes."""
        mark = self._advance()
        self.num_running += 1
        return mark

    def leave(self, mark: float) -> float:
        """The request that entered at `mark` is done; returns its device-seconds."""
        share = self._advance() - mark
        self.num_running -= 1
        return share


@dataclass
class UsageMeter:
    """One invocation as the node agent saw it, filled in by `NodeAgent.invoke`: complete when it yields `Finished`,
    or, for a request that ends otherwise (its client left, its wall time ran out), once its generator is closed."""

    arrived_s: float = 0.0  # agent clock
    dispatched_s: float | None = None
    first_event_s: float | None = None
    finished_s: float | None = None
    instance_id: str = ""
    cold_start: str = "warm"  # or the kind of the start the invocation waited for (libraries_preloaded, ...)
    cold_start_s: dict[str, float] = field(default_factory=dict)  # that start's stages (spawn, backbone, ...)
    device_s: float = 0.0
    active_bytes: int = 0
    keep_alive_s: float = 0.0
    idle_bytes: float = 0.0
    prompt_tokens: int = 0  # from the first token, then from Finished
    completion_tokens: int = 0  # the tokens that reached the node agent; Finished's count once it came

    @property
    def queue_s(self) -> float:
        return max(0.0, (self.dispatched_s or self.arrived_s) - self.arrived_s)

    @property
    def ttft_s(self) -> float:
        return max(0.0, (self.first_event_s or self.arrived_s) - self.arrived_s)

    @property
    def e2e_s(self) -> float:
        return max(0.0, (self.finished_s or self.arrived_s) - self.arrived_s)

    @property
    def memory_active_gb_s(self) -> float:
        return self.active_bytes * self.device_s / GB

    @property
    def memory_idle_gb_s(self) -> float:
        return self.idle_bytes * self.keep_alive_s / GB


    def charge_dispatch(self, table: InstanceTable, instance: Instance, dispatched_s: float) -> None:
        """What a request dispatched to `instance` is charged besides its device share."""
        self.dispatched_s, self.instance_id = dispatched_s, instance.instance_id
        # it became ready after the request arrived: the request waited for its start (an adopted one ran already)
        if instance.ready_s >= self.arrived_s and instance.start_kind != "adopted":
            self.cold_start, self.cold_start_s = instance.start_kind, dict(instance.cold_start)
        self.active_bytes = instance.backbone_bytes + adapter_bytes(instance)
        if instance.in_flight == 1:  # it was idle until this request: the keep-alive since is charged to it
            self.keep_alive_s += idle_s(instance, dispatched_s)
            self.idle_bytes = idle_bytes(table, instance)


def adapter_bytes(instance: Instance) -> int:
    return instance.adapter.held_bytes if instance.adapter is not None else 0


def idle_s(instance: Instance, now_s: float) -> float:
    """How long the instance has been idle: since its last request ended or it became ready."""
    return max(0.0, now_s - max(instance.last_used_s, instance.ready_s))


def idle_bytes(table: InstanceTable, instance: Instance) -> float:
    """What an idle instance keeps loaded for its function: its adapter and its share of the backbone copy (divided
    among the instances bound to it)."""
    bound = sum(1 for i in table.all() if i.backbone == instance.backbone and i.device == instance.device
                and i.state in ("ready", "draining", "hung"))
    return adapter_bytes(instance) + instance.backbone_bytes / max(1, bound)
