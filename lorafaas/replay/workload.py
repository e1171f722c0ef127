"""From trace records to a workload: timed requests of deployed functions with prompt and output lengths.

    inter_arrival_cov(times)          coefficient of variation of the gaps between arrivals
    classify(cov)                     the ServerlessLoRA paper's classes: Predictable CoV <= 1, Normal 1 < CoV <= 4,
                                      Bursty CoV > 4
    expand_minute_counts(counts, ...) per-minute counts -> arrival times: "uniform" spreads a minute's n arrivals
                                      evenly over it, "poisson" draws them uniformly at random (a Poisson process
                                      conditioned on its count), seeded
    select_per_class(stats, ...)      a seeded choice of trace functions per class
    Mapping                           trace function -> deployed functions (`*` matches every trace function; a trace
                                      function mapped to several functions has its requests spread over them, seeded)
    TokenSampler                      prompt and output lengths drawn from the LLM trace's token counts, seeded
    Workload.compressed(speedup)      time compression (arrival times divided by `speedup`)

Every random choice goes through a `random.Random` seeded by the caller: the same seed gives the same workload.
"""

from __future__ import annotations

import itertools
import math
import random
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, replace
from typing import Literal

from lorafaas.errors import InvalidInput
from lorafaas.replay.traces import FunctionMinuteCounts, Invocation2021, LLMRequest

TraceClass = Literal["predictable", "normal", "bursty"]
ExpansionMode = Literal["uniform", "poisson"]
CLASSES: tuple[TraceClass, ...] = ("predictable", "normal", "bursty")
PREDICTABLE_MAX_COV = 1.0
NORMAL_MAX_COV = 4.0


@dataclass(frozen=True, slots=True)
class Request:
    arrival_s: float
    trace_function: str
    function: str
    prompt_tokens: int
    output_tokens: int


@dataclass(frozen=True)
class Workload:
    requests: tuple[Request, ...]  # sorted by arrival
    duration_s: float
    deployed: tuple[str, ...] = ()  # functions deployed besides those the requests name (a fleet's never-called tail)

    @property
    def functions(self) -> tuple[str, ...]:
        return tuple(sorted({r.function for r in self.requests}.union(self.deployed)))

    def compressed(self, speedup: float) -> Workload:
        if not (math.isfinite(speedup) and speedup > 0):
            raise InvalidInput(f"speedup is {speedup}; it must be a finite number > 0")
        return Workload(
            tuple(replace(r, arrival_s=r.arrival_s / speedup) for r in self.requests), self.duration_s / speedup
        )

    def window(self, start_s: float, duration_s: float) -> Workload:
        """The requests arriving in [start_s, start_s + duration_s), shifted to start at 0."""
        end = start_s + duration_s
        kept = tuple(replace(r, arrival_s=r.arrival_s - start_s) for r in self.requests if start_s <= r.arrival_s < end)
        return Workload(kept, min(duration_s, max(0.0, self.duration_s - start_s)))


@dataclass(frozen=True, slots=True)
class FunctionStats:
    key: str
    num_invocations: int
    cov: float  # nan with fewer than two gaps
    trace_class: TraceClass | None  # None when the CoV is undefined


def inter_arrival_cov(arrival_s: Sequence[float]) -> float:
    """Population standard deviation over mean of the gaps between sorted arrivals; nan with fewer than 2 gaps."""
    times = sorted(arrival_s)
    if len(times) < 3:
        return math.nan
    gaps = [b - a for a, b in itertools.pairwise(times)]
    mean = sum(gaps) / len(gaps)
    if mean <= 0:
        return math.nan
    variance = sum((g - mean) ** 2 for g in gaps) / len(gaps)
    return math.sqrt(variance) / mean


def classify(cov: float) -> TraceClass | None:
    if math.isnan(cov):
        return None
    if cov <= PREDICTABLE_MAX_COV:
        return "predictable"
    return "normal" if cov <= NORMAL_MAX_COV else "bursty"


def expand_minute_counts(
    counts: Sequence[int], mode: ExpansionMode = "uniform", rng: random.Random | None = None
) -> list[float]:
    """Arrival times in seconds from minute 0 for per-minute invocation counts."""
    if mode not in ("uniform", "poisson"):
        raise InvalidInput(f"expansion mode is {mode!r}; choose 'uniform' or 'poisson'")
    if mode == "poisson" and rng is None:
        raise InvalidInput("poisson expansion needs a seeded random.Random")
    out: list[float] = []
    for minute, n in enumerate(counts):
        base = minute * 60.0
        if n <= 0:
            continue
        if mode == "uniform":
            out.extend(base + (i + 0.5) * 60.0 / n for i in range(n))
        else:
            assert rng is not None
            out.extend(sorted(base + rng.random() * 60.0 for _ in range(n)))
    return out


def stats_2019(rows: Iterable[FunctionMinuteCounts]) -> list[FunctionStats]:
    """CoV per function from its counts spread evenly within each minute (deterministic)."""
    out = []
    for row in rows:
        cov = inter_arrival_cov(expand_minute_counts(row.counts))
        out.append(FunctionStats(row.key, sum(row.counts), cov, classify(cov)))
    return out


def stats_from_arrivals(arrivals: dict[str, list[float]]) -> list[FunctionStats]:
    out = []
    for key in sorted(arrivals):
        cov = inter_arrival_cov(arrivals[key])
        out.append(FunctionStats(key, len(arrivals[key]), cov, classify(cov)))
    return out


def select_per_class(
    stats: Sequence[FunctionStats], wanted: dict[TraceClass, int], seed: int, min_invocations: int = 1
) -> dict[TraceClass, list[str]]:
    """`wanted[c]` trace functions of class c drawn at random (seeded) among those with >= `min_invocations`."""
    rng = random.Random(seed)
    out: dict[TraceClass, list[str]] = {}
    for cls, n in wanted.items():
        pool = sorted(s.key for s in stats if s.trace_class == cls and s.num_invocations >= min_invocations)
        if len(pool) < n:
            raise InvalidInput(
                f"{n} {cls} functions wanted; the trace has {len(pool)} with >= {min_invocations} invocations"
            )
        out[cls] = sorted(rng.sample(pool, n))
    return out


class Mapping:
    """trace function -> deployed functions, from `--map TRACE_FN=FUNCTION` (repeatable; `*` matches all)."""

    def __init__(self, pairs: dict[str, tuple[str, ...]]) -> None:
        if not pairs:
            raise InvalidInput("no function mapping; give at least one TRACE_FN=FUNCTION")
        self.pairs = pairs

    @classmethod
    def parse(cls, items: Sequence[str]) -> Mapping:
        pairs: dict[str, list[str]] = {}
        for item in items:
            trace_fn, sep, function = item.partition("=")
            if not sep or not trace_fn.strip() or not function.strip():
                raise InvalidInput(f"mapping {item!r} is not TRACE_FN=FUNCTION")
            pairs.setdefault(trace_fn.strip(), []).append(function.strip())
        return cls({k: tuple(v) for k, v in pairs.items()})

    def targets(self, trace_function: str) -> tuple[str, ...]:
        return self.pairs.get(trace_function) or self.pairs.get("*") or ()

    def pick(self, trace_function: str, rng: random.Random) -> str | None:
        targets = self.targets(trace_function)
        if not targets:
            return None
        return targets[0] if len(targets) == 1 else targets[rng.randrange(len(targets))]


class TokenSampler:
    """(prompt tokens, output tokens) pairs drawn with replacement from the LLM trace, clipped to the given maxima."""

    def __init__(
        self,
        pairs: Sequence[tuple[int, int]],
        rng: random.Random,
        max_prompt_tokens: int | None = None,
        max_output_tokens: int | None = None,
    ) -> None:
        if not pairs:
            raise InvalidInput("the token sampler needs at least one (prompt, output) pair")
        self.pairs, self.rng = list(pairs), rng
        self.max_prompt_tokens, self.max_output_tokens = max_prompt_tokens, max_output_tokens

    @classmethod
    def from_llm(cls, requests: Iterable[LLMRequest], rng: random.Random, **limits: int | None) -> TokenSampler:
        return cls([(r.context_tokens, r.generated_tokens) for r in requests], rng, **limits)

    def clip(self, prompt: int, output: int) -> tuple[int, int]:
        if self.max_prompt_tokens is not None:
            prompt = min(prompt, self.max_prompt_tokens)
        if self.max_output_tokens is not None:
            output = min(output, self.max_output_tokens)
        return max(1, prompt), max(1, output)

    def draw(self) -> tuple[int, int]:
        return self.clip(*self.pairs[self.rng.randrange(len(self.pairs))])


def workload_from_llm(
    requests: Sequence[LLMRequest],
    mapping: Mapping,
    seed: int,
    trace_function: str = "llm",
    sampler: TokenSampler | None = None,
) -> Workload:
    """The LLM trace as one trace function (`trace_function`); each request keeps its own token counts (clipped by
    `sampler`'s maxima when given)."""
    if not requests:
        return Workload((), 0.0)
    rng = random.Random(seed)
    t0 = min(r.timestamp for r in requests)
    out = []
    for r in requests:
        function = mapping.pick(trace_function, rng)
        if function is None:
            continue
        prompt, output = (
            sampler.clip(r.context_tokens, r.generated_tokens)
            if sampler
            else (max(1, r.context_tokens), max(1, r.generated_tokens))
        )
        out.append(Request((r.timestamp - t0).total_seconds(), trace_function, function, prompt, output))
    out.sort(key=lambda q: (q.arrival_s, q.function))
    duration = out[-1].arrival_s if out else 0.0
    return Workload(tuple(out), duration)


def workload_from_minute_counts(
    rows: Iterable[FunctionMinuteCounts],
    mapping: Mapping,
    sampler: TokenSampler,
    seed: int,
    mode: ExpansionMode = "poisson",
    keys: set[str] | None = None,
) -> Workload:
    """2019 counts of the functions in `keys` (all mapped ones when None) expanded to requests."""
    rng = random.Random(seed)
    out: list[Request] = []
    minutes = 0
    for row in rows:
        if (keys is not None and row.key not in keys) or not mapping.targets(row.key):
            continue
        minutes = max(minutes, len(row.counts))
        for t in expand_minute_counts(row.counts, mode, rng):
            function = mapping.pick(row.key, rng)
            assert function is not None
            out.append(Request(t, row.key, function, *sampler.draw()))
    out.sort(key=lambda q: (q.arrival_s, q.function))
    return Workload(tuple(out), minutes * 60.0)


def workload_from_2021(rows: Iterable[Invocation2021], mapping: Mapping, sampler: TokenSampler, seed: int) -> Workload:
    rng = random.Random(seed)
    out = []
    for row in rows:
        function = mapping.pick(row.key, rng)
        if function is not None:
            out.append(Request(row.arrival_s, row.key, function, *sampler.draw()))
    out.sort(key=lambda q: (q.arrival_s, q.function))
    start = out[0].arrival_s if out else 0.0
    shifted = tuple(replace(r, arrival_s=r.arrival_s - start) for r in out)
    return Workload(shifted, shifted[-1].arrival_s if shifted else 0.0)
