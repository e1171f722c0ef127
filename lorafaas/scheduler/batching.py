"""Adaptive batching (ServerlessLoRA): fill-or-expire batches sized by each function's prefill model and TTFT SLO.

    T(b) = T0 + a (b - 1)           prefill time of a batch of b requests, fitted online by least squares
    B    = max { b : T(b) <= SLO }  the largest batch whose prefill alone stays within the SLO (at least 1)
    d    = SLO - T(N)               how long the oldest of N queued requests may wait for the batch to fill
    dispatch when N >= B (full) or when the oldest request has waited d (expired)

Which instance a dispatched batch goes to, and whether one starts, is the admission policy's (`admission.py`).

The fit keeps exponentially weighted sums (x = b - 1): until two distinct batch sizes have been seen, the slope is
the prior `prior_per_request_s` and T0 the weighted mean of T(b) - a x (the prior `prior_t0_s` before any sample).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from lorafaas.scheduler.config import SchedulerConfig


class PrefillModel:
    """T(b) = T0 + a (b - 1), fitted online from observed (batch size, prefill seconds)."""

    def __init__(self, config: SchedulerConfig | None = None) -> None:
        self.config = config or SchedulerConfig()
        self._w = self._sx = self._sy = self._sxx = self._sxy = 0.0
        self._min_x = math.inf
        self._max_x = -math.inf
        self.num_observed = 0
        self.t0_s = self.config.prior_t0_s
        self.a_s = self.config.prior_per_request_s

    def observe(self, batch_size: int, prefill_s: float) -> None:
        if batch_size < 1 or not (math.isfinite(prefill_s) and prefill_s >= 0):
            raise ValueError(f"a prefill observation needs batch_size >= 1 and finite prefill_s >= 0, "
                             f"got ({batch_size}, {prefill_s})")
        decay = self.config.prefill_fit_decay
        x = float(batch_size - 1)
        self._w = self._w * decay + 1.0
        self._sx = self._sx * decay + x
        self._sy = self._sy * decay + prefill_s
        self._sxx = self._sxx * decay + x * x
        self._sxy = self._sxy * decay + x * prefill_s
        self._min_x, self._max_x = min(self._min_x, x), max(self._max_x, x)
        self.num_observed += 1
        self._refit()

    def _refit(self) -> None:
        mean_x, mean_y = self._sx / self._w, self._sy / self._w
        var_x = self._sxx / self._w - mean_x * mean_x
        a = self.config.prior_per_request_s
        if self._max_x > self._min_x and var_x > 1e-12 * max(1.0, mean_x * mean_x):
            a = max(0.0, (self._sxy / self._w - mean_x * mean_y) / var_x)  # a batch is never faster than a smaller one
        self.a_s = a
        self.t0_s = max(0.0, mean_y - a * mean_x)

    def predict_s(self, batch_size: int) -> float:
        return self.t0_s + self.a_s * (batch_size - 1)


@dataclass(frozen=True, slots=True)
class BatchDecision:
    dispatch: bool
    size: int  # how many to dispatch now, or the batch being filled
    wait_s: float  # 0 when dispatching; else how long until it expires (math.inf with an empty queue)
    recheck_at_s: float  # now_s + wait_s: when to ask again if nothing arrives


class BatchPolicy:
    """One function's batching: `observe` prefill times, `decide` on its queue."""

    def __init__(self, config: SchedulerConfig | None, slo_ttft_s: float, model: PrefillModel | None = None) -> None:
        if not slo_ttft_s > 0:
            raise ValueError(f"slo_ttft_s is {slo_ttft_s}; must be > 0")
        self.config = config or SchedulerConfig()
        self.slo_ttft_s = slo_ttft_s
        self.model = model or PrefillModel(self.config)
        self._max_batch = self._compute_max_batch()

    def observe(self, batch_size: int, prefill_s: float) -> None:
        self.model.observe(batch_size, prefill_s)
        self._max_batch = self._compute_max_batch()

    def _compute_max_batch(self) -> int:
        """B = max { b : T0 + a(b-1) <= SLO }, within [1, max_batch_size]."""
        cap = self.config.max_batch_size
        if not self.config.adaptive_batching:
            return cap
        t0, a = self.model.t0_s, self.model.a_s
        if t0 >= self.slo_ttft_s:
            return 1
        if a <= 0:
            return cap
        return max(1, min(cap, math.floor((self.slo_ttft_s - t0) / a + 1e-9) + 1))

    @property
    def max_batch_size(self) -> int:
        return self._max_batch

    def batch_delay_s(self, num_queued: int) -> float:
        """d = SLO - T(N), never negative."""
        return max(0.0, self.slo_ttft_s - self.model.predict_s(num_queued))

    def decide(self, queue_len: int, oldest_wait_s: float, now_s: float) -> BatchDecision:
        if queue_len <= 0:
            return BatchDecision(False, 0, math.inf, math.inf)
        cap = self._max_batch
        if not self.config.adaptive_batching or queue_len >= cap:
            return BatchDecision(True, min(queue_len, cap), 0.0, now_s)
        remaining = self.batch_delay_s(queue_len) - oldest_wait_s
        if remaining <= 0:
            return BatchDecision(True, queue_len, 0.0, now_s)
        return BatchDecision(False, queue_len, remaining, now_s + remaining)


def in_flight_limit(slo_batch: int, worker_capacity: int, can_start_instance: bool, adaptive: bool) -> int:
    """How many requests one instance may hold when every instance of the function holds `slo_batch` (B).

    B keeps a batch's prefill within the SLO while the excess can go elsewhere (a new instance). When none can start
    (the device has no compute to spare, or the function is at its maximum), the excess would wait in the queue for a
    running request to finish, a whole generation, which costs its time to first token far more than joining a
    running batch (continuous batching admits it at the next decode step, after the prefills admitted with it): up to
    the worker's capacity then. A fixed batch size (adaptive batching off) stays the hard limit it is.
    """
    if not adaptive or can_start_instance:
        return slo_batch
    return max(slo_batch, worker_capacity)
