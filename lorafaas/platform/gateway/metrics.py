"""Prometheus metrics: counters and histograms updated per request, gauges read from the node agent at scrape time.

Per function the series are bounded, so a fleet of a thousand functions scrapes in well under 2 MB (docs/platform.md,
"Metrics at a thousand functions"): invocations by status, TTFT and TPOT as summaries (`_sum` and `_count`: the
mean), cold starts by kind, instances by the live states they are in, and failures by reason: 8 series for a function
invoked and warm, about 20 at most. The latency distributions are histograms over the whole fleet
(`lorafaas_fleet_*`): a histogram per function would be 26 series each. No `_created` series (prometheus_client's,
one per counter and summary).
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Callable

from prometheus_client import CollectorRegistry, Counter, Histogram, Summary, disable_created_metrics
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, SummaryMetricFamily

from lorafaas.function_runtime.memory import read_memory
from lorafaas.platform.agent import NodeAgent
from lorafaas.platform.instance_table import INSTANCE_STATES
from lorafaas.platform.usage import UsageRecorder
from lorafaas.scheduler import PassChoice

LIVE_STATES = [s for s in INSTANCE_STATES if s not in ("stopped", "crashed")]

LATENCY_BUCKETS_S = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)
TPOT_BUCKETS_S = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1)
MAX_PSS_READS_PER_SCRAPE = 4
PSS_MAX_AGE_S = 10.0


class GatewayMetrics:
    def __init__(self, agent: NodeAgent, usage: UsageRecorder | None = None) -> None:
        disable_created_metrics()  # prometheus_client's switch is process-wide: the gateway's process is ours
        self.registry = CollectorRegistry()
        self.invocations = Counter("lorafaas_invocations", "Invocations by function and outcome",
                                   ["function", "status"], registry=self.registry)
        self.ttft = Summary("lorafaas_ttft_seconds", "Time to first token seen by the gateway", ["function"],
                            registry=self.registry)
        self.tpot = Summary("lorafaas_tpot_seconds", "Time per output token after the first", ["function"],
                            registry=self.registry)
        self.fleet_ttft = Histogram("lorafaas_fleet_ttft_seconds", "Time to first token seen by the gateway, every "
                                    "function's", buckets=LATENCY_BUCKETS_S, registry=self.registry)
        self.fleet_tpot = Histogram("lorafaas_fleet_tpot_seconds", "Time per output token after the first, every "
                                    "function's", buckets=TPOT_BUCKETS_S, registry=self.registry)
        self.registry.register(_AgentCollector(agent))
        if usage is not None:
            self.registry.register(UsageCollector(usage))

    def forget(self, function: str) -> None:
        """A deleted function's series go with it: a namesake deployed later (maybe another tenant's) starts at 0."""
        statuses = {sample.labels["status"] for family in self.invocations.collect() for sample in family.samples
                    if sample.labels.get("function") == function}
        for status in statuses:
            self.invocations.remove(function, status)
        for histogram in (self.ttft, self.tpot):
            with contextlib.suppress(KeyError):
                histogram.remove(function)

    def observe(self, function: str, status: str, ttft_s: float | None = None, e2e_s: float | None = None,
                completion_tokens: int = 0) -> None:
        self.invocations.labels(function, status).inc()
        if ttft_s is not None:
            self.ttft.labels(function).observe(ttft_s)
            self.fleet_ttft.observe(ttft_s)
            if e2e_s is not None and completion_tokens > 1:
                tpot_s = (e2e_s - ttft_s) / (completion_tokens - 1)
                self.tpot.labels(function).observe(tpot_s)
                self.fleet_tpot.observe(tpot_s)


class InstancePss:
    """The instances' PSS, each read again at most every `max_age_s`: reading one (/proc/PID/smaps_rollup walks its
    mappings, the backbone's included) takes about 10 ms, so a scrape reads at most `max_reads_per_scrape`, those read
    longest ago, and takes the others' last figure: a thousand warm instances scrape in milliseconds, not seconds.
    An instance not read yet counts from its first read."""

    def __init__(self, max_reads_per_scrape: int = MAX_PSS_READS_PER_SCRAPE, max_age_s: float = PSS_MAX_AGE_S,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.max_reads_per_scrape = max_reads_per_scrape
        self.max_age_s = max_age_s
        self.clock = clock
        self._lock = threading.Lock()  # scrapes render in worker threads, maybe two at once
        self._last: dict[int, tuple[float, int]] = {}  # pid -> (when it was read, its PSS bytes)

    def per_device(self, live: dict[int, str]) -> dict[str, int]:
        """`live` (pid -> device): the PSS summed per device."""
        with self._lock:
            now = self.clock()
            for pid in [pid for pid in self._last if pid not in live]:  # exited: gone with its process
                del self._last[pid]
            due = [pid for pid in live if pid not in self._last or now - self._last[pid][0] >= self.max_age_s]
            for pid in sorted(due, key=lambda pid: self._last.get(pid, (-1.0, 0))[0])[:self.max_reads_per_scrape]:
                try:
                    self._last[pid] = (now, read_memory(pid).pss_bytes)
                except OSError:  # exited between listing and reading
                    self._last.pop(pid, None)
            per_device: dict[str, int] = {}
            for pid, (_, pss) in self._last.items():
                per_device[live[pid]] = per_device.get(live[pid], 0) + pss
            return per_device


class _AgentCollector:
    def __init__(self, agent: NodeAgent, usage: UsageRecorder | None = None) -> None:
        self.agent = agent
        self.pss = InstancePss()

    def collect(self):
        # Runs in a worker thread (a scrape is rendered off the event loop): read the agent's live structures only
        # through one-step copies (atomic under the GIL), never by iterating them while the loop may change them.
        cold = GaugeMetricFamily("lorafaas_cold_starts", "Cold starts by function and kind",
                                 labels=["function", "kind"])
        for (function, kind), count in sorted(self.agent.cold_start_counts().items()):
            cold.add_metric([function, kind], count)
        stages = SummaryMetricFamily("lorafaas_instance_start_seconds", "The stages of instance starts, every "
                                     "function's (platform/agent/start_stages.py)", labels=["stage"])
        for stage, (count, sum_s) in sorted(self.agent.start_stage_totals().items()):
            stages.add_metric([stage], count, sum_s)
        instances = GaugeMetricFamily("lorafaas_instances", "Function instances by live state (a state with none "
                                      "has no series)", labels=["function", "state"])
        counts = self.agent.count_by_state()
        # Only the states a function's instances are in: zeros for the other four states of every function would
        # be most of a fleet's scrape. A series that goes is stale at once in Prometheus (no lingering last value).
        for (function, state), count in sorted(counts.items()):
            if state in LIVE_STATES and count:
                instances.add_metric([function, state], count)
        failures = CounterMetricFamily("lorafaas_instance_failures", "Instances that crashed, hung or failed to start",
                                       labels=["function", "reason"])
        for (function, reason), count in sorted(self.agent.failure_counts().items()):
            failures.add_metric([function, reason], count)
        memory = GaugeMetricFamily("lorafaas_instance_memory_bytes", "PSS of the function instances by device (each "
                                   "instance's as last read: a scrape reads a few)", labels=["device"])
        live = {instance.pid: instance.device for instance in self.agent.table.all()
                if instance.pid is not None and instance.state in ("ready", "draining")}
        for device, pss in sorted(self.pss.per_device(live).items()):
            memory.add_metric([device], pss)
        slots = GaugeMetricFamily("lorafaas_compute_slots", "Instances the device runs at full speed at once",
                                  labels=["device"])
        busy = GaugeMetricFamily("lorafaas_busy_instances", "Instances busy on the device now (running a request "
                                 "or starting)", labels=["device"])
        budget = GaugeMetricFamily("lorafaas_device_budget_bytes", "The memory the scheduler may fill on the device",
                                   labels=["device"])
        for device in self.agent.config.devices:
            slots.add_metric([device.name], self.agent.compute_slots)
            busy.add_metric([device.name], self.agent.table.busy_on_device(device.name))
            budget.add_metric([device.name], device.budget_bytes)
        peak = GaugeMetricFamily("lorafaas_busy_instances_peak", "Most instances busy at once on the device "
                                 "(running a request or starting) since the agent started", labels=["device"])
        for device, count in sorted(dict(self.agent.table.busy_peak).items()):
            peak.add_metric([device], count)
        families = [cold, stages, instances, failures, memory, slots, busy, budget, peak]
        gate = self.agent.gate
        if gate is not None:
            computing = GaugeMetricFamily("lorafaas_computing_instances_peak", "Most instances running an engine "
                                          "step at once on the device (the step gate's grants)", labels=["device"])
            computing.add_metric(["cpu"], gate.grants.most_holding)
            now = GaugeMetricFamily("lorafaas_computing_instances", "Instances running an engine step on the "
                                    "device now", labels=["device"])
            now.add_metric(["cpu"], gate.grants.holding)
            steps = CounterMetricFamily("lorafaas_gated_steps", "Engine steps granted by the device's step gate, "
                                        "of them the steps that waited for a core, those whose lease ran out, and "
                                        "those granted to the shared base pass",
                                        labels=["device", "kind"])
            steps.add_metric(["cpu", "granted"], gate.grants.num_granted)
            steps.add_metric(["cpu", "waited"], gate.grants.num_waited)
            steps.add_metric(["cpu", "lapsed"], gate.grants.num_lapsed)
            steps.add_metric(["cpu", "shared"], gate.grants.num_shared)  # in the shared base pass
            families += [computing, now, steps]
            if gate.grants.choice is not None:
                families.append(_pass_choice_estimates(gate.grants.choice, gate.grants.others_load))
        return families


def _pass_choice_estimates(choice: PassChoice, others_load: float) -> GaugeMetricFamily:
    """What the step gate decides the shared base pass by: its step-time estimates, and the host's other load."""
    family = GaugeMetricFamily("lorafaas_step_estimate_seconds", "The step gate's moving average of a step's time: "
                               "own steps by threads granted, shared-pass steps by members stepping; and (kind "
                               "host_load) the host's runnable tasks besides the gate's steps",
                               labels=["device", "kind", "n"])
    for threads, estimate in sorted(choice.own.items()):
        family.add_metric(["cpu", "own", str(threads)], estimate.seconds)
    for members, estimate in sorted(choice.pooled.items()):
        family.add_metric(["cpu", "shared", str(members)], estimate.seconds)
    family.add_metric(["cpu", "host_load", "0"], others_load)
    return family


class UsageCollector:
    def __init__(self, usage: UsageRecorder) -> None:
        self.usage = usage

    def collect(self):
        failures = CounterMetricFamily("lorafaas_usage_record_failures", "Invocations whose usage record could not "
                                       "be stored (billing data lost; each is logged)")
        failures.add_metric([], self.usage.num_failures)
        return [failures]
