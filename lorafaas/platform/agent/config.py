"""How the node agent runs: its devices, worker capacity, step gate, shared base pass and liveness budgets."""

from __future__ import annotations

from dataclasses import dataclass, field

from lorafaas.function_runtime import messages as m
from lorafaas.platform.devices import Device, check_devices
from lorafaas.platform.state.records import FunctionSpec
from lorafaas.scheduler import SchedulerConfig

# A step gate's grant lasts at most this long: a worker stuck in a step (until the hang detector kills it) stops
# holding other functions' steps back; a real step here takes well under a second (a padded prefill of 8 x 128 tokens:
# about 1.6 s on this 2-core machine)
GATE_LEASE_S = 5.0
REQUEST_STAGES: tuple[m.StageName, ...] = ("libraries", "backbone", "adapter")
WORKER_FIELDS = ("backbone", "adapter_digest", "lora_mode", "shared_base")  # what an instance was started with

# A worker's batch capacity by default. At 32 concurrent requests over three functions on two cores, 32 against 8
# gave 1.13x the tokens/s and a TTFT p90 of 1.75 s against 14.8 s: beyond its capacity a request waits for a whole
# generation to end (docs/performance.md, "Worker capacity").
DEFAULT_MAX_BATCH = 32
# `up`'s default idle-instance budget: this share of the machine's memory (the rest: backbones, running batches, the
# host tier, everything else the node runs)
DEFAULT_IDLE_BUDGET_FRACTION = 0.5


@dataclass(frozen=True)
class AgentConfig:
    # the CPU, or one or more GPUs, each with its memory budget; compute slots, busy counts and daemons are per device
    devices: tuple[Device, ...] = (Device("cpu", 8 * 1024**3),)
    max_batch_size: int = DEFAULT_MAX_BATCH  # per instance: the worker's batch capacity
    scheduler: SchedulerConfig = field(default_factory=lambda: SchedulerConfig(max_batch_size=DEFAULT_MAX_BATCH))
    num_threads: int = 1
    compute_slots: int | None = None  # per device, run at full speed at once; None: cores / num_threads on a CPU
    # never more busy instances than compute slots, functions taking turns (AdmissionView.strict_compute). Off by
    # default: measured on this 2-core machine it lost to time-slicing on both tokens/s and first-token latency
    # (docs/performance.md, "Strict compute against time-slicing")
    strict_compute: bool = False
    # local CPU workers ask the device's step gate before every engine step: never more of them compute at once than
    # compute slots, counted across functions; one computing alone gets up to `lone_threads` (None: every core)
    step_gate: bool = True
    lone_threads: int | None = None
    # local CPU workers join the daemon's shared base pass (docs/performance.md, "The shared base pass"). Under the
    # step gate the members stepping at once go to it, their backbone products batched together, while its measured
    # step times beat their own steps' (`PassChoice`), or with a fixed `shared_base_from`, while at least that many
    # step at once; otherwise members compute their own pass on granted cores. Without the gate they always go to it.
    shared_base: bool = True
    shared_base_from: int | None = None
    reconcile_interval_s: float = 0.5
    plan_interval_s: float = 5.0
    fill_or_expire: bool = False  # hold requests to fill a batch (for workers without continuous batching)
    stop_timeout_s: float = 10.0
    # Liveness: an instance holding requests that sent nothing for `heartbeat_after_s` is asked for a heartbeat; no
    # answer within `hang_timeout_s`, or no engine step for `hang_after_steps_s`, and it is declared hung.
    heartbeat_after_s: float = 2.0
    hang_timeout_s: float = 10.0
    hang_after_steps_s: float = 120.0
    # A cold start (spawn, then every stage: libraries, backbone, adapter, warm-up) that takes longer is killed and
    # counted a failed start: an adapter built to make its start expensive burns a core for this long at most. A
    # backbone daemon started on the way does not count (the node's work, with its own limit).
    start_timeout_s: float = 120.0
    # Bytes of idle instances (their own memory and adapters) the node keeps; beyond it the lowest expected saving
    # per byte retire (idle_budget.py). None: no budget (`up` sets DEFAULT_IDLE_BUDGET_FRACTION of the memory)
    idle_budget_bytes: int | None = None

    def __post_init__(self) -> None:
        check_devices(self.device_names)
        if self.idle_budget_bytes is not None and self.idle_budget_bytes < 0:
            raise ValueError(f"idle_budget_bytes is {self.idle_budget_bytes}; it must be >= 0 (None: no budget)")
        for name in ("heartbeat_after_s", "hang_timeout_s", "hang_after_steps_s", "reconcile_interval_s",
                     "start_timeout_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} is {getattr(self, name)}; it must be > 0")

    @property
    def device_names(self) -> tuple[str, ...]:
        return tuple(d.name for d in self.devices)

    @property
    def cpu(self) -> bool:
        """The agent drives the CPU (else GPUs: `cpu` stands alone)."""
        return self.devices[0].name == "cpu"


def same_worker(a: FunctionSpec, b: FunctionSpec) -> bool:
    """Whether an instance started for `a` answers exactly as one started for `b` (a settings-only change)."""
    return a.uid == b.uid and all(getattr(a, f) == getattr(b, f) for f in WORKER_FIELDS)
