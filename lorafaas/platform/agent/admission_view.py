"""The function as the admission policy sees it, from the agent's state: its instances' loads and the devices where
one could start, handed to the builder the simulator uses too (`lorafaas.scheduler.build_admission_view`)."""

from __future__ import annotations

from collections.abc import Callable

from lorafaas.platform.agent.config import AgentConfig
from lorafaas.platform.agent.instances import device_slots
from lorafaas.platform.devices import start_options
from lorafaas.platform.instance_table import Identity, InstanceTable
from lorafaas.platform.state.records import FunctionSpec
from lorafaas.scheduler import (
    AdmissionSettings,
    AdmissionView,
    ComputeTurns,
    FunctionName,
    InstanceId,
    InstanceLoad,
    Scheduler,
    StartOption,
    build_admission_view,
    worth_offering,
)


def admission_settings(config: AgentConfig) -> AdmissionSettings:
    return AdmissionSettings(
        worker_capacity=config.max_batch_size, adaptive=config.scheduler.adaptive_batching,
        requests_per_background_start=config.scheduler.requests_per_background_start,
        strict_compute=config.strict_compute, max_compute_wait_s=config.scheduler.max_compute_wait_s)


def admission_view_of(config: AgentConfig, table: InstanceTable, scheduler: Scheduler, turns: ComputeTurns,
                      spec: FunctionSpec, queue_length: int, current: bool, start_order: Callable[[], list[str]],
                      last_scale_out_s: float | None, now: float) -> AdmissionView:
    """The instances of exactly this spec's identity and, for the current spec only (`current`), the devices where
    one could start (each with its own busy count), best first as `start_order` ranks them (asked only when the
    decision can depend on it: with several devices it builds a view of the node)."""
    identity, name = Identity.of(spec), FunctionName(spec.name)
    slots = device_slots(config)
    instances = [i for i in table.of_identity(identity)
                 if i.state == "starting" or (i.serving and i.state in ("ready", "draining"))]
    busy = {d: table.busy_on_device(d) for d in config.device_names}
    wait = turns.wait_of(identity, now)
    shared = {i.device for i in table.all()
              if i.function != spec.name and i.state in ("starting", "ready", "draining")}
    loads = tuple(InstanceLoad(InstanceId(i.instance_id), i.state != "starting", i.in_flight, i.started_s,
                               busy.get(i.device, 0) < slots, i.device in shared) for i in instances)
    max_instances = spec.max_instances if current else len(loads)  # nothing starts for a superseded version
    slo_s = spec.slo_ttft_ms / 1e3

    def options(joinable: bool) -> tuple[StartOption, ...]:
        if not any(worth_offering(len(loads), max_instances, n, slots) for n in busy.values()):
            return ()
        return start_options(start_order(), busy, slots, len(loads), max_instances,
                             last_scale_out_s if joinable else None)

    return build_admission_view(name, queue_length, slo_s, scheduler.batch_policy(name, slo_s).max_batch_size,
                                max_instances, loads, scheduler.steady(name), admission_settings(config), wait,
                                options, scheduler.recent_arrivals(name, now))
