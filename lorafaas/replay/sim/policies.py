"""The policies the simulator compares, each a set of mechanism switches for the one engine.

lorafaas             backbone sharing, knapsack pre-loading, offloading, adaptive batching, hybrid keep-alive,
                     the scheduler's placement: the real `lorafaas.scheduler.Scheduler`, admitted as the node
                     agent admits (`lorafaas/platform/admission.py`, `AgentConfig` defaults): a request goes to
                     an instance as soon as one holds fewer than B in flight (its worker batches continuously),
                     and a function's dispatcher waits while it cold-starts an instance; another instance
                     starts on a device only while its busy instances are fewer than its compute slots (a CPU's
                     cores, one on a GPU: `lorafaas.scheduler.may_scale_out`, as the agent)
lorafaas-foe         the same with the paper's fill-or-expire admission (`AgentConfig.fill_or_expire=True`):
                     hold the queue until it holds B requests or the oldest has waited d = SLO - T(N)
lorafaas-rank-blind  the same with SchedulerConfig(rank_aware=False): decisions price every adapter as one shape
no-sharing           every function binds its own backbone copy (a per-function backbone name in the views)
no-preload           SchedulerConfig(preloading=False)
no-offload           SchedulerConfig(offloading=False); nothing resident is evicted for a batch or an instance
fixed-keep-alive     SchedulerConfig(keep_alive_policy="fixed"): the cluster's keep_alive_s after every invocation
                     instead of the hybrid histogram policy (the agent's `--policy fixed-keep-alive`)
fixed-batch-1        batches of one, dispatched at once, one request per instance (the agent's `--policy fixed-batch`)
fixed-batch-10       up to 10, dispatched when full or when the oldest waited 500 ms; at most 10 per instance
fixed-batch-20       up to 20, or 1000 ms; at most 20 per instance
serverlessllm        (Fu et al., OSDI 2024) each instance loads its own full backbone with the fast multi-tier
                     checkpoint loader (host-memory cache, then SSD), locality-aware placement (a node whose host
                     memory caches the checkpoint first), fixed keep-alive, requests dispatched at once
instainfer           (Sun et al., 2024) opportunistic pre-loading of libraries and the model per function into idle
                     memory (the knapsack without sharing: each function's backbone is its own), no sharing,
                     no offloading of what a request needs, fixed keep-alive, requests dispatched at once
serverful            vLLM-style always-on multi-LoRA servers: every device holds one backbone with all its
                     adapters from the start, continuous batching, no cold start, billed for every device always
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from lorafaas.errors import InvalidInput

BatchingKind = Literal["adaptive", "fixed", "immediate"]
LoaderKind = Literal["standard", "fast"]
EvictionKind = Literal["scheduler", "lru", "none"]


@dataclass(frozen=True)
class PolicySpec:
    name: str
    sharing: bool = True
    preloading: bool = True
    offloading: bool = True
    eviction: EvictionKind = "scheduler"  # how a new instance makes room: the scheduler's offloading, LRU, nothing
    batching: BatchingKind = "adaptive"
    fixed_batch_size: int = 1
    fixed_batch_timeout_s: float = 0.0
    fill_or_expire: bool = False  # adaptive batching only: the agent's `AgentConfig.fill_or_expire` (default False)
    # the lorafaas node agent's admission: its dispatcher awaits an instance's start, and a function scales out on a
    # device only while it has compute to spare (`may_scale_out`); False for the baselines
    agent_admission: bool = True
    keep_alive: Literal["hybrid", "fixed"] = "hybrid"
    loader: LoaderKind = "standard"
    locality: bool = False  # ServerlessLLM: prefer nodes whose host memory caches the checkpoint
    serverful: bool = False
    uses_scheduler_placement: bool = True
    shared_base: bool = False  # `up --shared-base`: the cluster's `device.shared_base` model (a CPU option)
    rank_aware: bool = True  # SchedulerConfig.rank_aware: decisions price adapters by rank and target modules


POLICIES: dict[str, PolicySpec] = {
    "lorafaas": PolicySpec("lorafaas"),
    "lorafaas-foe": PolicySpec("lorafaas-foe", fill_or_expire=True),
    "lorafaas-shared": PolicySpec("lorafaas-shared", shared_base=True),
    "lorafaas-rank-blind": PolicySpec("lorafaas-rank-blind", rank_aware=False),
    "no-sharing": PolicySpec("no-sharing", sharing=False),
    "no-preload": PolicySpec("no-preload", preloading=False),
    "no-offload": PolicySpec("no-offload", offloading=False, eviction="none"),
    "fixed-keep-alive": PolicySpec("fixed-keep-alive", keep_alive="fixed"),
    "fixed-batch-1": PolicySpec("fixed-batch-1", batching="fixed", fixed_batch_size=1),
    "fixed-batch-10": PolicySpec("fixed-batch-10", batching="fixed", fixed_batch_size=10, fixed_batch_timeout_s=0.5),
    "fixed-batch-20": PolicySpec("fixed-batch-20", batching="fixed", fixed_batch_size=20, fixed_batch_timeout_s=1.0),
    "serverlessllm": PolicySpec(
        "serverlessllm",
        sharing=False,
        preloading=False,
        offloading=False,
        eviction="lru",
        batching="immediate",
        keep_alive="fixed",
        loader="fast",
        locality=True,
        uses_scheduler_placement=False,
        agent_admission=False,
    ),
    "instainfer": PolicySpec(
        "instainfer",
        sharing=False,
        preloading=True,
        offloading=False,
        eviction="lru",
        batching="immediate",
        keep_alive="fixed",
        agent_admission=False,
    ),
    "serverful": PolicySpec(
        "serverful",
        batching="immediate",
        preloading=False,
        offloading=False,
        eviction="none",
        serverful=True,
        keep_alive="fixed",
        uses_scheduler_placement=False,
        agent_admission=False,
    ),
}
# lorafaas with the agent's other admission rule, with the shared base pass (a CPU option: `all` leaves it out, as
# the paper's GPU cluster has no model of it), and rank-blind (`all` leaves it out: it differs only where functions
# have adapter shapes, the fleet replay's); not among the paper's ablations
VARIANTS = ("lorafaas-foe", "lorafaas-shared", "lorafaas-rank-blind")
ABLATIONS = (
    "no-sharing",
    "no-preload",
    "no-offload",
    "fixed-keep-alive",
    "fixed-batch-1",
    "fixed-batch-10",
    "fixed-batch-20",
)
BASELINES = ("serverlessllm", "instainfer", "serverful")


def resolve_policies(names: list[str]) -> list[PolicySpec]:
    out: list[PolicySpec] = []
    for name in names:
        if name == "all":
            out.extend(p for p in POLICIES.values() if not p.shared_base and p.rank_aware)
        elif name == "fixed-batch":
            out.extend(POLICIES[n] for n in ("fixed-batch-1", "fixed-batch-10", "fixed-batch-20"))
        elif name in POLICIES:
            out.append(POLICIES[name])
        else:
            raise InvalidInput(f"policy {name!r} is not one of {[*POLICIES, 'fixed-batch', 'all']}")
    seen: dict[str, PolicySpec] = {}
    for p in out:
        seen.setdefault(p.name, p)
    return list(seen.values())
