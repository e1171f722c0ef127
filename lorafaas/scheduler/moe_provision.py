"""Provisioning the MoE LoRA server (InfiniLoRA): the minimum adapter-cache size M* and the devices it needs. Pure.

Cache size. N adapters with Zipf(s) popularity p_i; L instances each decoding B requests draw L*B adapter accesses
per step, so adapter i's access count is taken Poisson with lambda_i = L*B*p_i. An adapter is resident when its
count exceeds a threshold tau: q_i = P[Poisson(lambda_i) > tau], with tau set so that sum_i q_i = M. A request for
adapter i is immediately admissible if i is resident, or if it is not and fewer than M others are (a free slot):
P_free(i) = P[sum_{j != i} X_j < M] for independent X_j ~ Bernoulli(q_j), a Poisson-binomial computed by dynamic
programming (prefix and suffix distributions truncated at M, so each i costs O(M)). Then

    IAR(M) = sum_i p_i * (q_i + (1 - q_i) * P_free(i)),     M* = min { M : IAR(M) >= alpha }.

How tau is discretized: counts are integers, so with an integer tau, sum_i q_i moves in steps and rarely equals M.
tau is continuous instead: with n = floor(tau) and f = tau - n, q_i(tau) = (1 - f) * S_i(n) + f * S_i(n + 1), where
S_i(n) = P[X_i > n] (S_i(-1) = 1). It is the survival function linearly interpolated between integers, i.e. an
adapter with exactly n + 1 accesses is resident with probability 1 - f. sum_i q_i(tau) is continuous and strictly
decreasing in tau on [-1, inf), so bisection finds the tau with sum_i q_i = M exactly (to 1e-9).

`simulate_iar` is a Monte Carlo run of the same process with the real draw (multinomial, L*B accesses per step,
not independent Poissons), the same threshold rule and the same admissibility test, to check the model against.

Devices. Memory: M* adapters of `adapter_bytes`. Time (TPOT): per decode step and MoE layer the server receives
L*B*top_k routed rows in two round trips; its time on D devices is max(FLOPs / (D * flops), factor bytes touched /
(D * bandwidth)) plus the link's latency and transfer. The instance overlaps it with its base expert GEMMs, so a
layer adds max(0, t_lora - t_base_expert); num_layers of those must fit the TPOT slack (SLO - base TPOT). The server
needs max(devices for memory, devices for time).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np


def zipf_popularity(num_adapters: int, s: float) -> np.ndarray:
    """p_i proportional to 1 / i^s, i = 1..N."""
    if num_adapters < 1:
        raise ValueError(f"num_adapters must be >= 1, got {num_adapters}")
    if s < 0:
        raise ValueError(f"the Zipf exponent must be >= 0, got {s}")
    weights = 1.0 / np.arange(1, num_adapters + 1, dtype=np.float64) ** s
    return weights / weights.sum()


def poisson_survival_table(lambdas: np.ndarray) -> np.ndarray:
    """S[i, n + 1] = P[Poisson(lambda_i) > n] for n = -1 .. K, K beyond every lambda's tail (S[i, 0] = 1)."""
    max_k = int(np.max(lambdas) + 12.0 * math.sqrt(float(np.max(lambdas))) + 20)
    k = np.arange(max_k + 1, dtype=np.float64)
    lgamma = np.array([math.lgamma(x + 1.0) for x in k])
    safe = np.maximum(lambdas, 1e-300)[:, None]
    log_pmf = -lambdas[:, None] + k[None, :] * np.log(safe) - lgamma[None, :]
    pmf = np.exp(log_pmf)
    pmf[lambdas == 0, 1:] = 0.0
    pmf[lambdas == 0, 0] = 1.0
    survival = np.clip(1.0 - np.cumsum(pmf, axis=1), 0.0, 1.0)  # P[X > k]
    return np.concatenate([np.ones((len(lambdas), 1)), survival], axis=1)


def residency(survival: np.ndarray, tau: float) -> np.ndarray:
    """q_i(tau) with tau continuous (see the module docstring), from `poisson_survival_table`."""
    n = math.floor(tau)
    f = tau - n
    columns = survival.shape[1]
    lo = survival[:, min(n + 1, columns - 1)]
    hi = survival[:, min(n + 2, columns - 1)]
    return (1.0 - f) * lo + f * hi


def solve_tau(survival: np.ndarray, cache_size: int) -> float:
    """The tau at which sum_i q_i(tau) = cache_size (bisection on [-1, K])."""
    num_adapters = survival.shape[0]
    if cache_size >= num_adapters:
        return -1.0
    lo, hi = -1.0, float(survival.shape[1])
    for _ in range(200):
        mid = (lo + hi) / 2
        if residency(survival, mid).sum() > cache_size:
            lo = mid
        else:
            hi = mid
        if hi - lo < 1e-9:
            break
    return (lo + hi) / 2


def free_slot_probabilities(q: np.ndarray, cache_size: int) -> np.ndarray:
    """P_free(i) = P[fewer than M of the adapters other than i are resident], by a Poisson-binomial DP."""
    n, m = len(q), cache_size
    prefix = np.zeros((n + 1, m))  # prefix[i][a]: P[a of adapters 0..i-1 resident], a < M
    suffix = np.zeros((n + 2, m))  # suffix[i][b]: P[b of adapters i..n-1 resident], b < M
    prefix[0, 0] = suffix[n, 0] = 1.0
    for i in range(n):
        prefix[i + 1] = prefix[i] * (1 - q[i])
        prefix[i + 1, 1:] += prefix[i, :-1] * q[i]
    for i in range(n - 1, -1, -1):
        suffix[i] = suffix[i + 1] * (1 - q[i])
        suffix[i, 1:] += suffix[i + 1, :-1] * q[i]
    suffix_cdf = np.cumsum(suffix, axis=1)  # P[b' <= b]
    # P[a + b <= M - 1] = sum_a prefix[i][a] * P[b <= M - 1 - a]
    return np.einsum("ia,ia->i", prefix[:n], suffix_cdf[1 : n + 1, ::-1])


@dataclass(frozen=True)
class CacheModel:
    cache_size: int
    tau: float
    iar: float
    residency: tuple[float, ...]


def immediate_admission_rate(
    popularity: np.ndarray, num_instances: int, batch_size: int, cache_size: int, survival: np.ndarray | None = None
) -> CacheModel:
    """IAR(M) of the model (see the module docstring)."""
    if cache_size < 1:
        raise ValueError(f"the cache holds at least 1 adapter, got {cache_size}")
    lambdas = num_instances * batch_size * popularity
    survival = poisson_survival_table(lambdas) if survival is None else survival
    if cache_size >= len(popularity):
        return CacheModel(cache_size, -1.0, 1.0, tuple([1.0] * len(popularity)))
    tau = solve_tau(survival, cache_size)
    q = residency(survival, tau)
    free = free_slot_probabilities(q, cache_size)
    iar = float(np.sum(popularity * (q + (1 - q) * free)))
    return CacheModel(cache_size, tau, min(iar, 1.0), tuple(float(x) for x in q))


def min_cache_size(popularity: np.ndarray, num_instances: int, batch_size: int, alpha: float = 0.95) -> CacheModel:
    """The smallest M with IAR(M) >= alpha (IAR grows with M; bisection over 1..N)."""
    if not 0 < alpha <= 1:
        raise ValueError(f"alpha must lie in (0, 1], got {alpha}")
    if num_instances < 1 or batch_size < 1:
        raise ValueError(f"instances and batch size must be >= 1, got {num_instances} and {batch_size}")
    survival = poisson_survival_table(num_instances * batch_size * popularity)
    lo, hi = 1, len(popularity)
    best = immediate_admission_rate(popularity, num_instances, batch_size, hi, survival)
    while lo < hi:
        mid = (lo + hi) // 2
        model = immediate_admission_rate(popularity, num_instances, batch_size, mid, survival)
        if model.iar >= alpha:
            best, hi = model, mid
        else:
            lo = mid + 1
    if best.cache_size != lo:
        best = immediate_admission_rate(popularity, num_instances, batch_size, lo, survival)
    return best


def simulate_iar(
    popularity: np.ndarray,
    num_instances: int,
    batch_size: int,
    cache_size: int,
    *,
    num_trials: int = 4000,
    seed: int = 0,
) -> float:
    """Monte Carlo IAR of the same process: multinomial accesses, the model's tau rule, the admissibility test."""
    model = immediate_admission_rate(popularity, num_instances, batch_size, cache_size)
    if cache_size >= len(popularity):
        return 1.0
    rng = np.random.default_rng(seed)
    counts = rng.multinomial(num_instances * batch_size, popularity, size=num_trials)
    n = math.floor(model.tau)
    f = model.tau - n
    # resident: more than n + 1 accesses; exactly n + 1: with probability 1 - f (the interpolated threshold)
    boundary = (counts == n + 1) & (rng.random(counts.shape) < 1 - f)
    resident = (counts > n + 1) | boundary
    num_resident = resident.sum(axis=1, keepdims=True)
    admissible = resident | ((num_resident - resident) < cache_size)
    return float(np.mean(admissible @ popularity))


# -- devices -----------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class MoeShape:
    """An MoE backbone and its expert adapters' rank (defaults: Mixtral-8x7B, rank 64, bf16)."""

    num_layers: int = 32
    num_experts: int = 8
    top_k: int = 2
    hidden_size: int = 4096
    intermediate_size: int = 14336
    rank: int = 64
    bytes_per_param: int = 2
    fused_gate_up: bool = False  # Mixtral's checkpoints adapt w1, w3 separately (the paper's 1.69 GB)

    @property
    def expert_layer_params(self) -> int:
        """LoRA parameters of one expert in one layer."""
        h, i, r = self.hidden_size, self.intermediate_size, self.rank
        gate_up = r * (h + 2 * i) if self.fused_gate_up else 2 * r * (h + i)
        return gate_up + r * (i + h)

    @property
    def adapter_bytes(self) -> int:
        return self.expert_layer_params * self.num_experts * self.num_layers * self.bytes_per_param


@dataclass(frozen=True)
class ServerDevice:
    """One LoRA-server device (defaults: an A100-80GB-class GPU, 10% of memory kept free)."""

    memory_bytes: float = 72e9
    flops: float = 300e12
    bandwidth_bytes_s: float = 1.5e12
    link_latency_s: float = 20e-6  # one round trip, instance <-> server
    link_bandwidth_bytes_s: float = 25e9


@dataclass(frozen=True)
class TpotBudget:
    tpot_slo_s: float = 0.060
    base_tpot_s: float = 0.040  # the instance's decode step without LoRA
    base_expert_layer_s: float = 0.0004  # its base expert GEMMs per MoE layer (what the round trip overlaps)


@dataclass(frozen=True)
class DevicePlan:
    memory_devices: int
    tpot_devices: int | None  # None: no number of devices meets the TPOT budget (the link alone is too slow)
    lora_layer_s: float  # server time per layer on `devices`
    added_tpot_s: float

    @property
    def devices(self) -> int | None:
        return None if self.tpot_devices is None else max(self.memory_devices, self.tpot_devices)


def lora_layer_seconds(
    shape: MoeShape, device: ServerDevice, popularity: np.ndarray, num_instances: int, batch_size: int, num_devices: int
) -> float:
    """Server time of one MoE layer (both round trips) for one decode step of every instance."""
    requests = num_instances * batch_size
    rows = requests * shape.top_k
    h, i, r = shape.hidden_size, shape.intermediate_size, shape.rank
    flops = 2.0 * rows * r * ((h + 2 * i) + (i + h))
    active = float(np.sum(1 - (1 - popularity) ** requests))  # adapters in the step
    rows_per_adapter = rows / max(active, 1e-9)
    experts_touched = shape.num_experts * (1 - (1 - 1 / shape.num_experts) ** rows_per_adapter)
    factor_bytes = active * experts_touched * shape.expert_layer_params * shape.bytes_per_param
    compute = max(flops / (num_devices * device.flops), factor_bytes / (num_devices * device.bandwidth_bytes_s))
    transfer = batch_size * shape.top_k * (2 * h + 3 * i) * shape.bytes_per_param / device.link_bandwidth_bytes_s
    return compute + 2 * device.link_latency_s + transfer


def plan_devices(
    shape: MoeShape,
    device: ServerDevice,
    budget: TpotBudget,
    popularity: np.ndarray,
    num_instances: int,
    batch_size: int,
    cache_size: int,
    max_devices: int = 1024,
) -> DevicePlan:
    memory_devices = max(1, math.ceil(cache_size * shape.adapter_bytes / device.memory_bytes))
    slack = budget.tpot_slo_s - budget.base_tpot_s

    def added(devices: int) -> tuple[float, float]:
        layer_s = lora_layer_seconds(shape, device, popularity, num_instances, batch_size, devices)
        return layer_s, shape.num_layers * max(0.0, layer_s - budget.base_expert_layer_s)

    for devices in range(1, max_devices + 1):
        layer_s, added_s = added(devices)
        if added_s <= slack:
            return DevicePlan(memory_devices, devices, layer_s, added_s)
    layer_s, added_s = added(max_devices)
    return DevicePlan(memory_devices, None, layer_s, added_s)
