"""The fleet workload, one definition for the benchmark (`lorafaas bench fleet`) and the simulator (`lorafaas replay
fleet`): a fleet's adapters of mixed rank and target modules, and open-loop Poisson arrivals at a total rate, each
to a function drawn by Zipf.

Pure and seeded: the same (seed, rate, zipf, duration, functions) gives the same arrival sequence, so every server of
one run (and of a later run) gets exactly the same requests at the same offsets. Function k (0-based) is chosen with
probability proportional to 1 / (k+1)^s: function 0 is the most popular, the tail is called rarely.
"""

from __future__ import annotations

import bisect
import itertools
import random
from typing import NamedTuple

import msgspec


class Arrival(msgspec.Struct, frozen=True):
    at_s: float  # offset from the start of the run
    function: int  # index into the fleet
    prompt: int  # index into the prompt set


class WorkloadSpec(msgspec.Struct, frozen=True, kw_only=True):
    functions: int
    rate_per_s: float
    zipf_s: float = 1.0
    duration_s: float = 600.0
    prompts: int = 64
    seed: int = 0


def zipf_weights(count: int, s: float) -> list[float]:
    """The popularity of each of `count` functions (summing to 1): (k+1)^-s, normalised."""
    raw = [(k + 1) ** -s for k in range(count)]
    total = sum(raw)
    return [w / total for w in raw]


def arrivals(spec: WorkloadSpec) -> list[Arrival]:
    """Every arrival in [0, duration): exponential gaps of mean 1/rate, a Zipf function and a uniform prompt each."""
    if spec.functions < 1 or spec.rate_per_s <= 0 or spec.duration_s <= 0 or spec.prompts < 1:
        raise ValueError(f"a workload needs functions >= 1, prompts >= 1, rate > 0 and duration > 0: {spec}")
    rng = random.Random(spec.seed)
    cumulative = list(itertools.accumulate(zipf_weights(spec.functions, spec.zipf_s)))
    out = []
    at = rng.expovariate(spec.rate_per_s)
    while at < spec.duration_s:
        # min(): the last cumulative weight may round just under 1
        function = min(bisect.bisect_right(cumulative, rng.random()), spec.functions - 1)
        out.append(Arrival(at_s=at, function=function, prompt=rng.randrange(spec.prompts)))
        at += rng.expovariate(spec.rate_per_s)
    return out


# A fleet's mix, as real fleets are: ranks 4 to 64, most of them small, and target modules q/v only, attention, or
# every linear layer; each drawn with its weight (on smollm2-135m an adapter is 6.5 MB on average, 0.2 to 75 MB).
FLEET_RANKS = (4, 8, 16, 32, 64)
FLEET_RANK_WEIGHTS = (0.2, 0.35, 0.3, 0.1, 0.05)
FLEET_TARGETS = (
    ("q_proj", "v_proj"),
    ("q_proj", "k_proj", "v_proj", "o_proj"),
    ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"),
)
FLEET_TARGET_WEIGHTS = (0.5, 0.35, 0.15)


class FleetAdapter(NamedTuple):
    name: str
    rank: int
    target_modules: tuple[str, ...]
    seed: int


def fleet_plan(count: int, seed: int = 0, prefix: str = "fleet") -> list[FleetAdapter]:
    """The `count` adapters of a fleet, the same for the same (count, seed): rank and target modules drawn per
    adapter, each adapter's weights seeded by its own seed."""
    rng = random.Random(seed)
    width = max(5, len(str(count - 1)))
    return [FleetAdapter(name=f"{prefix}-{index:0{width}d}", rank=rng.choices(FLEET_RANKS, FLEET_RANK_WEIGHTS)[0],
                         target_modules=rng.choices(FLEET_TARGETS, FLEET_TARGET_WEIGHTS)[0],
                         seed=seed * 1_000_003 + index)
            for index in range(count)]
