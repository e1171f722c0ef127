"""The fleet workload in the simulator (issue 41): N functions, one adapter each of mixed rank and target modules,
Poisson arrivals at a total rate, the function drawn by Zipf popularity, fixed prompt and output lengths.

The workload is the fleet benchmark's (`lorafaas bench fleet`), from the same definition
(`lorafaas.testing.fleet_workload`): the same seed gives the same adapters' ranks and target modules and the same
arrivals to the same functions. The adapters' bytes and extra step time follow `lorafaas.scheduler.AdapterCostModel`
on the cluster's backbone widths (rank-aware: the simulated truth, whatever the policy's scheduler is told). Every
function is deployed, called or not: the scheduler plans for the whole fleet.

    fleet_cluster(cluster, options)   the cluster with the fleet's functions (backbones round-robin)
    fleet_workload(options)           the requests
    run_fleet(options, cluster, ...)  each policy simulated: TTFT, cost, cold starts and the scheduler's plan time
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, replace

from lorafaas.errors import InvalidInput
from lorafaas.replay.sim.cluster import ClusterSpec, FunctionSpec
from lorafaas.replay.sim.policies import resolve_policies
from lorafaas.replay.sim.runner import simulate
from lorafaas.replay.workload import Request, Workload
from lorafaas.scheduler import AdapterCostModel, AdapterShape, SchedulerConfig
from lorafaas.stats import percentile
from lorafaas.testing.fleet_workload import WorkloadSpec, arrivals, fleet_plan

FLEET_POLICIES = ("lorafaas", "lorafaas-rank-blind", "serverlessllm")


@dataclass(frozen=True)
class FleetOptions:
    functions: int = 1000
    rate_per_s: float = 10.0  # total, over the fleet (16 GPUs on `paper`)
    zipf_s: float = 1.0
    duration_s: float = 600.0
    prompt_tokens: int = 32  # the fleet benchmark's fixed lengths
    output_tokens: int = 32
    seed: int = 0

    def __post_init__(self) -> None:
        if not 1 <= self.functions <= 100_000:
            raise InvalidInput(f"functions is {self.functions}; a simulated fleet has 1 to 100000")
        for name, value, high in (("rate", self.rate_per_s, 10_000.0), ("zipf", self.zipf_s, 10.0),
                                  ("duration", self.duration_s, 86_400.0)):
            if not (math.isfinite(value) and 0 < value <= high) and not (name == "zipf" and value == 0):
                raise InvalidInput(f"{name} is {value}; it must be in (0, {high:g}]")
        if not (1 <= self.prompt_tokens <= 32_768 and 1 <= self.output_tokens <= 32_768):
            raise InvalidInput(f"prompt and output lengths are {self.prompt_tokens} and {self.output_tokens} tokens; "
                               "each must be in [1, 32768]")


def fleet_names(count: int) -> list[str]:
    return [adapter.name for adapter in fleet_plan(count)]


def fleet_shapes(options: FleetOptions) -> list[AdapterShape]:
    return [AdapterShape(a.rank, a.target_modules) for a in fleet_plan(options.functions, options.seed)]


def fleet_cluster(cluster: ClusterSpec, options: FleetOptions) -> ClusterSpec:
    """`cluster` with the fleet's functions: backbones round-robin, each adapter's bytes and step factor from its
    shape on its backbone (rank-aware)."""
    truth = AdapterCostModel(SchedulerConfig(rank_aware=True))
    backbones = sorted(cluster.backbones)
    functions: dict[str, FunctionSpec] = {}
    for k, (name, shape) in enumerate(zip(fleet_names(options.functions), fleet_shapes(options), strict=True)):
        backbone = cluster.backbones[backbones[k % len(backbones)]]
        if backbone.shape is None:
            raise InvalidInput(f"cluster {cluster.name!r}: backbone {backbone.name!r} has no widths (hidden, "
                               "intermediate, layers, params_b); a fleet's adapter costs need them")
        functions[name] = FunctionSpec(name, backbone.name, truth.adapter_bytes(shape, backbone.shape),
                                       cluster.default_slo_ttft_s, shape, truth.step_factor(shape, backbone.shape))
    return replace(cluster, functions=functions)


def fleet_workload(options: FleetOptions) -> Workload:
    names = fleet_names(options.functions)
    spec = WorkloadSpec(functions=options.functions, rate_per_s=options.rate_per_s, zipf_s=options.zipf_s,
                        duration_s=options.duration_s, seed=options.seed)
    requests = tuple(Request(arrival.at_s, names[arrival.function], names[arrival.function], options.prompt_tokens,
                             options.output_tokens) for arrival in arrivals(spec))
    return Workload(requests, options.duration_s, tuple(names))


def run_fleet(options: FleetOptions, cluster: ClusterSpec, policy_names: Sequence[str] = FLEET_POLICIES) -> dict:
    """Each policy on the fleet: the figures of issue 41's acceptance 4, as a JSON-able document."""
    spec = fleet_cluster(cluster, options)
    workload = fleet_workload(options)
    rows = []
    for policy in resolve_policies(list(policy_names)):
        outcome, result = simulate(workload, spec, policy, options.seed)
        plans_ms = [t * 1e3 for t in outcome.plan_times_s]
        rows.append({
            "policy": policy.name,
            "requests": result.summary.num_requests,
            "failed": sum(1 for r in outcome.results if not r.ok),
            "ttft_p50_s": result.summary.ttft_s.p50,
            "ttft_p99_s": result.summary.ttft_s.p99,
            "slo_attainment": result.slo_attainment,
            "cost": outcome.cost,
            "cold_starts": outcome.num_cold_starts,
            "budget_retirements": outcome.budget_retirements,
            "plans": outcome.num_plans,
            "plan_p50_ms": percentile(plans_ms, 50),
            "plan_max_ms": max(plans_ms, default=None),
            "sim_wall_s": result.sim_wall_s,
        })
    return {"cluster": cluster.name, "functions": options.functions, "rate_per_s": options.rate_per_s,
            "zipf_s": options.zipf_s, "duration_s": options.duration_s, "prompt_tokens": options.prompt_tokens,
            "output_tokens": options.output_tokens, "seed": options.seed, "currency": cluster.price.currency,
            "policies": rows}


def fleet_table(document: dict) -> str:
    lines = ["| policy | requests | failed | TTFT p50 s | TTFT p99 s | SLO | cost | cold starts | budget retired | "
             "plans | plan p50 ms | plan max ms | sim s |", "|---|" + "---:|" * 12]
    for r in document["policies"]:
        lines.append(
            f"| {r['policy']} | {r['requests']} | {r['failed']} | {_f(r['ttft_p50_s'])} | {_f(r['ttft_p99_s'])} | "
            f"{_f(r['slo_attainment'])} | {r['cost']:.3f} | {r['cold_starts']} | {r['budget_retirements']} | "
            f"{r['plans']} | {_f(r['plan_p50_ms'], 1)} | {_f(r['plan_max_ms'], 1)} | {r['sim_wall_s']:.1f} |")
    return "\n".join(lines)


def _f(value: float | None, digits: int = 3) -> str:
    return "-" if value is None else f"{value:.{digits}f}"
