"""`SchedulerConfig`: every switch and bound of the policies, checked once when it is built.

Each mechanism can be switched off so an evaluation can ablate it:
    preloading=False          the pre-load plan is empty (nothing is loaded or unloaded ahead of requests)
    adaptive_batching=False   every queued request is dispatched at once, up to `max_batch_size`, no waiting
    offloading=False          an arriving batch that does not fit gets a "cannot free" answer, nothing is evicted
    keep_alive_policy="fixed" every function is kept `fixed_keep_alive_s` after its last request, no pre-warm
    placement_top_k=1         placement is deterministic (no random tie-break)
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Literal

KeepAlivePolicyName = Literal["fixed", "hybrid"]


@dataclass(frozen=True)
class SchedulerConfig:
    # switches
    preloading: bool = True
    adaptive_batching: bool = True
    offloading: bool = True
    keep_alive_policy: KeepAlivePolicyName = "hybrid"

    # pre-loading: views with at most this many functions also run the greedy seeded with each of the
    # `preload_seeds` most valuable closures, keeping the best plan (0 turns it off)
    preload_seeded_max_functions: int = 32
    preload_seeds: int = 3
    # the device tier takes new device memory only for functions whose backbone's functions are together expected
    # within this horizon (summed rate x horizon >= 1: the copy serves them all): an idle device holds billed memory,
    # the host tier does not, and a copy expected less often than this costs more idle than a load from host memory
    # costs its next start (docs/scheduler.md, "Idle cost"); 0: no limit
    device_preload_horizon_s: float = 600.0

    # arrival rates: exponentially decaying event count with time constant `rate_window_s`
    rate_window_s: float = 60.0
    rate_min_horizon_s: float = 1.0  # a rate is never computed over less than this (no 1/0 at the first arrival)
    # the least rate a deployed function is planned with: one never invoked (or quiet for longer than the window
    # remembers) is still expected about once an hour, so its artifacts are staged where memory is idle rather than
    # loaded from disk by its first burst (docs/scheduler.md: Bursty's worst TTFTs were first bursts)
    rate_floor_per_s: float = 1.0 / 3600
    rate_change_tolerance: float = 0.25  # relative change of any rate that calls for a new pre-load plan
    # steadiness: a function whose last gaps between arrivals (at least `steady_min_gaps`, at most `steady_max_gaps`)
    # vary no more than a Poisson stream's do, within sampling noise (coefficient of variation <= 1 + 3 / sqrt(n)),
    # keeps a device busy: sent to an idle instance on a device other functions share, it also starts another where
    # compute is spare, and its idle instances are not retired stepwise (docs/scheduler.md, "Contention across
    # functions"); 0: off
    steady_min_gaps: int = 10
    steady_max_gaps: int = 100

    # batching: T(b) = T0 + a(b-1), fitted online; priors until two distinct batch sizes are seen
    max_batch_size: int = 32
    prior_t0_s: float = 0.05
    prior_per_request_s: float = 0.01
    prefill_fit_decay: float = 0.98  # weight kept by past observations at each new one (1.0: plain least squares)

    # admission: while requests join running batches beyond B, one instance starts in the background per this many
    # of them (one at the least), even where a start is slower than the SLO (docs/scheduler.md: measured choice)
    requests_per_background_start: int = 4
    # early scale-out: in a function's first `early_scale_out_s` of traffic (before its rates say much), more arrivals
    # within `burst_window_s` than its instances take in their batches (B each) start another instance in the
    # background while they still have room (docs/scheduler.md, "Early scale-out"); 0: off
    burst_window_s: float = 10.0
    early_scale_out_s: float = 300.0
    # strict compute (a CPU): the longest a function waits for a core other functions' batches hold before it runs
    # beside them anyway, time-slicing the cores: what one tenant's long generations can cost another's first token
    max_compute_wait_s: float = 10.0

    # rank-aware costs (CaraServe; `adapter_cost.py`): an adapter's bytes and extra FLOPs per token follow its rank
    # and target modules; False prices every adapter as rank `rank_blind_rank` on q/v (the comparison's baseline)
    rank_aware: bool = True
    rank_blind_rank: int = 16
    # an unmerged LoRA product runs this many times less efficiently per FLOP than the backbone's large ones
    # (batched small matmuls, launch overhead; CaraServe's measurements put rank-64 steps 10-30% above rank-8)
    lora_step_inefficiency: float = 4.0

    # offloading
    offload_to_host: bool = True  # an evicted adapter goes to its worker slot's host memory when it fits there

    # placement
    placement_top_k: int = 3  # random choice among this many best candidates of the best class

    # keep-alive (Shahrad et al., "Serverless in the Wild", ATC 2020)
    fixed_keep_alive_s: float = 600.0
    histogram_bin_s: float = 60.0
    # the paper's range is 4 hours; at 30 minutes a gap of hours between a function's bursts is out of range instead
    # of its 99th percentile, so it does not keep a burst's last instance, billed as idle device memory, for hours:
    # the window ends by 1.1 x the range (docs/scheduler.md, "Idle cost": chosen on the acceptance matrix)
    histogram_range_s: float = 1800.0
    head_percentile: float = 5.0
    tail_percentile: float = 99.0
    prewarm_margin: float = 0.10  # pre-warm window = head * (1 - margin)
    keep_alive_margin: float = 0.10  # keep-alive window ends at tail * (1 + margin)
    min_histogram_samples: int = 10
    min_histogram_cv: float = 2.0  # CV of the bin counts below this: the histogram is not representative
    max_out_of_range_fraction: float = 0.5  # more idle times beyond the range than this: fixed fallback
    # the histogram's window ends no earlier than this after an invocation: a function's idle times are between any
    # two of its invocations, and under steady traffic they say 66 s while a scaled-out instance, idle for minutes
    # between the traffic's waves, would cost a cold start (a backbone's load) to start again; 0: no floor
    min_keep_alive_s: float = 0.0
    # a function idle as a whole retires its idle instances one per this many seconds, least recently used first,
    # none later than its keep-alive window: a burst's scale-out is not billed through the hybrid window's long
    # tail, and the next burst finds the instances it most likely needs (docs/scheduler.md, "Idle cost"); 0: off
    idle_retire_step_s: float = 180.0
    # ... only for a function whose recent gaps between arrivals vary at least this much (coefficient of variation;
    # a Poisson stream's is 1); 0: every function not steady, on/off traffic's pauses included (Normal cost 7% more
    # than the flat window at 5; docs/scheduler.md, "Idle cost")
    idle_retire_min_cv: float = 0.0

    def __post_init__(self) -> None:
        positive = ("rate_window_s", "rate_min_horizon_s", "prior_t0_s", "fixed_keep_alive_s", "histogram_bin_s",
                    "histogram_range_s")
        for name in positive:
            value = getattr(self, name)
            if not (isinstance(value, int | float) and math.isfinite(value) and value > 0):
                raise ValueError(f"SchedulerConfig.{name} is {value!r}; it must be a finite number > 0")
        if self.keep_alive_policy not in ("fixed", "hybrid"):
            raise ValueError(f"SchedulerConfig.keep_alive_policy is {self.keep_alive_policy!r}; "
                             "choose 'fixed' or 'hybrid'")
        if self.prior_per_request_s < 0:
            raise ValueError(f"SchedulerConfig.prior_per_request_s is {self.prior_per_request_s}; must be >= 0")
        if not 1 <= self.requests_per_background_start <= 4096:
            raise ValueError(f"SchedulerConfig.requests_per_background_start is "
                             f"{self.requests_per_background_start}; must be in [1, 4096]")
        if not self.max_compute_wait_s > 0:
            raise ValueError(f"SchedulerConfig.max_compute_wait_s is {self.max_compute_wait_s}; must be > 0")
        if not 1 <= self.max_batch_size <= 4096:
            raise ValueError(f"SchedulerConfig.max_batch_size is {self.max_batch_size}; must be in [1, 4096]")
        if not 0 < self.prefill_fit_decay <= 1:
            raise ValueError(f"SchedulerConfig.prefill_fit_decay is {self.prefill_fit_decay}; must be in (0, 1]")
        for name in ("device_preload_horizon_s", "idle_retire_step_s", "idle_retire_min_cv", "burst_window_s",
                     "early_scale_out_s", "min_keep_alive_s"):
            value = getattr(self, name)
            if not (isinstance(value, int | float) and math.isfinite(value) and value >= 0):
                raise ValueError(f"SchedulerConfig.{name} is {value!r}; it must be a finite number >= 0 (0: off)")
        if not (0 <= self.steady_min_gaps <= self.steady_max_gaps <= 10_000 and self.steady_max_gaps >= 2):
            raise ValueError(f"SchedulerConfig: steady_min_gaps ({self.steady_min_gaps}) must be in [0, "
                             f"steady_max_gaps ({self.steady_max_gaps})], and steady_max_gaps in [2, 10000]")
        if not 1 <= self.rank_blind_rank <= 4096:
            raise ValueError(f"SchedulerConfig.rank_blind_rank is {self.rank_blind_rank}; must be in [1, 4096]")
        if not (math.isfinite(self.lora_step_inefficiency) and self.lora_step_inefficiency >= 0):
            raise ValueError(f"SchedulerConfig.lora_step_inefficiency is {self.lora_step_inefficiency}; must be a "
                             "finite number >= 0")
        if not self.rate_floor_per_s >= 0:
            raise ValueError(f"SchedulerConfig.rate_floor_per_s is {self.rate_floor_per_s}; must be >= 0")
        if self.rate_change_tolerance <= 0:
            raise ValueError(f"SchedulerConfig.rate_change_tolerance is {self.rate_change_tolerance}; must be > 0")
        if self.preload_seeded_max_functions < 0 or self.preload_seeds < 0:
            raise ValueError("SchedulerConfig: preload_seeded_max_functions and preload_seeds must be >= 0")
        if self.placement_top_k < 1:
            raise ValueError(f"SchedulerConfig.placement_top_k is {self.placement_top_k}; must be >= 1 "
                             "(1 turns the random tie-break off)")
        if not 0 <= self.head_percentile < self.tail_percentile <= 100:
            raise ValueError(f"SchedulerConfig percentiles: need 0 <= head ({self.head_percentile}) < tail "
                             f"({self.tail_percentile}) <= 100")
        for name in ("prewarm_margin", "keep_alive_margin", "max_out_of_range_fraction"):
            if not 0 <= getattr(self, name) <= 1:
                raise ValueError(f"SchedulerConfig.{name} is {getattr(self, name)}; must be in [0, 1]")
        if self.histogram_range_s < self.histogram_bin_s:
            raise ValueError(f"SchedulerConfig.histogram_range_s ({self.histogram_range_s}) is shorter than one bin "
                             f"(histogram_bin_s = {self.histogram_bin_s})")
        if self.histogram_range_s / self.histogram_bin_s > 100_000:
            raise ValueError(f"SchedulerConfig: {self.histogram_range_s / self.histogram_bin_s:.0f} histogram bins; "
                             "at most 100000 (widen histogram_bin_s or shorten histogram_range_s)")
        if self.min_histogram_samples < 1 or self.min_histogram_cv < 0:
            raise ValueError("SchedulerConfig: min_histogram_samples must be >= 1 and min_histogram_cv >= 0")

    @property
    def num_histogram_bins(self) -> int:
        return math.ceil(self.histogram_range_s / self.histogram_bin_s - 1e-9)


def for_device_kind(config: SchedulerConfig, kind: str) -> SchedulerConfig:
    """`config` for a device of `kind` ("cpu" or "gpu"): a CPU's device tier is its host's memory, so there is no
    cheaper tier to keep a rarely used function in and the pre-load horizon does not apply; and a host's cores are
    one device, so there is no device of its own for a steady function to move to, nor for an instance started
    early (it would only share the cores the running batches use)."""
    if kind == "cpu" and (config.device_preload_horizon_s or config.steady_min_gaps or config.burst_window_s):
        return replace(config, device_preload_horizon_s=0.0, steady_min_gaps=0, burst_window_s=0.0)
    return config
