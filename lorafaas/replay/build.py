"""One call from a trace file and options to a `Workload`: what `lorafaas replay` (live and simulated) runs.

Order of operations: parse (format from the header) -> select trace functions (2019/2021, optional, per CoV class)
-> map onto deployed functions -> expand to requests -> window [start, start + window) in trace time -> thin to
`sample_fraction` (seeded) -> compress by `speedup` -> cut at `duration_s` of replay time.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, replace
from pathlib import Path

from lorafaas.errors import InvalidInput
from lorafaas.replay.traces import detect_kind, iter_2019_invocations, iter_2021_invocations, iter_llm_requests
from lorafaas.replay.workload import (
    CLASSES,
    ExpansionMode,
    Mapping,
    TokenSampler,
    TraceClass,
    Workload,
    select_per_class,
    stats_2019,
    stats_from_arrivals,
    workload_from_2021,
    workload_from_llm,
    workload_from_minute_counts,
)

DEFAULT_TOKENS = ((256, 32),)  # (prompt, output) when a function trace comes without an LLM token trace


@dataclass(frozen=True)
class WorkloadOptions:
    mapping: Mapping
    seed: int = 0
    start_s: float = 0.0
    window_s: float | None = None
    speedup: float = 1.0
    duration_s: float | None = None
    sample_fraction: float = 1.0
    max_prompt_tokens: int | None = None
    max_output_tokens: int | None = None
    expansion: ExpansionMode = "poisson"
    tokens_trace: Path | None = None  # LLM trace whose token counts 2019/2021 requests draw from
    select: tuple[tuple[TraceClass, int], ...] = ()  # e.g. (("bursty", 2),): seeded choice per CoV class

    def __post_init__(self) -> None:
        if not 0 < self.sample_fraction <= 1:
            raise InvalidInput(f"sample fraction is {self.sample_fraction}; it must be in (0, 1]")
        for name in ("window_s", "duration_s"):
            value = getattr(self, name)
            if value is not None and value <= 0:
                raise InvalidInput(f"{name} is {value}; it must be > 0")


def parse_select(text: str | None) -> tuple[tuple[TraceClass, int], ...]:
    """'predictable:2,bursty:1' -> (("predictable", 2), ("bursty", 1))."""
    if not text:
        return ()
    out = []
    for part in text.split(","):
        cls, _, n = part.partition(":")
        cls = cls.strip().lower()
        if cls not in CLASSES or not n.strip().isdigit():
            raise InvalidInput(f"selection {part!r} is not CLASS:N with CLASS one of {list(CLASSES)}")
        out.append((cls, int(n)))
    return tuple(out)


def _sampler(options: WorkloadOptions, rng: random.Random) -> TokenSampler:
    limits = {"max_prompt_tokens": options.max_prompt_tokens, "max_output_tokens": options.max_output_tokens}
    if options.tokens_trace is not None:
        return TokenSampler.from_llm(iter_llm_requests(options.tokens_trace), rng, **limits)
    return TokenSampler(DEFAULT_TOKENS, rng, **limits)


def _selected_mapping(options: WorkloadOptions, chosen: list[str]) -> Mapping:
    """Selected trace functions without an explicit entry go round-robin onto the `*` targets, one each."""
    pairs = dict(options.mapping.pairs)
    spread = pairs.pop("*", ())
    for i, key in enumerate(chosen):
        if key not in pairs and spread:
            pairs[key] = (spread[i % len(spread)],)
    return Mapping(pairs)


def build_workload(trace: Path, options: WorkloadOptions) -> Workload:
    trace = Path(trace)
    kind = detect_kind(trace)
    rng = random.Random(options.seed)
    if kind == "azure_llm":
        sampler = TokenSampler([(1, 1)], rng, options.max_prompt_tokens, options.max_output_tokens)
        work = workload_from_llm(
            list(iter_llm_requests(trace)),
            options.mapping,
            options.seed,
            trace_function=_llm_name(options.mapping),
            sampler=sampler,
        )
    elif kind == "azure2019_invocations":
        mapping, keys = options.mapping, None
        if options.select:
            chosen = select_per_class(stats_2019(iter_2019_invocations(trace)), dict(options.select), options.seed)
            keys = {k for ks in chosen.values() for k in ks}
            mapping = _selected_mapping(options, sorted(keys))
        work = workload_from_minute_counts(
            iter_2019_invocations(trace), mapping, _sampler(options, rng), options.seed, options.expansion, keys
        )
    elif kind == "azure2021":
        mapping = options.mapping
        rows = list(iter_2021_invocations(trace))
        if options.select:
            arrivals: dict[str, list[float]] = {}
            for row in rows:
                arrivals.setdefault(row.key, []).append(row.arrival_s)
            chosen = select_per_class(stats_from_arrivals(arrivals), dict(options.select), options.seed)
            keys = {k for ks in chosen.values() for k in ks}
            rows = [r for r in rows if r.key in keys]
            mapping = _selected_mapping(options, sorted(keys))
        work = workload_from_2021(rows, mapping, _sampler(options, rng), options.seed)
    else:
        raise InvalidInput(
            f"{trace} is a 2019 {kind.split('_')[1]} file; replay needs invocations (2019 "
            "invocations, 2021 invocations or the LLM inference trace)"
        )
    if options.window_s is not None or options.start_s:
        work = work.window(options.start_s, options.window_s or max(0.0, work.duration_s - options.start_s))
    if options.sample_fraction < 1:
        thin = random.Random(options.seed + 1)
        work = Workload(tuple(r for r in work.requests if thin.random() < options.sample_fraction), work.duration_s)
    if options.speedup != 1:
        work = work.compressed(options.speedup)
    if options.duration_s is not None:
        kept = tuple(r for r in work.requests if r.arrival_s < options.duration_s)
        work = Workload(kept, min(work.duration_s, options.duration_s))
    if not work.requests:
        raise InvalidInput(
            f"the workload from {trace} is empty: check --map (trace functions: "
            f"{sorted(options.mapping.pairs)}), --start/--window and --duration"
        )
    return Workload(tuple(replace(r) for r in work.requests), work.duration_s)


def _llm_name(mapping: Mapping) -> str:
    """The LLM trace is one trace function: the mapping's only key that is not `*` (default "llm")."""
    named = [k for k in mapping.pairs if k != "*"]
    return named[0] if len(named) == 1 else "llm"
