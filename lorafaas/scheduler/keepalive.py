"""Keep-alive: a fixed window, or the hybrid histogram policy of Shahrad et al. ("Serverless in the Wild", ATC 2020).

Per function, a histogram of idle times (the time from the end of one invocation to the start of the next), bins of
`histogram_bin_s` up to `histogram_range_s` (1 minute and 4 hours in the paper; lorafaas's range is 30 minutes, so the
window ends by 33 minutes: a gap of hours between bursts is out of range, not the tail that keeps a burst's last
instance for hours); idle times beyond the range are counted as out of range. From it:

    head         = the `head_percentile` (5th) of the idle times, at the lower edge of its bin
    tail         = the `tail_percentile` (99th), at the upper edge of its bin
    pre-warm     = head * (1 - prewarm_margin)              unload after the invocation, load again after this long
    keep-alive   = max(tail * (1 + keep_alive_margin), min_keep_alive_s) - pre-warm    then keep it loaded this long

A function idle as a whole (no request in flight or queued) also retires its idle instances one per
`idle_retire_step_s`, least recently used first (`next_idle_retirement_s`), the window above still bounding each: the
histogram's long tail keeps one instance for the next burst, not the whole scale-out of the last one, whose idle
device memory is billed (docs/scheduler.md, "Idle cost").

The histogram is used only when it is representative; otherwise the fixed window applies (pre-warm 0, keep-alive
`fixed_keep_alive_s`):
    - fewer than `min_histogram_samples` idle times                                          -> "fixed:few_samples"
    - more than `max_out_of_range_fraction` of them beyond the range (the paper forecasts these with ARIMA; lorafaas
      falls back to the fixed window)                                                         -> "fixed:out_of_range"
    - the coefficient of variation of the bin counts below `min_histogram_cv` (idle times spread evenly over the
      range: no pattern to exploit)                                                          -> "fixed:flat"
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from lorafaas.scheduler.config import SchedulerConfig
from lorafaas.scheduler.messages import FunctionName


@dataclass(frozen=True, slots=True)
class KeepAliveDecision:
    prewarm_s: float  # after an invocation ends, how long to wait before (re)loading the function; 0: keep it
    keep_alive_s: float  # how long to keep it loaded after that
    reason: str  # "fixed", "histogram", or "fixed:<why the histogram was not used>"


class IdleTimeHistogram:
    def __init__(self, bin_s: float, num_bins: int) -> None:
        self.bin_s = bin_s
        self.counts = [0] * num_bins
        self.num_in_range = 0
        self.num_out_of_range = 0

    def add(self, idle_s: float) -> None:
        if not idle_s >= 0:
            raise ValueError(f"an idle time must be >= 0 seconds, got {idle_s}")
        k = int(idle_s // self.bin_s)
        if k >= len(self.counts):
            self.num_out_of_range += 1
            return
        self.counts[k] += 1
        self.num_in_range += 1

    @property
    def num_samples(self) -> int:
        return self.num_in_range + self.num_out_of_range

    def bin_of_percentile(self, percentile: float) -> int:
        """Index of the bin holding the `percentile`-th in-range idle time (nearest rank)."""
        rank = max(1, math.ceil(percentile / 100.0 * self.num_in_range))
        seen = 0
        for k, count in enumerate(self.counts):
            seen += count
            if seen >= rank:
                return k
        return len(self.counts) - 1

    def coefficient_of_variation(self) -> float:
        """Standard deviation over mean of the bin counts (0 for an empty histogram)."""
        n = len(self.counts)
        mean = self.num_in_range / n
        if mean == 0:
            return 0.0
        variance = sum((c - mean) ** 2 for c in self.counts) / n
        return math.sqrt(variance) / mean


class KeepAlivePolicy:
    def __init__(self, config: SchedulerConfig | None = None) -> None:
        self.config = config or SchedulerConfig()
        self._histograms: dict[FunctionName, IdleTimeHistogram] = {}
        self._decisions: dict[FunctionName, KeepAliveDecision] = {}

    def observe_idle(self, function: FunctionName, idle_s: float) -> None:
        histogram = self._histograms.get(function)
        if histogram is None:
            histogram = IdleTimeHistogram(self.config.histogram_bin_s, self.config.num_histogram_bins)
            self._histograms[function] = histogram
        histogram.add(idle_s)
        self._decisions.pop(function, None)

    def forget(self, function: FunctionName) -> None:
        self._histograms.pop(function, None)
        self._decisions.pop(function, None)

    def histogram(self, function: FunctionName) -> IdleTimeHistogram | None:
        return self._histograms.get(function)

    def decide(self, function: FunctionName) -> KeepAliveDecision:
        decision = self._decisions.get(function)
        if decision is None:
            decision = self._decide(function)
            self._decisions[function] = decision
        return decision

    def _decide(self, function: FunctionName) -> KeepAliveDecision:
        config = self.config
        if config.keep_alive_policy == "fixed":
            return KeepAliveDecision(0.0, config.fixed_keep_alive_s, "fixed")
        histogram = self._histograms.get(function)
        if histogram is None or histogram.num_samples < config.min_histogram_samples:
            return self._fixed("few_samples")
        if histogram.num_out_of_range > config.max_out_of_range_fraction * histogram.num_samples:
            return self._fixed("out_of_range")
        if histogram.coefficient_of_variation() < config.min_histogram_cv:
            return self._fixed("flat")
        head_s = histogram.bin_of_percentile(config.head_percentile) * histogram.bin_s
        tail_s = (histogram.bin_of_percentile(config.tail_percentile) + 1) * histogram.bin_s
        prewarm_s = head_s * (1.0 - config.prewarm_margin)
        end_s = max(tail_s * (1.0 + config.keep_alive_margin), config.min_keep_alive_s)
        return KeepAliveDecision(prewarm_s, end_s - prewarm_s, "histogram")

    def next_idle_retirement_s(self, function: FunctionName, idle_since_s: float, last_retired_s: float | None
                               ) -> float | None:
        """When `function`, idle as a whole since `idle_since_s`, retires its next idle instance (its least recently
        used): one step after it went idle or after its last such retirement, whichever is later. None: no stepped
        retirement (the step is 0, or the function's window is not the histogram's: a fixed window, the policy's or
        the function's own, stays as configured)."""
        step_s = self.config.idle_retire_step_s
        if step_s <= 0 or self.decide(function).reason != "histogram":
            return None
        since = idle_since_s if last_retired_s is None else max(idle_since_s, last_retired_s)
        return since + step_s

    def _fixed(self, why: str) -> KeepAliveDecision:
        return KeepAliveDecision(0.0, self.config.fixed_keep_alive_s, f"fixed:{why}")
