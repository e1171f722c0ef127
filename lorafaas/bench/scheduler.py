"""`lorafaas bench scheduler`: how long the pure policies take to decide, on synthetic views from a seeded RNG.

    preload_plan_ms_100x8     median ms of one pre-load plan (knapsack + difference) for 100 functions, 8 devices
    preload_plan_ms_1000x16   the same for 1000 functions, 16 devices
    batch_decision_us         median us of one fill-or-expire decision of a function's batch policy
    offload_decision_ms       median ms of one offload decision on the fullest device of the 1000x16 view once
                              its plan is loaded, asked for an eighth of its capacity more than is free

The views: backbones of 0.27-14 GB (one per ~50 functions), devices of 16-48 GB with 10-50% in use, idle worker
slots (1-4 GB) for three functions in four, Zipf-like arrival rates, artifact delays and sizes in the ranges of the
coldstart bench and the papers. The view timed is the second of two: its `resident` is the first view's plan, its
rates perturbed, so the difference step has work to do.
"""

from __future__ import annotations

import dataclasses
import random
import statistics
import time
from collections.abc import Callable

import msgspec

from lorafaas.scheduler.batching import BatchPolicy
from lorafaas.scheduler.config import SchedulerConfig
from lorafaas.scheduler.messages import (
    ArtifactCost,
    ArtifactCosts,
    BackboneName,
    ClusterView,
    DeviceId,
    DeviceView,
    FunctionName,
    FunctionProfile,
    SlotId,
    WorkerSlot,
)
from lorafaas.scheduler.offload import device_free_bytes, plan_offload
from lorafaas.scheduler.preload import PreloadPlanner

GB = 1 << 30
MB = 1 << 20
BACKBONE_BYTES = (int(0.27 * GB), 1 * GB, 3 * GB, 7 * GB, 14 * GB)


class SchedulerBenchResult(msgspec.Struct, frozen=True):
    preload_plan_ms_100x8: float
    preload_plan_ms_1000x16: float
    batch_decision_us: float
    offload_decision_ms: float


def synthetic_view(num_functions: int, num_devices: int, seed: int = 0) -> ClusterView:
    rng = random.Random(seed)
    num_backbones = max(2, num_functions // 50)
    backbones = [(BackboneName(f"bb{k}"), rng.choice(BACKBONE_BYTES)) for k in range(num_backbones)]
    functions: dict[FunctionName, FunctionProfile] = {}
    for n in range(num_functions):
        name = FunctionName(f"fn{n:04d}")
        backbone, size = rng.choice(backbones)
        adapter = rng.randint(5, 200) * MB
        costs = ArtifactCosts(
            libraries=ArtifactCost(rng.uniform(1.5, 5.0), rng.randint(200, 800) * MB),
            backbone_host=ArtifactCost(size / (2 * GB), size),
            backbone_device=ArtifactCost(size / (2 * GB) + size / (12 * GB), size),
            adapter_host=ArtifactCost(adapter / (500 * MB), adapter),
            adapter_device=ArtifactCost(adapter / (500 * MB) + 0.02, adapter),
            warmup=ArtifactCost(rng.uniform(0.3, 3.0), rng.randint(50, 400) * MB),
        )
        rate = 5.0 / (1 + rng.random() * num_functions) ** 0.9
        functions[name] = FunctionProfile(name, backbone, rate, costs, slo_ttft_s=rng.uniform(0.3, 2.0),
                                          kv_bytes_per_token=rng.choice((36, 128, 512)) * 1024)
    devices = []
    for d in range(num_devices):
        capacity = rng.choice((16, 24, 40, 48)) * GB
        devices.append(DeviceView(DeviceId(f"cuda:{d}"), capacity, int(capacity * rng.uniform(0.1, 0.5))))
    slots = tuple(WorkerSlot(SlotId(f"slot{k}"), rng.randint(1, 4) * GB, rng.randint(0, 100) * MB)
                  for k in range(num_functions * 3 // 4))
    return ClusterView(functions=functions, devices=tuple(devices), slots=slots)


def steady_view(num_functions: int, num_devices: int, seed: int = 0) -> ClusterView:
    """A view whose `resident` is the plan of the first one, with every rate perturbed by up to +-50%."""
    first = synthetic_view(num_functions, num_devices, seed)
    plan = PreloadPlanner().plan(first)
    rng = random.Random(seed + 1)
    functions = {name: dataclasses.replace(p, arrival_rate_per_s=p.arrival_rate_per_s * rng.uniform(0.5, 1.5))
                 for name, p in first.functions.items()}
    return ClusterView(functions=functions, devices=first.devices, slots=first.slots, resident=plan.target)


def _median_s(call: Callable[[], object], repeats: int, inner: int = 1) -> float:
    samples = []
    for _ in range(repeats):
        started = time.perf_counter()
        for _ in range(inner):
            call()
        samples.append((time.perf_counter() - started) / inner)
    return statistics.median(samples)


def run_scheduler_bench(repeats: int = 15, seed: int = 0) -> SchedulerBenchResult:
    planner = PreloadPlanner(SchedulerConfig())
    small, large = steady_view(100, 8, seed), steady_view(1000, 16, seed)
    small_s = _median_s(lambda: planner.plan(small), repeats)
    large_s = _median_s(lambda: planner.plan(large), max(3, repeats // 3))

    policy = BatchPolicy(SchedulerConfig(), slo_ttft_s=0.5)
    for size, seconds in ((1, 0.05), (4, 0.08), (8, 0.12), (2, 0.06)):
        policy.observe(size, seconds)
    batch_s = _median_s(lambda: policy.decide(3, 0.01, 100.0), repeats, inner=1000)

    # the large view once its plan is loaded; a batch asks the fullest device for an eighth of it more than is free
    loaded = ClusterView(functions=large.functions, devices=large.devices, slots=large.slots,
                         resident=planner.plan(large).target)
    free = {d.device_id: device_free_bytes(loaded, d.device_id) for d in loaded.devices}
    device = min(loaded.devices, key=lambda d: free[d.device_id])
    needed = free[device.device_id] + device.capacity_bytes // 8
    offload_s = _median_s(lambda: plan_offload(loaded, device.device_id, needed), repeats)
    return SchedulerBenchResult(
        preload_plan_ms_100x8=round(small_s * 1e3, 3),
        preload_plan_ms_1000x16=round(large_s * 1e3, 3),
        batch_decision_us=round(batch_s * 1e6, 3),
        offload_decision_ms=round(offload_s * 1e3, 3),
    )
