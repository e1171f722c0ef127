"""Online arrival rates per function: an exponentially decaying event count over an injected clock.

    c(t)      = sum over arrivals t_k <= t of exp(-(t - t_k) / tau)           (kept as one number per function)
    rate(t)   = c(t) / (tau * (1 - exp(-max(t - t_first, h) / tau)))

For a Poisson stream of rate lambda started at t_first, E[c(t)] = lambda * tau * (1 - exp(-(t - t_first) / tau)),
so the estimate is unbiased from the first arrival on (h, `rate_min_horizon_s`, only avoids dividing by zero) and
forgets the past with time constant tau (`rate_window_s`).

Steadiness: the last n gaps between arrivals (`steady_min_gaps` <= n <= `steady_max_gaps`) vary no more than a
Poisson stream's, whose gaps have a coefficient of variation of 1; an estimate over n gaps has a standard error of
about 1 / sqrt(n), so a function is steady while CV <= 1 + 3 / sqrt(n). On/off and bursty streams (CV 1.5-10 in
the paper's classes) are not.

Recent arrivals (`recent_arrivals`): how many arrived within the last `burst_window_s`, counted exactly, in a
function's first `early_scale_out_s` of traffic (before the decaying rate says much; early scale-out reads it).

Variation (`gap_variation`): the same coefficient over the same gaps, once at least `VARIATION_MIN_GAPS` are known.
Stepped retirement can use it to tell bursts (CV well above a Poisson stream's 1) from the active stretches of on/off
traffic (`idle_retire_min_cv`; 0 by default: both retire stepwise, docs/scheduler.md, "Idle cost").
"""

from __future__ import annotations

import dataclasses
import math
from collections import deque

from lorafaas.scheduler.config import SchedulerConfig
from lorafaas.scheduler.messages import ClusterView, FunctionName, FunctionProfile

VARIATION_MIN_GAPS = 10  # fewer gaps say too little about a stream's variation (standard error ~ 1 / sqrt(n))
RECENT_MAX = 4096  # arrival times kept per function for `recent_arrivals` (more than any batch takes)


@dataclasses.dataclass(slots=True)
class _Stream:
    count: float
    last_s: float
    first_s: float
    gaps: deque[float]  # the last `steady_max_gaps` gaps between arrivals (0 for simultaneous ones)


class RateTracker:
    def __init__(self, config: SchedulerConfig | None = None) -> None:
        self.config = config or SchedulerConfig()
        self._streams: dict[FunctionName, _Stream] = {}
        self._planned: dict[FunctionName, float] = {}
        self._first_planned: dict[FunctionName, float] = {}  # when a plan first saw each function (its deploy)
        self._recent: dict[FunctionName, deque[float]] = {}  # arrival times within `burst_window_s`

    def recent_arrivals(self, function: FunctionName, now_s: float) -> int:
        """Arrivals of `function` within the last `burst_window_s`, while its traffic is younger than
        `early_scale_out_s` (0 otherwise, and when either is 0: off)."""
        times, stream = self._recent.get(function), self._streams.get(function)
        if times is None or stream is None or now_s - stream.first_s > self.config.early_scale_out_s:
            return 0
        while times and times[0] < now_s - self.config.burst_window_s:
            times.popleft()
        return len(times)

    def observe_arrival(self, function: FunctionName, now_s: float, count: int = 1) -> None:
        if self.config.burst_window_s > 0:
            self._recent.setdefault(function, deque(maxlen=RECENT_MAX)).extend([now_s] * min(count, RECENT_MAX))
        stream = self._streams.get(function)
        if stream is None:
            gaps = deque([0.0] * (count - 1), maxlen=self.config.steady_max_gaps)
            self._streams[function] = _Stream(float(count), now_s, now_s, gaps)
            return
        stream.gaps.append(max(0.0, now_s - stream.last_s))
        stream.gaps.extend([0.0] * (count - 1))
        if now_s > stream.last_s:  # arrivals reported slightly out of order count as simultaneous
            stream.count *= math.exp(-(now_s - stream.last_s) / self.config.rate_window_s)
            stream.last_s = now_s
        stream.count += count

    def rate(self, function: FunctionName, now_s: float) -> float | None:
        """Arrivals per second, or None for a function never seen."""
        stream = self._streams.get(function)
        if stream is None:
            return None
        tau = self.config.rate_window_s
        decayed = stream.count * math.exp(-max(0.0, now_s - stream.last_s) / tau)
        horizon = max(now_s - stream.first_s, self.config.rate_min_horizon_s)
        return decayed / (tau * -math.expm1(-horizon / tau))

    def steady(self, function: FunctionName) -> bool:
        """Whether `function`'s arrivals are steady (module docstring); False while fewer than `steady_min_gaps`
        gaps are known, and always when that is 0 (off)."""
        wanted = self.config.steady_min_gaps
        if wanted <= 0:
            return False
        known = self._variation(function, wanted)
        return known is not None and known[0] <= 1.0 + 3.0 / math.sqrt(known[1])

    def gap_variation(self, function: FunctionName) -> float | None:
        """The coefficient of variation of `function`'s last gaps between arrivals (up to `steady_max_gaps`), or None
        while fewer than `VARIATION_MIN_GAPS` are known or they are all 0."""
        known = self._variation(function, VARIATION_MIN_GAPS)
        return None if known is None else known[0]

    def _variation(self, function: FunctionName, min_gaps: int) -> tuple[float, int] | None:
        stream = self._streams.get(function)
        if stream is None or len(stream.gaps) < min_gaps:
            return None
        n = len(stream.gaps)
        mean = sum(stream.gaps) / n
        if mean <= 0:
            return None
        variance = sum((g - mean) ** 2 for g in stream.gaps) / n
        return math.sqrt(variance) / mean, n

    def rates(self, now_s: float) -> dict[FunctionName, float]:
        return {f: self.rate(f, now_s) or 0.0 for f in self._streams}

    def forget(self, function: FunctionName) -> None:
        self._streams.pop(function, None)
        self._planned.pop(function, None)
        self._first_planned.pop(function, None)
        self._recent.pop(function, None)

    def apply(self, view: ClusterView, now_s: float) -> ClusterView:
        """The view with each profile's arrival rate replaced by the estimate (functions never seen keep theirs), and
        none below `rate_floor_per_s`. A function not yet invoked within `device_preload_horizon_s` of the first plan
        that saw it (its deploy) is expected within that horizon: a deploy is usually followed by its first calls."""
        functions = dict(view.functions)
        horizon = self.config.device_preload_horizon_s
        for name, profile in view.functions.items():
            estimate = self.rate(name, now_s)
            rate = max(profile.arrival_rate_per_s if estimate is None else estimate, self.config.rate_floor_per_s)
            deployed_s = self._first_planned.setdefault(name, now_s)
            if estimate is None and horizon > 0 and now_s - deployed_s < horizon:
                rate = max(rate, 1.0 / horizon)
            if rate != profile.arrival_rate_per_s:  # not dataclasses.replace: 20x slower, and 10,000 a plan
                functions[name] = FunctionProfile(profile.name, profile.backbone, rate, profile.costs,
                                                  profile.slo_ttft_s, profile.kv_bytes_per_token)
        return dataclasses.replace(view, functions=functions)

    def mark_planned(self, now_s: float) -> None:
        """Remember the rates a plan was made with (see `changed_since_plan`)."""
        self._planned = self.rates(now_s)

    def changed_since_plan(self, now_s: float) -> bool:
        """Has any rate moved by more than `rate_change_tolerance` (relative) since `mark_planned`? Rates below one
        arrival per window are compared as one arrival per window, so that noise on idle functions does not count."""
        floor = 1.0 / self.config.rate_window_s
        tolerance = self.config.rate_change_tolerance
        for function, rate in self.rates(now_s).items():
            before = max(self._planned.get(function, 0.0), floor)
            if abs(max(rate, floor) - before) > tolerance * before:
                return True
        return False
