"""The function as the admission policy sees it: one builder of the `AdmissionView` from the agent's state."""

from __future__ import annotations

from lorafaas.platform.agent.config import AgentConfig
from lorafaas.platform.agent.instances import device_slots
from lorafaas.platform.devices import start_options
from lorafaas.platform.instance_table import Identity, InstanceTable
from lorafaas.platform.state.records import FunctionSpec
from lorafaas.scheduler import (
    AdmissionView,
    ComputeTurns,
    FunctionName,
    InstanceId,
    InstanceLoad,
    Scheduler,
    can_join,
    needs_start_options,
    worth_offering,
)


def build_admission_view(config: AgentConfig, table: InstanceTable, scheduler: Scheduler, turns: ComputeTurns,
                         spec: FunctionSpec, queue_length: int, current: bool, start_order: list[str],
                         last_scale_out_s: float | None, now: float) -> AdmissionView:
    """The instances of exactly this spec's identity and, for the current spec only (`current`), the devices where
    one could start (each with its own busy count), best first as `start_order` ranks them."""
    identity, name = Identity.of(spec), FunctionName(spec.name)
    slots = device_slots(config)
    instances = [i for i in table.of_identity(identity)
                 if i.state == "starting" or (i.serving and i.state in ("ready", "draining"))]
    busy = {d: table.busy_on_device(d) for d in config.device_names}
    waiting_others, waiting_ahead = turns.counts(identity, now)
    shared = {i.device for i in table.all()
              if i.function != spec.name and i.state in ("starting", "ready", "draining")}
    loads = tuple(InstanceLoad(InstanceId(i.instance_id), i.state != "starting", i.in_flight, i.started_s,
                               busy.get(i.device, 0) < slots, i.device in shared) for i in instances)
    steady = scheduler.steady(name)
    max_instances = spec.max_instances if current else len(loads)  # nothing starts for a superseded version
    slo_s = spec.slo_ttft_ms / 1e3
    slo_batch = scheduler.batch_policy(name, slo_s).max_batch_size
    adaptive = config.scheduler.adaptive_batching
    options: tuple = ()
    if (needs_start_options(loads, slo_batch, config.max_batch_size, steady)
            and any(worth_offering(len(loads), max_instances, n, slots) for n in busy.values())):
        joinable = can_join(loads, slo_batch, config.max_batch_size, adaptive)
        options = start_options(start_order, busy, slots, len(loads), max_instances,
                                last_scale_out_s if joinable else None)
    return AdmissionView(
        function=name, queue_length=queue_length, slo_ttft_s=slo_s, slo_batch=slo_batch,
        worker_capacity=config.max_batch_size, adaptive=adaptive, max_instances=max_instances,
        instances=loads, start_options=options,
        requests_per_background_start=config.scheduler.requests_per_background_start,
        strict_compute=config.strict_compute, compute_waiting_others=waiting_others,
        compute_waiting_ahead=waiting_ahead, compute_waited_s=turns.waited_s(identity, now),
        max_compute_wait_s=config.scheduler.max_compute_wait_s, steady=steady,
    )
