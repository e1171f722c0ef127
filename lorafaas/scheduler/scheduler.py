"""`Scheduler`: the one object a node agent (or the simulator) drives; it owns the policies' learned state.

    observe_arrival / observe_prefill / observe_idle   feed what happened (times from the caller's clock)
    plan(view, now_s) -> Plan                          periodic: pre-load and offload actions
    should_replan(now_s)                               an arrival rate moved beyond tolerance since the last plan
    decide_batch(...)                                  one function's fill-or-expire decision, on each arrival
    make_room(view, device, needed_bytes)              offloading for an arriving batch
    place(function, view)                              which instance or device a request or instance goes to
    keep_alive(function)                               pre-warm and keep-alive windows after an invocation
    next_idle_retirement_s(function, idle_since, ...)  when a function idle as a whole retires its next instance
    steady(function)                                   its arrivals are steady: on a shared device, a spare instance

The agent's loop: `plan = scheduler.plan(view, now_s)`, apply `plan.preloads` (and `plan.offloads`) in order, then
feed what it observed; each queued request goes where `admission.decide_admission` says. Nothing here performs
I/O or reads a clock.
"""

from __future__ import annotations

import random

from lorafaas.scheduler.batching import BatchDecision, BatchPolicy
from lorafaas.scheduler.config import SchedulerConfig
from lorafaas.scheduler.keepalive import KeepAliveDecision, KeepAlivePolicy
from lorafaas.scheduler.messages import ClusterView, DeviceId, FunctionName, Plan
from lorafaas.scheduler.offload import OffloadDecision, plan_offload
from lorafaas.scheduler.placement import PlacementDecision, PlacementPolicy
from lorafaas.scheduler.preload import PreloadPlanner
from lorafaas.scheduler.rates import RateTracker


class Scheduler:
    def __init__(self, config: SchedulerConfig | None = None, rng: random.Random | None = None) -> None:
        self.config = config or SchedulerConfig()
        self.rates = RateTracker(self.config)
        self.preloader = PreloadPlanner(self.config)
        self.placement = PlacementPolicy(self.config, rng if rng is not None else random.Random(0))
        self.keep_alives = KeepAlivePolicy(self.config)
        self._batching: dict[FunctionName, BatchPolicy] = {}

    # -- observations ------------------------------------------------------------------------------------------

    def observe_arrival(self, function: FunctionName, now_s: float, count: int = 1) -> None:
        self.rates.observe_arrival(function, now_s, count)

    def observe_prefill(self, function: FunctionName, slo_ttft_s: float, batch_size: int, prefill_s: float) -> None:
        self.batch_policy(function, slo_ttft_s).observe(batch_size, prefill_s)

    def observe_idle(self, function: FunctionName, idle_s: float) -> None:
        self.keep_alives.observe_idle(function, idle_s)

    def forget(self, function: FunctionName) -> None:
        """A deleted function: drop what was learned about it."""
        self.rates.forget(function)
        self.keep_alives.forget(function)
        self._batching.pop(function, None)

    # -- decisions ---------------------------------------------------------------------------------------------

    def plan(self, view: ClusterView, now_s: float) -> Plan:
        """Pre-load actions from `view.resident` to the knapsack's target (rates: the online estimates where a
        function has had arrivals, the profile's otherwise)."""
        rated = self.rated(view, now_s)
        preload = self.preloader.plan(rated, now_s)
        self.rates.mark_planned(now_s)
        return Plan(offloads=preload.offloads, preloads=preload.preloads, target=preload.target)

    def rated(self, view: ClusterView, now_s: float) -> ClusterView:
        """`view` with the online rate estimates, as `plan` plans it: its first step. The rest (`preloader.plan`,
        pure and stateless, then `rates.mark_planned`) a caller may run apart, e.g. the knapsack in a thread."""
        return self.rates.apply(view, now_s)

    def should_replan(self, now_s: float) -> bool:
        return self.rates.changed_since_plan(now_s)

    def batch_policy(self, function: FunctionName, slo_ttft_s: float) -> BatchPolicy:
        """The function's policy; a changed SLO keeps the fitted prefill model."""
        policy = self._batching.get(function)
        if policy is None or policy.slo_ttft_s != slo_ttft_s:
            policy = BatchPolicy(self.config, slo_ttft_s, policy.model if policy is not None else None)
            self._batching[function] = policy
        return policy

    def decide_batch(self, function: FunctionName, slo_ttft_s: float, queue_len: int, oldest_wait_s: float,
                     now_s: float) -> BatchDecision:
        return self.batch_policy(function, slo_ttft_s).decide(queue_len, oldest_wait_s, now_s)

    def make_room(self, view: ClusterView, device: DeviceId, needed_bytes: int) -> OffloadDecision:
        return plan_offload(view, device, needed_bytes, self.config)

    def place(self, function: FunctionName, view: ClusterView) -> PlacementDecision | None:
        return self.placement.place(function, view)

    def keep_alive(self, function: FunctionName) -> KeepAliveDecision:
        return self.keep_alives.decide(function)

    def next_idle_retirement_s(self, function: FunctionName, idle_since_s: float, last_retired_s: float | None
                               ) -> float | None:
        """None for a steady function: its next arrival is due within about one mean gap (`RateTracker.steady`);
        and for one whose gaps vary less than `idle_retire_min_cv` (`RateTracker.gap_variation`; 0 by default, so
        on/off traffic's pauses retire stepwise too: kept to the window they cost more than the next stretch's
        starts). With fewer gaps known the step applies."""
        if self.rates.steady(function):
            return None
        variation = self.rates.gap_variation(function)
        if variation is not None and variation < self.config.idle_retire_min_cv:
            return None
        return self.keep_alives.next_idle_retirement_s(function, idle_since_s, last_retired_s)

    def steady(self, function: FunctionName) -> bool:
        return self.rates.steady(function)

    def recent_arrivals(self, function: FunctionName, now_s: float) -> int:
        return self.rates.recent_arrivals(function, now_s)
