"""One builder of the `AdmissionView` for every executor.

The node agent and the simulator differ only in how they find a function's instances (`InstanceLoad`s) and the
devices where one could start (`StartOption`s); the rest of the description (B, whether start options are needed at
all, whether a running batch could take a request instead of a start, the executor's settings, the compute turns) is
worked out here, once, so a function in the same state is described alike by both.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass

from lorafaas.scheduler.admission import AdmissionView, InstanceLoad, StartOption, can_join, needs_start_options
from lorafaas.scheduler.messages import FunctionName


@dataclass(frozen=True)
class AdmissionSettings:
    """What an executor's admission is configured with, the same for every function it serves."""

    worker_capacity: int  # the most requests one worker batches
    adaptive: bool  # adaptive batching (off: B is a hard limit)
    requests_per_background_start: int  # SchedulerConfig.requests_per_background_start
    strict_compute: bool  # busy instances never exceed compute slots; functions take turns
    max_compute_wait_s: float  # SchedulerConfig.max_compute_wait_s


@dataclass(frozen=True)
class ComputeWait:
    """A function's place in the compute turns (`ComputeTurns.wait_of`)."""

    waiting_others: int = 0  # other functions waiting for a compute slot
    waiting_ahead: int = 0  # of those, how many began waiting before it (all, if it does not wait)
    waited_s: float = 0.0  # how long it has waited for a core


# Given whether a running batch could take a request instead of a start, or a start is under way (then a start's
# expected time matters),
# the devices where an instance could start, best first. Called only when the decision can depend on them.
StartOptions = Callable[[bool], Iterable[StartOption]]


def build_admission_view(function: FunctionName, queue_length: int, slo_ttft_s: float, slo_batch: int,
                         max_instances: int, instances: tuple[InstanceLoad, ...], steady: bool,
                         settings: AdmissionSettings, wait: ComputeWait, start_options: StartOptions,
                         recent_arrivals: int = 0) -> AdmissionView:
    """The function as the admission policy sees it. `start_options` is not called while a ready instance has room
    within B (`needs_start_options`): finding a device can cost the executor a view of the cluster."""
    options: tuple[StartOption, ...] = ()
    if needs_start_options(instances, slo_batch, settings.worker_capacity, steady, recent_arrivals):
        joinable = can_join(instances, slo_batch, settings.worker_capacity, settings.adaptive)
        options = tuple(start_options(joinable or any(not i.ready for i in instances)))
    return AdmissionView(
        function=function, queue_length=queue_length, slo_ttft_s=slo_ttft_s, slo_batch=slo_batch,
        worker_capacity=settings.worker_capacity, adaptive=settings.adaptive, max_instances=max_instances,
        instances=instances, start_options=options,
        requests_per_background_start=settings.requests_per_background_start,
        strict_compute=settings.strict_compute, compute_waiting_others=wait.waiting_others,
        compute_waiting_ahead=wait.waiting_ahead, compute_waited_s=wait.waited_s,
        max_compute_wait_s=settings.max_compute_wait_s, steady=steady, recent_arrivals=recent_arrivals,
    )
