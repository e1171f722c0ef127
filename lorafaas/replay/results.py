"""Per-request outcomes of a replay (live or simulated) and their summary statistics.

Times are seconds. `arrival_s` is the request's scheduled time from the start of the replay; TTFT and E2E are measured
from it (so a request held back by the client's concurrency bound counts that wait). TPOT = (E2E - TTFT) /
(completion tokens - 1), None with fewer than two tokens.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict, dataclass, field, fields

from lorafaas.stats import percentile


@dataclass(slots=True)
class RequestResult:
    index: int
    function: str
    trace_function: str
    arrival_s: float
    prompt_tokens: int  # asked for (from the trace, clipped)
    max_tokens: int
    sent_s: float | None = None
    ttft_s: float | None = None
    e2e_s: float | None = None
    completion_tokens: int = 0
    usage_prompt_tokens: int | None = None
    cold: bool | None = None  # None: unknown (no instance information)
    cold_start_s: float | None = None
    error: str | None = None

    @property
    def ok(self) -> bool:
        return self.error is None and self.e2e_s is not None

    @property
    def tpot_s(self) -> float | None:
        if not self.ok or self.ttft_s is None or self.e2e_s is None or self.completion_tokens < 2:
            return None
        return (self.e2e_s - self.ttft_s) / (self.completion_tokens - 1)

    def row(self) -> dict:
        out = asdict(self)
        out["tpot_s"] = self.tpot_s
        return out

    @staticmethod
    def columns() -> list[str]:
        return [f.name for f in fields(RequestResult)] + ["tpot_s"]


@dataclass(frozen=True)
class Distribution:
    mean: float | None
    p50: float | None
    p90: float | None
    p99: float | None

    @classmethod
    def of(cls, values: Sequence[float]) -> Distribution:
        if not values:
            return cls(None, None, None, None)
        return cls(sum(values) / len(values), percentile(values, 50), percentile(values, 90), percentile(values, 99))


@dataclass(frozen=True)
class Summary:
    function: str  # "all" for every function
    num_requests: int
    num_ok: int
    num_errors: int
    num_cold: int
    ttft_s: Distribution
    tpot_s: Distribution
    e2e_s: Distribution
    extra: dict[str, float] = field(default_factory=dict)

    @classmethod
    def of(cls, function: str, results: Sequence[RequestResult]) -> Summary:
        ok = [r for r in results if r.ok]
        return cls(
            function,
            len(results),
            len(ok),
            len(results) - len(ok),
            sum(1 for r in results if r.cold),
            Distribution.of([r.ttft_s for r in ok if r.ttft_s is not None]),
            Distribution.of([t for r in ok if (t := r.tpot_s) is not None]),
            Distribution.of([r.e2e_s for r in ok if r.e2e_s is not None]),
        )


def summarize(results: Sequence[RequestResult]) -> list[Summary]:
    """One summary per function, then "all"."""
    by_function: dict[str, list[RequestResult]] = {}
    for r in results:
        by_function.setdefault(r.function, []).append(r)
    return [Summary.of(name, by_function[name]) for name in sorted(by_function)] + [Summary.of("all", results)]
